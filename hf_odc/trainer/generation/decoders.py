"""The decoding copies of the ``"static"`` and ``"tensor-parallel"`` generation modes (described in
:mod:`hf_odc.trainer.generation.modes`, whose owners make and call them): a plain copy of the policy in the compute
dtype (:class:`StaticDecoder`), or each rank's slice of one (:class:`TensorParallelDecoder`), kept for the whole run
with a static KV cache beside it and refreshed in place once per generation batch, so that the graphs recorded for the
first batch serve every later one; and the attention they decode with (:func:`grouped_decoding_attention`).

A copy fuses (``fuse=True``, the default) each attention's ``q/k/v_proj`` into one ``qkv_proj`` and each gated MLP's
``gate/up_proj`` into one ``gate_up_proj`` (Llama, Mistral, Mixtral, Qwen2, Qwen3 and Qwen3-MoE layers), so that a
decoding step runs one GEMM where it ran three, and one where it ran two. The fused weights are the copy's only ones:
each refresh writes the policy's weights into their rows (nothing is held twice), and the layers' own forwards run
unchanged on them: the fused projection runs on the module's input, and the parts it replaces read their rows of it.
"""

from __future__ import annotations

import atexit
import copy
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from transformers import AttentionInterface, GenerationConfig, PreTrainedModel, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ... import _compat
from ...accelerate_plugin import ODCRuntime
from ...kernels.decode_attention import decode_attention
from ...kernels.fused import SILU_MLP_CLASSES
from ..core.attention import PACKED_ATTENTION, _base_model
from . import _static_decoding
from .full_weights import checkpoint_name, full_named_weights

__all__ = [
    "DECODING_ATTENTION",
    "FUSED_ATTENTION_CLASSES",
    "StaticDecoder",
    "TensorParallelDecoder",
    "check_tensor_parallel",
    "grouped_decoding_attention",
    "shard_group",
]

DECODING_ATTENTION = "odc_decoding"
"""The attention :class:`StaticDecoder`'s copy runs where the policy runs SDPA (or hf_odc's packed attention):
:func:`grouped_decoding_attention`, registered under this name when this module is imported."""

FUSED_ATTENTION_CLASSES = frozenset(
    {"LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention"}
)
"""transformers' attention classes whose forward reads its input only through ``q_proj``, ``k_proj`` and ``v_proj``
(and for its shape but the last dimension): the ones a decoding copy fuses. The gated MLPs it fuses are
:data:`hf_odc.kernels.fused.SILU_MLP_CLASSES`."""

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""The fused projections a copy makes, and the projections each replaces (its rows, in this order)."""


@dataclass(frozen=True)
class _Place:
    """Where a copy holds one of the policy's weights: the parameter ``attribute`` of ``module``, all of it or its
    ``rows`` (``start, stop``: a fused weight's part)."""

    module: nn.Module
    attribute: str
    rows: tuple[int, int] | None = None

    def parameter(self) -> nn.Parameter:
        return getattr(self.module, self.attribute)

    def tensor(self) -> torch.Tensor:
        parameter = self.parameter()
        return parameter if self.rows is None else parameter[self.rows[0] : self.rows[1]]


class _Rows(nn.Module):
    """In place of a projection a fused one replaces: its rows of the fused output, which the module holding both
    passes in place of their common input (:class:`_FusedInput`)."""

    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        return fused[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"rows={self.start}:{self.stop}"


class _FusedInput:
    """A forward pre-hook: the module's input (its first argument, ``argument`` when passed by name) replaced by the
    output of its fused projection ``fused``, which its replaced projections (:class:`_Rows`) read their parts of."""

    def __init__(self, fused: str, argument: str):
        self.fused, self.argument = fused, argument

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        projection = getattr(module, self.fused)
        if args:
            return (projection(args[0]), *args[1:]), kwargs
        return args, {**kwargs, self.argument: projection(kwargs[self.argument])}


class _DecodingCopy:
    """A plain copy of the policy in the compute dtype that decodes in its place (:attr:`model`), refreshed in place
    from the policy's full weights (:meth:`refresh`); its ``generate`` is :meth:`_generate`. What a mode's copy holds
    of each weight (:meth:`_local`), its config (:meth:`_copy_config`) and the changes to its modules
    (:meth:`_restructure`: the fusion of its projections, a mode's own) are the mode's.

    Args:
        model: the policy as the trainer runs it (sharded by hf_odc, or not; a PEFT model's adapters are merged into
            the copy).
        runtime: the policy's :class:`~hf_odc.accelerate_plugin.ODCRuntime`.
        dtype: the copy's dtype, the policy's compute dtype.
        fuse: fuse the projections of every layer that allows it (see the module docstring).
    """

    def __init__(self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, fuse: bool = True):
        self._policy, self._runtime, self._dtype, self.fuse = model, runtime, dtype, fuse
        self._model: PreTrainedModel | None = None
        self._places: dict[str, _Place] = {}  # by the policy's weight names
        self._tied: dict[str, tuple[str, ...]] = {}  # the names the policy's config gives one weight, by each

    @property
    def model(self) -> PreTrainedModel:
        """The copy (made by the first :meth:`refresh`)."""
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.refresh() makes the copy before it decodes.")
        return self._model

    def weight(self, name: str) -> torch.Tensor:
        """What the copy holds of the policy's weight ``name`` (a checkpoint name): its parameter, or its rows of a
        fused one; a tensor-parallel copy's slice."""
        if name not in self._places:
            raise KeyError(f"the decoding copy holds no weight {name!r}.")
        return self._places[name].tensor()

    def refresh(self) -> None:
        """Copy the policy's current weights into :attr:`model`, in place (making it on the first call). The weights are
        assembled as for a vLLM sync (:func:`~hf_odc.trainer.generation.full_weights.full_named_weights`: one FSDP group
        at a time, one-sided with ODC): every rank of the shard group calls this together, once per generation batch. A
        weight the config ties to others fills every place of theirs, unless the policy gives them apart."""
        if self._model is None:
            self._model = self._make_copy()
        filled: set[str] = set()
        with torch.no_grad():
            for name, tensor in full_named_weights(self._policy, self._runtime):
                if name not in self._places:
                    raise RuntimeError(f"hf_odc: the policy's weight {name} has no place in its decoding copy.")
                names = self._tied.get(name, (name,))
                if filled.intersection(names):
                    # The policy holds apart what its config ties: the copy holds them apart too, from the first
                    # refresh on, before anything is compiled for it, and each takes its own weight from then on.
                    self._untie(name, [self._places[other] for other in names if other in filled])
                    for other in names:
                        del self._tied[other]
                    names = (name,)
                written: set[tuple] = set()
                for place_name in names:
                    place = self._places[place_name]
                    target = (id(place.parameter()), place.rows)
                    if target not in written:  # tied places holding one parameter take it once
                        place.tensor().copy_(self._local(place_name, tensor))
                        written.add(target)
                filled.update(names)
        missing = sorted(set(self._places) - filled)
        if missing:
            raise RuntimeError(f"hf_odc: the policy gave no weights for {missing} of its decoding copy.")

    def _local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What the copy holds of the policy's full weight ``name``: all of it."""
        return tensor

    def _copy_config(self, config: Any) -> Any:
        """The config the copy is made from: a copy of the policy's ``config``."""
        return copy.deepcopy(config)

    def _untie(self, name: str, others: list[_Place]) -> None:
        """Give the place of ``name``, where it shares a parameter with any of the ``others`` (tied), one of its
        own."""
        place = self._places[name]
        parameter = place.parameter()
        if place.rows is None and any(other.parameter() is parameter for other in others):
            setattr(place.module, place.attribute, nn.Parameter(parameter.detach().clone(), requires_grad=False))

    def _make_copy(self) -> PreTrainedModel:
        """An uninitialised copy of the policy's (base) model class on its device in :attr:`_dtype`, made from
        :meth:`_copy_config` and changed by :meth:`_restructure` on the meta device (so that nothing replaced is
        allocated), with the places of the policy's weights in it, its buffers (rotary frequencies) taken from the
        policy; the weights come from :meth:`refresh`."""
        base = _base_model(self._policy)
        config = self._copy_config(base.config)
        # With a KV cache hf_odc's packed attention is SDPA, which decodes faster grouped.
        attention = _compat.attn_implementation(config)
        attention = DECODING_ATTENTION if attention in ("sdpa", PACKED_ATTENTION) else attention
        with torch.device("meta"):
            model = _compat.model_from_config(
                _model_class(base), config, dtype=self._dtype, attn_implementation=attention
            )
        names = _names_by_parameter(model)
        self._tied = {name: tuple(tied) for tied in names if len(tied) > 1 for name in tied}
        self._places = {name: _Place(*_owner(model, name)) for tied in names for name in tied}
        self._restructure(model)
        shared = _names_by_parameter(model)
        device = next(self._policy.parameters()).device
        model.to_empty(device=device).eval().requires_grad_(False)
        for tied in shared:  # to_empty gave tied weights (embeddings and head) storages of their own
            for name in tied[1:]:
                setattr(*_owner(model, name), model.get_parameter(tied[0]))
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, buffer in self._policy.named_buffers():
                buffers[checkpoint_name(name)].copy_(buffer)
        model.generation_config = copy.deepcopy(base.generation_config)
        model.generate = self._generate  # every call, TRL's included, decodes as this copy's mode does
        return model

    def _restructure(self, model: PreTrainedModel) -> None:
        """Change the copy's modules (on the meta device) before they are allocated: with :attr:`fuse`, every layer
        of :data:`FUSED_ATTENTION_CLASSES` and :data:`~hf_odc.kernels.fused.SILU_MLP_CLASSES` gets its fused
        projections (see the module docstring)."""
        if not self.fuse:
            return
        for module in list(model.modules()):
            kind = type(module)
            if not kind.__module__.startswith("transformers."):
                continue
            if kind.__name__ in FUSED_ATTENTION_CLASSES:
                self._fuse(module, "qkv_proj")
            elif kind.__name__ in SILU_MLP_CLASSES:
                self._fuse(module, "gate_up_proj")

    def _fuse(self, module: nn.Module, fused_name: str) -> None:
        """Give ``module`` the projection ``fused_name`` in place of those of :data:`_FUSED` (left as they are where
        they are not all linear, with a bias on all or none), moving their weights' places to its rows."""
        parts = [getattr(module, name) for name in _FUSED[fused_name]]
        if not all(type(part) is nn.Linear for part in parts) or len({part.bias is None for part in parts}) > 1:
            return
        first = parts[0]
        fused = nn.Linear(
            first.in_features,
            sum(part.out_features for part in parts),
            bias=first.bias is not None,
            device="meta",
            dtype=first.weight.dtype,
        )
        setattr(module, fused_name, fused)
        start = 0
        for name, part in zip(_FUSED[fused_name], parts, strict=True):
            rows = (start, start + part.out_features)
            self._move_places(part, fused, rows)
            setattr(module, name, _Rows(*rows))
            start = rows[1]
        argument = next(iter(inspect.signature(module.forward).parameters))
        module.register_forward_pre_hook(_FusedInput(fused_name, argument), with_kwargs=True)

    def _move_places(self, old: nn.Module, new: nn.Module, rows: tuple[int, int] | None = None) -> None:
        """The weights placed in ``old`` go to ``new`` (its ``rows``)."""
        for name, place in self._places.items():
            if place.module is old:
                self._places[name] = _Place(new, place.attribute, rows)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _model_class(base: nn.Module) -> type:
    """``base``'s transformers class, below FSDP2's dynamic class."""
    return next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))


def _names_by_parameter(model: nn.Module) -> list[list[str]]:
    """``model``'s parameter names, those of one parameter (tied) together, the first as ``named_parameters`` gives
    it."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return list(names.values())


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding ``model``'s parameter ``name``, and its attribute there."""
    owner, _, leaf = name.rpartition(".")
    return model.get_submodule(owner), leaf


class StaticDecoder(_DecodingCopy):
    """The ``"static"`` mode (see the module docstring): :attr:`model`, a plain copy of the policy, refreshed by
    :meth:`refresh` and decoded by hf_odc's loop (or transformers' ``generate``) with a static KV cache held here.

    Why it is kept: a decoding step's CUDA graphs (the loop's, or those transformers' default compile records) are
    bound to the copy's parameters and the cache's tensors; refreshing both in place keeps every later generation
    batch on the graphs recorded for the first. The cache is sized for the longest prompt plus ``max_new_tokens`` seen
    so far, rounded up to :data:`CACHE_LENGTH_MULTIPLE` tokens (and one slot more, which the loop never fills:
    :func:`~hf_odc.trainer.generation._static_decoding.cache_slots`), and re-made (its graphs recorded again) only for a
    longer one or another batch size. The copy has no FSDP mark, so transformers decodes it on this rank alone.

    Args:
        model, runtime, dtype, fuse: as :class:`_DecodingCopy`'s.
        loop: decode with hf_odc's loop where it decodes what ``generate`` would (``odc_decoding_loop``), else always
            with transformers' ``generate``.
    """

    CACHE_LENGTH_MULTIPLE = 256
    _COMPILE = True
    """Whether the copy's forward is compiled on a GPU (by the loop, or by transformers' ``generate``)."""

    def __init__(
        self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, loop: bool = False, fuse: bool = True
    ):
        super().__init__(model, runtime, dtype, fuse)
        self._use_loop = loop
        self._cache: StaticCache | None = None
        self._cache_shape = (0, 0)  # batch size, length
        self._loop: _static_decoding.Loop | None = None  # decodes with the cache, made on its first use
        self.compile_layers = True
        """Whether the loop compiles the copy's forward by layer (see
        :mod:`hf_odc.trainer.generation._static_decoding`), set before the first call: a shorter compile, without fusion
        across layers, at the same step time on a GPU; ``False`` compiles the whole forward."""
        self.log_prob_temperature: float | None = None
        """Set: a call the loop decodes also records its chosen tokens' log-probabilities under the logits divided by
        it, :attr:`last_log_probs` (``[batch, new tokens]``; ``None`` after a call ``generate`` decoded)."""
        self.last_log_probs: torch.Tensor | None = None
        # Closed at the latest when Python exits, before the process groups are torn down: a script that never calls
        # the trainer's end() still exits.
        atexit.register(_close_if_alive, weakref.ref(self))

    def _generate(self, *args: Any, generation_config: GenerationConfig | None = None, **kwargs: Any) -> Any:
        """The copy's ``generate``: with ``loop``, hf_odc's decoding loop
        (:mod:`hf_odc.trainer.generation._static_decoding`) where it decodes what transformers' ``generate`` would, else
        transformers', with the kept static cache and compilation allowed."""
        model = self.model
        config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
        kwargs = config.update(**kwargs)  # generation options given as arguments, as generate() takes them
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if config.max_new_tokens is not None:
            length = input_ids.shape[1] + config.max_new_tokens
        else:
            length = config.max_length or model.config.max_position_embeddings
        config.cache_implementation = None  # the cache is ours
        config.disable_compile = not self._COMPILE  # (transformers compiles where it pays)
        cache = self._cache_for(input_ids.shape[0], length)
        plan = self._use_loop and _static_decoding.decoding_plan(
            model, cache, self._cache_shape[1], config, args, kwargs
        )
        if plan:
            if self._loop is None:
                compile = self._COMPILE and model.device.type == "cuda"
                self._loop = _static_decoding.Loop(
                    model, cache, *self._cache_shape, compile=compile, compile_layers=self.compile_layers
                )
            self._loop.log_prob_temperature = self.log_prob_temperature
            decoded = self._loop.decode(plan)
            self.last_log_probs = self._loop.last_log_probs
            return decoded
        self.last_log_probs = None
        kwargs[_compat.cache_argument(model)] = cache
        return type(model).generate(model, *args, generation_config=config, **kwargs)

    def close(self) -> None:
        """Release the decoding loop's CUDA graphs and the cache (at the run's end, before the process groups are
        destroyed: see :meth:`~hf_odc.trainer.generation._static_decoding.Loop.release`); a later call decodes anew."""
        if self._loop is not None:
            self._loop.release()
        self._loop, self._cache, self._cache_shape = None, None, (0, 0)

    def _cache_for(self, batch_size: int, length: int) -> StaticCache:
        """The kept cache, emptied, or a new one where it is too short or of another batch size (and with it a new
        decoding loop: the loop's CUDA graphs are bound to the cache's tensors)."""
        if batch_size == self._cache_shape[0] and length <= self._cache_shape[1]:
            self._cache.reset()
            return self._cache
        length = max(math.ceil(length / self.CACHE_LENGTH_MULTIPLE) * self.CACHE_LENGTH_MULTIPLE, self._cache_shape[1])
        self.close()
        self._cache = StaticCache(config=self.model.config, max_cache_len=_static_decoding.cache_slots(length))
        self._cache_shape = (batch_size, length)
        return self._cache


def _close_if_alive(decoder: weakref.ref) -> None:
    alive = decoder()
    if alive is not None:
        alive.close()


_TENSOR_PARALLEL_MODELS = ("llama", "mistral", "qwen2", "qwen3")
_ROW_PARALLEL = ("o_proj", "down_proj")


def shard_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group ``model``'s parameters are sharded over (FSDP2's mesh's shard dimension, its last), or
    ``None`` for a model that is not sharded."""
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            return mesh.get_group(mesh.ndim - 1)
    return None


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Raise ``ValueError``, naming the modes to use instead, where ``model`` (the policy) cannot decode
    tensor-parallel over ``size`` ranks: not a Llama/Mistral/Qwen2/Qwen3 decoder (MoE models included), or fewer
    attention heads than ranks (each rank computes at least one). Any other head count is sliced (see
    :class:`TensorParallelDecoder`)."""
    instead = "Use odc_generation='static', 'gathered' or 'sharded'."
    config = _base_model(model).config
    if config.model_type not in _TENSOR_PARALLEL_MODELS:
        raise ValueError(
            f"odc_generation='tensor-parallel' slices the decoder layers of {'/'.join(_TENSOR_PARALLEL_MODELS)} "
            f"models (dense: self_attn.q/k/v/o_proj, mlp.gate/up/down_proj); the policy is {config.model_type!r}. "
            + instead
        )
    if config.num_attention_heads < size:
        raise ValueError(
            f"odc_generation='tensor-parallel' gives each of the shard group's {size} ranks at least one attention "
            f"head; the policy has {config.num_attention_heads}. " + instead
        )


def _even(total: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(total)`` cut into ``parts`` consecutive parts whose sizes differ by one at most, the
    larger first."""
    size, larger = divmod(total, parts)
    start = index * size + min(index, larger)
    return range(start, start + size + (index < larger))


def _head_ranges(heads: int, kv_heads: int, size: int, rank: int) -> tuple[range, range]:
    """The query heads and key/value heads rank ``rank`` of ``size`` computes: with at least as many key/value heads
    as ranks, its part of them and all their query heads; with fewer, one key/value head, held by each of the ranks
    it falls to (the ranks shared out among the key/value heads as evenly as they go), and its part of that head's
    query heads. Every query head is computed once, with the key/value head it reads."""
    groups = heads // kv_heads
    if size <= kv_heads:
        kv = _even(kv_heads, size, rank)
        return range(kv.start * groups, kv.stop * groups), kv
    kv_head = next(k for k in range(kv_heads) if rank in _even(size, kv_heads, k))
    ranks = _even(size, kv_heads, kv_head)
    part = _even(groups, len(ranks), rank - ranks.start)
    return range(kv_head * groups + part.start, kv_head * groups + part.stop), range(kv_head, kv_head + 1)


class _RankSlice:
    """What rank ``rank`` of ``size`` holds of a tensor-parallel copy of a ``config`` decoder (see
    :class:`TensorParallelDecoder`): its query and key/value heads (:func:`_head_ranges`), its MLP rows (all of them
    where ``size`` does not divide the intermediate size), its rows of the LM head's vocabulary (where ``size``
    divides the vocabulary, else ``None``: the head whole)."""

    def __init__(self, config: Any, size: int, rank: int):
        self.size, self.rank = size, rank
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.heads, self.kv_heads = _head_ranges(heads, kv_heads, size, rank)
        intermediate = config.intermediate_size
        self.mlp_sliced = size > 1 and intermediate % size == 0
        self.mlp_rows = _even(intermediate, size, rank) if self.mlp_sliced else range(intermediate)
        self.vocab_rows = _even(config.vocab_size, size, rank) if size > 1 and config.vocab_size % size == 0 else None
        query = range(self.heads.start * self.head_dim, self.heads.stop * self.head_dim)
        key_value = range(self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim)
        # A sliced projection's rows (column-parallel) or input columns (row-parallel) of the full weight.
        self._parts = {"q_proj": query, "k_proj": key_value, "v_proj": key_value, "o_proj": query}
        if self.mlp_sliced:
            self._parts |= dict.fromkeys(("gate_proj", "up_proj", "down_proj"), self.mlp_rows)

    def config(self, config: Any) -> Any:
        """A copy of ``config`` with this rank's head and MLP row counts (the head dimension kept), so that
        transformers' attention, the KV cache and the grouping of query heads per key/value head are the local
        layer's."""
        config = copy.deepcopy(config)
        config.head_dim = self.head_dim
        config.num_attention_heads, config.num_key_value_heads = len(self.heads), len(self.kv_heads)
        config.intermediate_size = len(self.mlp_rows)
        return config

    def local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full weight ``name``: a column-parallel projection's rows (``q_proj``: its query
        heads, ``k/v_proj``: its key/value heads, ``gate/up_proj``: its MLP rows; a head's rows are consecutive), a
        row-parallel one's matching input columns (``o_proj``, ``down_proj``) and its bias on the first rank only
        (the outputs are summed over the ranks), the LM head's vocabulary rows; all of anything else."""
        if name == "lm_head.weight" and self.vocab_rows is not None:
            return tensor[self.vocab_rows.start : self.vocab_rows.stop]
        module, leaf = name.rsplit(".", 2)[-2:] if ".layers." in name else (None, None)
        part = self._parts.get(module)
        if part is None:
            return tensor
        if module not in _ROW_PARALLEL:
            return tensor[part.start : part.stop]
        if leaf == "weight":
            return tensor[:, part.start : part.stop]
        return tensor if self.rank == 0 else torch.zeros_like(tensor)


class TensorParallelDecoder(StaticDecoder):
    """The ``"tensor-parallel"`` mode (see the module docstring): :attr:`model`, a copy of the policy whose decoder
    layers hold this rank's slice of the shard group's: query heads and the key/value heads they read, and MLP rows
    (column-parallel ``q/k/v_proj``, ``gate/up_proj``, fused as a static copy's), the matching input columns of
    ``o_proj`` and ``down_proj`` (row-parallel, their outputs summed over the group by an all-reduce, a bias added on
    the first rank); embeddings and norms whole; the LM head's rows of the vocabulary, its logits all-gathered.

    The heads go as inference engines slice them: with at least as many key/value heads as ranks, each rank takes a
    part of them and all their query heads; with fewer (Qwen2.5-1.5B's 2 on 4 ranks), each key/value head is held by
    the ranks its query heads are shared out to, each computing a part of them (Qwen2.5-1.5B: 3 of the 6 per key/value
    head; 7B's 28 heads, 4 key/value, on 8 ranks: 4 or 3 of the 7). Where the ranks' parts differ, so do their
    configs; each rank's config says its local head and row counts (the head dimension kept), so that transformers'
    attention, the KV cache and the grouping of query heads per key/value head are the local layer's. The MLP is
    sliced where the group's size divides its intermediate size, else held whole by every rank (no all-reduce); the
    LM head likewise, by the vocabulary (tied to the embeddings, which stay whole, it becomes a weight of its own).

    Every rank of the group decodes the group's prompts together (:meth:`_generate`) and keeps its own rows, with the
    static cache and decoding loop of :class:`StaticDecoder` (the loop's CUDA graphs record the collectives; the
    forward is not compiled).

    Args:
        model, runtime, dtype, fuse: as :class:`_DecodingCopy`'s.
        loop: as :class:`StaticDecoder`'s.
    """

    _COMPILE = False  # the row-parallel projections' all-reduces and the head's all-gather run in forward hooks

    def __init__(
        self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, loop: bool = False, fuse: bool = True
    ):
        super().__init__(model, runtime, dtype, loop, fuse)
        self.group = shard_group(model)
        self.size = 1 if self.group is None else dist.get_world_size(self.group)
        self.rank = 0 if self.group is None else dist.get_rank(self.group)
        check_tensor_parallel(model, self.size)
        self._slice = _RankSlice(_base_model(model).config, self.size, self.rank)

    @staticmethod
    def bytes_per_rank(model: nn.Module, size: int, dtype: torch.dtype) -> int:
        """The most bytes any rank's copy of ``model`` (the policy) takes in ``dtype`` when sliced over ``size`` ranks
        (checked with :func:`check_tensor_parallel`), the KV cache not counted."""
        base = _base_model(model)
        with torch.device("meta"):
            whole = _compat.model_from_config(_model_class(base), copy.deepcopy(base.config))
        parameters = dict(whole.named_parameters(remove_duplicate=False))
        most = 0
        for rank in range(size):
            local = _RankSlice(base.config, size, rank).local
            # Tied names whose parts differ (a sliced head, whole embeddings) are held apart.
            numel = sum(
                sum(math.prod(shape) for shape in {tuple(local(name, parameters[name]).shape) for name in tied})
                for tied in _names_by_parameter(whole)
            )
            most = max(most, numel)
        return most * dtype.itemsize

    def _local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full weight ``name`` (:meth:`_RankSlice.local`)."""
        return self._slice.local(name, tensor)

    def _copy_config(self, config: Any) -> Any:
        return self._slice.config(config)

    def _restructure(self, model: PreTrainedModel) -> None:
        """The fusion, the LM head's vocabulary slice (its logits all-gathered over the group) and the row-parallel
        projections' all-reduces."""
        super()._restructure(model)
        if self._slice.vocab_rows is not None:
            head = model.lm_head
            sliced = nn.Linear(
                head.in_features, len(self._slice.vocab_rows), bias=False, device="meta", dtype=head.weight.dtype
            )
            model.lm_head = sliced
            self._move_places(head, sliced)
            sliced.register_forward_hook(self._gather_vocabulary)
        if self.size > 1:
            summed = _ROW_PARALLEL if self._slice.mlp_sliced else ("o_proj",)
            for name, module in model.named_modules():
                if name.rpartition(".")[2] in summed:
                    module.register_forward_hook(self._sum_over_group)

    def _sum_over_group(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: the sum of every rank's partial output."""
        dist.all_reduce(output, group=self.group)
        return output

    def _gather_vocabulary(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """The sliced LM head's output: every rank's logits, in the vocabulary's order."""
        rows = output.reshape(-1, output.shape[-1]).contiguous()
        gathered = rows.new_empty((self.size * rows.shape[0], rows.shape[1]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.13)
        gather(gathered, rows, group=self.group)
        return gathered.view(self.size, *rows.shape).transpose(0, 1).reshape(*output.shape[:-1], -1)

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The copy's ``generate``: every rank of the group decodes the group's left-padded prompts together
        (gathered, padded on the left to the longest), sampling from a generator seeded alike on every rank (drawn
        on each, rank 0's taken), so all compute the same logits and tokens and end together. Each returns what it
        would have decoded alone: its own rows, its own prompt width, and the new tokens up to where its own rows
        have all ended (at an EOS; only EOS and length end them here). Every rank of the group calls it with the same
        generation options (TRL's). Decoded as :class:`StaticDecoder` decodes."""
        model = self.model
        if self.group is None:
            return super()._generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        config = inputs.pop("generation_config", None)
        eos = _static_decoding.eos_token_ids(_compat.generation_setup(model, config, inputs).criteria)
        if eos is None:
            raise NotImplementedError(
                "odc_generation='tensor-parallel' ends a rank's completions at an EOS token or the length; the "
                "generation has another stopping criterion (stop strings, max_time, custom). Use 'static' or "
                "'gathered'."
            )
        device = input_ids.device
        shapes = [torch.zeros(2, dtype=torch.long, device=device) for _ in range(self.size)]
        dist.all_gather(shapes, torch.tensor(input_ids.shape, device=device), group=self.group)
        rows, width = max(int(s[0]) for s in shapes), max(int(s[1]) for s in shapes)
        batch = []
        for tensor in (input_ids, attention_mask):
            padded = F.pad(tensor, (width - tensor.shape[1], 0, 0, rows - tensor.shape[0]))
            gathered = [torch.empty_like(padded) for _ in range(self.size)]
            dist.all_gather(gathered, padded, group=self.group)
            batch.append(torch.cat([g[: int(s[0])] for g, s in zip(gathered, shapes, strict=True)]))
        seed = torch.randint(2**62, (1,), device=device)
        dist.broadcast(seed, group=self.group, group_src=0)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed(int(seed))
            out = super()._generate(input_ids=batch[0], attention_mask=batch[1], **kwargs)
        start = sum(int(s[0]) for s in shapes[: self.rank])
        out = out[start : start + input_ids.shape[0], width - input_ids.shape[1] :]
        new = out[:, input_ids.shape[1] :]
        ended = torch.isin(new, torch.tensor(eos, dtype=new.dtype, device=device))
        ends = torch.where(ended.any(dim=1), ended.int().argmax(dim=1) + 1, new.shape[1])
        return out[:, : input_ids.shape[1] + (int(ends.max()) if len(ends) else 0)]


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
    """transformers' SDPA attention, except for one query token per row under a boolean mask (a static cache's
    decoding step): there :func:`hf_odc.kernels.decode_attention.decode_attention` attends, which reads each key and
    value once for the query heads that share it and, on a GPU, only the cache's blocks the mask holds. transformers'
    SDPA repeats the keys and values once per query head whenever a mask is given (a static cache always gives one,
    for its empty slots) and groups the query only outside ``torch.compile``; in a compiled decoding step the repeat
    writes and reads the whole cache several times over. The result is the same: a one-token query's mask is the
    same for every head.

    A mask narrower than the keys (hf_odc's decoding loop where the kernel does not run,
    :mod:`hf_odc.trainer.generation._static_decoding`) covers the cache's first slots, all that is filled: the keys and
    values beyond it are not read."""
    if attention_mask is not None:  # (sliced to its own length where it is as wide: one compiled graph for both)
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    if (
        query.shape[2] != 1
        or dropout
        or kwargs.get("position_bias") is not None
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or attention_mask.shape[1:3] != (1, 1)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = decode_attention(query[:, :, 0], key, value, attention_mask[:, 0, 0], scale)
    return out[:, None], None


AttentionInterface.register(DECODING_ATTENTION, grouped_decoding_attention)
AttentionMaskInterface.register(DECODING_ATTENTION, sdpa_mask)
