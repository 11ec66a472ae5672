"""``ODCGRPOTrainer``: TRL's ``GRPOTrainer`` whose policy updates are packed, balanced across ranks and free of
per-microbatch collectives.

What is GRPO-specific, hook by hook (generation, deferred scoring and the rollouts' plan are every online trainer's:
:class:`hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer`; the step loop, sharding, ODC, the timings, bounded
collectives and checkpoints every ODC trainer's: :class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``_deferred_passes``: the old-policy pass when TRL scores one (``steps_per_generation`` above the accumulation, or
  ``num_iterations > 1``), the reference pass with ``beta > 0`` (a PEFT policy's reference: the same sharded model
  with its adapter disabled, :func:`hf_odc.trainer.core._reference.reference_of`).
* ``_plan_step``: with ``top_entropy_quantile < 1``, each step's high-entropy token mask from a forward-only pass of
  the current policy and one gather (:meth:`_mask_low_entropy_tokens`).
* ``_after_scoring``: vLLM's importance-sampling metrics over the whole generation batch.
* ``_microbatch_loss``: TRL's per-token objective with the minibatch's global normaliser (see
  :class:`ODCGRPOConfig`), so no collective runs inside; TRL's metrics are accumulated on the device
  (``_declare_step_metrics``) and reduced once per step, with TRL's names and meaning. A group microbatch (a rollout
  split over a group of ranks by sequence parallelism) trains this rank's completion tokens; what needs the whole
  rollout (its sequence-level ratio, its clip ratios' means) sums the group's parts (:func:`~hf_odc.kernels.group_sum`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar

import torch
from accelerate.utils import gather_object
from torch import nn
from trl import GRPOTrainer

from ...kernels import SequenceShard, group_sum
from ..core._reference import check_peft_reference, reference_of
from ..core._step import StepMetrics
from . import _sampling_correction
from ._rollout_trainer import Pass, _ODCRolloutTrainer
from .grpo_config import ODCGRPOConfig
from .rollouts import Rollouts, RolloutStep

__all__ = ["ODCGRPOTrainer"]

_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class ODCGRPOTrainer(_ODCRolloutTrainer, GRPOTrainer):
    """
    Trainer for Group Relative Policy Optimization with On-Demand Communication (ODC) and minibatch-level load
    balancing of the policy updates.

    Same arguments as [`~trl.GRPOTrainer`], with `args` an [`ODCGRPOConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding. Rollouts can be injected with TRL's `rollout_func` (e.g. to replay fixed completions).

    Example:

    ```python
    >>> from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    >>> trainer = ODCGRPOTrainer(
    ...     model=model, reward_funcs=reward_len, args=ODCGRPOConfig("out"), train_dataset=prompts, processing_class=tok
    ... )
    >>> trainer.train()
    ```
    """

    _tag_names: ClassVar[list[str]] = ["trl", "grpo", "hf-odc"]
    _name = "ODC GRPO"
    _config_class = ODCGRPOConfig

    def __init__(self, model: Any, reward_funcs: Any, args: ODCGRPOConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        self._high_entropy = (0, 0.0)  # this step's tokens above the entropy quantile: count and mean entropy
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        check_peft_reference(self.accelerator.unwrap_model(self.model), "ODCGRPOTrainer", alternative="")
        self._setup_odc(self._declare_step_metrics())
        self._setup_generation()

    # -- rollouts -----------------------------------------------------------------------------------------------------

    def _deferred_passes(self, scored: dict[str, Any]) -> list[Pass]:
        """The old-policy pass when TRL scored one, the reference pass when it scored one (``beta > 0``)."""
        passes: list[Pass] = []
        if "old_per_token_logps" in scored:
            passes.append((self.model, self.odc, contextlib.nullcontext(), "old_logps"))
        if "ref_per_token_logps" in scored:
            passes.append((*reference_of(self), "ref_logps"))
        return passes

    def _single_turn_arguments(self, prompt_ids: list, images: Any, multimodal_fields: dict) -> tuple:
        """TRL's training call passes the group size too."""
        return (prompt_ids, images, multimodal_fields, self.num_generations)

    def _plan_step(self, window: list[Any]) -> RolloutStep:
        """The rollout trainer's, then with ``top_entropy_quantile < 1`` the step's high-entropy token mask."""
        step = super()._plan_step(window)
        if self.top_entropy_quantile < 1.0:
            self._mask_low_entropy_tokens(step)
        return step

    def _mask_low_entropy_tokens(self, step: RolloutStep) -> None:
        """TRL's ``top_entropy_quantile``: the current policy's entropy at every trained token of the minibatch, from a
        forward-only pass over this rank's packed microbatches, gathered once; each microbatch's loss inputs get
        ``entropy_mask``, its trained tokens at or above the minibatch's ``1 - top_entropy_quantile`` quantile. Keeps
        the selected tokens' count and mean entropy over the minibatch (``_high_entropy``): the entropy bonus's
        normaliser and the adaptive controller's measure (see :class:`ODCGRPOConfig`)."""
        microbatches = step.microbatches
        self._warm_attention(step.attended_lengths(), forward_only=[self.model])
        seconds = self._score_rollouts(
            self.model, self.odc, contextlib.nullcontext(), microbatches, "entropies", output="entropy"
        )
        self._metrics["train"]["entropy_scoring_s"].append(seconds)
        values = [(mb["loss"].pop("entropies").cpu(), mb["loss"]["mask"].bool()) for mb in microbatches]
        local = torch.cat([entropies[mask] for entropies, mask in values]) if values else torch.zeros(0)
        with self.odc.bounded("the entropy quantile's gather"):
            gathered = torch.cat(gather_object([local]))
        if gathered.numel() == 0:
            threshold, self._high_entropy = math.inf, (0, 0.0)
        else:
            threshold = torch.quantile(gathered, 1.0 - self.top_entropy_quantile)
            selected = gathered[gathered >= threshold]
            self._high_entropy = (selected.numel(), selected.mean().item())
        for microbatch, (entropies, mask) in zip(microbatches, values, strict=True):
            microbatch["loss"]["entropy_mask"] = ((entropies >= threshold) & mask).float()

    def _after_scoring(self, rollouts: Rollouts, planned: list[RolloutStep]) -> None:
        if self.use_vllm and self.vllm_importance_sampling_correction:
            self._log_sampling_correction([microbatch for step in planned for microbatch in step.microbatches])

    def _sampling_ratio(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """TRL's importance-sampling ratio of vLLM's rollouts for one packed microbatch's loss inputs, or ``None``
        when the correction is off (:mod:`hf_odc.trainer.online._sampling_correction`)."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return None
        return _sampling_correction.importance_sampling_ratio(
            inputs["old_logps"], inputs["sampling_logps"], inputs["mask"], self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max,
        )  # fmt: skip

    def _log_sampling_correction(self, microbatches: list[dict[str, Any]]) -> None:
        """TRL's correction metrics over the whole generation batch, in place of those TRL logged while scoring
        (from the deferred old log-probabilities' placeholders); one gather."""
        mode = self.vllm_importance_sampling_mode
        local = _sampling_correction.local_statistics(microbatches, self._sampling_ratio, mode)
        with self.odc.bounded("the sampling-correction metrics gather"):
            gathered = self.accelerator.gather(local[None].to(self.args.device)).cpu()
        for name, value in _sampling_correction.metrics(gathered).items():
            self._metrics["train"][name][-1] = value

    # -- the loss ---------------------------------------------------------------------------------------------------

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: RolloutStep) -> torch.Tensor:
        """TRL's per-token GRPO objective on one packed microbatch, normalised for the whole minibatch.

        A group microbatch's ``mask`` holds this rank's completion tokens only: each token's loss and metrics count
        once in the group, and the per-rollout normalisers (``sequence_tokens``) are the whole rollout's."""
        args, inputs = self.args, microbatch["loss"]
        shard = microbatch["model"].get("sequence_shard")
        outputs = model(**microbatch["model"], use_cache=False, fused_lm_head=True)
        index, mask, tokens = inputs["token_index"], inputs["mask"], inputs["sequence_tokens"]
        logps = outputs.log_probs[0][index].float()
        entropies = outputs.entropy[0][index].float()
        advantages = inputs["advantages"].unsqueeze(1)
        old_logps = inputs.get("old_logps")
        old_logps = logps.detach() if old_logps is None else old_logps

        if self.off_policy_mask_threshold is not None:
            sampling = inputs["sampling_logps"] if inputs["sampling_logps"] is not None else old_logps
            threshold = self.off_policy_mask_threshold
            off_policy_mask = self.get_off_policy_mask(advantages, logps, sampling, mask, threshold)
        sampling_ratio = self._sampling_ratio(inputs)
        log_ratio = logps - old_logps
        if self.importance_sampling_level == "token":
            log_weights = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_weights = (_rollout_sums(log_ratio * mask, shard) / tokens.clamp(min=1.0)).unsqueeze(-1)
        else:
            raise ValueError(f"Unknown importance_sampling_level {self.importance_sampling_level!r}.")
        coef_1 = torch.exp(log_weights)
        if self.beta != 0.0:
            ref_delta = inputs["ref_logps"] - logps
            per_token_kl = torch.exp(ref_delta) - ref_delta - 1
            if args.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        loss_type = self.loss_type
        if loss_type == "cispo":
            per_token_loss = -torch.clamp(coef_1, max=self.epsilon_high).detach() * advantages * logps
        elif loss_type in _CLIPPED_LOSSES:
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
            if args.delta is not None:
                coef_1 = torch.clamp(coef_1, max=args.delta)
            per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        elif loss_type == "sapo":
            temperatures = torch.where(advantages > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
            per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
        elif loss_type == "vespo":
            phi_seq = self.get_gamma_weights(
                advantages, log_ratio, mask, sampling_ratio,
                args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg,
            )  # fmt: skip
            per_token_loss = -phi_seq * advantages * logps
        else:
            raise ValueError(f"Unknown loss_type {loss_type!r}.")
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask
        entropy_mask = inputs.get("entropy_mask")
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if sampling_ratio is not None and loss_type != "vespo":
            per_token_loss = per_token_loss * sampling_ratio
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        policy_loss = self._normalised(per_token_loss, mask, tokens, step)
        loss = policy_loss
        if self._entropy_bonus_enabled:
            coef = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
                coef = 0.0
            if entropy_mask is None:
                bonus = (entropies * mask).sum() / max(step.num_loss_tokens, 1)
            else:  # on the tokens the entropy mask trains
                bonus = (entropies * mask * entropy_mask).sum() / max(self._high_entropy[0], 1)
            loss = loss - coef * bonus
            self._step_metrics.add("policy_loss", policy_loss.detach())

        with torch.no_grad():
            leads = shard is None or shard.index == 0  # a rollout's own values counted once in its group
            self._add_mean("entropy", entropies, mask, leads)
            if self.beta != 0.0:
                self._add_mean("kl", per_token_kl, mask, leads)
            if loss_type in _CLIPPED_LOSSES:
                low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
                high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
                self._add_mean("clip_ratio/low_mean", low, mask, leads)
                self._add_mean("clip_ratio/high_mean", high, mask, leads)
                self._add_mean("clip_ratio/region_mean", torch.maximum(low, high), mask, leads)
                self._step_metrics.add_extreme("clip_ratio/low_min", _sequence_means(low, mask, tokens, shard))
                self._step_metrics.add_extreme("clip_ratio/high_max", _sequence_means(high, mask, tokens, shard))
            elif loss_type == "cispo":
                clipped = ((coef_1 > self.epsilon_high) & (advantages > 0)).float()
                self._add_mean("cispo_clip_ratio", clipped, mask, leads)
            elif loss_type == "vespo":
                self._add_mean("vespo/phi_seq_mean", phi_seq, mask, leads)
        return loss

    def _normalised(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, step: RolloutStep
    ) -> torch.Tensor:
        """This microbatch's share of the minibatch's loss (see :class:`ODCGRPOConfig` for each definition);
        ``tokens``: each rollout's trained tokens (all of them, where ``mask`` holds a group microbatch's share)."""
        loss_type, rollouts, masked_loss = self.loss_type, step.num_samples, per_token_loss * mask
        if loss_type in ("grpo", "sapo"):
            return (masked_loss.sum(-1) / tokens.clamp(min=1.0)).sum() / rollouts
        if loss_type == "bnpo":
            return masked_loss.sum() / max(step.num_loss_tokens, 1)
        if loss_type == "dr_grpo":
            return masked_loss.sum() / (rollouts * self.max_completion_length)
        if loss_type in ("dapo", "cispo", "vespo"):  # TRL's: the generation batch's tokens per optimizer step
            return masked_loss.sum() * step.generation_steps / max(step.generation_loss_tokens, 1)
        if loss_type == "luspo":
            return masked_loss.sum() / rollouts
        raise ValueError(f"Unknown loss_type {loss_type!r}.")

    # -- metrics ------------------------------------------------------------------------------------------------------

    def _declare_step_metrics(self) -> StepMetrics:
        """The metrics one step accumulates, with TRL's names: the masked means TRL logs for this configuration, the
        clip ratios' extremes, and ``policy_loss`` with the entropy bonus."""
        means = ["entropy"] + (["kl"] if self.beta != 0.0 else [])
        minima, maxima = [], []
        if self.loss_type in _CLIPPED_LOSSES:
            means += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
            minima, maxima = ["clip_ratio/low_min"], ["clip_ratio/high_max"]
        elif self.loss_type == "cispo":
            means.append("cispo_clip_ratio")
        elif self.loss_type == "vespo":
            means.append("vespo/phi_seq_mean")
        sums = ["policy_loss"] if self._entropy_bonus_enabled else []
        return StepMetrics(self.args.device, sums=sums, means=means, minima=minima, maxima=maxima)

    def _add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor, leads: bool = True) -> None:
        """TRL's global masked mean: per token over the mask, or per rollout for ``(k, 1)`` (counted only where
        ``leads``: by the first rank of a group microbatch's group)."""
        if values.shape[1] == 1:
            if leads:
                self._step_metrics.add_mean(name, values.sum(), values.shape[0])
        else:
            self._step_metrics.add_mean(name, (values * mask).sum(), mask.sum())

    def _end_step(self, step: RolloutStep, metrics: dict[str, float]) -> None:
        """TRL's adaptive entropy controller, on the minibatch's entropy over every rank's trained tokens (those the
        entropy mask keeps, with ``top_entropy_quantile < 1``)."""
        if not self._entropy_bonus_enabled:
            return
        if self.use_adaptive_entropy:
            world_entropy = metrics["entropy"] if self.top_entropy_quantile == 1.0 else self._high_entropy[1]
            delta = self.args.entropy_coef_delta
            if world_entropy <= self.args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + delta, self.args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - delta, self.args.entropy_coef_min)
            self._last_world_entropy = world_entropy
        self._metrics["train"]["entropy_coef"].append(self.entropy_coef)


def _rollout_sums(values: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """Each rollout's sum of ``values`` ``(k, C)`` (zero off its trained tokens): the group's, for a group microbatch
    (collective: the group's ranks call it together)."""
    sums = values.sum(-1)
    return sums if shard is None else group_sum(sums, shard)


def _sequence_means(
    values: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, shard: SequenceShard | None
) -> torch.Tensor:
    """Each rollout's mean over its ``tokens`` trained tokens (NaN without any), or the value itself for ``(k, 1)``."""
    if values.shape[1] == 1:
        return values.squeeze(1)
    return _rollout_sums(values * mask, shard) / tokens
