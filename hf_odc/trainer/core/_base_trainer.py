"""What every ODC trainer shares: :class:`_ODCTrainer`, the one step loop and its setup.

A trainer is ``class ODCXTrainer(_ODCTrainer, XTrainer)`` with ``class ODCXConfig(_ODCConfig, XConfig)``: the mixins
come first, so their overrides wrap TRL's. The loop (:meth:`_ODCTrainer.training_step`) is the same for every trainer:
it collects the optimizer step's inputs, asks the trainer to plan them (:meth:`_ODCTrainer._plan_step`), runs this
rank's microbatches inside one ODC minibatch, each through the trainer's loss (:meth:`_ODCTrainer._microbatch_loss`),
and gathers every rank's timings and metrics once. What stays in a trainer is what is specific to it: its data path,
its loss, and which metrics it declares.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import datasets
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from ... import _compat
from ...accelerate_plugin import ODCRuntime, accelerate_without_parallelism
from ...kernels import install_fused_kernels
from ...kernels.attention import sdpa_length
from ...packing import MinibatchPlanner, idle_fraction, named_cost
from ...packing.calibration import FEATURES, Calibration, Calibrator
from ...packing.flops import mfu, peak_flops, training_flops
from ._base_config import compute_dtype
from ._checkpoint_hooks import _CheckpointHooks
from ._collector import StepCollector
from ._console import CONSOLE_CALLBACKS
from ._moe import ExpertActivity, ExpertLoad
from ._quiet import without_checkpointing_alias_warning
from ._step import PlannedStep, StepMetrics
from .activation_checkpointing import checkpoint_layer_share, checkpointed_layers, save_attention_in_checkpoints
from .attention import attention_shape, check_sequence_parallel, use_packed_attention, warm_attention_plans
from .vision import is_vision_dataset


class _ODCTrainer(_CheckpointHooks, ABC):
    """The ODC side of a TRL trainer (a mixin placed before the TRL class).

    A trainer implements the two hooks, :meth:`_plan_step` and :meth:`_microbatch_loss`, and calls
    :meth:`_setup_odc` at the end of its ``__init__`` with the metrics its loss accumulates. Optional hooks:
    :meth:`_microbatch_context` (a context around the minibatch's microbatches) and :meth:`_end_step` (after each
    step's metrics are reduced).
    """

    _weighs_moe_aux_loss = True
    """Whether the router's load-balancing loss (:mod:`hf_odc.trainer.core._moe`) is checked against TRL's for this
    trainer; ``False`` refuses a MoE model with the loss on, at construction."""

    _config_class: ClassVar[type]
    """The trainer's config, ``ODCXConfig``: the only ``args`` it takes (:meth:`_odc_args`)."""

    # -- construction -------------------------------------------------------------------------------------------------

    def __init__(self, *args: Any, **kwargs: Any):
        """TRL's construction, without a deprecation warning the user did not cause (PEFT reads the property it names
        as TRL wraps the model with ``peft_config``)."""
        with without_checkpointing_alias_warning():
            super().__init__(*args, **kwargs)

    @classmethod
    def _odc_args(cls, args: Any) -> Any:
        """``args``, or when ``None`` the config's defaults (output directory ``odc-x``, as TRL names its default
        one after the trainer); another config is refused (``TypeError``): TRL's own lacks the ODC fields."""
        config_class = cls._config_class
        if args is None:
            return config_class(f"odc-{config_class.__name__.removeprefix('ODC').removesuffix('Config').lower()}")
        if not isinstance(args, config_class):
            raise TypeError(f"{cls.__name__} needs an {config_class.__name__}, got {type(args).__name__}.")
        return args

    @classmethod
    def _check_train_data(cls, kwargs: dict[str, Any], packs: str | None, text: str | None) -> None:
        """Refuse, before TRL builds anything, what the planner cannot train on: a ``data_collator`` (the planner packs
        the ``packs`` itself; ``None``: the trainer refuses it itself), a ``train_dataset`` that is not a map-style
        ``datasets.Dataset`` (it samples global minibatches) and, when the trainer trains on ``text`` only, a vision
        dataset (``NotImplementedError``)."""
        if packs is not None and kwargs.get("data_collator") is not None:
            raise ValueError(f"{cls.__name__} does not accept `data_collator`: the planner packs the {packs}.")
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is not None and not isinstance(train_dataset, datasets.Dataset):
            raise TypeError(f"{cls.__name__} needs a map-style `datasets.Dataset`: it samples global minibatches.")
        if text is not None and train_dataset is not None and is_vision_dataset(train_dataset):
            raise NotImplementedError(f"{cls.__name__} trains on text {text}; vision datasets are not supported.")

    # -- the hooks a trainer supplies ---------------------------------------------------------------------------------

    @abstractmethod
    def _plan_step(self, window: list[Any]) -> PlannedStep:
        """The optimizer step's minibatch, planned. ``window`` holds what the Trainer's data loader gave each of the
        step's ``gradient_accumulation_steps`` calls of ``training_step`` (fewer at the end of an epoch), in order;
        every rank must return the same plan (its own row of microbatches)."""

    @abstractmethod
    def _microbatch_loss(self, model: nn.Module, microbatch: Any, step: PlannedStep) -> torch.Tensor:
        """The loss of one of this rank's microbatches (on the device), normalised for the whole minibatch, so that the
        sum over every rank's microbatches is the single-process loss of the minibatch (the step scales it by the
        world size: ODC, as FSDP2, averages gradients over ranks). Accumulates the step's metrics into
        ``self._step_metrics``."""

    def _model_inputs(self, microbatch: Any) -> dict[str, Any]:
        """The model's forward inputs of one of this rank's microbatches (on the device): its ``"model"`` entry, as
        the packers of preference pairs and rollouts make them; SFT's microbatch is the inputs itself."""
        return microbatch["model"]

    def _microbatch_context(self) -> contextlib.AbstractContextManager:
        """A context around the minibatch's microbatches (SFT: activation offloading)."""
        return contextlib.nullcontext()

    def _training_documents(self) -> Iterable[int] | None:
        """The token counts of the documents training will attend, where the trainer knows them before the first
        step (``warm_attention_plans`` builds cuDNN's plans for their lengths); ``None`` where it does not."""
        return None

    def _forward_only_models(self) -> list[nn.Module]:
        """The models that run forward-only passes over the documents the trainer trains on (a reference, the policy
        for a KL estimate, a teacher), whose attention plans are warmed with the training ones: cuDNN plans a forward
        without autograd apart. None by default; a pass a trainer runs only at times warms its plans itself
        (:meth:`_warm_attention`)."""
        return []

    def _end_step(self, step: PlannedStep, metrics: dict[str, float]) -> None:
        """After the step's metrics are reduced over the ranks and logged (``metrics``, by name)."""

    # -- setup --------------------------------------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's, with Accelerate's ``parallelism_config`` hidden from the ``Accelerator``: hf_odc honours it
        itself (the config's ``sp_size``), on CPU too, where the ``Accelerator`` would refuse it."""
        with accelerate_without_parallelism(self.args):
            super().create_accelerator_and_postprocess()

    def _setup_odc(self, step_metrics: StepMetrics) -> None:
        """Packed attention and what activation checkpointing keeps of it (enabled later, by ``Trainer.train``), the
        fused kernels, then (with several processes) FSDP2 sharding and ODC; the planner's cost model; the metrics the
        trainer's loss accumulates. Checks first that the TRL and transformers names hf_odc relies on are there
        (:mod:`hf_odc._compat`)."""
        _compat.check_trainer(self)
        args = self.args
        if args.min_tokens_per_microbatch is None:
            args.min_tokens_per_microbatch = self._busy_microbatch_tokens()
        use_packed_attention(self.model, args.packed_attention, args.device)
        check_sequence_parallel(self.model, args.sp_size)
        if args.checkpoint_attention == "save":
            save_attention_in_checkpoints(self.model)
        checkpoint_layer_share(self.model, args.checkpoint_layer_share)
        self._install_fused_kernels(self.model)
        self._warmed_lengths: dict[tuple[bool, tuple[int, int, int]], set[int]] = {}
        self._warm_s = 0.0
        self._collector = StepCollector(args.manual_gc)
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
                _compat.mark_distributed_loading(self)
        self.odc.enable(self.model)
        self._expert_activity = self._expert_counter()
        self._planner = self._minibatch_planner()
        self._frozen_runtimes: list[ODCRuntime] = []
        self._step_metrics = step_metrics
        self._expert_load = self._moe_load_balancing()
        self._window: list[Any] = []
        # The Trainer's estimate (6 x parameters x tokens), counted on the tokens of this rank's share.
        count = getattr(self.model, "num_parameters", None)
        self._flops_per_token = 6 * count(exclude_embeddings=True) if count is not None else 0
        self._step_flos = 0
        self._cycle_start: float | None = None  # where the step being run began on the host (_log_step)
        device = self.args.device
        self._peak_flops = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")

    def _busy_microbatch_tokens(self) -> int:
        """``min_tokens_per_microbatch``'s default: on a GPU, the tokens whose kept activations fill an eighth of the
        smallest rank's device memory (every rank must plan alike); 0 on the CPU, where the host is the device.

        Kept per token and layer: by a checkpointed layer, its input and its saved attention output (two hidden-size
        vectors); by another, an estimate of what a decoder layer's forward keeps (six hidden-size and three MLP-width
        vectors). The recomputed layer's working set and the chunked logits come on top, which the remaining seven
        eighths leave room for."""
        args = self.args
        if args.device.type != "cuda":
            return 0
        config = self.model.config.get_text_config()
        hidden, layers = config.hidden_size, config.num_hidden_layers
        whole = 6 * hidden + 3 * (getattr(config, "intermediate_size", None) or 4 * hidden)
        checkpointed = checkpointed_layers(args.checkpoint_layer_share, layers) if args.checkpoints_activations else 0
        kept = checkpointed * 2 * hidden + (layers - checkpointed) * whole  # per token, over every layer
        value_bytes = 2 if args.bf16 or args.fp16 else 4
        memory = torch.tensor([torch.cuda.get_device_properties(args.device).total_memory], device=args.device)
        smallest = int(self.accelerator.gather(memory).min())
        return smallest // 8 // (kept * value_bytes)

    def _install_fused_kernels(self, model: nn.Module) -> None:
        """``fused_kernels``: the fused RMSNorm and MLP forwards on ``model``, before it is sharded, in a CUDA run (the
        kernels are Triton's; a CPU run keeps transformers' forwards, which they equal)."""
        if self.args.fused_kernels and self.args.device.type == "cuda":
            install_fused_kernels(model)

    def _moe_load_balancing(self) -> ExpertLoad | None:
        """The router's load-balancing loss over each step's global minibatch (:mod:`hf_odc.trainer.core._moe`), when
        TRL enabled it for this model (a MoE model with ``router_aux_loss_coef != 0``); ``None`` otherwise. Refused by a
        trainer whose parity with TRL's loss has not been checked (:attr:`_weighs_moe_aux_loss`)."""
        if not getattr(self, "aux_loss_enabled", False):
            return None
        if self.args.sp_size > 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not weight MoE auxiliary losses with sequence parallelism yet; set "
                "router_aux_loss_coef=0 or sp_size to 1."
            )
        if not self._weighs_moe_aux_loss:
            raise NotImplementedError(
                f"{type(self).__name__} does not weight MoE auxiliary losses yet; set router_aux_loss_coef=0 (SFT, "
                "DPO and GRPO train MoE models with it)."
            )
        config = self.model.config.get_text_config()
        return ExpertLoad(self.model, config.num_experts, config.num_experts_per_tok, self.router_aux_loss_coef)

    def _expert_counter(self) -> ExpertActivity | None:
        """For a Mixture-of-Experts model planned with the calibrated cost, the counter of each microbatch's active
        (layer, expert) pairs that the cost's expert term is fitted to (:class:`~hf_odc.packing.CalibratedCost`);
        ``None`` for a dense model or another cost model."""
        config = self.model.config.get_text_config()
        if self.args.cost_model != "calibrated" or not getattr(config, "num_experts_per_tok", None):
            return None
        if not _compat.router_modules(self.model):  # a MoE whose router logits transformers does not record
            return None
        return ExpertActivity(self.model, config.num_experts, config.num_experts_per_tok)

    def _shard_frozen(self, model: nn.Module) -> tuple[nn.Module, ODCRuntime]:
        """A frozen model the trainer reads beside the trained one (a reference policy), set up like it: packed
        attention, fused kernels, sharded, with ODC of its own (run it in ``runtime.minibatch(backward=False)``),
        released by :meth:`close_odc`. Returns the sharded model and its runtime. Call it after :meth:`_setup_odc`."""
        model.requires_grad_(False)  # no gradient buffers: it is only read
        use_packed_attention(model, self.args.packed_attention, self.args.device)
        self._install_fused_kernels(model)
        runtime = ODCRuntime(self.args.odc_plugin(), self.accelerator)
        model = runtime.shard(model)
        runtime.enable(model)
        self._frozen_runtimes.append(runtime)
        return model, runtime

    def _forward_only(
        self,
        model: nn.Module,
        runtime: ODCRuntime,
        microbatches: list[dict[str, Any]],
        store: Callable[[dict[str, Any], dict[str, Any], Any], None],
        contexts: tuple[contextlib.AbstractContextManager, ...] = (),
    ) -> float:
        """The one forward-only pass of every trainer: ``model`` (a frozen reference or teacher from
        :meth:`_shard_frozen`, or the policy scoring without a gradient) over this rank's packed ``microbatches``, in
        one forward-only ODC minibatch of its ``runtime``, inside ``contexts`` (a disabled adapter) and autocast;
        ``store(microbatch, inputs, outputs)`` keeps what the caller needs of each forward. Returns the minibatch's
        device-timed span (seconds)."""
        with runtime.minibatch(backward=False), contextlib.ExitStack() as stack:
            for context in (*contexts, self.accelerator.autocast()):
                stack.enter_context(context)
            for microbatch in microbatches:
                inputs = self._to_device(microbatch)
                store(microbatch, inputs, model(**inputs["model"], use_cache=False, fused_lm_head=True))
        return runtime.last.step

    def _minibatch_planner(self) -> MinibatchPlanner:
        """The run's planner: ``balance`` with the configured cost model (a calibrated one starts from the attention
        cost, or from ``calibration_file``) under the synchronisation the run uses."""
        args, world_size = self.args, self.accelerator.num_processes
        calibrator = None
        if args.cost_model == "calibrated":
            initial = Calibration.load(args.calibration_file) if args.calibration_file is not None else None
            slots = self._expert_activity.slots if self._expert_activity is not None else 0
            calibrator = Calibrator(world_size, initial=initial, frozen=args.freeze_calibration, expert_slots=slots)
        analytical = "attention" if args.cost_model == "calibrated" else args.cost_model
        cost = named_cost(analytical, self.model.config.get_text_config())
        sync = "minibatch" if self.odc.active else "layer"
        return MinibatchPlanner(args.balance, world_size, sync, cost, calibrator, group_size=args.sp_size)

    # -- one optimizer step -------------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """One call per accumulation step, as the Trainer makes them. The optimizer step's calls are planned and run
        together, as one ODC minibatch, at the last of them (the Trainer's gradient-sync step); the earlier ones only
        hold their inputs and return a zero loss. Returns the minibatch's loss (the sum of this rank's normalised
        microbatch losses)."""
        self._window.append(inputs)
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        window, self._window = self._window, []
        started = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self._warm_s = 0.0
        step = self._plan_step(window)
        self._warm_attention(step.attended_lengths())
        if self.args.warm_attention_plans:
            self._metrics["train"]["attention_warm_s"].append(self._warm_s)
        self._collector.before_step(self.state.global_step)
        self._step_metrics.reset()
        loss = self._run_minibatch(model, step)
        self._end_step(step, self._log_step(step))
        self._step_flos = self._flops_per_token * step.rank_tokens(self.accelerator.process_index)
        self._metrics["train"]["step_time"].append(time.perf_counter() - started)
        return loss

    def _warm_attention(self, documents: Iterable[int], forward_only: Iterable[nn.Module] | None = None) -> None:
        """With ``warm_attention_plans``, cuDNN's attention plans for the lengths of ``documents`` (token counts) that
        this run has not warmed yet (:func:`~hf_odc.trainer.core.attention.warm_attention_plans`): the training
        passes' and, for each model of ``forward_only`` (by default :meth:`_forward_only_models`), its forward-only
        passes'. Every rank passes the same lengths, so every rank spends the same time planning them, and none plans
        inside a minibatch (a training or a forward-only one) while the others wait. The time is added to the step's
        ``attention_warm_s``."""
        if not self.args.warm_attention_plans:
            return
        args, documents = self.args, list(documents)
        dtype = compute_dtype(args)
        models = self._forward_only_models() if forward_only is None else forward_only
        started, warmed_any = time.perf_counter(), False
        for model, backward in ((self.model, True), *((model, False) for model in models)):
            warmed = self._warmed_lengths.setdefault((backward, attention_shape(model)), set())
            new = [length for length in documents if sdpa_length(length) not in warmed]
            if new:
                warm_attention_plans(model, new, args.device, dtype, backward)
                warmed.update(map(sdpa_length, new))
                warmed_any = True
        if warmed_any and args.device.type == "cuda":
            # This stream's work only: a batch decoding ahead (max_rollout_staleness=1) runs on a stream of its own.
            torch.cuda.current_stream(args.device).synchronize()
        self._warm_s += time.perf_counter() - started

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        """The Trainer's ``no_sync`` for the accumulation calls before the last (transformers >= 5.23, for models it
        knows FSDP-managed, as hf_odc marks them): those calls run nothing here, and the minibatch defers FSDP2's
        reduction itself (:meth:`_run_minibatch`), so there is nothing to defer."""
        yield

    def _run_minibatch(self, model: nn.Module, step: PlannedStep) -> torch.Tensor:
        """Forward and backward of this rank's microbatches inside the minibatch context, each loss (with the router's
        load-balancing loss) times the world size, as ODC and FSDP2 average gradients over ranks; without ODC, FSDP2's
        reduce-scatter runs once, in the last backward. Returns the summed loss, detached."""
        defer_reduction = not self.odc.active and isinstance(model, FSDPModule)
        world_size = self.accelerator.num_processes
        expert_load = self._expert_load
        if expert_load is not None:
            self._count_expert_load(model, step, expert_load)
        counting = self._expert_activity.recording if self._expert_activity is not None else contextlib.nullcontext
        loss = torch.zeros((), device=self.args.device)
        last = len(step.microbatches) - 1
        with self._microbatch_context(), self.odc.minibatch():
            for index, microbatch in enumerate(step.microbatches):
                if defer_reduction:
                    model.set_requires_gradient_sync(index == last)
                with torch.profiler.record_function(f"microbatch {index}"):  # names the range in a profiler's trace
                    with self.compute_loss_context_manager(), counting():
                        if expert_load is None:
                            microbatch_loss = self._microbatch_loss(model, self._to_device(microbatch), step)
                        else:
                            with expert_load.recording():
                                microbatch_loss = self._microbatch_loss(model, self._to_device(microbatch), step)
                                microbatch_loss = microbatch_loss + expert_load.loss()
                        microbatch_loss = microbatch_loss * world_size
                    self.accelerator.backward(microbatch_loss)
                    loss += microbatch_loss.detach()
                    self.odc.lap()
        return loss

    def _count_expert_load(self, model: nn.Module, step: PlannedStep, expert_load: ExpertLoad) -> None:
        """The router's assignments over the whole minibatch, which the load-balancing loss of every microbatch needs
        before the first backward (:mod:`hf_odc.trainer.core._moe`): this rank's microbatches in a forward-only ODC
        minibatch, then one all-reduce of the counts. Logs TRL's ``aux_loss``, the minibatch's, and ``expert_load_s``,
        the forward-only minibatch (device-timed)."""
        totals = torch.zeros(2 * expert_load.num_experts + 1, dtype=torch.float64, device=self.args.device)
        with self.odc.minibatch(backward=False), torch.no_grad():
            for microbatch in step.microbatches:
                inputs = self._model_inputs(self._to_device(microbatch))
                with self.compute_loss_context_manager(), expert_load.recording():
                    model(**inputs, use_cache=False, fused_lm_head=True)
                    totals += expert_load.count().to(totals.device)
        counted_s = self.odc.last.step
        with self.odc.bounded("the MoE expert-load all-reduce"):
            totals = self.accelerator.reduce(totals, reduction="sum")
        self._metrics["train"]["aux_loss"].append(expert_load.start_step(totals))
        self._metrics["train"]["expert_load_s"].append(counted_s)

    def _to_device(self, inputs: Any) -> Any:
        """``inputs`` (tensors, nested in mappings, lists and tuples) on the training device, copied without waiting
        for the device. A blocking copy from host memory waits for every kernel queued before it: one such copy per
        input of every microbatch drained the queue each time and left the device idle while the host queued the next
        kernels. A non-blocking copy from pageable memory is staged by the driver before it returns, so the host
        tensor may be freed at once."""
        if isinstance(inputs, torch.Tensor):
            return inputs.to(self.args.device, non_blocking=True)
        if isinstance(inputs, Mapping):
            return type(inputs)({key: self._to_device(value) for key, value in inputs.items()})
        if isinstance(inputs, (list, tuple)):
            return type(inputs)(self._to_device(value) for value in inputs)
        return inputs

    def floating_point_ops(self, inputs: Any) -> int:
        """The Trainer's estimate for this rank's share of the step (``inputs`` is one accumulation call's loader
        item; the whole step is counted once, after its last call)."""
        flos, self._step_flos = self._step_flos, 0
        return flos

    def _log_step(self, step: PlannedStep) -> dict[str, float]:
        """Gather this step's metrics and timings from every rank in one collective, after the minibatch; log them,
        with the plan's own metrics, and feed the measured microbatch times to the calibration. Returns the step's
        metrics reduced over the ranks (:meth:`StepMetrics.reduce`).

        The minibatch's timings are device-timed and mean the same with and without ODC (:mod:`hf_odc.engine.timing`).
        ``step_s``, over which ``tokens_per_second`` and ``mfu`` are counted, is the host's time since the previous
        step's minibatch ended (the slowest rank's; the first step's: its minibatch): everything a step costs, its
        loading, planning, the previous optimizer step, clipping and logging included, so that a step's rate is what
        the wall clock sees."""
        stats = self.odc.last
        lengths = step.microbatch_lengths
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        counts = step.microbatch_counts()
        times = stats.microbatches + [0.0] * (max(counts) - len(stats.microbatches))  # the same width on every rank
        # The minibatch ended at its exit meeting point, after this device's work: the host clock is current here.
        now = time.perf_counter()
        cycle = now - self._cycle_start if self._cycle_start is not None else stats.busy + stats.wait
        self._cycle_start = now
        own = torch.tensor([stats.busy, stats.wait, peak_gib, stats.all_reduce, cycle, *times], dtype=torch.float64)
        local = torch.cat([self._step_metrics.local(), own.to(self.args.device), self._active_experts(len(times))])
        with self.odc.bounded("the step's metrics gather"):
            gathered = self.accelerator.gather(local[None]).cpu().tolist()
        first = len(self._step_metrics)  # then busy, wait, peak, the cross-host all-reduce, the cycle, microbatches
        reduced = self._step_metrics.reduce([row[:first] for row in gathered])
        busy, wait, peak, all_reduce, cycles = ([row[first + i] for row in gathered] for i in range(5))
        width = len(times)
        times = [row[first + 5 : first + 5 + width] for row in gathered]
        active = [row[first + 5 + width :] for row in gathered] if self._expert_activity is not None else None
        minibatch_s = max(b + w for b, w in zip(busy, wait, strict=True))
        step_s = max(max(cycles), minibatch_s)
        metrics = self._metrics["train"]
        for name, value in (reduced | step.metrics).items():
            metrics[name].append(value)
        metrics["step_s"].append(step_s)
        metrics["minibatch_s"].append(minibatch_s)
        metrics["tokens_per_second"].append(step.num_tokens / max(step_s, 1e-9))
        metrics["bubble_rate"].append(idle_fraction(busy, minibatch_s))
        metrics["predicted_bubble_rate"].append(step.predicted_bubble_rate)
        if torch.cuda.is_available():
            metrics["peak_memory_gib"].append(max(peak))  # the largest rank's, since the start
        if self._peak_flops is not None:
            flops = training_flops(step.documents(), self.model.config.get_text_config())
            metrics["mfu"].append(mfu(flops, step_s, len(lengths), self._peak_flops))
        if self.odc.hybrid:
            metrics["all_reduce_s"].append(max(all_reduce))
        for rank in range(len(lengths)):
            metrics[f"busy_s/rank_{rank}"].append(busy[rank])
            metrics[f"wait_s/rank_{rank}"].append(wait[rank])
            metrics[f"microbatches/rank_{rank}"].append(counts[rank])
            metrics[f"tokens/rank_{rank}"].append(step.rank_tokens(rank))
            metrics[f"documents/rank_{rank}"].append(step.rank_documents(rank))
        self._planner.record(
            lengths,
            [step.own_times(rank, times[rank]) for rank in range(len(lengths))],
            None if active is None else [step.own_times(rank, active[rank]) for rank in range(len(lengths))],
        )
        calibration = self._planner.calibration
        if calibration is not None:
            for name in FEATURES if calibration.cost.expert_slots else FEATURES[:-1]:  # per_expert: a MoE's
                metrics[f"calibration/{name}"].append(getattr(calibration.cost, name))
            metrics["calibration/error"].append(calibration.error)
            for rank, speed in enumerate(calibration.speeds):
                metrics[f"calibration/speed/rank_{rank}"].append(speed)
        return reduced

    def _active_experts(self, width: int) -> torch.Tensor:
        """The (layer, expert) pairs each microbatch of the minibatch just run activated (:class:`ExpertActivity`), as
        float64 on the device, padded to ``width`` as the times are; empty for a dense model."""
        device = self.args.device
        if self._expert_activity is None:
            return torch.zeros(0, dtype=torch.float64, device=device)
        ran = len(self.odc.last.microbatches)
        counts = self._expert_activity.take()[-ran:] if ran else []  # the minibatch's: the last ones counted
        if len(counts) != ran:
            raise RuntimeError(
                f"The experts' counter saw {len(counts)} microbatch forwards for the {ran} microbatches run; the "
                "cost's expert term needs one each. Set cost_model='attention' to plan without it."
            )
        active = torch.zeros(width, dtype=torch.float64, device=device)
        if counts:
            active[:ran] = torch.stack(counts).to(device, torch.float64)
        return active

    # -- the console --------------------------------------------------------------------------------------------------

    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        """``Trainer.add_callback``, with transformers' console printers (which the Trainer adds this way) replaced by
        ones that summarise the per-rank values (:mod:`hf_odc.trainer.core._console`); the ``report_to`` loggers and
        ``trainer_state.json`` still get every value."""
        if isinstance(callback, type):
            callback = CONSOLE_CALLBACKS.get(callback, callback)
        super().add_callback(callback)

    # -- the collectives around the step, bounded (ODCRuntime.bounded) -----------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        with self.odc.bounded("gradient clipping"):
            return super()._clip_grad_norm(model)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        with self.odc.bounded("logging, evaluation and checkpointing"):
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self.odc.bounded("evaluation"):
            return super().evaluate(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; if it fails on this rank the other ranks are told at once, and a collective that failed
        because a peer went away is re-raised naming it (:meth:`ODCRuntime.failing_together`). With ``manual_gc``,
        Python's collector runs only between steps (:mod:`hf_odc.trainer.core._collector`). First, the attention
        plans of the documents the trainer knows it will train on (:meth:`_training_documents`) are warmed."""
        with self.odc.failing_together("training"), self._collector.training():
            documents = self._training_documents()
            if documents is not None:
                self._warm_attention(documents)
            return super().train(*args, **kwargs)

    # -- the end ------------------------------------------------------------------------------------------------------

    def close_odc(self) -> None:
        """Release ODC (collective), on the frozen models too, keeping the process group: the model then runs as
        plain FSDP2."""
        for runtime in self._frozen_runtimes:
            runtime.close()
        self.odc.close()

    def end(self) -> None:
        """Release ODC, then finish the trackers and destroy the process group (``Trainer.end``). Collective: call it
        once, on every rank, at the very end of the script."""
        self.close_odc()
        self.accelerator.end_training()
