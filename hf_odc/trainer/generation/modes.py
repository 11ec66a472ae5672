"""How an online ODC trainer (GRPO, RLOO, distillation) generates its rollouts: one owner per generation mode, chosen
once (:func:`make_generator`) and called by the trainer at TRL's generation hooks. This docstring is where the modes
are described; :func:`check_generation_mode` is where a requested one is checked.

transformers' ``generate`` on an FSDP2 model all-gathers every layer group for every decoded token, and keeps the
ranks in lockstep (``synced_gpus``): a rank whose completions end early runs dummy forwards until the longest one
anywhere ends. The modes (``odc_generation``; ``"vllm"`` with ``use_vllm``):
 * ``"static"`` (:class:`StaticGenerator`, :class:`StaticDecoder`): a plain copy of the policy in the compute dtype,
  kept for the whole run and refreshed in place once per generation batch (the full weights assembled one FSDP group at
  a time, one-sided: :mod:`hf_odc.trainer.generation.full_weights`), decodes with a static KV cache kept beside it, by
  hf_odc's own loop (:mod:`hf_odc.trainer.generation._static_decoding`: on a GPU each step replayed from a CUDA graph,
  with no host synchronisation per token) where it decodes what ``generate`` would, else (or with
  ``odc_decoding_loop=False``) by transformers' ``generate`` with the forward transformers compiles for it: CUDA graphs
  and compile are paid once per run, as the copy's weights and the cache's tensors never move. The loop is the
  default because it is faster from the first batch on: its forward is compiled once for every cache width and by
  decoder layer (one body shared by the layers), a shorter compile than ``generate``'s whole forward, and each step is
  then shorter too. Costs the full weights in the compute dtype for the whole run, plus the cache.
* ``"gathered"`` (:class:`GatheredGenerator`): the policy's full weights are held in place once per generation batch
  (:meth:`~hf_odc.accelerate_plugin.ODCRuntime.gathered`: one-sided reads with ODC, no collective), every rank decodes
  its own prompts with no communication at all, and they are freed before the policy update. Costs the full weights
  in the compute dtype while decoding, on top of the shards.
* ``"sharded"`` (:class:`ShardedGenerator`): decoding inside one forward-only ODC minibatch: each forward reads the
  layer shards it needs from the peers one-sidedly, as in training, so no copy is held and no collective runs; each
  token pays the reads. Needs ODC.
* ``"tensor-parallel"`` (:class:`TensorParallelGenerator`, :class:`TensorParallelDecoder`): for a policy whose copy
  does not fit beside it, a copy kept for the whole run of which each rank of the shard group holds a slice of every
  decoder layer (its query heads and the key/value heads they read, replicated where the ranks outnumber them, and
  its MLP rows column-parallel; ``o_proj`` and ``down_proj`` row-parallel, their outputs all-reduced over the group)
  and of the LM head's vocabulary (its logits all-gathered), embeddings and norms whole, refreshed in place once per
  generation batch as the static copy is. The group's ranks decode their prompts together (gathered once per
  ``generate`` call), sampling alike from a seed they agree on, so the weights never move per token: two all-reduces
  of the activations per layer per token and one all-gather of the logits instead. Each rank keeps its own rows,
  ended where they would have ended alone, but every rank steps until the longest completion of the group ends.
  Decodes as ``"static"`` does (a kept static cache, fused projections, hf_odc's loop, its CUDA graphs recording the
  collectives), with the forward not compiled. Llama, Mistral, Qwen2 and Qwen3 dense decoders with at least as many
  attention heads as the group has ranks (:func:`check_tensor_parallel`), any key/value head count; the MLP and the
  LM head are held whole where the group's size does not divide them; not with tools (the ranks decode different
  numbers of turns); with one process it is the whole copy. Chosen by default where the static copy does not fit and
  the largest rank's slice does (:func:`choose_generation_mode`). Costs about 1/N of the layers' weights and LM head
  in the compute dtype (plus the embeddings whole) for the whole run, plus the group's KV cache sliced by heads.
* ``"lockstep"`` (:class:`Generator`): TRL's own path, kept as the baseline the others are measured against.
* ``"vllm"`` (:class:`VLLMGenerator`, ``use_vllm=True``): TRL's vLLM generation, ``vllm_mode="colocate"`` (an engine
  on each rank) or ``"server"`` (rank 0 sends TRL's requests to a vLLM server), with hf_odc's weight sync
  (:mod:`hf_odc.trainer.generation.vllm_sync`: the full weights assembled one-sidedly, no collective) and a colocated
  engine shut down at the run's end, before the process groups go.

With ``max_rollout_staleness=1`` (the online trainers' overlap, :mod:`hf_odc.trainer.online._overlap`), ``"static"``
also decodes the next generation batch in a background thread while the update runs (:meth:`StaticGenerator.ahead`):
the only mode whose rank decodes alone, with no collective, on weights the update does not touch; the others are
refused with it.

With tools, the transformers modes hold their decoding context (the assembled weights, the ODC minibatch) from a
generation batch's first turn through TRL's tool loop, so that each rank decodes as many turns as its own completions
need, alone. A rank that finishes decoding first waits for the others at the rollouts' gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ... import _compat
from ...accelerate_plugin import ODCRuntime
from ...engine import lazy_init_root
from ..core._base_config import compute_dtype
from .decoders import StaticDecoder, TensorParallelDecoder, check_tensor_parallel, shard_group
from .vllm_sync import ODCWeightSync, shut_down_engine

__all__ = [
    "GENERATION_MODES",
    "GatheredGenerator",
    "Generator",
    "ShardedGenerator",
    "StaticGenerator",
    "TensorParallelGenerator",
    "VLLMGenerator",
    "check_generation_mode",
    "choose_generation_mode",
    "decoding",
    "make_generator",
    "uses_tools",
]

GENERATION_MODES = ("static", "gathered", "sharded", "lockstep", "tensor-parallel")
"""The transformers modes ``odc_generation`` takes (``"vllm"`` is chosen by ``use_vllm``)."""

# The share of the device's free memory the full weights may take, by mode, when the mode is chosen: the static copy
# is held through the policy update too, so it takes less; what is left goes to the KV cache and the activations.
_COPY_SHARE_OF_FREE_MEMORY = {"static": 0.25, "gathered": 0.5}


def check_generation_mode(
    requested: str | None, use_vllm: bool = False, model: nn.Module | None = None, runtime: ODCRuntime | None = None
) -> None:
    """Raise ``ValueError``, naming what to set, for a generation mode the run cannot use: ``requested``
    (``odc_generation``) is not one of :data:`GENERATION_MODES`, or is set with ``use_vllm`` (vLLM decodes then), or
    is ``"sharded"`` for a ``model`` sharded by plain FSDP2 (``runtime`` not active), or is ``"tensor-parallel"`` for a
    ``model`` it cannot slice over its shard group (:func:`check_tensor_parallel`); the last two checked once the model
    is known."""
    if requested is None:
        return
    if requested not in GENERATION_MODES:
        raise ValueError(f"odc_generation must be one of {GENERATION_MODES}, got {requested!r}.")
    if use_vllm:
        raise ValueError(
            "odc_generation chooses how each rank decodes with transformers; with use_vllm=True vLLM decodes. "
            "Leave odc_generation unset, or set use_vllm=False."
        )
    if requested == "sharded" and isinstance(model, FSDPModule) and not runtime.active:
        raise ValueError(
            "odc_generation='sharded' decodes inside an ODC minibatch, which plain FSDP2 (odc=False) cannot run "
            "(its per-layer all-gathers would need every rank's forwards in lockstep). Use 'gathered' or "
            "'lockstep'."
        )
    if requested == "tensor-parallel" and model is not None:
        group = shard_group(model)
        check_tensor_parallel(model, 1 if group is None else dist.get_world_size(group))


def choose_generation_mode(
    requested: str | None,
    model: nn.Module,
    runtime: ODCRuntime,
    dtype: torch.dtype,
    device: torch.device,
    tools: bool = False,
) -> str:
    """``requested`` checked against the run (:func:`check_generation_mode`), or (``None``) on a GPU ``device``, by
    measured speed per decoding step: ``"static"`` where its copy of the full weights in ``dtype`` fits its share of
    the device's free memory (:data:`_COPY_SHARE_OF_FREE_MEMORY`); else ``"tensor-parallel"`` where the model decodes
    tensor-parallel over its shard group of N > 1 ranks (:func:`check_tensor_parallel`), the largest rank's slice of
    the copy fits that share (:meth:`TensorParallelDecoder.bytes_per_rank`: its layers' part, the embeddings whole)
    and the run has no ``tools``; else ``"gathered"`` where the full weights fit
    theirs; else ``"lockstep"``, or ``"sharded"`` for a run with ``tools`` under ODC (each rank then decodes its own
    number of turns, which lockstep's per-token collectives cannot). ``"sharded"`` moves every layer's weights per
    token as lockstep does and was measured slower per step; the slowest rank steps to the longest completion in
    both, so without tools it never wins (``benchmarks/RESULTS.md``). On a CPU ``"gathered"`` (a CPU compiles
    nothing for the static cache). ``device`` is where the model trains, which it may not have reached yet: with one
    process the Trainer places it when training starts."""
    sharded = isinstance(model, FSDPModule)
    if requested is not None:
        check_generation_mode(requested, model=model, runtime=runtime)
        return requested
    if device.type != "cuda":
        return "gathered"
    copy_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free_bytes, _ = torch.cuda.mem_get_info(device)
    kept_share = _COPY_SHARE_OF_FREE_MEMORY["static"]
    if copy_bytes <= kept_share * free_bytes:
        return "static"
    size = 1 if tools else _tensor_parallel_size(model)
    if size > 1 and TensorParallelDecoder.bytes_per_rank(model, size, dtype) <= kept_share * free_bytes:
        return "tensor-parallel"
    if copy_bytes <= _COPY_SHARE_OF_FREE_MEMORY["gathered"] * free_bytes:
        return "gathered"
    if not sharded:
        return "gathered"
    return "sharded" if tools and runtime.active else "lockstep"


def _tensor_parallel_size(model: nn.Module) -> int:
    """The size of ``model``'s shard group where it can decode tensor-parallel over it, else 1."""
    group = shard_group(model)
    size = 1 if group is None else dist.get_world_size(group)
    try:
        check_tensor_parallel(model, size)
    except ValueError:
        return 1
    return size


def uses_tools(trainer: Any) -> bool:
    """Whether ``trainer`` generates with tools or environments (TRL's tool loop: a number of turns per rank)."""
    return bool(getattr(trainer, "tools", None) or getattr(trainer, "environments", None))


@contextlib.contextmanager
def decoding(model: nn.Module, runtime: ODCRuntime, mode: str) -> Iterator[None]:
    """The context in which ``model`` decodes a generation batch in ``mode`` (see the module docstring); nothing
    changes for a model that is not sharded, in ``"lockstep"``, or in ``"static"`` and ``"tensor-parallel"`` (their
    copy is decoded instead)."""
    if mode in ("lockstep", "static", "tensor-parallel") or not isinstance(model, FSDPModule):
        yield
        return
    with _compat.decoding_alone(model):
        if mode == "sharded":
            with runtime.minibatch(backward=False):
                yield
        else:
            with runtime.gathered(model):
                yield


# -- the owners, one per mode -----------------------------------------------------------------------------------------


class Generator:
    """The ``"lockstep"`` mode, and what every mode's owner does at the trainer's generation hooks (see the module
    docstring): :meth:`generation_batch` around TRL's ``_generate`` (every turn of a generation batch, the tool loop
    included), :meth:`hold_turns` at each turn's decoding and :meth:`release_turns` after the last one, :meth:`end` at
    the run's end. Reads the trainer's model and runtime when it generates (with one process the Trainer places the
    model when training starts).

    Args:
        trainer: the online ODC trainer, its policy sharded and ODC installed.
    """

    mode = "lockstep"

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self._turns: contextlib.ExitStack | None = None  # held from a generation's first turn to its last

    @contextlib.contextmanager
    def generation_batch(self) -> Iterator[None]:
        """Around TRL's ``_generate``: a sharded PEFT policy generates through the model it wraps, below the FSDP
        root, so the root's parameters (embeddings, head) are gathered around it, as the root's forward would. A
        sharded vision-language policy runs its vision blocks before any root forward when it first generates, so
        FSDP2's lazy initialisation is run from the root first."""
        model = self.trainer.model
        if isinstance(model, FSDPModule) and _compat.is_vision_trainer(self.trainer):
            lazy_init_root(model)
        if not (isinstance(model, FSDPModule) and is_peft_model(model)):
            yield
            return
        lazy_init_root(model)
        model.unshard()
        try:
            yield
        finally:
            model.reshard()

    def turns(self) -> contextlib.AbstractContextManager:
        """The context the turns of a generation batch decode in (entered at the first, left after the last)."""
        return contextlib.nullcontext()

    def hold_turns(self) -> None:
        """Enter :meth:`turns`, unless a turn of this generation batch already did."""
        if self._turns is None:
            self._turns = contextlib.ExitStack()
            self._turns.enter_context(self.turns())

    def release_turns(self) -> None:
        """Leave :meth:`turns` (after the generation batch's last turn, or on an error)."""
        if self._turns is not None:
            turns, self._turns = self._turns, None
            turns.close()

    def end(self) -> None:
        """At the run's end, before the process groups are destroyed."""


class GatheredGenerator(Generator):
    """The ``"gathered"`` mode: the turns decode with the full weights held in place."""

    mode = "gathered"

    def turns(self) -> contextlib.AbstractContextManager:
        return decoding(self.trainer.model, self.trainer.odc, self.mode)


class ShardedGenerator(GatheredGenerator):
    """The ``"sharded"`` mode: the turns decode inside one forward-only ODC minibatch."""

    mode = "sharded"


class _CopyGenerator(Generator):
    """A mode that generates on a decoding copy (:attr:`decoder`, of :attr:`decoder_class`), made at the first
    generation on the prepared model, refreshed once per generation batch, closed at the run's end.

    Args:
        trainer: as :class:`Generator`'s; its ``odc_decoding_loop`` chooses the decoder's loop.
        dtype: the copy's dtype, the policy's compute dtype.
    """

    decoder_class: type[StaticDecoder] = StaticDecoder

    def __init__(self, trainer: Any, dtype: torch.dtype):
        super().__init__(trainer)
        self.dtype = dtype
        self.decoder: StaticDecoder | None = None

    @contextlib.contextmanager
    def generation_batch(self) -> Iterator[None]:
        if self.decoder is None:
            loop = self.trainer.args.odc_decoding_loop
            self.decoder = self.decoder_class(self.trainer.model, self.trainer.odc, self.dtype, loop=loop)
        self.decoder.refresh()
        with _compat.generating_on(self.trainer, self.decoder.model):
            yield

    def end(self) -> None:
        if self.decoder is not None:
            self.decoder.close()


class StaticGenerator(_CopyGenerator):
    """The ``"static"`` mode: TRL generates on :attr:`decoder`'s copy; with ``max_rollout_staleness=1`` also in a
    background thread, the next generation batch (:meth:`ahead`)."""

    mode = "static"

    def ahead(self) -> contextlib.AbstractContextManager:
        """Called on the main thread after a refresh: the context in which another thread decodes on the copy as that
        refresh left it, while the main thread trains (the copy decodes on this rank alone, with no collective). TRL
        reads the model to generate with from the trainer's ``model_wrapped``, which the trainer keeps per thread
        (:class:`~hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer`); on a GPU the thread runs on its own CUDA
        stream, ordered after everything the main thread has queued so far (the refresh), and waits for it at the
        end. The main thread refreshes the copy again only once the thread has ended."""
        ready = None
        if torch.cuda.is_available() and self.decoder.model.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return self._ahead(ready)

    @contextlib.contextmanager
    def _ahead(self, ready: torch.cuda.Event | None) -> Iterator[None]:
        with _compat.generating_on(self.trainer, self.decoder.model):
            if ready is None:
                yield
                return
            stream = torch.cuda.Stream(self.decoder.model.device)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                yield
            stream.synchronize()


class TensorParallelGenerator(_CopyGenerator):
    """The ``"tensor-parallel"`` mode: TRL generates on :attr:`decoder`'s sliced copy, every rank of the shard group
    decoding the group's prompts together. Refused with tools (TRL's tool loop decodes as many turns on each rank as
    its own completions need, so the ranks' ``generate`` calls would not meet)."""

    mode = "tensor-parallel"
    decoder_class = TensorParallelDecoder

    def __init__(self, trainer: Any, dtype: torch.dtype):
        if uses_tools(trainer):
            raise ValueError(
                "odc_generation='tensor-parallel' decodes every rank's prompts together, one generate call per turn "
                "on every rank; with tools the ranks decode different numbers of turns. Use 'static', 'gathered' or "
                "'sharded'."
            )
        super().__init__(trainer, dtype)


class VLLMGenerator(Generator):
    """The ``"vllm"`` mode (``use_vllm=True``; ``vllm_mode`` colocate or server): TRL's engine decodes, with hf_odc's
    weight sync installed in TRL's ``VLLMGeneration`` when this is built; a colocated engine is shut down at
    :meth:`end`."""

    mode = "vllm"

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        ODCWeightSync.install(trainer.vllm_generation, trainer.model, trainer.odc)

    def end(self) -> None:
        shut_down_engine(self.trainer.vllm_generation)


def make_generator(trainer: Any) -> Generator:
    """The owner of ``trainer``'s generation mode: ``"vllm"`` with ``use_vllm``, else ``odc_generation`` as
    :func:`choose_generation_mode` settles it. Called once, after the policy is sharded and ODC installed.

    A vision-language policy (TRL's ``_is_vlm``) decodes its images with transformers' ``generate`` on the policy
    itself, its full weights held in place: ``"gathered"``, its only mode. The others are refused: the copy modes
    (``"static"``, ``"tensor-parallel"``: text decoders), vLLM (whose weight sync is the text model's), and
    ``"sharded"`` and ``"lockstep"``, in which ``generate`` runs the vision tower before the FSDP root's forward
    gathers the root's own parameters (the patch embedding among them)."""
    args = trainer.args
    vision = _compat.is_vision_trainer(trainer)
    if vision and (args.use_vllm or args.odc_generation not in (None, "gathered")):
        chosen = "use_vllm=True" if args.use_vllm else f"odc_generation={args.odc_generation!r}"
        raise ValueError(
            f"{chosen} cannot decode a vision-language policy's images; leave odc_generation unset (or 'gathered'), "
            "use_vllm=False."
        )
    if args.use_vllm:
        return VLLMGenerator(trainer)
    dtype = compute_dtype(args)
    device, tools = trainer.accelerator.device, uses_tools(trainer)
    if vision:
        mode = "gathered"
    else:
        mode = choose_generation_mode(args.odc_generation, trainer.model, trainer.odc, dtype, device, tools)
    if mode == "static":
        return StaticGenerator(trainer, dtype)
    if mode == "tensor-parallel":
        return TensorParallelGenerator(trainer, dtype)
    return {"gathered": GatheredGenerator, "sharded": ShardedGenerator, "lockstep": Generator}[mode](trainer)
