"""Attention for packed microbatches: hf_odc's ``"odc_packed"`` implementation, and which others keep samples apart.

A packed microbatch is one row: samples concatenated, ``position_ids`` restarting at 0 for each, no attention mask,
and TRL's padding-free collator adds the boundaries as ``cu_seq_lens_q/k``. In transformers 5.x the model builds the
mask from the positions when no ``attention_mask`` and no KV cache are passed (``masking_utils`` finds the sample
boundaries and the implementation's mask function applies them), so these implementations keep samples apart:

* ``"odc_packed"`` (:data:`PACKED_ATTENTION`, registered when this module is imported): each document attended
  causally on its own (:func:`hf_odc.kernels.attention.packed_causal_attention`, which picks per row between
  per-document SDPA and one varlen launch for runs of short documents), so a row costs the sum of its documents,
  with no ``T x T`` tensor and no compilation. With a padding mask or a KV cache (evaluation, generation)
  it is ``sdpa``, mask included. The ODC trainers switch ``sdpa`` and ``eager`` models to it by default;
* ``eager`` and ``sdpa``: a materialised block-diagonal causal mask, ``T x T`` for a row of ``T`` tokens whatever
  its split (the trainers warn when it is chosen on a GPU);
* ``flex_attention``: a block mask from the same boundaries (it compiles anew for new lengths);
* ``flash_attention_2/3/4``: the varlen kernels, fed ``cu_seq_lens_q/k``.

Anything else (``paged|...`` implementations for generation, custom kernels registered at run time) could silently
attend across samples, so it is refused.

Under activation checkpointing every layer's forward runs twice, the attention kernels included; on long packed rows
those are the largest part of a step. :func:`attention_saving_context_fn` makes the checkpoint keep the attention
operators' outputs (with the softmax statistics their backward reads) and recompute the rest: one extra
``tokens x heads x head_dim`` tensor per layer, and the attention forward runs once. The ODC trainers apply it when
they checkpoint (``checkpoint_attention="save"``,
:func:`hf_odc.trainer.core.activation_checkpointing.save_attention_in_checkpoints`).
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..._compat import attention_operators, attn_implementation
from ...kernels.attention import Backend, packed_causal_attention, warm_sdpa_plans
from ...kernels.ulysses import sharded_causal_attention

__all__ = [
    "CHECKPOINT_ATTENTION",
    "DENSE_MASK_IMPLEMENTATIONS",
    "PACKED_ATTENTION",
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "attention_saving_context_fn",
    "attention_shape",
    "check_packed_attention",
    "check_sequence_parallel",
    "packed_attention_forward",
    "register_packed_attention",
    "save_attention_checkpoint_kwargs",
    "use_packed_attention",
    "warm_attention_plans",
]

PACKED_ATTENTION = "odc_packed"
"""The name of hf_odc's packed attention in transformers' ``AttentionInterface``."""

DENSE_MASK_IMPLEMENTATIONS = frozenset({"eager", "sdpa"})
"""Implementations that keep packed samples apart with a dense ``T x T`` mask."""

PACKED_ATTENTION_IMPLEMENTATIONS = frozenset(
    {PACKED_ATTENTION, *DENSE_MASK_IMPLEMENTATIONS, "flex_attention"}
    | {f"flash_attention_{version}" for version in (2, 3, 4)}
)


def register_packed_attention(name: str = PACKED_ATTENTION, backend: Backend = "auto") -> str:
    """Register packed attention (attention and mask functions) with transformers under ``name``; returns it.

    Idempotent; importing :mod:`hf_odc.trainer` registers :data:`PACKED_ATTENTION`, after which
    ``attn_implementation="odc_packed"`` works in ``from_pretrained``, ``from_config`` and
    ``set_attn_implementation``. Another ``name`` with a fixed ``backend`` (``"sdpa"``, ``"varlen"``) is for
    comparing the kernels (benchmarks/packed_attention.py); the trainers switch models to :data:`PACKED_ATTENTION`.
    """
    forward = (
        packed_attention_forward if backend == "auto" else functools.partial(packed_attention_forward, backend=backend)
    )
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, _packed_attention_mask)
    return name


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    backend: Backend = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query (B, H_q, T, D)``, ``key/value (B, H_kv, T, D)`` in, the
    output ``(B, T, H_q, D)`` out. Document boundaries come from ``cu_seq_lens_q`` (one row) or ``position_ids`` (a
    position that does not follow its predecessor by one starts a document); without either, each row is one. A
    ``sequence_shard`` (:class:`~hf_odc.kernels.SequenceShard`, passed to the model's forward with a shard of a row
    split over a group of ranks) attends the whole row with the group
    (:func:`~hf_odc.kernels.sharded_causal_attention`), the documents' bounds its own."""
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"attn_implementation={PACKED_ATTENTION!r} has no sliding-window attention; use flash_attention_2 or "
            "flex_attention for models with sliding-window layers."
        )
    causal_rows = attention_mask is None and query.shape[2] == key.shape[2] and getattr(module, "is_causal", True)
    if not causal_rows:  # a padding mask, a KV cache or bidirectional attention: sdpa with the mask built for it
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, tokens, dim = query.shape
    shard = kwargs.get("sequence_shard")
    if shard is None:
        attend, layout = (
            packed_causal_attention,
            _document_lengths(batch, tokens, kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")),
        )
    elif batch == 1:
        attend, layout = sharded_causal_attention, shard
    else:
        raise ValueError(f"A row split over ranks is one row; got a batch of {batch}.")
    out = attend(
        _tokens_first(query),
        _tokens_first(key),
        _tokens_first(value),
        layout,
        scale=scaling,
        dropout_p=dropout,
        backend=backend,
    )
    return out.view(batch, tokens, heads, dim), None


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, D)`` -> ``(B * T, H, D)``: a view for one row (transformers' projections are laid out so)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _packed_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No mask for causal rows without padding or cache (packed or not: the attention finds the boundaries itself),
    else ``sdpa``'s mask."""
    if attention_mask is None and q_length == kv_length and not isinstance(q_offset, torch.Tensor) and q_offset == 0:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


class _BoundaryCache:
    """The document boundaries of the row being computed, derived once per forward rather than once per layer.

    Every layer of a forward (and its recomputation under activation checkpointing) receives the same
    ``cu_seq_lens_q`` or ``position_ids`` tensor, so one entry, keyed by that tensor's identity, suffices; reading a
    device tensor's boundaries costs one host sync, paid on the first layer only.
    """

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref, tuple[int, ...]] | None = None

    def get(self, source: torch.Tensor) -> tuple[int, ...] | None:
        entry = self._entry
        return entry[1] if entry is not None and entry[0]() is source else None

    def put(self, source: torch.Tensor, value: tuple[int, ...]) -> None:
        self._entry = (weakref.ref(source), value)


_boundaries = _BoundaryCache()


def _document_lengths(
    batch: int, tokens: int, cu_seq_lens: torch.Tensor | None, position_ids: torch.Tensor | None
) -> tuple[int, ...]:
    """The token counts of the documents of ``batch`` rows of ``tokens`` tokens, in order."""
    source = cu_seq_lens if cu_seq_lens is not None and batch == 1 else position_ids
    if source is None:
        return (tokens,) * batch
    cached = _boundaries.get(source)
    if cached is not None:
        return cached
    if source is cu_seq_lens:
        lengths = tuple(b - a for a, b in itertools.pairwise(cu_seq_lens.tolist()))
    else:
        positions = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        begins = starts.reshape(-1).nonzero().flatten().tolist()
        lengths = tuple(b - a for a, b in zip(begins, [*begins[1:], batch * tokens], strict=True))
    if sum(lengths) != batch * tokens:
        raise ValueError(
            f"The packed row's boundaries cover {sum(lengths)} tokens, but the row has {batch} x {tokens}; pass "
            "cu_seq_lens_q of this row (TRL's padding-free collator does) or position_ids restarting at 0 per sample."
        )
    _boundaries.put(source, lengths)
    return lengths


def check_packed_attention(model: nn.Module) -> str:
    """Return the model's attention implementation; raise if it could attend across packed samples."""
    implementation = attention_implementation(model)
    if implementation not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"The model uses attn_implementation={implementation!r}, which does not build a block-diagonal mask from "
            "position_ids, so samples packed into one microbatch would attend to each other. Use one of "
            f"{sorted(PACKED_ATTENTION_IMPLEMENTATIONS)} (e.g. attn_implementation={PACKED_ATTENTION!r})."
        )
    return implementation


def check_sequence_parallel(model: nn.Module, sp_size: int) -> None:
    """Refuse, before training, a model whose attention cannot run split over groups of ``sp_size`` ranks: one that
    does not attend with :data:`PACKED_ATTENTION` (the only implementation that reads a ``sequence_shard``), or whose
    query heads ``sp_size`` does not divide. Nothing to check for ``sp_size`` 1."""
    if sp_size == 1:
        return
    implementation = attention_implementation(model)
    if implementation != PACKED_ATTENTION:
        raise ValueError(
            f"sp_size={sp_size} splits long documents inside hf_odc's {PACKED_ATTENTION!r} attention, and the model "
            f"uses {implementation!r}: load it with attn_implementation='sdpa' (switched) or {PACKED_ATTENTION!r}."
        )
    heads = _base_model(model).config.get_text_config().num_attention_heads
    if heads % sp_size:
        raise ValueError(
            f"sp_size={sp_size} splits the attention heads among a group's ranks, and the model's {heads} query heads "
            f"do not split into {sp_size}; use an sp_size that divides {heads}."
        )


def use_packed_attention(model: nn.Module, enabled: bool, device: torch.device) -> str:
    """Switch a model whose attention builds dense masks (``sdpa``, ``eager``) to :data:`PACKED_ATTENTION` if
    ``enabled``; warn if it keeps one on a GPU. Other implementations are kept. Returns the implementation in use,
    after checking that it keeps packed samples apart (:func:`check_packed_attention`)."""
    implementation = attention_implementation(model)
    if implementation in DENSE_MASK_IMPLEMENTATIONS:
        if enabled:
            _base_model(model).set_attn_implementation(PACKED_ATTENTION)
        elif torch.device(device).type == "cuda":
            warnings.warn(
                f"attn_implementation={implementation!r} keeps packed samples apart with a dense T x T mask: the "
                "attention of a packed microbatch of T tokens then costs time and memory in T**2, whatever its split "
                "(a 64K-token row costs several times its documents run alone). Leave packed_attention=True (the "
                f"default) or pass attn_implementation={PACKED_ATTENTION!r}, which costs the sum of the documents.",
                stacklevel=3,
            )
    return check_packed_attention(model)


def warm_attention_plans(
    model: nn.Module, documents: Iterable[int], device: torch.device, dtype: torch.dtype, backward: bool = True
) -> int:
    """Build cuDNN's plans for ``documents``' lengths before training (``warm_attention_plans``): on a GPU, for a
    model whose attention is :data:`PACKED_ATTENTION`, attend once, forward and backward (``backward=False``: forward
    only, the plan of a forward-only pass), at each length that one of ``documents`` (token counts) is attended at
    alone (:func:`hf_odc.kernels.attention.warm_sdpa_plans`, with the model's head counts). Returns the number of
    lengths warmed (0 where nothing is).

    Every document's length is warmed, the shortest too: a row attends a short document alone where no other short
    document is beside it (a pair's short reply between two long sequences), and a length met for the first time
    inside a minibatch keeps the other ranks waiting while this one plans it."""
    if torch.device(device).type != "cuda" or attention_implementation(model) != PACKED_ATTENTION:
        return 0
    documents = list(documents)
    if not documents:
        return 0
    heads, kv_heads, head_dim = attention_shape(model)
    warmed = warm_sdpa_plans(
        heads, kv_heads, head_dim, max(documents), device, dtype, documents=documents, backward=backward
    )
    return len(warmed)


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """``model``'s query heads, key/value heads and head size: with the dtype and the length, what a cuDNN attention
    plan is built for (a reference or teacher of another shape needs plans of its own)."""
    config = _base_model(model).config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # Qwen3's may differ
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def attention_implementation(model: nn.Module) -> str:
    """The attention implementation of ``model``'s text model (a PEFT wrapper's base model)."""
    config = _base_model(model).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return attn_implementation(config) or "eager"


CHECKPOINT_ATTENTION: tuple[str, ...] = ("save", "recompute")
"""What activation checkpointing does with the attention: keep its outputs (``"save"``) or run it again in the
backward like every other operator (``"recompute"``, the stock behaviour)."""


def attention_saving_context_fn() -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for non-reentrant ``torch.utils.checkpoint.checkpoint``: selective activation checkpointing
    that saves the outputs of every attention operator SDPA and ``varlen_attn`` run (the fused kernels'; see
    :func:`hf_odc._compat.attention_operators`) and recomputes everything else, so the backward reruns a layer's
    forward without its attention. Gradients are those of plain checkpointing: the saved tensors are what the
    recomputation would produce."""
    return functools.partial(create_selective_checkpoint_contexts, attention_operators())


def save_attention_checkpoint_kwargs(checkpoint_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """``checkpoint_kwargs`` (what ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` passes
    to ``torch.utils.checkpoint.checkpoint``) with ``use_reentrant=False`` and :func:`attention_saving_context_fn`.
    Refuses reentrant checkpointing (it has no ``context_fn``) and a ``context_fn`` of the caller's own, which this
    would replace."""
    checkpoint_kwargs = dict(checkpoint_kwargs or {})
    if checkpoint_kwargs.get("use_reentrant"):
        raise ValueError(
            "Saving the attention in activation checkpoints needs non-reentrant checkpointing: unset use_reentrant in "
            "gradient_checkpointing_kwargs, or set checkpoint_attention='recompute'."
        )
    if checkpoint_kwargs.get("context_fn") is not None:
        raise ValueError(
            "gradient_checkpointing_kwargs has a context_fn of its own, which saving the attention would replace: set "
            "checkpoint_attention='recompute' to keep yours."
        )
    return {**checkpoint_kwargs, "use_reentrant": False, "context_fn": attention_saving_context_fn()}


def _base_model(model: nn.Module) -> nn.Module:
    """The model a PEFT ``model`` wraps, or ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


register_packed_attention()
