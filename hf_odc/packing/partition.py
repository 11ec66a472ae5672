"""Balanced k-way number partitioning: Karmarkar–Karp's largest differencing method, local search, and a bounded
search for the few-items-per-part cases where those fall short.

Balancing a minibatch across ranks (or a rank's share across microbatches) is k-way partitioning of per-sample
costs, minimising the largest part. The largest differencing method (LDM, :mod:`._ldm`) is the standard heuristic:
it beats greedy LPT on the ragged, long-tailed cost sets of variable-length training, and a short exchange pass
afterwards (:mod:`._exchange`) removes most of what it leaves on the table. With about four items per part or
fewer, or items nearly as large as a part, both can stay several percent above what is attainable
(benchmarks/RESULTS.md, partition quality); :class:`_Rescue` then tries other constructions within a fixed amount of
work.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Sequence

from ._bin_packing import best_fit_decreasing
from ._exchange import exchange_pass
from ._ldm import ldm

__all__ = ["karmarkar_karp"]

_GOOD_ENOUGH = 1e-4  # the first exchange pass stops this close to the lower bound
_EXCHANGE_BUDGET = 16  # candidate items per item for the first exchange pass
_RESCUE_ABOVE = 5e-3  # rescue partitions more than this far above the lower bound; stop once within it
_RESCUE_WORK = 48  # work units per item for the whole rescue ...
_RESCUE_WORK_CAP = 32768  # ... and at most this many (a unit is about a microsecond)
_POLISH_WORK = 8  # work units per item for one exchange pass inside the rescue (at most a quarter of the cap)
_LDM_WORK = 4  # what one LDM costs, in work units per item
_PROBES = (1 + 1e-4, 1.005, 1.01)  # best-fit-decreasing capacities tried first, relative to the lower bound
_MULTIFIT_ROUNDS = 6
_MULTIFIT_RESOLUTION = 5e-4
_ALONE_MAX = 8  # at most this many items in parts of their own
_PIGEONHOLE_DEPTH = 8
_MANY_PER_PART = 8  # from this many items per part on, LDM is followed by a long exchange pass


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split item indices ``0..len(costs)-1`` into ``k`` parts with nearly equal cost sums.

    Every index appears in exactly one part; parts are sorted by descending cost sum and each part's indices are
    ascending. With ``equal_size`` every part gets ``len(costs) // k`` items (``len(costs)`` must be a multiple of
    ``k``); otherwise counts are free and, with fewer items than parts, some parts are empty. The result depends
    only on the input (ties broken by index), so every rank computes the same partition without communicating.
    """
    values = _validated_costs(costs)
    k = _validated_parts(k)
    if equal_size and len(values) % k:
        raise ValueError(
            f"karmarkar_karp(equal_size=True) needs the number of items ({len(values)}) to be a multiple of k={k}; "
            "drop or add items, or pass equal_size=False."
        )
    order = sorted(range(len(values)), key=values.__getitem__)
    parts = ldm(order, values, k, equal_size)
    if len(values) > k:
        bound = _lower_bound(order, values, k, equal_size)
        if len(values) >= _MANY_PER_PART * k:  # with fewer, the rescue's packings do better for less
            exchange_pass(
                parts,
                values,
                allow_moves=not equal_size,
                stop_at=bound * (1 + _GOOD_ENOUGH),
                budget=_EXCHANGE_BUDGET * len(values),
            )
        parts = _Rescue(order, values, k, bound, equal_size).run(parts)
    sums = [math.fsum(values[i] for i in part) for part in parts]
    ranked = sorted(range(k), key=lambda p: (-sums[p], p))
    return [sorted(parts[p]) for p in ranked]


def _validated_costs(costs: Sequence[float]) -> list[float]:
    values = [float(cost) for cost in costs]
    if any(not math.isfinite(value) or value < 0 for value in values):
        raise ValueError("karmarkar_karp needs finite, non-negative costs.")
    return values


def _validated_parts(k: int) -> int:
    try:
        if not isinstance(k, bool) and operator.index(k) >= 1:
            return operator.index(k)
    except TypeError:
        pass
    raise ValueError(f"karmarkar_karp needs a positive integer number of parts k, got {k!r}.")


def _lower_bound(order: list[int], values: list[float], k: int, equal_size: bool) -> float:
    """No partition of the items ``order`` (ascending cost) has a largest part cheaper than this.

    The mean part; the part holding the largest item (with equal sizes it also holds ``n/k - 1`` others, at best
    the cheapest ones); and by pigeonhole, of the ``j*k + 1`` most expensive items some part holds ``j + 1``, at
    best the ``j + 1`` cheapest of them. The last one is what makes parts of two to four items measurable.
    """
    n = len(order)
    companions = n // k - 1 if equal_size else 0
    bound = max(
        math.fsum(values[i] for i in order) / k,
        values[order[-1]] + math.fsum(values[i] for i in order[:companions]),
    )
    for j in range(1, min(_PIGEONHOLE_DEPTH, (n - 1) // k) + 1):
        bound = max(bound, math.fsum(values[i] for i in order[n - j * k - 1 : n - j * k + j]))
    return bound


def _largest(parts: list[list[int]], values: list[float]) -> float:
    return max(math.fsum(values[i] for i in part) for part in parts)


class _Rescue:
    """Other constructions, tried when LDM (and, with many items per part, the exchange pass) leave the largest part
    more than ``_RESCUE_ABOVE`` over the lower bound; the best partition is kept, and the search stops as soon as
    one is within it:

    1. (free sizes) best-fit decreasing into k bins at a few capacities just above the bound (items that fit
       nowhere go to the lightest bins), then MULTIFIT: bisect that capacity between the bound and the best so far;
       each packing is polished by the exchange passes;
    2. trades of up to two items of the top part for up to two of a lighter part, on the best so far;
    3. (free sizes) the largest items that cannot share a part with even the cheapest item within the bound each
       in a part of its own, LDM and the exchange passes on the rest (LDM would give each a companion).

    Everything shares ``_RESCUE_WORK`` units per item, at most ``_RESCUE_WORK_CAP`` (a packing costs one per item,
    an LDM ``_LDM_WORK``, the exchange passes one per candidate group), so the rescue is deterministic (no clocks)
    and costs tens of milliseconds at most. On a grid of 540 random sets (2-8 items per part, 64-512 items) it
    brought the partitions more than 1% over the best known (CP-SAT, 10-20 s per set) from 47 to 0.
    """

    def __init__(self, order: list[int], values: list[float], k: int, bound: float, equal_size: bool):
        self.order, self.values, self.k, self.bound = order, values, k, bound
        self.descending = order[::-1]  # what best-fit decreasing packs, for every capacity tried
        self.free = not equal_size
        self.enough = bound * (1 + _RESCUE_ABOVE)
        self.work = min(_RESCUE_WORK * len(order), _RESCUE_WORK_CAP)
        self.best: list[list[int]] = []
        self.top = math.inf

    def run(self, parts: list[list[int]]) -> list[list[int]]:
        self._offer(parts)
        if self.top <= self.enough:
            return self.best
        if self.free:
            for factor in _PROBES:
                if self._packing(self.bound * factor):
                    return self.best
            if self._multifit():
                return self.best
        self._spend(self.best, self.bound, self.enough, group_size=2)
        self.top = _largest(self.best, self.values)  # the pass edited the best partition in place
        if self.free and self.top > self.enough:
            self._largest_alone()
        return self.best

    def _offer(self, parts: list[list[int]]) -> bool:
        """Keep ``parts`` if its largest part is the smallest so far; True once the search may stop."""
        largest = _largest(parts, self.values)
        if largest < self.top:
            self.best, self.top = parts, largest
        return self.top <= self.enough

    def _spend(self, parts: list[list[int]], bound: float, enough: float, group_size: int) -> None:
        """One exchange pass on ``parts`` within ``_POLISH_WORK`` per item of the work left, charged to it."""
        budget = min(self.work, _POLISH_WORK * len(self.values), _RESCUE_WORK_CAP // 4)
        stop_at = bound * (1 + _GOOD_ENOUGH) if group_size == 1 else enough
        left = exchange_pass(
            parts, self.values, allow_moves=self.free, stop_at=stop_at, budget=budget, group_size=group_size
        )
        self.work -= budget - left

    def _polish(self, parts: list[list[int]], bound: float, enough: float) -> None:
        """Single-item trades, then (if still above ``enough``) trades of up to two items."""
        self._spend(parts, bound, enough, group_size=1)
        if self.work > 0 and _largest(parts, self.values) > enough:
            self._spend(parts, bound, enough, group_size=2)

    def _pack(self, capacity: float) -> list[list[int]]:
        """Best-fit decreasing into k bins of ``capacity``; what fits nowhere goes to the lightest bins."""
        self.work -= len(self.order)
        parts, overflow = best_fit_decreasing(self.descending, self.values, self.k, capacity)
        loads = [(math.fsum(self.values[i] for i in part), b) for b, part in enumerate(parts)]
        heapq.heapify(loads)
        for i in overflow:
            load, b = loads[0]
            parts[b].append(i)
            heapq.heapreplace(loads, (load + self.values[i], b))
        return parts

    def _packing(self, capacity: float) -> bool:
        if self.work < len(self.order):
            return False
        parts = self._pack(capacity)
        self._polish(parts, self.bound, self.enough)
        return self._offer(parts)

    def _multifit(self) -> bool:
        """MULTIFIT: bisect the capacity between the bound and the best largest part, keeping the best packing."""
        low, high, best = self.bound, self.top, None
        for _ in range(_MULTIFIT_ROUNDS):
            if high - low <= _MULTIFIT_RESOLUTION * low or high <= self.enough or self.work < len(self.order):
                break
            capacity = (low + high) / 2
            parts = self._pack(capacity)
            largest = _largest(parts, self.values)
            if largest < high:
                best, high = parts, largest
            if largest > capacity:
                low = capacity
        if best is None:
            return False
        self._polish(best, self.bound, self.enough)
        return self._offer(best)

    def _largest_alone(self) -> None:
        """The largest items that cannot share a part within the bound, alone; LDM and polish for the rest."""
        n, order, values = len(self.order), self.order, self.values
        cheapest, alone = values[order[0]], 0
        while alone < min(self.k - 1, _ALONE_MAX) and values[order[n - 1 - alone]] + cheapest > self.bound:
            alone += 1
        if not alone or self.work < _LDM_WORK * n:
            return
        self.work -= _LDM_WORK * n
        rest_order = order[: n - alone]
        rest_bound = _lower_bound(rest_order, values, self.k - alone, equal_size=False)
        rest = ldm(rest_order, values, self.k - alone, equal_size=False)
        # Polished on their own: with the single-item parts in reach, the passes would fill those first.
        self._polish(rest, rest_bound, rest_bound * (1 + _RESCUE_ABOVE))
        self._offer(rest + [[i] for i in order[n - alone :]])
