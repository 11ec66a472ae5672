"""``ODCRLOOTrainer``: TRL's ``RLOOTrainer`` whose policy updates are packed, balanced across ranks and free of
per-microbatch collectives.

Generation, deferred scoring and the rollouts' plan are GRPO's (:class:`hf_odc.trainer.online._rollout_trainer.
_ODCRolloutTrainer`); what is RLOO's, hook by hook:

* ``_deferred_passes``: the old policy's pass when the update can differ from the generating policy or when the KL
  penalty needs it (``beta > 0``), and then the reference's (a PEFT policy's: the same sharded model with its adapter
  disabled, :func:`hf_odc.trainer.core._reference.reference_of`).
* ``_after_scoring``: with ``beta > 0``, the KL penalty enters the rewards, so the leave-one-out advantages are
  recomputed from TRL's rewards once the packed passes have run (:func:`leave_one_out_advantages`; one all-reduce of
  the per-rollout KL sums per generation batch), and TRL's ``kl`` and ``frac_reward_zero_std`` metrics are replaced
  by the batch's.
* ``_microbatch_loss``: TRL's clipped sequence-ratio objective, averaged over the minibatch's rollouts; TRL's metrics
  accumulated on the device and reduced once per step.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch import nn
from trl import RLOOTrainer
from trl.trainer.utils import nanstd

from ..core._reference import check_peft_reference, reference_of
from ..core._step import StepMetrics
from ._rollout_trainer import Pass, _ODCRolloutTrainer
from .rloo_config import ODCRLOOConfig
from .rollouts import Rollouts, RolloutStep

__all__ = ["ODCRLOOTrainer", "leave_one_out_advantages"]


class ODCRLOOTrainer(_ODCRolloutTrainer, RLOOTrainer):
    """
    Trainer for REINFORCE Leave-One-Out (RLOO) with On-Demand Communication (ODC) and minibatch-level load balancing
    of the policy updates.

    Same arguments as [`~trl.RLOOTrainer`], with `args` an [`ODCRLOOConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding.

    Example:

    ```python
    >>> from hf_odc.trainer import ODCRLOOConfig, ODCRLOOTrainer

    >>> trainer = ODCRLOOTrainer(
    ...     model=model, reward_funcs=reward_len, args=ODCRLOOConfig("out"), train_dataset=prompts, processing_class=tok
    ... )
    >>> trainer.train()
    ```
    """

    _weighs_moe_aux_loss = False  # the router's loss not yet checked against TRL's here

    _tag_names: ClassVar[list[str]] = ["trl", "rloo", "hf-odc"]
    _name = "ODC RLOO"
    _config_class = ODCRLOOConfig

    def __init__(self, model: Any, reward_funcs: Any, args: ODCRLOOConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        self._rewards_per_func: torch.Tensor | None = None
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        check_peft_reference(self.accelerator.unwrap_model(self.model), "ODCRLOOTrainer", alternative="")
        metrics = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
        self._setup_odc(
            StepMetrics(args.device, means=metrics, minima=["clip_ratio/low_min"], maxima=["clip_ratio/high_max"])
        )
        self._setup_generation()

    # -- rollouts -----------------------------------------------------------------------------------------------------

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """TRL's (every process's rewards, per function), kept for the advantages' recomputation with the KL."""
        self._rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        return self._rewards_per_func

    def _deferred_passes(self, scored: dict[str, Any]) -> list[Pass]:
        """The old policy's pass when TRL's differs from the updated policy's detached log-probabilities (a later
        minibatch or iteration of the generation batch) or the KL needs it; the reference's with ``beta > 0``."""
        args = self.args
        passes = []
        if self.beta != 0.0 or self.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps:
            passes.append((self.model, self.odc, contextlib.nullcontext(), "old_logps"))
        if self.beta != 0.0:
            passes.append((*reference_of(self), "ref_logps"))
        return passes

    def _after_scoring(self, rollouts: Rollouts, planned: list[RolloutStep]) -> None:
        """With ``beta > 0``: each rollout's summed KL (``old - ref`` over its trained tokens) from this rank's packed
        passes, summed over the ranks (one all-reduce), then TRL's advantages and the metrics it logs from them."""
        if self.beta == 0.0:
            return
        kl = torch.zeros(len(rollouts), dtype=torch.float64)
        for step in planned:
            for microbatch, indices in zip(step.microbatches, step.rollout_indices, strict=True):
                inputs = microbatch["loss"]
                per_rollout = (inputs["old_logps"] - inputs["ref_logps"]) * inputs["mask"].to(inputs["old_logps"])
                kl[indices] = per_rollout.sum(-1).double().cpu()
        with self.odc.bounded("the KL penalty's all-reduce"):
            kl = self.accelerator.reduce(kl.to(self.args.device), reduction="sum").cpu()
        advantages, rewards = leave_one_out_advantages(
            self._rewards_per_func.cpu(),
            self.reward_weights.cpu(),
            kl_penalty=(self.beta * kl).float(),
            num_generations=self.num_generations,
            clip_range=self.reward_clip_range,
            normalize=self.normalize_advantages,
        )
        for step in planned:
            for microbatch, indices in zip(step.microbatches, step.rollout_indices, strict=True):
                microbatch["loss"]["advantages"] = advantages[indices].clone()
        metrics = self._metrics["train"]
        metrics["kl"][-1] = float(kl.sum()) / max(rollouts.count_loss_tokens(), 1)
        group_std = nanstd(rewards.view(-1, self.num_generations), dim=1)
        zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
        metrics["frac_reward_zero_std"][-1] = zero_std.float().mean().item()
        self._logs["advantages"].extend(advantages.tolist())  # in place of TRL's, logged without the KL

    # -- the loss -----------------------------------------------------------------------------------------------------

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: RolloutStep) -> torch.Tensor:
        """TRL's RLOO objective on one packed microbatch: per rollout ``-min(r A, clip(r) A)`` with ``r`` the ratio of
        its sequence probabilities under the current and old policies, summed and divided by the minibatch's
        rollouts."""
        inputs = microbatch["loss"]
        outputs = model(**microbatch["model"], use_cache=False, fused_lm_head=True)
        index, mask = inputs["token_index"], inputs["mask"]
        logps = (outputs.log_probs[0][index].float() * mask).sum(-1)
        entropies = outputs.entropy[0][index].float()
        old_logps = inputs.get("old_logps")
        old_logps = logps.detach() if old_logps is None else (old_logps * mask).sum(-1)
        advantages = inputs["advantages"]
        coef_1 = torch.exp(logps - old_logps)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_rollout_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)

        with torch.no_grad():
            metrics = self._step_metrics
            metrics.add_mean("entropy", (entropies * mask).sum(), mask.sum())
            low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
            for name, values in (("low", low), ("high", high), ("region", torch.maximum(low, high))):
                metrics.add_mean(f"clip_ratio/{name}_mean", values.sum(), values.numel())
            metrics.add_extreme("clip_ratio/low_min", low)
            metrics.add_extreme("clip_ratio/high_max", high)
        return per_rollout_loss.sum() / step.num_samples


def leave_one_out_advantages(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    *,
    kl_penalty: torch.Tensor,
    num_generations: int,
    clip_range: tuple[float, float] | None,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's RLOO advantages of a generation batch (every process's rollouts, in order, groups of ``num_generations``
    consecutive ones): weighted rewards (a rollout every function left unscored has none), clipped to
    ``clip_range``, minus ``kl_penalty``; each minus the mean of its scorable siblings; optionally standardised over
    the batch; 0 where undefined. Returns the advantages and the penalised rewards (NaN where unscored)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if clip_range:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    rewards = rewards - kl_penalty
    grouped = rewards.view(-1, num_generations)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    siblings_mean = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = rewards - siblings_mean.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards
