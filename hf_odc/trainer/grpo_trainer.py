"""``ODCGRPOTrainer``: TRL's ``GRPOTrainer`` whose policy updates are packed, balanced across ranks and free of
per-microbatch collectives.

What changes with respect to ``GRPOTrainer``, hook by hook (the hooks every ODC trainer shares are in
:class:`hf_odc.trainer._base._ODCTrainer`):

* ``__init__``: packed attention; with several processes the policy (and the reference model, frozen) are sharded by
  hf_odc and ODC is installed on each (``_setup_odc``).
* ``_generate``: TRL's, recording each completion's true length (TRL pads them).
* ``_get_per_token_logps_and_entropies``: while a training generation batch is scored, the old- and reference-policy
  passes are deferred (a placeholder is returned); they run afterwards, packed and balanced (``_score_rollouts``).
* ``_prepare_inputs``: once per ``steps_per_generation * num_iterations`` steps, TRL generates and scores; then every
  rank gathers the rollouts, cuts and plans the minibatches (:mod:`hf_odc.trainer.rollouts`), and runs the
  old/reference log-probability passes on its own packed microbatches inside forward-only minibatches. Each step
  then takes its planned minibatch. Evaluation is TRL's.
* ``training_step``: this rank's microbatches inside ``odc.minibatch()``; the loss of each microbatch is TRL's
  per-token objective with the minibatch's global normaliser (see :class:`ODCGRPOConfig`), so no collective runs
  inside; TRL's metrics are accumulated on the device and reduced once per step, with TRL's names and meaning.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from trl import GRPOTrainer

from ..accelerate_plugin import ODCRuntime
from ._base import _ODCTrainer
from .attention import use_packed_attention
from .grpo_config import ODCGRPOConfig
from .rollouts import PlannedStep, Rollouts, gather_rollouts, plan_generation_batch

__all__ = ["ODCGRPOTrainer"]

_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "token_type_ids", "mm_token_type_ids")
_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class ODCGRPOTrainer(_ODCTrainer, GRPOTrainer):
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

    def __init__(self, model: Any, reward_funcs: Any, args: ODCGRPOConfig | None = None, **kwargs: Any):
        if args is None:
            args = ODCGRPOConfig("odc-grpo")
        elif not isinstance(args, ODCGRPOConfig):
            raise TypeError(f"ODCGRPOTrainer needs an ODCGRPOConfig, got {type(args).__name__}.")
        self._deferring_scores = False
        self._completion_lengths: list[int] = []
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "ODCGRPOTrainer does not weight MoE auxiliary losses yet; set router_aux_loss_coef=0."
            )
        if self.beta != 0.0 and self.ref_model is None:
            raise NotImplementedError(
                "ODCGRPOTrainer does not support beta > 0 with a PEFT model yet (its reference is the model with the "
                "adapter disabled); set beta=0.0, or train without PEFT."
            )
        self._setup_odc()
        self._ref_odc = ODCRuntime(args.odc_plugin(), self.accelerator) if self.ref_model is not None else None
        if self._ref_odc is not None:
            use_packed_attention(self.ref_model, args.packed_attention, args.device)  # TRL built it with sdpa
            self.ref_model.requires_grad_(False)  # no gradient buffers: it is only read
            self.ref_model = self._ref_odc.shard(self.ref_model)
            self._ref_odc.enable(self.ref_model)
        self._generation_index = 0
        self._step_values: dict[str, torch.Tensor] = {}

    # -- rollouts -----------------------------------------------------------------------------------------------------

    def _generate(self, prompts: list) -> tuple:
        """TRL's, recording each completion's true length (TRL pads them to the longest)."""
        result = super()._generate(prompts)
        self._completion_lengths = [len(ids) for ids in result[1]]
        return result

    def _get_per_token_logps_and_entropies(self, model: nn.Module, input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        """TRL's, except while a training generation batch is scored: then the old/reference passes are deferred to
        :meth:`_score_rollouts` (packed, balanced, one-sided), and a placeholder of the right shape is returned."""
        if not self._deferring_scores:
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        logits_to_keep = kwargs.get("logits_to_keep", args[1] if len(args) > 1 else None)
        return input_ids.new_zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32), None, None

    @contextlib.contextmanager
    def _deferred_scoring(self) -> Iterator[None]:
        self._deferring_scores = True
        try:
            yield
        finally:
            self._deferring_scores = False

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """Training: this step's :class:`~hf_odc.trainer.rollouts.PlannedStep`, generating, scoring and planning
        a new generation batch every ``steps_per_generation * num_iterations`` steps (as TRL). Evaluation: TRL's."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._generate_and_plan(generation_batch)
        return self._buffered_inputs[self._step % steps]

    def _generate_and_plan(self, generation_batch: list[dict[str, Any]]) -> list[PlannedStep]:
        """Generate and score with TRL, gather the rollouts, plan every minibatch of the generation batch, pack this
        rank's microbatches and run the deferred old/reference passes on them."""
        args, metrics = self.args, self._metrics["train"]
        started = time.perf_counter()
        with self._deferred_scoring():
            scored = self._generate_and_score_completions(generation_batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        metrics["generation_s"].append(time.perf_counter() - started)
        if any(key in scored for key in _MULTIMODAL_KEYS):
            raise NotImplementedError("ODCGRPOTrainer trains text-only policies; multimodal prompts are not supported.")
        rollouts = gather_rollouts(Rollouts.from_scored(scored, self._completion_lengths))
        planned = plan_generation_batch(
            rollouts,
            steps=args.steps_per_generation,
            rank=self.accelerator.process_index,
            seed=args.seed + self._generation_index,
            planner=self._planner,
            token_cap=args.token_cap_for,
        )
        self._generation_index += 1
        microbatches = [microbatch for step in planned for microbatch in step.packed]
        passes = [(self.model, self.odc, "old_logps")] if "old_per_token_logps" in scored else []
        if "ref_per_token_logps" in scored:
            passes.append((self.ref_model, self._ref_odc, "ref_logps"))
        if passes:
            metrics["scoring_s"].append(sum(self._score_rollouts(*p[:2], microbatches, p[2]) for p in passes))
        return planned

    def _score_rollouts(
        self, model: nn.Module, runtime: ODCRuntime, microbatches: list[dict[str, Any]], key: str
    ) -> float:
        """Per-token log-probabilities of ``model`` on this rank's packed microbatches, stored under ``key`` in each
        one's loss inputs, in one forward-only minibatch; returns its device-timed span (seconds)."""
        with runtime.minibatch(backward=False), self.accelerator.autocast():
            for microbatch in microbatches:
                inputs = self._to_device(microbatch)
                outputs = model(**inputs["model"], use_cache=False, fused_lm_head=True)
                microbatch["loss"][key] = outputs.log_probs[0][inputs["loss"]["token_index"]].float()
        return runtime.last.step

    # -- one optimizer step -------------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward and backward of this rank's planned microbatches; returns their summed (normalised) loss."""
        started = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        with self._bounded("generation and scoring"):
            step: PlannedStep = self._prepare_inputs(inputs)
        self._step_values = self._zero_step_values()

        def loss_of(microbatch: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager():
                return self._microbatch_loss(model, microbatch, step)

        loss = self._run_minibatch(model, step.packed, loss_of)
        self._log_step(step)
        self._step += 1
        self._metrics["train"]["step_time"].append(time.perf_counter() - started)
        return loss

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: PlannedStep) -> torch.Tensor:
        """TRL's per-token GRPO objective on one packed microbatch, normalised for the whole minibatch and scaled by
        the world size (ODC and FSDP2 average gradients over ranks)."""
        args, inputs = self.args, microbatch["loss"]
        outputs = model(**microbatch["model"], use_cache=False, fused_lm_head=True)
        index, mask = inputs["token_index"], inputs["mask"]
        logps = outputs.log_probs[0][index].float()
        entropies = outputs.entropy[0][index].float()
        advantages = inputs["advantages"].unsqueeze(1)
        old_logps = inputs.get("old_logps")
        old_logps = logps.detach() if old_logps is None else old_logps

        if self.off_policy_mask_threshold is not None:
            sampling = inputs["sampling_logps"] if inputs["sampling_logps"] is not None else old_logps
            threshold = self.off_policy_mask_threshold
            off_policy_mask = self.get_off_policy_mask(advantages, logps, sampling, mask, threshold)
        log_ratio = logps - old_logps
        if self.importance_sampling_level == "token":
            log_weights = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
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
                advantages, log_ratio, mask, None,
                args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg,
            )  # fmt: skip
            per_token_loss = -phi_seq * advantages * logps
        else:
            raise ValueError(f"Unknown loss_type {loss_type!r}.")
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        policy_loss = self._normalised(per_token_loss, mask, step)
        loss = policy_loss
        if self._entropy_bonus_enabled:
            coef = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
                coef = 0.0
            loss = loss - coef * (entropies * mask).sum() / max(step.num_loss_tokens, 1)

        with torch.no_grad():
            self._accumulate("policy_loss", policy_loss)
            self._accumulate_mean("entropy", entropies, mask)
            if self.beta != 0.0:
                self._accumulate_mean("kl", per_token_kl, mask)
            if loss_type in _CLIPPED_LOSSES:
                low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
                high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
                self._accumulate_mean("clip_ratio/low_mean", low, mask)
                self._accumulate_mean("clip_ratio/high_mean", high, mask)
                self._accumulate_mean("clip_ratio/region_mean", torch.maximum(low, high), mask)
                self._accumulate_extreme("clip_ratio/low_min", _sequence_means(low, mask), torch.minimum)
                self._accumulate_extreme("clip_ratio/high_max", _sequence_means(high, mask), torch.maximum)
            elif loss_type == "cispo":
                clipped = ((coef_1 > self.epsilon_high) & (advantages > 0)).float()
                self._accumulate_mean("cispo_clip_ratio", clipped, mask)
            elif loss_type == "vespo":
                self._accumulate_mean("vespo/phi_seq_mean", phi_seq, mask)
        return loss * self.accelerator.num_processes

    def _normalised(self, per_token_loss: torch.Tensor, mask: torch.Tensor, step: PlannedStep) -> torch.Tensor:
        """This microbatch's share of the minibatch's loss (see :class:`ODCGRPOConfig` for each definition)."""
        loss_type, rollouts, masked_loss = self.loss_type, step.num_rollouts, per_token_loss * mask
        if loss_type in ("grpo", "sapo"):
            return (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rollouts
        if loss_type == "bnpo":
            return masked_loss.sum() / max(step.num_loss_tokens, 1)
        if loss_type == "dr_grpo":
            return masked_loss.sum() / (rollouts * self.max_completion_length)
        if loss_type in ("dapo", "cispo", "vespo"):  # TRL's: the generation batch's tokens per optimizer step
            return masked_loss.sum() * self.args.steps_per_generation / max(step.generation_loss_tokens, 1)
        if loss_type == "luspo":
            return masked_loss.sum() / rollouts
        raise ValueError(f"Unknown loss_type {loss_type!r}.")

    # -- metrics ------------------------------------------------------------------------------------------------------

    def _zero_step_values(self) -> dict[str, torch.Tensor]:
        """The per-rank values one step accumulates, by name, in the same order on every rank (a rank may run no
        microbatch): ``policy_loss``, then ``<metric>/sum`` and ``<metric>/count`` of each masked mean TRL logs,
        then the running extremes."""
        names = ["entropy"] + (["kl"] if self.beta != 0.0 else [])
        extremes = {}
        if self.loss_type in _CLIPPED_LOSSES:
            names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
            extremes = {"clip_ratio/low_min": math.inf, "clip_ratio/high_max": -math.inf}
        elif self.loss_type == "cispo":
            names.append("cispo_clip_ratio")
        elif self.loss_type == "vespo":
            names.append("vespo/phi_seq_mean")
        values = {"policy_loss": 0.0} | {f"{n}/{part}": 0.0 for n in names for part in ("sum", "count")} | extremes
        device = self.args.device
        return {name: torch.tensor(value, dtype=torch.float64, device=device) for name, value in values.items()}

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        self._step_values[name] += value.detach().double()

    def _accumulate_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Sum and count for TRL's global masked mean: per token over the mask, or per rollout for ``(k, 1)``."""
        if values.shape[1] == 1:
            total, count = values.sum(), torch.tensor(float(values.shape[0]), device=values.device)
        else:
            total, count = (values * mask).sum(), mask.sum()
        self._accumulate(f"{name}/sum", total)
        self._accumulate(f"{name}/count", count)

    def _accumulate_extreme(self, name: str, values: torch.Tensor, pick: Any) -> None:
        """Running min/max over rollouts; NaN (a rollout with no trained token) is skipped, as TRL's nanmin."""
        fill = math.inf if pick is torch.minimum else -math.inf
        values = torch.where(torch.isnan(values), fill, values).double()
        value = values.min() if pick is torch.minimum else values.max()
        self._step_values[name] = pick(self._step_values[name], value)

    def _log_step(self, step: PlannedStep) -> None:
        """One gather for the step's timings and TRL's metrics (same names and meaning as one process logs)."""
        values = self._step_values
        per_rank = self._log_minibatch(step.microbatch_lengths, step.num_tokens, step.predicted_bubble_rate, values)
        metrics = self._metrics["train"]
        metrics["predicted_bubble_rate_unbalanced"].append(step.unbalanced_bubble_rate)
        for rank, tokens in enumerate(step.generated_tokens):
            metrics[f"tokens_generated/rank_{rank}"].append(tokens)
        for name in [key.removesuffix("/sum") for key in values if key.endswith("/sum")]:
            total, count = sum(per_rank[f"{name}/sum"]), sum(per_rank[f"{name}/count"])
            metrics[name].append(total / max(count, 1.0))
        for name, pick in (("clip_ratio/low_min", min), ("clip_ratio/high_max", max)):
            if name in per_rank:
                finite = [v for v in per_rank[name] if math.isfinite(v)]
                metrics[name].append(pick(finite) if finite else math.nan)
        if self._entropy_bonus_enabled:
            metrics["policy_loss"].append(sum(per_rank["policy_loss"]))
            if self.use_adaptive_entropy:
                world_entropy = sum(per_rank["entropy/sum"]) / max(sum(per_rank["entropy/count"]), 1.0)
                delta = self.args.entropy_coef_delta
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + delta, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - delta, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
            metrics["entropy_coef"].append(self.entropy_coef)

    def close_odc(self) -> None:
        """Release ODC on the policy and on the reference model (collective)."""
        if self._ref_odc is not None:
            self._ref_odc.close()
        super().close_odc()


def _sequence_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each rollout's mean over its trained tokens (NaN without any), or the value itself for ``(k, 1)``."""
    if values.shape[1] == 1:
        return values.squeeze(1)
    return (values * mask).sum(-1) / mask.sum(-1)
