"""Causal attention over a packed row split across a group of ranks (Ulysses sequence parallelism).

A row too long for one rank (a document longer than a microbatch) is cut into contiguous shards, one per rank of a
group of ``N`` ranks. Every operator of a decoder but attention works token by token, so each rank runs its shard on
its own; attention needs the whole row. Around it, one all-to-all gives each rank every token of ``1/N`` of the heads
(query, key and value), the rank attends causally over the whole row for those heads
(:func:`~hf_odc.kernels.attention.packed_causal_attention`, each document on its own), and a second all-to-all gives
each rank its own tokens back with every head. The backward of an all-to-all is the reverse all-to-all, so the
gradients take the same way back, and every rank of the group must run the same rows in the same order (forward,
recomputation and backward alike): the group's ranks run them in step.

Grouped-query key/value heads are split as the query heads are when the group size divides their number; otherwise
each key/value head is repeated for its query heads first (exact: a query head reads the same key/value head either
way).

A loss that is not a sum over tokens (DPO's, of each sequence's summed log-probabilities; GRPO's sequence-level
ratio) needs the whole sequence's sums on every rank of the group: :func:`group_sum` adds the ranks' partial sums,
differentiably.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .attention import Backend, packed_causal_attention

__all__ = ["SequenceShard", "group_sum", "new_sequence_group", "sharded_causal_attention"]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of a row split over a group of ranks: what :func:`sharded_causal_attention` needs besides the
    tensors.

    Attributes:
        group: the group's process group (its ranks in group-rank order hold the row's shards in order).
        sizes: the tokens each rank of the group holds, in group-rank order (their sum is the row's length).
        lengths: the row's documents' token counts, in order (the whole row's, not this shard's).
    """

    group: Any
    sizes: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.sizes) != sum(self.lengths) or min(self.sizes, default=0) < 1:
            raise ValueError(
                f"A row's shards {self.sizes} must be non-empty and hold its {sum(self.lengths)} tokens exactly."
            )

    @property
    def index(self) -> int:
        """This rank's place in the group (the shard it holds)."""
        return dist.get_rank(self.group)


def new_sequence_group(size: int) -> Any:
    """Collective (every rank of the job calls it, in the same order): the process groups of ``size`` consecutive
    ranks (``0..size-1``, ``size..2*size-1``, ...); returns this rank's. The job's size must be a multiple of
    ``size``."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world_size % size:
        raise ValueError(f"A sequence-parallel group size of {size} does not divide the {world_size} processes.")
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along the first dimension (``sent[j]`` rows to group rank ``j``, ``received[j]`` from
    it); its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sent: Sequence[int], received: Sequence[int], group: Any) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group = sent, received, group
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(received), list(sent), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), list(ctx.sent), list(ctx.received), group=ctx.group)
        return back, None, None, None


class _GroupSum(torch.autograd.Function):
    """All-reduce (sum) over a group; its backward sums the gradients the same way: every rank's loss may read the
    sum, so a rank's partial sum gets the gradient of every rank's use of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def group_sum(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Collective over ``shard.group`` (its ranks call it together, in step): ``x`` summed over the group's ranks, on
    every one of them (each holds its shard's part of a sum over the whole row). Differentiable: the group's losses
    adding up to the whole loss (each rank's the loss of its own tokens, or ``1 / N`` of one function of the sum),
    each rank's part gets the whole loss's gradient with respect to the sum."""
    return _GroupSum.apply(x, shard.group)


def _heads_for_tokens(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """``(T_rank, H, D)`` -> ``(T, H / N, D)``: this rank's head slice of every token of the row, in row order."""
    count = len(shard.sizes)
    tokens, heads, dim = x.shape
    by_destination = x.reshape(tokens, count, heads // count, dim).transpose(0, 1).reshape(-1, heads // count, dim)
    return _AllToAll.apply(by_destination, (tokens,) * count, shard.sizes, shard.group)


def _tokens_for_heads(y: torch.Tensor, shard: SequenceShard, rank: int) -> torch.Tensor:
    """``(T, H / N, D)`` -> ``(T_rank, H, D)``: every head of this rank's tokens (the reverse of
    :func:`_heads_for_tokens`)."""
    count, tokens = len(shard.sizes), shard.sizes[rank]
    _, heads, dim = y.shape
    by_source = _AllToAll.apply(y, shard.sizes, (tokens,) * count, shard.group)  # group rank j's head slice
    return by_source.view(count, tokens, heads, dim).transpose(0, 1).reshape(tokens, count * heads, dim)


def sharded_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: SequenceShard,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention of each document of a row split over ``shard.group``, for this rank's shard of it.

    Args:
        query: ``(T_rank, H_q, D)``, this rank's tokens (its shard of the row, already rotated by their positions in
            the whole row).
        key, value: ``(T_rank, H_kv, D)``.
        shard: the group and the row's layout; the group's size must divide ``H_q``.
        scale, dropout_p, backend: as :func:`~hf_odc.kernels.attention.packed_causal_attention`'s.

    Returns:
        ``(T_rank, H_q, D)``: what attending the whole row gives this rank's tokens.
    """
    count = len(shard.sizes)
    rank = shard.index
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % count:
        raise ValueError(
            f"Sequence parallelism over {count} ranks splits the attention heads among them, and {heads} query heads "
            f"do not split into {count}; use an sp_size that divides {heads}."
        )
    if query.shape[0] != shard.sizes[rank]:
        raise ValueError(f"This rank holds {query.shape[0]} tokens of the row, but its shard is {shard.sizes[rank]}.")
    if kv_heads % count:  # each query head's key/value head, repeated, so that they split as the query heads do
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    query, key, value = (_heads_for_tokens(t, shard) for t in (query, key, value))
    out = packed_causal_attention(query, key, value, shard.lengths, scale=scale, dropout_p=dropout_p, backend=backend)
    return _tokens_for_heads(out, shard, rank)
