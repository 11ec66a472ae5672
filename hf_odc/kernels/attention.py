"""Causal attention over a packed row at the cost of its documents: :func:`packed_causal_attention`.

A packed microbatch concatenates documents into one row of ``T`` tokens, and attention must stay inside each
document. A block-diagonal ``T x T`` mask (what transformers builds for ``sdpa`` and ``eager``) makes every packed row
cost ``T**2`` in time and memory, whatever its split, and keeps the fused kernels out (they take no arbitrary mask).
Here each document is attended causally on its own, so a row costs the sum of its documents' ``L**2``, no tensor
grows with ``T**2``, and nothing is compiled, so a new split or length costs nothing extra. Two kernels do it:

* ``scaled_dot_product_attention(is_causal=True)`` on one document, on views of the packed tensors: the very kernel
  an unpacked document gets, so the result is that of running the document alone. GQA goes through ``enable_gqa``
  (no copy of K/V per query head). Any device. Its price is per document: the host launches a forward, a
  recomputation under activation checkpointing and a backward for each one, and on rows of many short documents
  those launches, not the GPU, set the pace.
* ``torch.nn.attention.varlen.varlen_attn``: one launch over a run of documents, whatever their number (CUDA,
  bf16/fp16, no dropout; grouped-query K/V shared by the kernel, not copied). On long documents its flash kernel is
  slower than the one SDPA picks on Hopper (cuDNN's).

``backend`` chooses per row:

* ``"auto"`` (the default): where ``varlen_attn`` runs these inputs, every document of at least :data:`ALONE_FROM`
  tokens is attended alone through SDPA and each run of shorter documents between them in one ``varlen_attn``
  launch (a run of one through SDPA). A row then launches at most ``2 * T / ALONE_FROM + 1`` attention kernels
  whatever its split, and each long document keeps SDPA's kernel. The threshold is where the two kernels cost the
  same on a whole model's row (benchmarks/RESULTS.md). Elsewhere (CPU, fp32, dropout): per-document SDPA.
* ``"sdpa"``: per-document SDPA for every document.
* ``"varlen"``: one ``varlen_attn`` launch for the whole row.

The documents are cut with one ``split`` (its backward concatenates the gradients once; slicing each document out
would add a full-size zero gradient per document), and the pieces' outputs concatenated once.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "ALONE_FROM",
    "BACKENDS",
    "SDPA_LENGTHS_PER_OCTAVE",
    "Backend",
    "Piece",
    "attention_pieces",
    "packed_causal_attention",
    "sdpa_length",
    "varlen_available",
    "warm_sdpa_plans",
]

Backend = Literal["auto", "sdpa", "varlen"]
BACKENDS: tuple[str, ...] = ("auto", "sdpa", "varlen")

ALONE_FROM = 2048
"""``"auto"``: documents of at least this many tokens are attended alone through SDPA, shorter ones together."""

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

_VARLEN_PARAMETERS = inspect.signature(_varlen_attn).parameters if _varlen_attn is not None else {}
# Grouped-query K/V reach the flash kernel as they are (it shares each K/V head across its query heads, no copy):
# torch 2.13 asks for ``enable_gqa=True``; torch 2.11 has no such argument and passes them through unchecked.
_VARLEN_GQA_ARGUMENT = "enable_gqa" in _VARLEN_PARAMETERS
_VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def varlen_available(query: torch.Tensor, key: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether ``varlen_attn`` can run these inputs: a torch whose ``varlen_attn`` takes ``window_size`` (2.11 on),
    a CUDA device, half precision and no dropout."""
    return (
        "window_size" in _VARLEN_PARAMETERS
        and query.is_cuda
        and query.dtype in _VARLEN_DTYPES
        and key.dtype == query.dtype
        and dropout_p == 0.0
    )


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention of each document of a packed row with itself only.

    Args:
        query: ``(T, H_q, D)``, the row's tokens in order.
        key, value: ``(T, H_kv, D)``; ``H_q`` must be a multiple of ``H_kv`` (grouped-query attention).
        lengths: the documents' token counts, in order, summing to ``T`` (host integers: no device sync here).
        scale: softmax scale; ``None`` is ``D ** -0.5``.
        dropout_p: attention dropout (per-document SDPA only; ``"auto"`` uses it when this is set).
        backend: ``"auto"``, ``"sdpa"`` or ``"varlen"`` (see the module docstring).

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
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    varlen = varlen_available(query, key, dropout_p)
    if backend == "varlen" and not varlen:
        raise ValueError(
            "The 'varlen' attention backend needs torch.nn.attention.varlen (torch >= 2.11), a CUDA device, "
            f"bf16/fp16 inputs and no dropout (got {query.device.type}, {query.dtype}, dropout {dropout_p}); use "
            "backend='sdpa' or 'auto'."
        )
    if backend == "auto" and not varlen:
        backend = "sdpa"
    pieces = _pieces(lengths, backend, ALONE_FROM)
    if len(pieces) == 1:
        return _attend(pieces[0], query, key, value, scale, dropout_p).contiguous()
    sizes = [piece.tokens for piece in pieces]
    return torch.cat(
        [
            _attend(piece, q, k, v, scale, dropout_p)
            for piece, q, k, v in zip(pieces, query.split(sizes), key.split(sizes), value.split(sizes), strict=True)
        ]
    )


class Piece(NamedTuple):
    """Consecutive documents of a row attended by one kernel launch: ``varlen_attn`` or SDPA (one document)."""

    lengths: tuple[int, ...]
    tokens: int
    varlen: bool


def attention_pieces(lengths: Sequence[int], backend: Backend = "auto") -> tuple[Piece, ...]:
    """The kernel launches ``backend`` makes for a row of documents of ``lengths`` tokens, where ``varlen_attn`` runs
    (:func:`packed_causal_attention` asks for ``"sdpa"``'s where it does not)."""
    return _pieces(tuple(int(n) for n in lengths), backend, ALONE_FROM)


@functools.lru_cache(maxsize=64)
def _pieces(lengths: tuple[int, ...], backend: str, alone_from: int) -> tuple[Piece, ...]:
    """Cached: every layer of a forward, and its recomputation, asks for the same row."""
    if backend == "varlen":
        return (Piece(lengths, sum(lengths), True),)
    if backend == "sdpa":
        return tuple(Piece((n,), n, False) for n in lengths)
    pieces: list[Piece] = []
    for short, group in itertools.groupby(lengths, key=lambda n: n < alone_from):
        group = tuple(group)
        if short and len(group) > 1:
            pieces.append(Piece(group, sum(group), True))
        else:
            pieces.extend(Piece((n,), n, False) for n in group)
    return tuple(pieces)


def _attend(
    piece: Piece,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    if piece.varlen:
        return _varlen(query, key, value, piece.lengths, scale)
    length = piece.tokens
    padded = sdpa_length(length) if query.device.type in _PADDED_ON else length
    if padded != length:  # zeros after the document: causal, its own tokens never attend to them
        query, key, value = (F.pad(t, (0, 0, 0, 0, 0, padded - length)) for t in (query, key, value))
    # (L, H, D) -> (1, H, L, D): views; SDPA returns (1, H, L, D) laid out as (1, L, H, D).
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        dropout_p=dropout_p,
        is_causal=True,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out[0].transpose(0, 1)[:length]


def sdpa_length(tokens: int) -> int:
    """The length a document of ``tokens`` tokens is attended at through SDPA on a GPU: rounded up to one of
    :data:`SDPA_LENGTHS_PER_OCTAVE` steps per power of two (at least 64 tokens), so at most about 3% more.

    Why: cuDNN's attention (what SDPA picks on Hopper) builds an execution plan for each new sequence length, tens
    of milliseconds of host time in which the device runs dry, and long-context data brings a new length with nearly
    every document. Rounded, a run meets a few hundred lengths in all, each planned once. The padding is exact:
    attention is causal, so the document's tokens never attend to the zeros after them, and nothing of the padded
    rows' outputs reaches a gradient."""
    octave = 1 << (tokens.bit_length() - 1)  # the power of two at or below tokens
    step = max(64, octave // SDPA_LENGTHS_PER_OCTAVE)
    return -(-tokens // step) * step


SDPA_LENGTHS_PER_OCTAVE = 32
"""Lengths per power of two that :func:`sdpa_length` rounds to (a power of two itself)."""


def warm_sdpa_plans(
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    longest: int,
    device: torch.device,
    dtype: torch.dtype,
    shortest: int = 1,
    documents: Iterable[int] | None = None,
    backward: bool = True,
) -> list[int]:
    """Attend once, forward and backward, at every length :func:`sdpa_length` rounds a document of ``shortest`` to
    ``longest`` tokens to (``documents``: only those of these documents' lengths), as :func:`packed_causal_attention`
    attends a document alone (padded, grouped-query, scaled by ``head_dim ** -0.5``); returns those lengths. The
    default ``shortest`` is 1, not :data:`ALONE_FROM`: ``"auto"`` attends a short document alone too where no other
    short document is beside it in its row. ``backward=False``: forward only, without autograd, as a forward-only
    pass attends (a reference, a teacher, scoring): cuDNN keys that plan apart from the training one, since it returns
    no softmax statistics, so each kind is planned at each length.

    Why: cuDNN plans each new length on the host the first time it meets it, on each rank. A run of a few steps (a
    benchmark) meets most of its lengths for the first time, and a plan that moves documents to other ranks meets more
    of them than one that keeps them where another scheme already ran them; warmed first, every scheme finds them
    planned, as every step of a long run does."""
    among = range(max(1, shortest), longest + 1)
    lengths = sorted({sdpa_length(n) for n in (among if documents is None else filter(among.__contains__, documents))})
    for padded in lengths:
        tokens = padded - 1 if sdpa_length(padded - 1) == padded else padded  # padded, as most documents are
        # Constant inputs: a plan does not depend on the values, and a random draw would move the generator that the
        # run samples from afterwards (warming on or off must not change a run).
        with torch.set_grad_enabled(backward):
            query = torch.ones(tokens, query_heads, head_dim, device=device, dtype=dtype, requires_grad=backward)
            key, value = (
                torch.ones(tokens, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=backward)
                for _ in range(2)
            )
            out = _attend(Piece((tokens,), tokens, False), query, key, value, head_dim**-0.5, 0.0)
        if backward:
            out.sum().backward()
    return lengths


_PADDED_ON = ("cuda",)  # the devices whose SDPA plans per length (a CPU's does not: padding would only cost)


@functools.lru_cache(maxsize=64)
def _cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[0, cumsum(lengths)...]`` as int32 on ``device``, copied there once per row."""
    return torch.tensor((0, *itertools.accumulate(lengths)), dtype=torch.int32).to(device)


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: tuple[int, ...],
    scale: float | None,
) -> torch.Tensor:
    cu_seqlens = _cu_seqlens(lengths, query.device)
    longest = max(lengths)
    extra = {"enable_gqa": True} if _VARLEN_GQA_ARGUMENT and query.shape[1] != key.shape[1] else {}
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
