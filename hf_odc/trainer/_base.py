"""What every ODC trainer shares: :class:`_ODCConfig` (fields and validation) and :class:`_ODCTrainer` (sharding,
the minibatch context, the once-per-step metric gather, DCP checkpoints, ``end``).

A trainer is ``class ODCXTrainer(_ODCTrainer, XTrainer)`` with ``class ODCXConfig(_ODCConfig, XConfig)``: the mixins
come first, so their overrides wrap TRL's, and what stays in the subclass is what is specific to X (its data path,
its loss, its metrics).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME

from ..accelerate_plugin import ODCPlugin, ODCRuntime
from ..kernels import DEFAULT_TIMEOUT_S, TRANSPORTS, PeerFailureError
from ..packing import COSTS, PLANNERS, Calibration, Calibrator, MinibatchPlanner, idle_fraction, named_cost, token_cap
from ..packing.calibration import FEATURES
from . import _checkpoint
from ._bounded import bound_process_groups, is_backend_failure, named_failure
from ._console import CONSOLE_CALLBACKS
from ._quiet import without_resumed_batch_size_warning
from .attention import use_packed_attention

CALIBRATION_FILE = "odc_calibration.json"
"""Where the ODC trainers save the calibrated cost model, beside the model (and in every checkpoint)."""

_COST_MODELS = (*COSTS, "calibrated")

_ODC_PARAMETERS = """
        > Parameters of On-Demand Communication and the minibatch plan

        odc (`bool`, *optional*):
            Run each rank's microbatches with On-Demand Communication: ranks meet once per minibatch, so they may run
            different numbers of microbatches. `False` runs plain FSDP2 (collectives in every layer), which needs the
            same microbatch count on every rank: the fair baseline is `balance="lb-micro"`. `None` reads
            `HF_ODC_ENABLED` (default `True`).
        odc_timeout (`float`, *optional*):
            Seconds any rank waits for another before raising `hf_odc.PeerFailureError` naming it: at the minibatch
            barriers, before every collective of a step (metrics, clipping, logging, evaluation, checkpoints), and
            inside them (every process group gets this timeout, on CPU too). A rank that stops beating (stopped or
            frozen: `hf_odc.kernels.heartbeat`) is named after it too, during startup as well. `None` reads
            `HF_ODC_TIMEOUT`, else `hf_odc.kernels.DEFAULT_TIMEOUT_S`.
        odc_transport (`str`, *optional*):
            The transport ODC reads and pushes through, a name of `hf_odc.kernels.TRANSPORTS` (`"cpu-shm"`,
            `"cuda-symm-mem"`). `None` reads `HF_ODC_TRANSPORT`, else the one for the model's device.
        odc_shard_size (`int`, *optional*):
            Ranks per shard group: parameters are sharded within a group and replicated across groups (hybrid ODC,
            FSDP2's HSDP layout: one-sided reads and pushes inside a group, one all-reduce of each gradient shard
            across replicas per minibatch). A group must lie within one host. `None` reads `HF_ODC_SHARD_SIZE`, else
            a host's ranks, so a job on one host shards over every rank and a job over several hosts is hybrid.
        balance (`str`, *optional*):
            How each global minibatch is split (a name of `hf_odc.packing.PLANNERS`): `"lb-mini"` balances each rank's
            total cost, ranks may run different numbers of microbatches (needs `odc=True`); `"lb-micro"` gives every
            rank the same number of microbatches, each microbatch step balanced across ranks; `"local-sort"` deals
            samples round-robin, one per microbatch (the unbalanced baseline). `None`: `"lb-mini"` with ODC,
            `"lb-micro"` without.
        max_tokens_per_microbatch (`int`, *optional*):
            Token capacity of one packed microbatch. Mutually exclusive with `packing_ratio`.
        packing_ratio (`float`, *optional*):
            Token capacity of one packed microbatch as a multiple of the longest sample it must fit (SFT:
            `max_length`; GRPO: the minibatch's longest rollout), so `1.0` fits exactly one longest sample. Used when
            `max_tokens_per_microbatch` is not set; defaults to `1.0`.
        cost_model (`str`, *optional*, defaults to `"calibrated"`):
            Per-sample cost the planner balances. `"calibrated"`: start from `"attention"` (or from
            `calibration_file`) and refit after every step to the microbatch times every rank measured
            (`hf_odc.packing.Calibrator`: fixed costs per microbatch and per sequence, per token and per squared
            token); with ODC and `balance="lb-mini"`, each rank also gets work in proportion to its measured speed.
            The fit is logged (`calibration/*`) and saved with the model as `odc_calibration.json`, which
            `hf-odc plan --calibration` reads. Plans then depend on measured times, so two runs may group samples
            differently (same gradients up to floating-point summation order); `"attention"` (FLOPs of the trained
            model's shape, linear plus quadratic in the length; see `hf_odc.packing.AttentionCost`) and `"tokens"`
            (sequence length) plan identically in every run.
        calibration_file (`str`, *optional*):
            A calibration to start from (`odc_calibration.json` of an earlier run; its speeds are kept only with the
            same number of ranks). Needs `cost_model="calibrated"`.
        freeze_calibration (`bool`, *optional*, defaults to `False`):
            Plan with `calibration_file` as it is, without refitting. Needs `calibration_file`.
        packed_attention (`bool`, *optional*, defaults to `True`):
            Switch a model whose attention implementation is `"sdpa"` or `"eager"` (transformers' default) to
            hf_odc's `"odc_packed"` (`hf_odc.trainer.attention`): each packed sample is attended on its own, so a
            microbatch costs the sum of its samples instead of the square of its length, with no `T x T` mask.
            `False` keeps the model's implementation (with a warning for `sdpa`/`eager` on a GPU). Flash and flex
            attention are always kept.

    > [!NOTE]
    > Defaults that differ from TRL's configs: `bf16` defaults to `True` only when CUDA is available (CPU runs are
    > fp32, exact enough to compare with a single-process run), and `use_cpu` defaults to `True` when no CUDA device
    > exists: `accelerate launch` starts CPU processes through torchrun without telling them to use the CPU, and
    > without it every process would silently train alone.
"""


def _document_odc_fields(config_class: type) -> type:
    """Put the shared ODC fields' documentation where ``config_class``'s docstring says ``{odc_parameters}``, so that
    every ODC config documents every field and the text exists once."""
    config_class.__doc__ = config_class.__doc__.replace("    {odc_parameters}", _ODC_PARAMETERS.strip("\n"))
    return config_class


@dataclass
class _ODCConfig:
    r"""
    The ODC fields of every ODC trainer's config; each config's docstring documents them (see
    :class:`~hf_odc.trainer.ODCSFTConfig`), and :meth:`__post_init__` validates them before TRL's own checks.
    """

    odc: bool | None = field(
        default=None,
        metadata={
            "help": "Run each rank's microbatches with On-Demand Communication (ranks meet once per minibatch). False "
            "runs plain FSDP2 (the baseline). Unset: HF_ODC_ENABLED, default true."
        },
    )
    odc_timeout: float | None = field(
        default=None,
        metadata={
            "help": f"Seconds a rank waits for another (minibatch barriers, every collective of a step) before naming "
            f"it in an error. Unset: HF_ODC_TIMEOUT, default {DEFAULT_TIMEOUT_S:g}."
        },
    )
    odc_transport: str | None = field(
        default=None,
        metadata={
            "help": "ODC's transport by name. Unset: HF_ODC_TRANSPORT, else the one for the model's device.",
            "choices": list(TRANSPORTS),
        },
    )
    odc_shard_size: int | None = field(
        default=None,
        metadata={
            "help": "Ranks per shard group, replicated across groups (one all-reduce per minibatch). Unset: "
            "HF_ODC_SHARD_SIZE, else a host's ranks."
        },
    )
    balance: str | None = field(
        default=None,
        metadata={
            "help": "Minibatch plan: 'lb-mini' (balance each rank's total, needs odc), 'lb-micro' (equal microbatch "
            "counts, each step balanced) or 'local-sort' (round-robin, one sample per microbatch). Unset: lb-mini "
            "with ODC, lb-micro without.",
            "choices": list(PLANNERS),
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={"help": "Token capacity of one packed microbatch. Exclusive with packing_ratio."},
    )
    packing_ratio: float | None = field(
        default=None,
        metadata={"help": "Microbatch capacity as a multiple of max_length (default 1.0 when no token cap is set)."},
    )
    cost_model: str = field(
        default="calibrated",
        metadata={
            "help": "Per-sample cost to balance: 'attention' (FLOPs of the model's shape), 'tokens', or 'calibrated' "
            "(fitted to measured microbatch times while training, with a speed per rank for LB-Mini).",
            "choices": list(_COST_MODELS),
        },
    )
    calibration_file: str | None = field(
        default=None,
        metadata={"help": "odc_calibration.json of an earlier run to start from (cost_model='calibrated')."},
    )
    freeze_calibration: bool = field(
        default=False,
        metadata={"help": "Plan with calibration_file as it is, without refitting."},
    )
    packed_attention: bool = field(
        default=True,
        metadata={
            "help": "Switch sdpa/eager models to hf_odc's 'odc_packed' attention (each packed sample attended on its "
            "own, no T x T mask). False keeps the model's implementation."
        },
    )

    def __post_init__(self):
        if not torch.cuda.is_available():
            self.use_cpu = True
            if self.bf16 is None:
                self.bf16 = False
        plugin = self.odc_plugin()
        self.odc, self.odc_timeout, self.odc_transport = plugin.enabled, plugin.timeout, plugin.transport
        self.odc_shard_size = plugin.shard_size
        if self.balance is None:
            self.balance = "lb-mini" if self.odc else "lb-micro"
        if self.balance not in PLANNERS:
            raise ValueError(f"balance must be one of {tuple(PLANNERS)}, got {self.balance!r}.")
        if self.balance == "lb-mini" and not self.odc:
            raise ValueError(
                "balance='lb-mini' gives ranks different numbers of microbatches, which plain FSDP2 (odc=False) "
                "cannot run: its per-layer collectives would deadlock. Use --balance lb-micro for the baseline, or "
                "--odc true."
            )
        if self.cost_model not in _COST_MODELS:
            raise ValueError(f"cost_model must be one of {_COST_MODELS}, got {self.cost_model!r}.")
        if self.calibration_file is not None and self.cost_model != "calibrated":
            raise ValueError("calibration_file is the starting point of cost_model='calibrated'; set that too.")
        if self.freeze_calibration and self.calibration_file is None:
            raise ValueError(
                "freeze_calibration keeps a calibration as it is: pass calibration_file (an earlier run's "
                "odc_calibration.json), or unset freeze_calibration to calibrate during this run."
            )
        if self.max_tokens_per_microbatch is not None and self.packing_ratio is not None:
            raise ValueError("Set max_tokens_per_microbatch or packing_ratio, not both.")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}.")
        if self.packing_ratio is not None and not self.packing_ratio > 0:
            raise ValueError(f"packing_ratio must be > 0, got {self.packing_ratio}.")
        if self.per_device_train_batch_size < 1:
            raise ValueError(
                f"per_device_train_batch_size must be >= 1 (samples per rank in each global minibatch), got "
                f"{self.per_device_train_batch_size}."
            )
        if getattr(self, "activation_checkpointing", False) is None:
            # transformers 5.23 renamed gradient_checkpointing, and warns when the old name is set: TRL's configs set
            # it by default, and the examples' documented flag is --gradient_checkpointing. Both names mean the same.
            for old, new in (
                ("gradient_checkpointing", "activation_checkpointing"),
                ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
            ):
                if getattr(self, new) is None:
                    setattr(self, new, getattr(self, old))
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                f"{type(self).__name__} runs one global minibatch per optimizer step, cut into microbatches by the "
                "planner; set gradient_accumulation_steps=1 and grow per_device_train_batch_size instead."
            )
        super().__post_init__()

    def odc_plugin(self) -> ODCPlugin:
        """The :class:`~hf_odc.accelerate_plugin.ODCPlugin` these fields describe."""
        return ODCPlugin(
            enabled=self.odc, timeout=self.odc_timeout, transport=self.odc_transport, shard_size=self.odc_shard_size
        )

    def token_cap_for(self, longest_sample: int) -> int:
        """Tokens one packed microbatch may hold: ``max_tokens_per_microbatch``, else ``packing_ratio`` (default 1)
        times ``longest_sample``, the longest sample the microbatches must fit."""
        if self.max_tokens_per_microbatch is not None:
            return self.max_tokens_per_microbatch
        return token_cap(longest_sample, self.packing_ratio or 1.0)


class _ODCTrainer:
    """The ODC side of a TRL trainer (a mixin placed before the TRL class).

    The subclass calls :meth:`_setup_odc` at the end of its ``__init__``, runs each step's microbatches through
    :meth:`_run_minibatch`, and logs through :meth:`_log_minibatch`.
    """

    def _setup_odc(self) -> None:
        """Packed attention, then (with several processes) FSDP2 sharding and ODC; the planner's cost model."""
        args = self.args
        use_packed_attention(self.model, args.packed_attention, args.device)
        self.odc = ODCRuntime(args.odc_plugin(), self.accelerator)
        if self.accelerator.num_processes > 1:
            fsdp_plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            if fsdp_plugin is not None and fsdp_plugin.fsdp_version != 2:
                raise ValueError(
                    f"{type(self).__name__} shards with FSDP2; set `fsdp_version: 2` in the Accelerate config."
                )
            self.model = self.model_wrapped = self.odc.shard(self.model)
            if not self.is_fsdp_enabled:
                # Accelerate runs CPU processes as MULTI_CPU, whose prepare() would wrap the sharded model in DDP. The
                # model manages its own placement and gradient reduction, so Accelerate only adds autocast (and
                # compilation): prepared here, the model is marked prepared and the Trainer's own prepare() leaves it
                # as it is, on transformers 5.17 as on 5.23 (which also reads the flag below).
                prepared = self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
                self.model = self.model_wrapped = prepared
                self.is_distributed_loading_by_transformers = True
        self.odc.enable(self.model)
        bound_process_groups(args.odc_timeout)
        self._planner = self._minibatch_planner()

    def _minibatch_planner(self) -> MinibatchPlanner:
        """The run's planner: ``balance`` with the configured cost model (a calibrated one starts from the attention
        cost, or from ``calibration_file``) under the synchronisation the run uses."""
        args, world_size = self.args, self.accelerator.num_processes
        calibrator = None
        if args.cost_model == "calibrated":
            initial = Calibration.load(args.calibration_file) if args.calibration_file is not None else None
            calibrator = Calibrator(world_size, initial=initial, frozen=args.freeze_calibration)
        analytical = "attention" if args.cost_model == "calibrated" else args.cost_model
        cost = named_cost(analytical, self.model.config.get_text_config())
        sync = "minibatch" if self.odc.active else "layer"
        return MinibatchPlanner(args.balance, world_size, sync, cost, calibrator)

    @property
    def _global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.args.per_device_train_batch_size * self.accelerator.num_processes

    @property
    def _is_sharded(self) -> bool:
        return isinstance(self.model, FSDPModule)

    def _run_minibatch(
        self, model: nn.Module, microbatches: list[dict[str, Any]], loss_of: Callable[[dict[str, Any]], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward of this rank's ``microbatches`` (``loss_of`` gives each one's already normalised
        loss, given it on the device) inside the minibatch context; without ODC, FSDP2's reduce-scatter runs once, in
        the last backward. Returns the summed loss, detached."""
        defer_reduction = not self.odc.active and isinstance(model, FSDPModule)
        loss = torch.zeros((), device=self.args.device)
        offload = getattr(self, "maybe_activation_offload_context", contextlib.nullcontext())  # SFT's option
        with offload, self.odc.minibatch():
            for index, microbatch in enumerate(microbatches):
                if defer_reduction:
                    model.set_requires_gradient_sync(index == len(microbatches) - 1)
                microbatch_loss = loss_of(self._to_device(microbatch))
                self.accelerator.backward(microbatch_loss)
                loss += microbatch_loss.detach()
                self.odc.lap()
        return loss

    def _to_device(self, inputs: Any) -> Any:
        """``inputs`` on the training device: the Trainer's ``_prepare_inputs``, not a subclass's (GRPO's generates
        rollouts there)."""
        return Trainer._prepare_inputs(self, inputs)

    def _log_minibatch(
        self,
        microbatch_lengths: list[list[list[int]]],
        num_tokens: int,
        predicted_bubble_rate: float,
        values: dict[str, torch.Tensor],
    ) -> dict[str, list[float]]:
        """Gather this step's values from every rank in one collective, after the minibatch; log the timings and feed
        the measured microbatch times to the calibration.

        ``microbatch_lengths[rank][m]`` are the sample lengths of every rank's microbatches (the plan, known on every
        rank), ``num_tokens`` the whole minibatch's tokens, ``predicted_bubble_rate`` the plan's. ``values`` are
        per-rank scalars (kept on the device until now), returned as per-rank lists by name for the caller to reduce.
        Timings are device-timed and mean the same with and without ODC (:mod:`hf_odc.engine.timing`)."""
        stats = self.odc.last
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        counts = [len(rank) for rank in microbatch_lengths]
        times = stats.microbatches + [0.0] * (max(counts) - len(stats.microbatches))  # the same width on every rank
        device = self.args.device
        stacked = [v.reshape(()).to(device, torch.float64) for v in values.values()]
        own = [stats.busy, stats.wait, peak_gib, stats.all_reduce, *times]
        stacked.append(torch.tensor(own, dtype=torch.float64, device=device))
        with self._bounded("the step's metrics gather"):
            gathered = self.accelerator.gather(torch.cat([v.reshape(-1) for v in stacked])[None]).cpu().tolist()
        per_rank = {name: [row[i] for row in gathered] for i, name in enumerate(values)}
        first = len(values)  # then busy, wait, peak, the cross-host all-reduce and the microbatch times
        busy, wait, peak, all_reduce = ([row[first + i] for row in gathered] for i in range(4))
        times = [row[first + 4 :] for row in gathered]
        step = max(b + w for b, w in zip(busy, wait, strict=True))
        metrics = self._metrics["train"]
        metrics["step_s"].append(step)
        metrics["tokens_per_second"].append(num_tokens / max(step, 1e-9))
        metrics["bubble_rate"].append(idle_fraction(busy, step))
        metrics["predicted_bubble_rate"].append(predicted_bubble_rate)
        if torch.cuda.is_available():
            metrics["peak_memory_gib"].append(max(peak))  # the largest rank's, since the start
        if self.odc.hybrid:
            metrics["all_reduce_s"].append(max(all_reduce))
        for rank, lengths in enumerate(microbatch_lengths):
            metrics[f"busy_s/rank_{rank}"].append(busy[rank])
            metrics[f"wait_s/rank_{rank}"].append(wait[rank])
            metrics[f"microbatches/rank_{rank}"].append(counts[rank])
            metrics[f"tokens/rank_{rank}"].append(sum(map(sum, lengths)))
        self._planner.record(microbatch_lengths, [times[rank][:count] for rank, count in enumerate(counts)])
        calibration = self._planner.calibration
        if calibration is not None:
            for name in FEATURES:
                metrics[f"calibration/{name}"].append(getattr(calibration.cost, name))
            metrics["calibration/error"].append(calibration.error)
            for rank, speed in enumerate(calibration.speeds):
                metrics[f"calibration/speed/rank_{rank}"].append(speed)
        return per_rank

    # -- the console --------------------------------------------------------------------------------------------------

    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        """``Trainer.add_callback``, with transformers' console printers (which the Trainer adds this way) replaced by
        ones that summarise the per-rank values (:mod:`hf_odc.trainer._console`); the ``report_to`` loggers and
        ``trainer_state.json`` still get every value."""
        if isinstance(callback, type):
            callback = CONSOLE_CALLBACKS.get(callback, callback)
        super().add_callback(callback)

    # -- bounded collectives (hf_odc.trainer._bounded) -----------------------------------------------------------------

    @contextlib.contextmanager
    def _bounded(self, what: str) -> Iterator[None]:
        """Run the collectives of ``what`` once every rank has met (:meth:`hf_odc.ODC.meet` names a rank that died or
        stalled, within the ODC timeout, where the collective would block); a collective that fails inside is re-raised
        as :class:`~hf_odc.PeerFailureError` naming the rank if it is known. Every rank must enter the same blocks in
        the same order, as they run the same collectives. Without ODC the process groups' timeout alone bounds them."""
        odc = self.odc.odc
        if odc is None:
            yield
            return
        odc.meet(f"{what} (hf_odc's meeting before its collectives)")
        try:
            yield
        except RuntimeError as error:
            if not is_backend_failure(error):
                raise
            raise named_failure(odc, what, error) from error

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        with self._bounded("gradient clipping"):
            return super()._clip_grad_norm(model)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        with self._bounded("logging, evaluation and checkpointing"):
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self._bounded("evaluation"):
            return super().evaluate(*args, **kwargs)

    def close_odc(self) -> None:
        """Release ODC (collective), keeping the process group: the model then runs as plain FSDP2."""
        self.odc.close()

    def end(self) -> None:
        """Release ODC, then finish the trackers and destroy the process group (``Trainer.end``). Collective: call it
        once, on every rank, at the very end of the script."""
        self.close_odc()
        self.accelerator.end_training()

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from complete checkpoints only. ``True`` takes the newest complete
        ``checkpoint-N`` of ``output_dir`` (:func:`~hf_odc.trainer._checkpoint.last_complete_checkpoint`, in place of
        transformers' ``get_last_checkpoint``, which takes the newest however incomplete); a checkpoint that is
        incomplete, or lacks the optimizer or scheduler state, is refused before anything is loaded (the string
        ``"true"`` of a command line counts as ``True`` unless such a directory exists).

        If training fails on this rank, the others are told at once (their next meeting fails naming this rank), and a
        collective that failed because a peer went away is re-raised as :class:`~hf_odc.PeerFailureError` naming it."""
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == "true":
            resume_from_checkpoint = True if not os.path.isdir(resume_from_checkpoint) else resume_from_checkpoint
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _checkpoint.last_complete_checkpoint(self.args.output_dir)
        quiet = contextlib.nullcontext()
        if isinstance(resume_from_checkpoint, str | os.PathLike):
            _checkpoint.check_resumable(os.fspath(resume_from_checkpoint))
            if _checkpoint.saved_global_batch_size(os.fspath(resume_from_checkpoint)) == self._global_batch_size:
                quiet = without_resumed_batch_size_warning()  # another process count, the same minibatches
        try:
            with quiet:
                return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as error:
            odc = self.odc.odc
            if odc is None or isinstance(error, PeerFailureError):
                raise
            odc.abort(f"{type(error).__name__}: {error}")
            if is_backend_failure(error):
                raise named_failure(odc, "training", error) from error
            raise

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer._save_checkpoint``, then, once every rank's part is on disk, the completion marker, then the
        rotation of older checkpoints (``save_total_limit``). Transformers rotates at the end of its save, which would
        be before the marker: a save killed in between could leave no complete checkpoint, so the rotation is held
        back until this one is complete."""
        with self._bounded("a checkpoint save"):
            self._save_complete_checkpoint(model, trial)

    def _save_complete_checkpoint(self, model: nn.Module, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        output_dir = _checkpoint.checkpoint_dir_of(run_dir, self.state.global_step)
        if self.args.should_save:
            _checkpoint.unmark_complete(output_dir)  # before any rank overwrites an earlier save of this step
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit
        self.accelerator.wait_for_everyone()  # every rank's shards and RNG state are written
        if self.args.should_save:
            _checkpoint.mark_complete(output_dir, self.state.global_step, self._global_batch_size)
            _checkpoint.rotate(run_dir, save_total_limit, self.state.best_model_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``save_pretrained`` of the unsharded model (collective: every rank must call it), and the calibrated cost
        model beside it (:data:`CALIBRATION_FILE`)."""
        with self._bounded("saving the model"):
            self._save_unsharded(output_dir, _internal_call)

    def _save_unsharded(self, output_dir: str | None, _internal_call: bool) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        calibration = self._planner.calibration
        if calibration is not None and self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            calibration.save(os.path.join(output_dir, CALIBRATION_FILE))
        if not self._is_sharded:
            return super().save_model(output_dir, _internal_call)
        state_dict = _checkpoint.full_model_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The model and optimizer state through DCP (each rank's shards, or one process's whole state) and the LR
        scheduler's (one process): the same format whatever the process count, so that a checkpoint resumes on any
        other. The Trainer's one-process ``optimizer.pt`` is not written."""
        _checkpoint.save_state(self.model, _torch_optimizer(self.optimizer), _state_dir(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The model's weights from the DCP state, resharded to this run's processes (``model``: the Trainer's wrapper
        of ``self.model``, when it passes one), and the checkpoint's calibration (newer than ``calibration_file``)
        unless frozen."""
        saved = os.path.join(resume_from_checkpoint, CALIBRATION_FILE)
        calibrator = self._planner.calibrator
        if calibrator is not None and not calibrator.frozen and os.path.isfile(saved):
            self._planner.calibrator = Calibrator(calibrator.world_size, initial=Calibration.load(saved))
        _checkpoint.load_model_state(model if model is not None else self.model, _state_dir(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer state from DCP, resharded, and the LR scheduler's. The Trainer subclass's part runs first, for
        the state a TRL trainer keeps there (GRPO's entropy controller); its stock branch looks for ``optimizer.pt``,
        which this format does not have, and loads nothing."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        _checkpoint.load_optimizer_state(self.model, _torch_optimizer(self.optimizer), _state_dir(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer inside Accelerate's wrapper (DCP steps it once to initialise empty state)."""
    return getattr(optimizer, "optimizer", optimizer)


def _state_dir(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, _checkpoint.STATE_DIR)
