"""``ODCGRPOTrainer``: TRL's ``GRPOTrainer`` whose policy updates are packed, balanced across ranks and free of
per-microbatch collectives.

What is GRPO-specific, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints
are every ODC trainer's: :class:`hf_odc.trainer._base_trainer._ODCTrainer`):

* ``__init__``: the reference model (frozen) is sharded by hf_odc and ODC installed on it, like the policy.
* ``_generate_single_turn``: TRL's, decoded on each rank alone, never in lockstep (:mod:`hf_odc.trainer.generation`);
  with vLLM, TRL's as it is, the weights pushed by hf_odc's sync (:mod:`hf_odc.trainer.vllm_sync`).
* ``_generate``: TRL's, recording each completion's true length (TRL pads them).
* ``_get_per_token_logps_and_entropies``: while a training generation batch is scored, the old- and reference-policy
  passes are deferred (a placeholder is returned); they run afterwards, packed and balanced (``_score_rollouts``).
* ``_plan_step``: once per ``steps_per_generation * num_iterations`` calls of ``training_step``, TRL generates and
  scores; then every rank gathers the rollouts, cuts and plans the minibatches (:mod:`hf_odc.trainer.rollouts`), and
  runs the old/reference log-probability passes on its own packed microbatches inside forward-only minibatches. Each
  optimizer step then takes its planned minibatch. Evaluation is TRL's.
* ``_microbatch_loss``: TRL's per-token objective with the minibatch's global normaliser (see
  :class:`ODCGRPOConfig`), so no collective runs inside; TRL's metrics are accumulated on the device
  (``_declare_step_metrics``) and reduced once per step, with TRL's names and meaning.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from accelerate.utils import is_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from trl import GRPOTrainer

from .. import _compat
from ..accelerate_plugin import ODCRuntime
from ..engine._fsdp_internals import lazy_init_root
from . import _sampling_correction
from ._base_trainer import _ODCTrainer
from ._quiet import without_ignored_model_init_kwargs_warning
from ._step import StepMetrics
from .generation import StaticDecoder, choose_generation_mode, decoding
from .grpo_config import ODCGRPOConfig
from .rollouts import Rollouts, RolloutStep, gather_rollouts, plan_generation_batch
from .vllm_sync import ODCWeightSync

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
        quiet = contextlib.nullcontext()
        if args.model_init_kwargs is None and _loads_a_model(model, reward_funcs, args):
            args.model_init_kwargs = {"device_map": None}  # whole models on every rank (see ODCGRPOConfig)
            if not isinstance(model, str):
                quiet = without_ignored_model_init_kwargs_warning()  # not ignored: the reference model uses them
        with quiet:
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        if self.beta != 0.0 and self.ref_model is None:
            raise NotImplementedError(
                "ODCGRPOTrainer does not support beta > 0 with a PEFT model yet (its reference is the model with the "
                "adapter disabled); set beta=0.0, or train without PEFT."
            )
        self._setup_odc(self._declare_step_metrics())
        if args.use_vllm:
            ODCWeightSync.install(self.vllm_generation, self.model, self.odc)
        self._ref_odc = None
        if self.ref_model is not None:
            self.ref_model, self._ref_odc = self._shard_frozen(self.ref_model)
        self._generation_index = 0
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        self._generation_mode = choose_generation_mode(
            args.odc_generation, self.model, self.odc, dtype, self.accelerator.device
        )
        self._generation_dtype = dtype
        self._static_decoder: StaticDecoder | None = None  # made at the first generation, on the prepared model

    # -- rollouts -----------------------------------------------------------------------------------------------------

    def _generate(self, prompts: list) -> tuple:
        """TRL's, recording each completion's true length (TRL pads them to the longest). In the ``"static"`` mode the
        copy is refreshed first (every rank, once per generation batch) and TRL generates on it. Otherwise a sharded
        PEFT policy generates through the model it wraps, below the FSDP root: the root's parameters (embeddings,
        head) are gathered around it, as the root's forward would."""
        if self._generation_mode == "static" and not self.use_vllm:
            if self._static_decoder is None:
                self._static_decoder = StaticDecoder(self.model, self.odc, self._generation_dtype)
            self._static_decoder.refresh()
            context = _compat.generating_on(self, self._static_decoder.model)
        elif _generates_below_the_root(self.model):
            context = _root_gathered(self.model)
        else:
            context = contextlib.nullcontext()
        with context:
            result = super()._generate(prompts)
        self._completion_lengths = [len(ids) for ids in result[1]]
        return result

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> tuple:
        """TRL's, decoded on this rank alone in the run's generation mode (:mod:`hf_odc.trainer.generation`), or by
        vLLM."""
        if self.use_vllm:
            return super()._generate_single_turn(*args, **kwargs)
        with decoding(self.model, self.odc, self._generation_mode):
            return super()._generate_single_turn(*args, **kwargs)

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

    def _plan_step(self, window: list[Any]) -> RolloutStep:
        """This optimizer step's :class:`~hf_odc.trainer.rollouts.RolloutStep`: generating, scoring and planning a new
        generation batch when TRL would (every ``steps_per_generation * num_iterations`` calls of ``training_step``),
        then taking its next minibatch. ``window`` holds each accumulation call's prompts (TRL repeats the generation
        batch's prompts for each call)."""
        first, self._step = self._step, self._step + len(window)  # TRL counts calls of training_step
        args = self.args
        if first % (args.steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None:
            with self.odc.bounded("generation and scoring"):
                self._buffered_inputs = self._generate_and_plan(window[0])
        return self._buffered_inputs[(first % args.steps_per_generation) // args.gradient_accumulation_steps]

    def _generate_and_plan(self, generation_batch: list[dict[str, Any]]) -> list[RolloutStep]:
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
            steps=args.steps_per_generation // args.gradient_accumulation_steps,
            rank=self.accelerator.process_index,
            seed=args.seed + self._generation_index,
            planner=self._planner,
            max_tokens_for=args.max_tokens_for,
        )
        self._generation_index += 1
        microbatches = [microbatch for step in planned for microbatch in step.microbatches]
        passes = [(self.model, self.odc, "old_logps")] if "old_per_token_logps" in scored else []
        if "ref_per_token_logps" in scored:
            passes.append((self.ref_model, self._ref_odc, "ref_logps"))
        if passes:
            metrics["scoring_s"].append(sum(self._score_rollouts(*p[:2], microbatches, p[2]) for p in passes))
        if self.use_vllm and self.vllm_importance_sampling_correction:
            self._log_sampling_correction(microbatches)
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

    def _sampling_ratio(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """TRL's importance-sampling ratio of vLLM's rollouts for one packed microbatch's loss inputs, or ``None``
        when the correction is off (:mod:`hf_odc.trainer._sampling_correction`)."""
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
        sampling_ratio = self._sampling_ratio(inputs)
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
                advantages, log_ratio, mask, sampling_ratio,
                args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg,
            )  # fmt: skip
            per_token_loss = -phi_seq * advantages * logps
        else:
            raise ValueError(f"Unknown loss_type {loss_type!r}.")
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask
        if sampling_ratio is not None and loss_type != "vespo":
            per_token_loss = per_token_loss * sampling_ratio
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        policy_loss = self._normalised(per_token_loss, mask, step)
        loss = policy_loss
        if self._entropy_bonus_enabled:
            coef = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
                coef = 0.0
            loss = loss - coef * (entropies * mask).sum() / max(step.num_loss_tokens, 1)
            self._step_metrics.add("policy_loss", policy_loss.detach())

        with torch.no_grad():
            self._add_mean("entropy", entropies, mask)
            if self.beta != 0.0:
                self._add_mean("kl", per_token_kl, mask)
            if loss_type in _CLIPPED_LOSSES:
                low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
                high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
                self._add_mean("clip_ratio/low_mean", low, mask)
                self._add_mean("clip_ratio/high_mean", high, mask)
                self._add_mean("clip_ratio/region_mean", torch.maximum(low, high), mask)
                self._step_metrics.add_extreme("clip_ratio/low_min", _sequence_means(low, mask))
                self._step_metrics.add_extreme("clip_ratio/high_max", _sequence_means(high, mask))
            elif loss_type == "cispo":
                clipped = ((coef_1 > self.epsilon_high) & (advantages > 0)).float()
                self._add_mean("cispo_clip_ratio", clipped, mask)
            elif loss_type == "vespo":
                self._add_mean("vespo/phi_seq_mean", phi_seq, mask)
        return loss * self.accelerator.num_processes

    def _normalised(self, per_token_loss: torch.Tensor, mask: torch.Tensor, step: RolloutStep) -> torch.Tensor:
        """This microbatch's share of the minibatch's loss (see :class:`ODCGRPOConfig` for each definition)."""
        loss_type, rollouts, masked_loss = self.loss_type, step.num_samples, per_token_loss * mask
        if loss_type in ("grpo", "sapo"):
            return (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rollouts
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

    def _add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL's global masked mean: per token over the mask, or per rollout for ``(k, 1)``."""
        if values.shape[1] == 1:
            self._step_metrics.add_mean(name, values.sum(), values.shape[0])
        else:
            self._step_metrics.add_mean(name, (values * mask).sum(), mask.sum())

    def _end_step(self, step: RolloutStep, metrics: dict[str, float]) -> None:
        """TRL's adaptive entropy controller, on the minibatch's entropy over every rank's trained tokens."""
        if not self._entropy_bonus_enabled:
            return
        if self.use_adaptive_entropy:
            world_entropy, delta = metrics["entropy"], self.args.entropy_coef_delta
            if world_entropy <= self.args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + delta, self.args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - delta, self.args.entropy_coef_min)
            self._last_world_entropy = world_entropy
        self._metrics["train"]["entropy_coef"].append(self.entropy_coef)


def _generates_below_the_root(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule) and is_peft_model(model)


@contextlib.contextmanager
def _root_gathered(model: FSDPModule) -> Iterator[None]:
    lazy_init_root(model)
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _loads_a_model(model: Any, reward_funcs: Any, args: ODCGRPOConfig) -> bool:
    """Whether TRL will load a model by name with ``model_init_kwargs``: the policy, the reference model (``beta > 0``
    without PEFT) or a reward model."""
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    return isinstance(model, str) or args.beta != 0.0 or any(isinstance(func, str) for func in funcs)


def _sequence_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each rollout's mean over its trained tokens (NaN without any), or the value itself for ``(k, 1)``."""
    if values.shape[1] == 1:
        return values.squeeze(1)
    return (values * mask).sum(-1) / mask.sum(-1)
