"""The ODC fields every ODC trainer's config shares (:class:`_ODCConfig`), validated once, and their documentation,
written once and placed in each config's docstring (:func:`_document_odc_fields`).

A config is ``class ODCXConfig(_ODCConfig, XConfig)``: the mixin comes first, so its ``__post_init__`` checks the ODC
fields before TRL's own checks run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import packing
from ..._env import parse_bool
from ...accelerate_plugin import (
    ODCPlugin,
    accelerate_without_parallelism,
    parallelism_config_from,
    sequence_parallel_size,
)
from ...accelerate_plugin.plugin import odc_field
from ...packing import COSTS, PLANNERS
from .activation_checkpointing import check_layer_share
from .attention import CHECKPOINT_ATTENTION, save_attention_checkpoint_kwargs

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
            frozen: `hf_odc.liveness.heartbeat`) is named after it too, during startup as well. `None` reads
            `HF_ODC_TIMEOUT`, else `hf_odc.liveness.DEFAULT_TIMEOUT_S`.
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
        min_tokens_per_microbatch (`int`, *optional*):
            Least token capacity of one packed microbatch of DPO, reward modelling, KTO and the rollout trainers (GRPO,
            RLOO, distillation), whose samples are short: their capacity from `packing_ratio` is raised to this. The
            host's work for a microbatch (each layer's parameter reads, hooks and kernel launches) hardly grows with
            its tokens, so a few short rows per microbatch leave the GPU waiting on the host, and a rank's time then
            follows its number of microbatches, not its tokens. `None` (the default): on a GPU, the tokens whose kept
            activations (with activation checkpointing each layer's input and saved attention output, without it
            about what a layer's forward keeps) fill an eighth of the device's memory; on the CPU, no floor. `0`: no
            floor. Ignored when `max_tokens_per_microbatch` is set, and by SFT, whose microbatches hold `max_length`
            tokens.
        packing_ratio (`float`, *optional*):
            Token capacity of one packed microbatch as a multiple of the longest sample it must fit (SFT:
            `max_length`; GRPO: the minibatch's longest rollout; DPO and reward modelling: a pair, `2 * max_length`;
            KTO: an example with its mismatched sequence, `2 * max_length`),
            so `1.0` fits exactly one longest sample. Used when `max_tokens_per_microbatch` is not set; defaults to
            `1.0`, but for the rollout trainers (GRPO, RLOO, distillation) to `per_device_train_batch_size`: as many
            longest rollouts as one of stock TRL's padded forward passes holds.
        cost_model (`str`, *optional*, defaults to `"calibrated"`):
            Per-sample cost the planner balances. `"calibrated"`: start from `"attention"` (or from
            `calibration_file`) and refit after every step to the microbatch times every rank measured
            (`hf_odc.packing.Calibrator`: fixed costs per microbatch and per sequence, per token and per squared
            token, and for a Mixture-of-Experts model per (layer, expert) pair a microbatch's tokens activate, counted
            at its routers); with ODC and `balance="lb-mini"`, each rank also gets work in proportion to its measured
            speed.
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
            hf_odc's `"odc_packed"` (`hf_odc.trainer.core.attention`): each packed sample is attended on its own, so a
            microbatch costs the sum of its samples instead of the square of its length, with no `T x T` mask.
            `False` keeps the model's implementation (with a warning for `sdpa`/`eager` on a GPU). Flash and flex
            attention are always kept.
        checkpoint_attention (`str`, *optional*, defaults to `"save"`):
            What activation checkpointing (`gradient_checkpointing`) does with the attention. `"save"`: each layer
            keeps its attention operators' outputs and softmax statistics (one `tokens x heads x head_dim` tensor per
            layer) and recomputes the rest, so the backward does not run the attention forward again (selective
            activation checkpointing: `hf_odc.trainer.core.attention.save_attention_checkpoint_kwargs`); the same
            gradients. It needs non-reentrant checkpointing and replaces `gradient_checkpointing_kwargs`' `context_fn`,
            so a `use_reentrant=True` or a `context_fn` of your own there is refused with it. `"recompute"`: the stock
            behaviour, every operator recomputed: slower, without those tensors, for a run whose peak memory
            matters more than its speed. No effect without activation checkpointing.
        checkpoint_layer_share (`float`, *optional*, defaults to `1.0`):
            The share of the decoder layers that activation checkpointing checkpoints: the first `ceil(share x n)` of
            the model's `n` (transformers' `GradientCheckpointingLayer`s); the others keep their whole activations, so
            their backward recomputes nothing (`hf_odc.trainer.core.activation_checkpointing`). The same gradients;
            each layer taken out of checkpointing saves a share of the step's time and keeps its activations (several
            hidden- and MLP-width vectors per token instead of one) until its backward. `1.0` checkpoints every layer,
            as transformers does; lower it where the device has memory to spare (`docs/performance.md`). The default
            `min_tokens_per_microbatch`, which fills an eighth of the device's memory with what the layers keep, falls
            with it. No effect without activation checkpointing.
        allow_truncated_data (`bool`, *optional*, defaults to `False`):
            Train even when truncation to `max_length` damages most of the training dataset: most samples cut (SFT:
            they train on their first `max_length` tokens only, or lose every token carrying a loss and TRL drops
            them), or most preference pairs left with nothing to prefer (DPO: a whole reply lost, or the same tokens
            kept in both sequences), or dropped (reward modelling: TRL drops a pair with a sequence longer than
            `max_length`). By default such a run is refused at construction, naming the counts; with this, it warns
            once and trains. A run left with nothing at all to train on is refused either way. The other trainers do
            not truncate their data this way and ignore it.
        fused_kernels (`bool`, *optional*, defaults to `True`):
            On a GPU, give the model's RMSNorms and SiLU-gated MLPs (Llama, Mistral, Qwen2, Qwen3; the norms of
            Mixtral, Qwen2-MoE and Qwen3-MoE) one Triton kernel each way in place of their chains of elementwise
            kernels (`hf_odc.kernels.install_fused_kernels`): the same formulas and roundings, up to the order of
            fp32 sums. Other modules, and CPU runs, are left as they are. `False` keeps transformers' forwards.
        manual_gc (`bool`, *optional*, defaults to `True`):
            Run Python's garbage collector only between steps, on every rank at the same place, for the run of
            `train` (`hf_odc.trainer.core._collector`): automatic collection off, the objects alive when training
            starts frozen out of later collections, and before each step's minibatch a collection of the young
            generations (of all of them every 50 steps). A full collection walks every object of the process, tens to
            hundreds of milliseconds on the host, and under ODC a rank whose collector fires inside its minibatch keeps
            every other rank waiting at the minibatch's end. `False` leaves the collector as it is. A script that
            turned the collector off itself keeps it off either way, and objects frozen by someone else (vLLM's
            engine freezes the process at its start) are left frozen.
        warm_attention_plans (`bool`, *optional*, defaults to `True`):
            On a GPU with packed attention, attend once, forward and backward, at every length that a document of the
            training data is attended at (`hf_odc.kernels.attention.sdpa_length` rounds them to a few hundred) before
            the first step. cuDNN builds an execution plan the first time it meets a length, on the host, while the
            device runs dry; without this the first steps of a run, which meet most lengths for the first time, run
            far below the speed of the later ones. When `train` starts, it takes the lengths of the training data,
            where the trainer knows its documents before training (SFT, DPO, KTO, reward). Then, at every step, every
            rank warms the lengths of the whole minibatch met for the first time, before its microbatches: under ODC
            the rank that met a new length alone would plan it inside the minibatch and keep the others waiting at
            its end. A forward-only pass (a reference, KTO's KL estimate, a teacher, the scoring of rollouts) needs
            plans of its own (cuDNN keys a forward without autograd apart), for each model shape: those are warmed
            too, before the pass that would meet a length first. The time a step spends warming is logged as
            `attention_warm_s`. CPU runs, and models whose attention is not `"odc_packed"`, skip it.

    > [!NOTE]
    > Defaults that differ from TRL's configs: `bf16` defaults to `True` only when CUDA is available (CPU runs are
    > fp32, exact enough to compare with a single-process run), and `use_cpu` defaults to `True` when no CUDA device
    > exists: `accelerate launch` starts CPU processes through torchrun without telling them to use the CPU, and
    > without it every process would silently train alone.

    > [!NOTE]
    > Documents longer than a microbatch: Accelerate's `parallelism_config` with `sp_size` (the yaml's
    > `parallelism_config: {parallelism_config_sp_size: N}` or `ParallelismConfig(sp_size=N)` as `parallelism_config`)
    > turns on sequence parallelism inside ODC, hf_odc's own, on CPU and GPU alike (Accelerate never sees the
    > setting): a document longer than the microbatch's tokens, up to `N` times them, is split over a group of `N`
    > consecutive ranks that run it together, attention exchanging heads for tokens all-to-all (Ulysses); every other
    > document stays a microbatch of one rank. It needs `odc=True`, `balance="lb-mini"` and `packed_attention=True`,
    > a number of processes that `N` divides and attention heads that `N` divides. `cp_size` (ring attention) and the
    > other sizes are refused, naming what to set instead. SFT, DPO (a pair longer than a microbatch) and GRPO (a
    > rollout longer than a microbatch) only: the other trainers refuse it.

    > [!NOTE]
    > Mixture-of-Experts models (Qwen3-MoE, Mixtral, OLMoE...): as in TRL, the router's load-balancing loss is on for
    > a model whose config declares `output_router_logits` (whatever its value) when `router_aux_loss_coef` (else the
    > config's own) is non-zero, and the loss gains `router_aux_loss_coef * aux_loss`, with `aux_loss` transformers'
    > `load_balancing_loss_func` taken over the whole global minibatch: expert assignments and router probabilities
    > counted over every token of the optimizer step, on every rank (packed rows have no padding, so every token
    > counts, as in TRL's padding-free rows). Stock TRL computes it per forward pass, over that microbatch's tokens,
    > so its value changes with the accumulation, the number of processes and, under ODC, the plan; hf_odc's does
    > not, and equals stock TRL's when one forward holds the whole minibatch. The experts are balanced over what one
    > update sees, not within each microbatch (a few similar documents cannot use every expert evenly, and balancing
    > them per microbatch works against expert specialisation). It costs one forward-only pass over the minibatch per
    > step (the assignments are needed before the first backward) and one all-reduce; the logged `aux_loss` is the
    > minibatch's. `router_aux_loss_coef=0` trains without it. Qwen3-MoE's and Mixtral's routers have no z-loss (in
    > transformers only the encoder-decoder Switch Transformers and NLLB-MoE have one).

    > [!NOTE]
    > `gradient_accumulation_steps` keeps TRL's batch size: an optimizer step takes `per_device_train_batch_size *
    > gradient_accumulation_steps` samples per process. hf_odc plans those samples of every process as *one* ODC
    > minibatch (the ranks meet once per optimizer step, whatever the accumulation), and the planner, not the
    > accumulation count, decides how many microbatches each rank runs.
"""


def compute_dtype(args: Any) -> torch.dtype:
    """The dtype a run of ``args`` computes in (``bf16``, ``fp16``, else float32): what its attention plans are built
    for and its decoding copies are made in."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def whole_model_kwargs(init_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """TRL's ``model_init_kwargs`` (or a teacher's) for a model that TRL loads by name: ``device_map`` defaults to
    ``None``, so that every rank loads the whole model and hf_odc shards it, where TRL's default ``"auto"`` would
    spread it over all of this host's GPUs."""
    return {"device_map": None, **(init_kwargs or {})}


def _refuse_cpu_offload(config: Any) -> None:
    """Refuse FSDP's CPU offload, which hf_odc's sharding does not apply (ODC reads and pushes device shards): asked
    for by the Accelerate config (``fsdp_offload_params: true``, exported to the processes as ``FSDP_OFFLOAD_PARAMS``)
    or by the config's own ``fsdp`` options (``"offload"``) or ``fsdp_config`` (``offload_params``)."""
    fsdp = config.fsdp if isinstance(config.fsdp, str) else " ".join(map(str, config.fsdp or ()))
    fsdp_config = config.fsdp_config if isinstance(config.fsdp_config, dict) else {}
    asked = {
        "fsdp_offload_params: true in the Accelerate config (FSDP_OFFLOAD_PARAMS)": parse_bool(
            os.environ.get("FSDP_OFFLOAD_PARAMS", "false"), "FSDP_OFFLOAD_PARAMS"
        ),
        f"fsdp={config.fsdp!r}": "offload" in fsdp.split(),
        "fsdp_config's offload_params": bool(fsdp_config.get("offload_params", fsdp_config.get("fsdp_offload_params"))),
    }
    for source, on in asked.items():
        if on:
            raise ValueError(
                f"{source} asks for FSDP's CPU offload, which hf_odc's trainers do not apply (ODC reads and pushes "
                "shards on the training device): set it to false, or train with a stock TRL trainer to offload."
            )


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

    _splits_sequences = False
    """Whether the trainer runs documents longer than a microbatch split over ranks (Accelerate's ``sp_size``);
    ``False`` refuses ``sp_size > 1``."""

    odc: bool | None = odc_field("enabled")
    odc_timeout: float | None = odc_field("timeout")
    odc_transport: str | None = odc_field("transport")
    odc_shard_size: int | None = odc_field("shard_size")
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
    min_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Least capacity of a microbatch of short samples (DPO, reward, KTO, GRPO, RLOO, distillation). "
            "Unset: on a GPU, the tokens whose kept activations fill an eighth of its memory; 0: none."
        },
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
    checkpoint_attention: str = field(
        default="save",
        metadata={
            "help": "With activation checkpointing: 'save' keeps each layer's attention outputs, so the backward does "
            "not recompute the attention (same gradients); 'recompute' reruns it (stock).",
            "choices": list(CHECKPOINT_ATTENTION),
        },
    )
    checkpoint_layer_share: float = field(
        default=1.0,
        metadata={
            "help": "With activation checkpointing: the share of the decoder layers checkpointed, in (0, 1]; the "
            "others keep their activations and recompute nothing (faster, more memory; same gradients)."
        },
    )
    allow_truncated_data: bool = field(
        default=False,
        metadata={
            "help": "Train even when truncation to max_length damages most samples (SFT) or pairs (DPO), or drops most "
            "pairs (reward); by default such a run is refused."
        },
    )
    fused_kernels: bool = field(
        default=True,
        metadata={
            "help": "On a GPU, run the RMSNorms and SiLU-gated MLPs of Llama/Mistral/Qwen2/Qwen3 models as fused "
            "Triton kernels (same formulas). False keeps transformers' forwards."
        },
    )

    manual_gc: bool = field(
        default=True,
        metadata={
            "help": "Run Python's garbage collector between steps, at the same place on every rank, instead of "
            "whenever it triggers (inside a rank's minibatch, where the other ranks wait for it). False leaves it on."
        },
    )

    warm_attention_plans: bool = field(
        default=True,
        metadata={
            "help": "On a GPU with packed attention, build cuDNN's attention plan for every rounded document length "
            "of the training data before the first step, and on every rank for each step's new lengths (those of its "
            "forward-only passes too: a reference, a teacher, scoring), instead of on the rank that meets a length "
            "first."
        },
    )

    def __post_init__(self):
        _refuse_cpu_offload(self)
        if not torch.cuda.is_available():
            self.use_cpu = True
            if self.bf16 is None:
                self.bf16 = False
        # The settings resolved (HF_ODC_* fallbacks) and validated once, by the plugin, which also makes the timeout
        # the process's before TrainingArguments' __post_init__ creates the process group; the fields show the result.
        # Accelerate's parallelism_config is taken over (hf_odc.accelerate_plugin.parallelism); JSON text from a
        # command line is parsed.
        given = self.parallelism_config = parallelism_config_from(self.parallelism_config)
        plugin = self._odc_plugin = ODCPlugin(
            enabled=self.odc,
            timeout=self.odc_timeout,
            transport=self.odc_transport,
            shard_size=self.odc_shard_size,
            sp_size=sequence_parallel_size(given) if given is not None else None,
        )
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
        if plugin.sp_size > 1:
            self._check_sequence_parallel(plugin.sp_size)
        if self.cost_model not in _COST_MODELS:
            raise ValueError(f"cost_model must be one of {_COST_MODELS}, got {self.cost_model!r}.")
        if self.calibration_file is not None and self.cost_model != "calibrated":
            raise ValueError("calibration_file is the starting point of cost_model='calibrated'; set that too.")
        if self.calibration_file is not None and not os.path.isfile(self.calibration_file):
            raise ValueError(
                f"calibration_file {self.calibration_file}: no such file; pass the odc_calibration.json an earlier run "
                "saved beside its model, or leave it unset to calibrate from the attention cost."
            )
        if self.freeze_calibration and self.calibration_file is None:
            raise ValueError(
                "freeze_calibration keeps a calibration as it is: pass calibration_file (an earlier run's "
                "odc_calibration.json), or unset freeze_calibration to calibrate during this run."
            )
        if self.max_tokens_per_microbatch is not None and self.packing_ratio is not None:
            raise ValueError("Set max_tokens_per_microbatch or packing_ratio, not both.")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {self.max_tokens_per_microbatch}.")
        if self.min_tokens_per_microbatch is not None and self.min_tokens_per_microbatch < 0:
            raise ValueError(
                f"min_tokens_per_microbatch must be >= 0 (0: no floor), got {self.min_tokens_per_microbatch}."
            )
        if self.packing_ratio is not None and not self.packing_ratio > 0:
            raise ValueError(f"packing_ratio must be > 0, got {self.packing_ratio}.")
        if self.per_device_train_batch_size < 1:
            raise ValueError(
                f"per_device_train_batch_size must be >= 1 (samples per rank in each global minibatch), got "
                f"{self.per_device_train_batch_size}."
            )
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}.")
        if self.checkpoint_attention not in CHECKPOINT_ATTENTION:
            raise ValueError(
                f"checkpoint_attention must be one of {CHECKPOINT_ATTENTION}, got {self.checkpoint_attention!r}."
            )
        check_layer_share(self.checkpoint_layer_share)
        if getattr(self, "activation_checkpointing", False) is None:
            # transformers 5.23 renamed gradient_checkpointing, and warns when the old name is set: TRL's configs set
            # it by default, and the examples' documented flag is --gradient_checkpointing. Both names mean the same.
            for old, new in (
                ("gradient_checkpointing", "activation_checkpointing"),
                ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
            ):
                if getattr(self, new) is None:
                    setattr(self, new, getattr(self, old))
        with accelerate_without_parallelism(self):  # taken over: TRL's GRPOConfig would refuse sp_size > 1
            super().__post_init__()
        if self.checkpoint_attention == "save" and self.checkpoints_activations:
            # what the trainer will pass, checked now (TrainingArguments has parsed the kwargs from JSON)
            save_attention_checkpoint_kwargs(
                getattr(self, "activation_checkpointing_kwargs", self.gradient_checkpointing_kwargs)
            )

    def _check_sequence_parallel(self, sp_size: int) -> None:
        """Refuse sequence parallelism where it cannot run: a trainer that does not split sequences (SFT, DPO and GRPO
        do), plain FSDP2, another planner than LB-Mini, or the model's own attention."""
        setting = f"sp_size={sp_size} (Accelerate's parallelism_config)"
        if not self._splits_sequences:
            raise ValueError(
                f"{type(self).__name__}: {setting} is supported by ODCSFTConfig, ODCDPOConfig and ODCGRPOConfig only; "
                "set sp_size to 1 for this trainer."
            )
        if not self.odc or self.balance != "lb-mini":
            raise ValueError(
                f"{setting} runs long documents as group microbatches beside unequal microbatch counts, which needs "
                f"odc=True and balance='lb-mini' (got odc={self.odc}, balance={self.balance!r})."
            )
        if not self.packed_attention:
            raise ValueError(f"{setting} runs in hf_odc's 'odc_packed' attention; leave packed_attention=True.")

    @property
    def checkpoints_activations(self) -> bool:
        """Whether activation checkpointing is on, under either of its names (transformers 5.23 renamed
        ``gradient_checkpointing`` to ``activation_checkpointing``; before, only the first exists)."""
        return bool(getattr(self, "activation_checkpointing", self.gradient_checkpointing))

    @property
    def sp_size(self) -> int:
        """Ranks per sequence-parallel group (1: none), as Accelerate's ``parallelism_config`` set it."""
        return self._odc_plugin.sp_size

    def odc_plugin(self) -> ODCPlugin:
        """The :class:`~hf_odc.accelerate_plugin.ODCPlugin` these fields describe, built once, when the config was."""
        return self._odc_plugin

    def max_tokens_for(self, longest_sample: int) -> int:
        """Tokens one packed microbatch may hold: ``max_tokens_per_microbatch``, else ``packing_ratio`` (default 1)
        times ``longest_sample``, the longest sample the microbatches must fit."""
        if self.max_tokens_per_microbatch is not None:
            return self.max_tokens_per_microbatch
        return packing.max_tokens_for(longest_sample, self.packing_ratio or 1.0)

    def max_tokens_for_pairs(self, longest_pair: int) -> int:
        """Tokens one packed microbatch of two-sequence items (DPO's and reward modelling's pairs, KTO's examples with
        their mismatched sequences) may hold, given the minibatch's longest item (both sequences): `max_tokens_for`
        the longest item `max_length` allows (`2 * max_length`), else for ``longest_pair``; at least
        `min_tokens_per_microbatch`."""
        max_length = getattr(self, "max_length", None)
        return self.at_least_min_tokens(self.max_tokens_for(2 * max_length if max_length is not None else longest_pair))

    def at_least_min_tokens(self, tokens: int) -> int:
        """A microbatch capacity of short samples, ``tokens``, raised to ``min_tokens_per_microbatch`` unless
        ``max_tokens_per_microbatch`` fixes it (an unset floor, which the trainer resolves at setup, is none)."""
        if self.max_tokens_per_microbatch is not None:
            return tokens
        return max(tokens, self.min_tokens_per_microbatch or 0)
