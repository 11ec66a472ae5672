"""Documents longer than one microbatch: planned on a group of ranks that run them together (sequence parallelism).

With sequence parallelism of size ``N`` the ranks form groups of ``N`` consecutive ranks (``0..N-1``, ``N..2N-1``,
...). A document longer than the token cap (up to ``N`` times it) becomes a *group microbatch*: each rank of one
group holds a contiguous ``1/N`` of its tokens (:func:`shard_sizes`), and the ranks exchange heads for tokens around
attention (Ulysses: :mod:`hf_odc.kernels.ulysses`), so that they run it together, in step. Every other document stays
an independent microbatch, and ranks keep unequal microbatch counts: a group's ranks run its group microbatches
first, in the same order, then their own, so no rank outside the group ever waits for them before the minibatch's end.

Per rank, a group microbatch costs ``1/N`` of the document (a rank projects ``1/N`` of the tokens and attends over
all of them with ``1/N`` of the heads) plus its all-to-alls (:func:`split_costs`). :func:`lb_mini_groups` deals the
long documents to groups, then balances the other documents over the ranks around that load, as LB-Mini does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cost import CostLike, evaluate_costs
from .partition import _validated_speeds, karmarkar_karp
from .planners import CapacityError, MicrobatchCost, Plan, _check_world_size, _checked_lengths, _pack_share, lb_mini

__all__ = ["EXCHANGE", "GroupPlan", "check_group_size", "lb_mini_groups", "shard_sizes", "split_costs"]

EXCHANGE = 0.1
"""What the all-to-alls of one token cost, as a share of a token's own per-token work (:func:`split_costs`): four
exchanges per layer and pass (query, key, value, output) of ``hidden`` values each, against about ``24 x hidden**2``
FLOPs of the token's matmuls. The value is ``benchmarks/ulysses_exchange.py``'s fit on 4 NVLink-connected GPUs
(benchmarks/RESULTS.md); pass ``exchange=`` where a slower link makes it dearer."""


@dataclass(frozen=True)
class GroupPlan:
    """A minibatch plan with group microbatches.

    Attributes:
        plan: ``plan[rank][microbatch]``: the sample indices of each rank's own microbatches (as every planner's).
        group_size: ranks per group (``N``); group ``g`` is ranks ``g * N .. g * N + N - 1``.
        groups: ``groups[g]``: the documents group ``g`` runs as group microbatches, one each, in that order,
            before its ranks' own microbatches.
    """

    plan: Plan
    group_size: int
    groups: list[list[int]]

    def shared(self, rank: int) -> list[int]:
        """The documents of ``rank``'s group microbatches, in the order it runs them."""
        return self.groups[rank // self.group_size]

    def rank_costs(
        self, lengths: Sequence[int], cost: CostLike = "tokens", exchange: float = EXCHANGE
    ) -> list[list[float]]:
        """``[rank][microbatch]`` -> the cost of each microbatch a rank runs: its group microbatches' shares
        (:func:`split_costs`) first, then its own microbatches' (the sums of their samples' costs)."""
        costs = evaluate_costs(lengths, cost)
        split = split_costs(lengths, self.group_size, cost, exchange)
        return [
            [float(split[i]) for i in self.shared(rank)] + [float(costs[microbatch].sum()) for microbatch in own]
            for rank, own in enumerate(self.plan)
        ]


def shard_sizes(length: int, group_size: int) -> tuple[int, ...]:
    """The tokens each rank of a group holds of a document of ``length`` tokens, in group-rank order: contiguous
    shards as equal as can be, the first ``length % group_size`` one token longer."""
    base, extra = divmod(length, group_size)
    return tuple(base + (rank < extra) for rank in range(group_size))


def split_costs(
    lengths: Sequence[int], group_size: int, cost: CostLike = "tokens", exchange: float = EXCHANGE
) -> np.ndarray:
    """Each document's cost *per rank* when a group of ``group_size`` ranks runs it: ``1/N`` of its cost, plus the
    all-to-alls: each rank sends ``(N - 1) / N`` of its ``L / N`` tokens, each token costed at ``exchange`` times a
    token's per-token cost (the cost model's increment from one token to two)."""
    if not exchange >= 0:
        raise ValueError(f"exchange must be a non-negative share of a token's cost, got {exchange!r}.")
    costs = evaluate_costs(lengths, cost)
    if group_size == 1:
        return costs
    one, two = evaluate_costs([1, 2], cost)
    sent = np.asarray(lengths, dtype=np.float64) * (group_size - 1) / group_size**2
    return costs / group_size + exchange * (two - one) * sent


def check_group_size(world_size: int, group_size: int) -> None:
    """Refuse a group size that is not a positive divisor of ``world_size``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer) or group_size < 1:
        raise ValueError(f"The sequence-parallel size sp_size must be a positive integer, got {group_size!r}.")
    if world_size % group_size:
        raise ValueError(
            f"sp_size={group_size} must divide the number of processes ({world_size}): ranks form groups of sp_size "
            "consecutive ranks that split long documents."
        )


def lb_mini_groups(
    lengths: Sequence[int],
    world_size: int,
    max_tokens: int,
    cost: CostLike = "tokens",
    *,
    group_size: int,
    speeds: Sequence[float] | None = None,
    per_microbatch: MicrobatchCost = 0.0,
    exchange: float = EXCHANGE,
) -> GroupPlan:
    """LB-Mini with group microbatches: documents longer than ``max_tokens`` (up to ``group_size`` times it) are
    split over a group of ``group_size`` ranks; the others are planned on single ranks.

    Without such a document the plan is :func:`~hf_odc.packing.lb_mini`'s. Otherwise the long documents are dealt to
    the groups by Karmarkar–Karp on their per-rank costs (:func:`split_costs`, plus the fixed cost of a microbatch;
    with ``speeds``, a group runs at its slowest rank's), each group's longest first; then the other documents go,
    costliest first, to the rank that would finish them first given what it already runs (LPT from that load), and
    each rank's share is packed into microbatches as LB-Mini packs it.
    """
    lengths = _checked_lengths(lengths)
    _check_world_size(world_size)
    check_group_size(world_size, group_size)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer (tokens per microbatch), got {max_tokens!r}.")
    too_long = [i for i, length in enumerate(lengths) if length > group_size * max_tokens]
    if too_long:
        index = too_long[0]
        raise CapacityError(
            f"Sample {index} has {lengths[index]} tokens, more than sp_size={group_size} ranks x "
            f"max_tokens={max_tokens} hold; raise max_tokens or sp_size, or truncate or drop the sample(s) "
            f"({len(too_long)} exceed it)."
        )
    groups = world_size // group_size
    long = [i for i, length in enumerate(lengths) if length > max_tokens]
    if not long:
        return GroupPlan(
            lb_mini(lengths, world_size, max_tokens, cost, speeds, per_microbatch), group_size, [[]] * groups
        )
    if callable(per_microbatch):  # a group microbatch and a packed one are both about full
        per_microbatch = per_microbatch(max_tokens)
    rates = [1.0] * world_size if speeds is None else _validated_speeds(speeds, world_size)
    split = split_costs([lengths[i] for i in long], group_size, cost, exchange) + per_microbatch
    group_rates = [min(rates[g * group_size : (g + 1) * group_size]) for g in range(groups)]
    parts = karmarkar_karp(split, groups, speeds=None if speeds is None else group_rates)
    shared = [sorted((long[j] for j in part), key=lambda i: (-lengths[i], i)) for part in parts]
    load = [float(sum(split[j] for j in parts[rank // group_size])) for rank in range(world_size)]
    costs = evaluate_costs(lengths, cost)
    spread = costs + per_microbatch * np.asarray(lengths, dtype=np.float64) / max_tokens
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted((i for i in range(len(lengths)) if lengths[i] <= max_tokens), key=lambda i: (-spread[i], i)):
        rank = min(range(world_size), key=lambda r: ((load[r] + spread[i]) / rates[r], r))
        load[rank] += float(spread[i])
        shares[rank].append(i)
    plan = [_pack_share(share, lengths, costs, max_tokens) for share in shares]
    return GroupPlan(plan, group_size, shared)
