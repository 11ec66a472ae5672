"""Causal attention over a packed row at the cost of its documents: :func:`packed_causal_attention`.

A packed microbatch concatenates documents into one row of ``T`` tokens, and attention must stay inside each
document. A block-diagonal ``T x T`` mask (what transformers builds for ``sdpa`` and ``eager``) makes every packed row
cost ``T**2`` in time and memory, whatever its split, and keeps the fused kernels out (they take no arbitrary mask).
Here each document is attended causally on its own, so a row costs the sum of its documents' ``L**2``, no tensor
grows with ``T**2``, and nothing is compiled, so a new split or length costs nothing extra. Two backends:

* ``"sdpa"``: ``scaled_dot_product_attention(is_causal=True)`` per document, on views of the packed tensors: the very
  kernel an unpacked document gets, so the result is that of running each document alone. GQA goes through
  ``enable_gqa`` (no copy of K/V per query head). The inputs are cut with one ``split`` (its backward concatenates the
  documents' gradients once; slicing each document out would add a full-size zero gradient per document). Any device.
* ``"varlen"``: one launch of ``torch.nn.attention.varlen.varlen_attn`` over every document (CUDA, bf16/fp16, no
  dropout; grouped-query attention only where that torch's ``varlen_attn`` takes ``enable_gqa``, 2.13 on).

``"sdpa"`` is the default, the one measured against unpacked documents (benchmarks/RESULTS.md); ``"varlen"`` could
not be measured with grouped-query attention on torch 2.11 and stays an explicit choice.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "Backend", "packed_causal_attention", "varlen_available"]

Backend = Literal["sdpa", "varlen"]
BACKENDS: tuple[str, ...] = ("sdpa", "varlen")

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

_VARLEN_GQA = _varlen_attn is not None and "enable_gqa" in inspect.signature(_varlen_attn).parameters
_VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def varlen_available(query: torch.Tensor, key: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether the ``"varlen"`` backend can run these inputs: a CUDA device, half precision, no dropout, and key/value
    heads that either match the query heads or that this torch's ``varlen_attn`` shares across query heads."""
    return (
        _varlen_attn is not None
        and query.is_cuda
        and query.dtype in _VARLEN_DTYPES
        and dropout_p == 0.0
        and (query.shape[1] == key.shape[1] or _VARLEN_GQA)
    )


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
    *,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "sdpa",
) -> torch.Tensor:
    """Causal attention of each document of a packed row with itself only.

    Args:
        query: ``(T, H_q, D)``, the row's tokens in order.
        key, value: ``(T, H_kv, D)``; ``H_q`` must be a multiple of ``H_kv`` (grouped-query attention).
        lengths: the documents' token counts, in order, summing to ``T`` (host integers: no device sync here).
        cu_seqlens: ``[0, cumsum(lengths)...]`` as int32 on the device, if the caller already has it (``"varlen"``
            builds it otherwise).
        scale: softmax scale; ``None`` is ``D ** -0.5``.
        dropout_p: attention dropout (``"sdpa"`` only).
        backend: ``"sdpa"`` or ``"varlen"`` (see the module docstring).

    Returns:
        ``(T, H_q, D)``, contiguous.
    """
    total, heads, _ = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != total or value.shape[0] != total:
        raise ValueError(
            f"query, key and value must hold the same tokens, got {query.shape}, {key.shape}, {value.shape}."
        )
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly.")
    lengths = tuple(int(n) for n in lengths)
    if sum(lengths) != total or any(n < 1 for n in lengths):
        raise ValueError(f"Document lengths {lengths[:8]}... must be positive and sum to the row's {total} tokens.")
    if backend == "varlen":
        if not varlen_available(query, key, dropout_p):
            raise ValueError(
                "The 'varlen' attention backend needs torch.nn.attention.varlen (torch >= 2.10), a CUDA device, "
                f"bf16/fp16 inputs and no dropout (got {query.device.type}, {query.dtype}, dropout {dropout_p}, "
                f"{heads} query / {kv_heads} key-value heads); use backend='sdpa'."
            )
        return _varlen(query, key, value, lengths, cu_seqlens, scale)
    if backend != "sdpa":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    return _per_document_sdpa(query, key, value, lengths, scale, dropout_p)


def _per_document_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: tuple[int, ...],
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True):
        # (L, H, D) -> (1, H, L, D): views; SDPA returns (1, H, L, D) laid out as (1, L, H, D).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        outputs.append(out[0].transpose(0, 1))
    return outputs[0].contiguous() if len(outputs) == 1 else torch.cat(outputs)


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: tuple[int, ...],
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    if cu_seqlens is None:
        cu_seqlens = torch.tensor((0, *itertools.accumulate(lengths)), dtype=torch.int32, device=query.device)
    longest = max(lengths)
    extra = {"enable_gqa": True} if _VARLEN_GQA and query.shape[1] != key.shape[1] else {}
    return _varlen_attn(
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        scale=scale,
        window_size=(-1, 0),
        **extra,
    )
