"""TRL 1.16's DPO losses as functions of each pair's summed log-probabilities, so that a minibatch's loss is a sum
over pairs that any split of the pairs across ranks and microbatches adds up to.

Every loss type of ``DPOConfig.loss_type`` whose value for a pair depends on that pair alone is here
(:data:`PAIR_LOSSES`), with TRL's f-divergence scores (``f_divergence_type``). ``sft`` is a token mean over the
minibatch's chosen completions, also a sum over microbatches once divided by the minibatch's chosen tokens
(:class:`hf_odc.trainer.ODCDPOTrainer` adds it). ``aot`` and ``aot_unpaired`` sort the log-ratios of the whole batch,
which no rank holds: they are refused (:data:`UNSUPPORTED_LOSSES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PAIR_LOSSES", "TOKEN_LOSSES", "UNSUPPORTED_LOSSES", "PairLogps", "pair_losses"]

PAIR_LOSSES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
    "discopop", "sigmoid_norm",
)  # fmt: skip
"""Loss types computed per pair, averaged over the minibatch's pairs."""

TOKEN_LOSSES = ("sft",)
"""Loss types averaged over the minibatch's chosen completion tokens."""

UNSUPPORTED_LOSSES = {
    "aot": "it sorts the log-ratios of every pair of the batch, which no rank holds in an ODC minibatch",
    "aot_unpaired": "it sorts the log-ratios of every pair of the batch, which no rank holds in an ODC minibatch",
}
"""TRL's loss types :class:`~hf_odc.trainer.ODCDPOTrainer` refuses, with the reason."""


@dataclass
class PairLogps:
    """The summed completion log-probabilities of ``k`` pairs under the policy and the reference, ``(k,)`` each,
    and each completion's length (the IPO and ``sigmoid_norm`` normaliser)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @property
    def chosen_logratios(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected


def _scores(logratios: torch.Tensor, f_divergence_type: str, alpha: float) -> torch.Tensor:
    """The f-DPO score of each log-ratio ``log(pi / pi_ref)``: ``f'`` of the ratio (reverse KL: the log-ratio)."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        # (ratio^(alpha - 1) - 1) / (alpha - 1), the exponent bounded so that it stays finite in the input's dtype
        bound = 11.0 if logratios.dtype == torch.float16 else 80.0
        exponent = torch.clamp((alpha - 1.0) * logratios.float(), max=bound)
        return (torch.exp(exponent) - 1.0).to(logratios.dtype) / (alpha - 1.0)
    raise ValueError(f"Unknown f_divergence_type {f_divergence_type!r}.")


def _pair_loss(loss_type: str, pairs: PairLogps, args) -> torch.Tensor:
    """One loss type's value for each pair, ``(k,)``."""
    beta, smoothing = args.beta, args.label_smoothing
    chosen_ratio, rejected_ratio = pairs.chosen_logratios, pairs.rejected_logratios
    chosen = _scores(chosen_ratio, args.f_divergence_type, args.f_alpha_divergence_coef)
    rejected = _scores(rejected_ratio, args.f_divergence_type, args.f_alpha_divergence_coef)
    margin = beta * (chosen - rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(margin)
    if loss_type == "hinge":
        return torch.relu(1 - margin)
    if loss_type in ("ipo", "sigmoid_norm"):  # the scores' per-token means
        per_token = chosen / pairs.chosen_tokens.clamp(min=1.0) - rejected / pairs.rejected_tokens.clamp(min=1.0)
        return (per_token - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * per_token)
    if loss_type == "exo_pair":  # KL from the policy's preference to (1 - eps, eps)
        p_chosen, p_rejected = torch.sigmoid(margin), torch.sigmoid(-margin)
        return p_chosen * (F.logsigmoid(margin) - math.log1p(-smoothing)) + p_rejected * (
            F.logsigmoid(-margin) - math.log(smoothing)
        )
    if loss_type == "robust":
        return (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) / (1 - 2 * smoothing)
    chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    if loss_type == "nca_pair":
        return -F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward) - 0.5 * F.logsigmoid(-rejected_reward)
    if loss_type == "bco_pair":
        return -F.logsigmoid(chosen_reward) - F.logsigmoid(-rejected_reward)
    if loss_type == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(chosen_reward) + torch.sigmoid(rejected_reward)
    if loss_type == "apo_down":
        return torch.sigmoid(chosen_reward) + 1 - torch.sigmoid(chosen_reward - rejected_reward)
    if loss_type == "discopop":  # logistic and exponential losses, mixed by the margin
        mix = torch.sigmoid(margin / args.discopop_tau)
        return -F.logsigmoid(margin) * (1 - mix) + torch.exp(-margin) * mix
    raise ValueError(f"{loss_type!r} is not a per-pair DPO loss; those are {PAIR_LOSSES}.")


def pair_losses(pairs: PairLogps, args) -> torch.Tensor:
    """The weighted sum of ``args.loss_type``'s per-pair losses (``args.loss_weights``, default 1 each) for each
    pair, ``(k,)``; :data:`TOKEN_LOSSES` are left out (they are not per pair). ``args`` is a ``DPOConfig``."""
    weights = args.loss_weights or [1.0] * len(args.loss_type)
    total = torch.zeros_like(pairs.chosen)
    for loss_type, weight in zip(args.loss_type, weights, strict=True):
        if loss_type not in TOKEN_LOSSES:
            total = total + weight * _pair_loss(loss_type, pairs, args)
    return total
