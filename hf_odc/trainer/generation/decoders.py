"""The decoding copies of the ``"static"`` and ``"tensor-parallel"`` generation modes (described in
:mod:`hf_odc.trainer.generation.modes`, whose owners make and call them): a plain copy of the policy in the compute
dtype (:class:`StaticDecoder`), or each rank's 1/N slice of one (:class:`TensorParallelDecoder`), kept for the whole run
with a static KV cache beside it and refreshed in place once per generation batch, so that the graphs recorded for the
first batch serve every later one; and the attention they decode with (:func:`grouped_decoding_attention`).
"""

from __future__ import annotations

import atexit
import copy
import math
import weakref
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
from ..core.attention import PACKED_ATTENTION, _base_model
from . import _static_decoding
from .full_weights import checkpoint_name, full_named_weights

__all__ = [
    "DECODING_ATTENTION",
    "StaticDecoder",
    "TensorParallelDecoder",
    "check_tensor_parallel",
    "grouped_decoding_attention",
    "shard_group",
]

DECODING_ATTENTION = "odc_decoding"
"""The attention :class:`StaticDecoder`'s copy runs where the policy runs SDPA (or hf_odc's packed attention):
:func:`grouped_decoding_attention`, registered under this name when this module is imported."""


class _DecodingCopy:
    """A plain copy of the policy in the compute dtype that decodes in its place (:attr:`model`), refreshed in place
    from the policy's full weights (:meth:`refresh`); its ``generate`` is :meth:`_generate`. What a mode's copy holds
    of each weight (:meth:`_local`) and its config (:meth:`_copy_config`) are the mode's.

    Args:
        model: the policy as the trainer runs it (sharded by hf_odc, or not; a PEFT model's adapters are merged into
            the copy).
        runtime: the policy's :class:`~hf_odc.accelerate_plugin.ODCRuntime`.
        dtype: the copy's dtype, the policy's compute dtype.
    """

    def __init__(self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype):
        self._policy, self._runtime, self._dtype = model, runtime, dtype
        self._model: PreTrainedModel | None = None

    @property
    def model(self) -> PreTrainedModel:
        """The copy (made by the first :meth:`refresh`)."""
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.refresh() makes the copy before it decodes.")
        return self._model

    def refresh(self) -> None:
        """Copy the policy's current weights into :attr:`model`, in place (making it on the first call). The weights
        are assembled as for a vLLM sync (:func:`~hf_odc.trainer.generation.full_weights.full_named_weights`: one FSDP
        group at a time, one-sided with ODC): every rank of the shard group calls this together, once per generation
        batch."""
        if self._model is None:
            self._model = self._make_copy()
        parameters = dict(self._model.named_parameters(remove_duplicate=False))  # tied ones under every name
        loaded: set[int] = set()
        with torch.no_grad():
            for name, tensor in full_named_weights(self._policy, self._runtime):
                if name not in parameters:
                    raise RuntimeError(f"hf_odc: the policy's weight {name} has no place in its decoding copy.")
                if id(parameters[name]) in loaded:
                    # The policy holds apart what its config ties, and the copy ties: the copy holds them apart too,
                    # from the first refresh on, before anything is compiled for it.
                    parameters[name] = self._untie(name)
                parameters[name].copy_(self._local(name, tensor))
                loaded.add(id(parameters[name]))
        missing = sorted(name for name, parameter in self._model.named_parameters() if id(parameter) not in loaded)
        if missing:
            raise RuntimeError(f"hf_odc: the policy gave no weights for {missing} of its decoding copy.")

    def _local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What the copy holds of the policy's full weight ``name``: all of it."""
        return tensor

    def _copy_config(self, config: Any) -> Any:
        """The config the copy is made from: a copy of the policy's ``config``."""
        return copy.deepcopy(config)

    def _untie(self, name: str) -> nn.Parameter:
        """The copy's parameter ``name``, tied to another, given a tensor of its own."""
        owner, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(owner)
        parameter = nn.Parameter(getattr(module, leaf).detach().clone(), requires_grad=False)
        setattr(module, leaf, parameter)
        return parameter

    def _make_copy(self) -> PreTrainedModel:
        """An uninitialised copy of the policy's (base) model class on its device in :attr:`_dtype`, made from
        :meth:`_copy_config`, its buffers (rotary frequencies) taken from the policy; the weights come from
        :meth:`refresh`."""
        base = _base_model(self._policy)
        config = self._copy_config(base.config)
        # With a KV cache hf_odc's packed attention is SDPA, which decodes faster grouped.
        attention = _compat.attn_implementation(config)
        attention = DECODING_ATTENTION if attention in ("sdpa", PACKED_ATTENTION) else attention
        with torch.device("meta"):
            model = _compat.model_from_config(
                _model_class(base), config, dtype=self._dtype, attn_implementation=attention
            )
        device = next(self._policy.parameters()).device
        model.to_empty(device=device).eval().requires_grad_(False)
        model.tie_weights()  # to_empty gave tied weights (embeddings and head) storages of their own
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, buffer in self._policy.named_buffers():
                buffers[checkpoint_name(name)].copy_(buffer)
        model.generation_config = copy.deepcopy(base.generation_config)
        model.generate = self._generate  # every call, TRL's included, decodes as this copy's mode does
        return model

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _model_class(base: nn.Module) -> type:
    """``base``'s transformers class, below FSDP2's dynamic class."""
    return next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))


class StaticDecoder(_DecodingCopy):
    """The ``"static"`` mode (see the module docstring): :attr:`model`, a plain copy of the policy, refreshed by
    :meth:`refresh` and decoded by hf_odc's loop (or transformers' ``generate``) with a static KV cache held here.

    Why it is kept: a decoding step's CUDA graphs (the loop's, or those transformers' default compile records) are
    bound to the copy's parameters and the cache's tensors; refreshing both in place keeps every later generation
    batch on the graphs recorded for the first. The cache is sized for the longest prompt plus ``max_new_tokens`` seen
    so far, rounded up to :data:`CACHE_LENGTH_MULTIPLE` tokens, and re-made (its graphs recorded again) only for a
    longer one or another batch size. The copy has no FSDP mark, so transformers decodes it on this rank alone.

    Args:
        model, runtime, dtype: as :class:`_DecodingCopy`'s.
        loop: decode with hf_odc's loop where it decodes what ``generate`` would (``odc_decoding_loop``), else always
            with transformers' ``generate``.
    """

    CACHE_LENGTH_MULTIPLE = 256
    _COMPILE = True
    """Whether the copy's forward is compiled on a GPU (by the loop, or by transformers' ``generate``)."""

    def __init__(self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, loop: bool = False):
        super().__init__(model, runtime, dtype)
        self._use_loop = loop
        self._cache: StaticCache | None = None
        self._cache_shape = (0, 0)  # batch size, length
        self._loop: _static_decoding.Loop | None = None  # decodes with the cache, made on its first use
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
                self._loop = _static_decoding.Loop(model, cache, *self._cache_shape, compile=compile)
            return self._loop.decode(plan)
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
        self._cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._cache_shape = (batch_size, length)
        return self._cache


def _close_if_alive(decoder: weakref.ref) -> None:
    alive = decoder()
    if alive is not None:
        alive.close()


_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_TENSOR_PARALLEL_MODELS = ("llama", "mistral", "qwen2", "qwen3")
_TENSOR_PARALLEL_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


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
    tensor-parallel over ``size`` ranks: not a Llama/Mistral/Qwen2/Qwen3 decoder (MoE models included), its attention
    heads, key/value heads or intermediate size not divisible by ``size``, or a bias on ``o_proj`` or ``down_proj``
    (a row-parallel bias would be summed ``size`` times)."""
    instead = "Use odc_generation='static', 'gathered' or 'sharded'."
    config = _base_model(model).config
    if config.model_type not in _TENSOR_PARALLEL_MODELS:
        raise ValueError(
            f"odc_generation='tensor-parallel' slices the decoder layers of {'/'.join(_TENSOR_PARALLEL_MODELS)} "
            f"models (dense: self_attn.q/k/v/o_proj, mlp.gate/up/down_proj); the policy is {config.model_type!r}. "
            + instead
        )
    indivisible = {name: getattr(config, name) for name in _TENSOR_PARALLEL_SIZES if getattr(config, name) % size}
    if indivisible:
        raise ValueError(
            f"odc_generation='tensor-parallel' splits the attention heads, key/value heads and MLP rows over the "
            f"shard group's {size} ranks; the policy's {indivisible} are not divisible by {size}. " + instead
        )
    with torch.device("meta"):
        layer = _compat.model_from_config(_model_class(_base_model(model)), copy.deepcopy(config)).model.layers[0]
    row_parallel = {"self_attn.o_proj": layer.self_attn.o_proj, "mlp.down_proj": layer.mlp.down_proj}
    biased = [name for name, module in row_parallel.items() if module.bias is not None]
    if biased:
        raise ValueError(
            f"odc_generation='tensor-parallel' sums {biased} over the shard group's ranks, which a bias there "
            "would enter once per rank. " + instead
        )


class TensorParallelDecoder(StaticDecoder):
    """The ``"tensor-parallel"`` mode (see the module docstring): :attr:`model`, a copy of the policy whose decoder
    layers hold this rank's slice of the shard group's: query and key/value heads, and MLP rows (column-parallel
    ``q/k/v_proj``, ``gate/up_proj``), the matching input columns of ``o_proj`` and ``down_proj`` (row-parallel, their
    outputs summed over the group by an all-reduce); embeddings, norms and head whole. Its config says the local head
    and row counts (the head dimension kept), so transformers' attention, the KV cache and the grouping of query heads
    per key/value head (the same ratio) are the local layer's. Every rank of the group decodes the group's prompts
    together (:meth:`_generate`) and keeps its own rows, with the static cache and decoding loop of
    :class:`StaticDecoder` (the loop's CUDA graphs record the all-reduces; the forward is not compiled).

    Args:
        model, runtime, dtype: as :class:`_DecodingCopy`'s.
        loop: as :class:`StaticDecoder`'s.
    """

    _COMPILE = False  # the row-parallel projections' all-reduces run in forward hooks

    def __init__(self, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype, loop: bool = False):
        super().__init__(model, runtime, dtype, loop)
        self.group = shard_group(model)
        self.size = 1 if self.group is None else dist.get_world_size(self.group)
        self.rank = 0 if self.group is None else dist.get_rank(self.group)
        check_tensor_parallel(model, self.size)

    def _local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full weight ``name``: a column-parallel projection's rows (its heads are
        consecutive rows), a row-parallel one's input columns, else all of it."""
        module = name.rsplit(".", 2)[-2] if ".layers." in name else None
        if module in _COLUMN_PARALLEL:
            return tensor.chunk(self.size, dim=0)[self.rank]
        if module in _ROW_PARALLEL and name.endswith(".weight"):
            return tensor.chunk(self.size, dim=1)[self.rank]
        return tensor

    def _copy_config(self, config: Any) -> Any:
        config = copy.deepcopy(config)
        config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for name in _TENSOR_PARALLEL_SIZES:
            setattr(config, name, getattr(config, name) // self.size)
        return config

    def _make_copy(self) -> PreTrainedModel:
        model = super()._make_copy()
        if self.size > 1:
            for name, module in model.named_modules():
                if name.rpartition(".")[2] in _ROW_PARALLEL:
                    module.register_forward_hook(self._sum_over_group)
        return model

    def _sum_over_group(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: the sum of every rank's partial output."""
        dist.all_reduce(output, group=self.group)
        return output

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
    """transformers' SDPA attention, except for one query token in a grouped-query layer: there the query heads that
    share a key/value head become that head's query rows, so each key and value is read once. transformers' SDPA
    repeats the keys and values once per query head whenever a mask is given (a static cache always gives one, for
    its empty slots) and groups the query only outside ``torch.compile``; in a compiled decoding step the repeat
    writes and reads the whole cache several times over. The result is the same: a one-token query's mask is the
    same for every head.

    A mask narrower than the keys (hf_odc's decoding loop, :mod:`hf_odc.trainer.generation._static_decoding`) covers the
    cache's first slots, all that is filled: the keys and values beyond it are not read."""
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
