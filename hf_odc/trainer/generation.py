"""How an online ODC trainer (GRPO, RLOO, distillation) generates its rollouts: one owner per generation mode, chosen
once (:func:`make_generator`) and called by the trainer at TRL's generation hooks. This docstring is where the modes
are described; :func:`check_generation_mode` is where a requested one is checked.

transformers' ``generate`` on an FSDP2 model all-gathers every layer group for every decoded token, and keeps the
ranks in lockstep (``synced_gpus``): a rank whose completions end early runs dummy forwards until the longest one
anywhere ends. The modes (``odc_generation``; ``"vllm"`` with ``use_vllm``):

* ``"static"`` (:class:`StaticGenerator`, :class:`StaticDecoder`): a plain copy of the policy in the compute dtype,
  kept for the whole run and refreshed in place once per generation batch (the full weights assembled one FSDP group
  at a time, one-sided: :mod:`hf_odc.trainer.full_weights`), decodes with a static KV cache kept beside it, by
  transformers' ``generate`` with the forward transformers compiles for it, or, with ``odc_decoding_loop``, by
  hf_odc's own loop (:mod:`hf_odc.trainer._static_decoding`: on a GPU each step replayed from a CUDA graph, with no
  host synchronisation per token) where it decodes what ``generate`` would: CUDA graphs and compile are paid once
  per run, as the copy's weights and the cache's tensors never move. The loop is opt-in until it has been measured
  on a GPU (its CUDA graphs have not run on one). Costs the full weights in the compute dtype for the whole run,
  plus the cache.
* ``"gathered"`` (:class:`GatheredGenerator`): the policy's full weights are held in place once per generation batch
  (:meth:`~hf_odc.accelerate_plugin.ODCRuntime.gathered`: one-sided reads with ODC, no collective), every rank decodes
  its own prompts with no communication at all, and they are freed before the policy update. Costs the full weights
  in the compute dtype while decoding, on top of the shards.
* ``"sharded"`` (:class:`ShardedGenerator`): decoding inside one forward-only ODC minibatch: each forward reads the
  layer shards it needs from the peers one-sidedly, as in training, so no copy is held and no collective runs; each
  token pays the reads. Needs ODC.
* ``"lockstep"`` (:class:`Generator`): TRL's own path, kept as the baseline the others are measured against.
* ``"vllm"`` (:class:`VLLMGenerator`, ``use_vllm=True``): TRL's vLLM generation, ``vllm_mode="colocate"`` (an engine
  on each rank) or ``"server"`` (rank 0 sends TRL's requests to a vLLM server), with hf_odc's weight sync
  (:mod:`hf_odc.trainer.vllm_sync`: the full weights assembled one-sidedly, no collective) and a colocated engine shut
  down at the run's end, before the process groups go.

With tools, the transformers modes hold their decoding context (the assembled weights, the ODC minibatch) from a
generation batch's first turn through TRL's tool loop, so that each rank decodes as many turns as its own completions
need, alone. A rank that finishes decoding first waits for the others at the rollouts' gather.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import is_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F
from transformers import AttentionInterface, GenerationConfig, PreTrainedModel, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _compat
from ..accelerate_plugin import ODCRuntime
from ..engine import lazy_init_root
from . import _static_decoding
from .attention import PACKED_ATTENTION
from .full_weights import checkpoint_name, full_named_weights
from .vllm_sync import ODCWeightSync, shut_down_engine

__all__ = [
    "DECODING_ATTENTION",
    "GENERATION_MODES",
    "GatheredGenerator",
    "Generator",
    "ShardedGenerator",
    "StaticDecoder",
    "StaticGenerator",
    "VLLMGenerator",
    "check_generation_mode",
    "choose_generation_mode",
    "decoding",
    "grouped_decoding_attention",
    "make_generator",
]

GENERATION_MODES = ("static", "gathered", "sharded", "lockstep")
"""The transformers modes ``odc_generation`` takes (``"vllm"`` is chosen by ``use_vllm``)."""

# The share of the device's free memory the full weights may take, by mode, when the mode is chosen: the static copy
# is held through the policy update too, so it takes less; what is left goes to the KV cache and the activations.
_COPY_SHARE_OF_FREE_MEMORY = {"static": 0.25, "gathered": 0.5}

DECODING_ATTENTION = "odc_decoding"
"""The attention :class:`StaticDecoder`'s copy runs where the policy runs SDPA (or hf_odc's packed attention):
:func:`grouped_decoding_attention`, registered under this name when this module is imported."""


def check_generation_mode(
    requested: str | None, use_vllm: bool = False, model: nn.Module | None = None, runtime: ODCRuntime | None = None
) -> None:
    """Raise ``ValueError``, naming what to set, for a generation mode the run cannot use: ``requested``
    (``odc_generation``) is not one of :data:`GENERATION_MODES`, or is set with ``use_vllm`` (vLLM decodes then), or
    is ``"sharded"`` for a ``model`` sharded by plain FSDP2 (``runtime`` not active; checked once the model is)."""
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


def choose_generation_mode(
    requested: str | None, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, device: torch.device
) -> str:
    """``requested`` checked against the run (:func:`check_generation_mode`), or (``None``) on a GPU ``device`` the
    first of ``"static"`` and ``"gathered"`` whose copy of the full weights in ``dtype`` fits its share of the
    device's free memory (:data:`_COPY_SHARE_OF_FREE_MEMORY`), else ``"sharded"`` with ODC, ``"lockstep"`` with plain
    FSDP2; on a CPU ``"gathered"`` (a CPU compiles nothing for the static cache). ``device`` is where the model
    trains, which it may not have reached yet: with one process the Trainer places it when training starts."""
    sharded = isinstance(model, FSDPModule)
    if requested is not None:
        check_generation_mode(requested, model=model, runtime=runtime)
        return requested
    if device.type != "cuda":
        return "gathered"
    copy_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free_bytes, _ = torch.cuda.mem_get_info(device)
    fitting = [mode for mode, share in _COPY_SHARE_OF_FREE_MEMORY.items() if copy_bytes <= share * free_bytes]
    if fitting:
        return fitting[0]
    return "gathered" if not sharded else "sharded" if runtime.active else "lockstep"


@contextlib.contextmanager
def decoding(model: nn.Module, runtime: ODCRuntime, mode: str) -> Iterator[None]:
    """The context in which ``model`` decodes a generation batch in ``mode`` (see the module docstring); nothing
    changes for a model that is not sharded, in ``"lockstep"``, or in ``"static"`` (its copy is decoded instead)."""
    if mode in ("lockstep", "static") or not isinstance(model, FSDPModule):
        yield
        return
    with _compat.decoding_alone(model):
        if mode == "sharded":
            with runtime.minibatch(backward=False):
                yield
        else:
            with runtime.gathered(model):
                yield


class StaticDecoder:
    """The ``"static"`` mode (see the module docstring): :attr:`model`, a plain copy of the policy, refreshed by
    :meth:`refresh` and decoded by hf_odc's loop (or transformers' ``generate``) with a static KV cache held here.

    Why it is kept: a decoding step's CUDA graphs (the loop's, or those transformers' default compile records) are
    bound to the copy's parameters and the cache's tensors; refreshing both in place keeps every later generation
    batch on the graphs recorded for the first. The cache is sized for the longest prompt plus ``max_new_tokens`` seen
    so far, rounded up to :data:`CACHE_LENGTH_MULTIPLE` tokens, and re-made (its graphs recorded again) only for a
    longer one or another batch size. The copy has no FSDP mark, so transformers decodes it on this rank alone.

    Args:
        model: the policy as the trainer runs it (sharded by hf_odc, or not; a PEFT model's adapters are merged into
            the copy).
        runtime: the policy's :class:`~hf_odc.accelerate_plugin.ODCRuntime`.
        dtype: the copy's dtype, the policy's compute dtype.
        loop: decode with hf_odc's loop where it decodes what ``generate`` would (``odc_decoding_loop``), else always
            with transformers' ``generate``.
    """

    CACHE_LENGTH_MULTIPLE = 256

    def __init__(self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, loop: bool = False):
        self._policy, self._runtime, self._dtype, self._use_loop = model, runtime, dtype, loop
        self._model: PreTrainedModel | None = None
        self._cache: StaticCache | None = None
        self._cache_shape = (0, 0)  # batch size, length
        self._loop: _static_decoding.Loop | None = None  # decodes with the cache, made on its first use

    @property
    def model(self) -> PreTrainedModel:
        """The copy (made by the first :meth:`refresh`)."""
        if self._model is None:
            raise RuntimeError("StaticDecoder.refresh() makes the copy before it decodes.")
        return self._model

    def refresh(self) -> None:
        """Copy the policy's current weights into :attr:`model`, in place (making it on the first call). The weights
        are assembled as for a vLLM sync (:func:`~hf_odc.trainer.full_weights.full_named_weights`: one FSDP group at a
        time, one-sided with ODC): every rank of the shard group calls this together, once per generation batch."""
        if self._model is None:
            self._model = self._make_copy()
        parameters = dict(self._model.named_parameters(remove_duplicate=False))  # tied ones under every name
        loaded: set[int] = set()
        with torch.no_grad():
            for name, tensor in full_named_weights(self._policy, self._runtime):
                if name not in parameters:
                    raise RuntimeError(f"hf_odc: the policy's weight {name} has no place in its static-decoding copy.")
                if id(parameters[name]) in loaded:
                    # The policy holds apart what its config ties, and the copy ties: the copy holds them apart too,
                    # from the first refresh on, before anything is compiled for it.
                    parameters[name] = self._untie(name)
                parameters[name].copy_(tensor)
                loaded.add(id(parameters[name]))
        missing = sorted(name for name, parameter in self._model.named_parameters() if id(parameter) not in loaded)
        if missing:
            raise RuntimeError(f"hf_odc: the policy gave no weights for {missing} of its static-decoding copy.")

    def _untie(self, name: str) -> nn.Parameter:
        """The copy's parameter ``name``, tied to another, given a tensor of its own."""
        owner, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(owner)
        parameter = nn.Parameter(getattr(module, leaf).detach().clone(), requires_grad=False)
        setattr(module, leaf, parameter)
        return parameter

    def _make_copy(self) -> PreTrainedModel:
        """An uninitialised copy of the policy's (base) model class on its device in :attr:`_dtype`, its buffers
        (rotary frequencies) taken from the policy; the weights come from :meth:`refresh`."""
        base = self._policy.get_base_model() if hasattr(self._policy, "get_base_model") else self._policy
        cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))  # below FSDP2's dynamic class
        config = copy.deepcopy(base.config)
        # With a KV cache hf_odc's packed attention is SDPA, which decodes faster grouped.
        attention = _compat.attn_implementation(config)
        attention = DECODING_ATTENTION if attention in ("sdpa", PACKED_ATTENTION) else attention
        with torch.device("meta"):
            model = _compat.model_from_config(cls, config, dtype=self._dtype, attn_implementation=attention)
        device = next(self._policy.parameters()).device
        model.to_empty(device=device).eval().requires_grad_(False)
        model.tie_weights()  # to_empty gave tied weights (embeddings and head) storages of their own
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, buffer in self._policy.named_buffers():
                buffers[checkpoint_name(name)].copy_(buffer)
        model.generation_config = copy.deepcopy(base.generation_config)
        model.generate = self._generate  # every call, TRL's included, decodes with the kept cache
        return model

    def _generate(self, *args: Any, generation_config: GenerationConfig | None = None, **kwargs: Any) -> Any:
        """The copy's ``generate``: with ``loop``, hf_odc's decoding loop (:mod:`hf_odc.trainer._static_decoding`)
        where it decodes what transformers' ``generate`` would, else transformers', with the kept static cache and
        compilation allowed."""
        model = self.model
        config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
        kwargs = config.update(**kwargs)  # generation options given as arguments, as generate() takes them
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if config.max_new_tokens is not None:
            length = input_ids.shape[1] + config.max_new_tokens
        else:
            length = config.max_length or model.config.max_position_embeddings
        config.cache_implementation, config.disable_compile = None, False  # the cache is ours; compile where it pays
        cache = self._cache_for(input_ids.shape[0], length)
        plan = self._use_loop and _static_decoding.decoding_plan(
            model, cache, self._cache_shape[1], config, args, kwargs
        )
        if plan:
            if self._loop is None:
                self._loop = _static_decoding.Loop(model, cache, *self._cache_shape)
            return self._loop.decode(plan)
        kwargs[_compat.cache_argument(model)] = cache
        return type(model).generate(model, *args, generation_config=config, **kwargs)

    def _cache_for(self, batch_size: int, length: int) -> StaticCache:
        """The kept cache, emptied, or a new one where it is too short or of another batch size (and with it a new
        decoding loop: the loop's CUDA graphs are bound to the cache's tensors)."""
        if batch_size == self._cache_shape[0] and length <= self._cache_shape[1]:
            self._cache.reset()
            return self._cache
        length = max(math.ceil(length / self.CACHE_LENGTH_MULTIPLE) * self.CACHE_LENGTH_MULTIPLE, self._cache_shape[1])
        self._cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._cache_shape = (batch_size, length)
        self._loop = None
        return self._cache


def grouped_decoding_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for one query token in a grouped-query layer: there the query heads that
    share a key/value head become that head's query rows, so each key and value is read once. transformers' SDPA
    repeats the keys and values once per query head whenever a mask is given (a static cache always gives one, for
    its empty slots) and groups the query only outside ``torch.compile``; in a compiled decoding step the repeat
    writes and reads the whole cache several times over. The result is the same: a one-token query's mask is the
    same for every head.

    A mask narrower than the keys (hf_odc's decoding loop, :mod:`hf_odc.trainer._static_decoding`) covers the cache's
    first slots, all that is filled: the keys and values beyond it are not read."""
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[-2]:
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, _ = query.shape
    if (
        length != 1
        or groups == 1
        or dropout
        or kwargs.get("position_bias") is not None
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    grouped = query.reshape(batch, heads // groups, groups, query.shape[-1])
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


AttentionInterface.register(DECODING_ATTENTION, grouped_decoding_attention)
AttentionMaskInterface.register(DECODING_ATTENTION, sdpa_mask)


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
        root, so the root's parameters (embeddings, head) are gathered around it, as the root's forward would."""
        model = self.trainer.model
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


class StaticGenerator(Generator):
    """The ``"static"`` mode: TRL generates on :attr:`decoder`'s copy, refreshed once per generation batch.

    Args:
        trainer: as :class:`Generator`'s; its ``odc_decoding_loop`` chooses the decoder's loop.
        dtype: the copy's dtype, the policy's compute dtype.
    """

    mode = "static"

    def __init__(self, trainer: Any, dtype: torch.dtype):
        super().__init__(trainer)
        self.dtype = dtype
        self.decoder: StaticDecoder | None = None  # made at the first generation, on the prepared model

    @contextlib.contextmanager
    def generation_batch(self) -> Iterator[None]:
        if self.decoder is None:
            loop = self.trainer.args.odc_decoding_loop
            self.decoder = StaticDecoder(self.trainer.model, self.trainer.odc, self.dtype, loop=loop)
        self.decoder.refresh()
        with _compat.generating_on(self.trainer, self.decoder.model):
            yield


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
    :func:`choose_generation_mode` settles it. Called once, after the policy is sharded and ODC installed."""
    args = trainer.args
    if args.use_vllm:
        return VLLMGenerator(trainer)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    mode = choose_generation_mode(args.odc_generation, trainer.model, trainer.odc, dtype, trainer.accelerator.device)
    if mode == "static":
        return StaticGenerator(trainer, dtype)
    return {"gathered": GatheredGenerator, "sharded": ShardedGenerator, "lockstep": Generator}[mode](trainer)
