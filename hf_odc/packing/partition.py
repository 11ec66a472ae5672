"""Balanced k-way number partitioning: Karmarkar–Karp's largest differencing method, local search, and a bounded
search for the few-items-per-part cases where those fall short.

Balancing a minibatch across ranks (or a rank's share across microbatches) is k-way partitioning of per-sample
costs, minimising the largest part. The largest differencing method (LDM, :mod:`._ldm`) is the standard heuristic:
it beats greedy LPT on the ragged, long-tailed cost sets of variable-length training, and a short exchange pass
afterwards (:mod:`._exchange`) removes most of what it leaves on the table. With about four items per part or
fewer, or items nearly as large as a part, both can stay several percent above what is attainable
(benchmarks/RESULTS.md, partition quality); :class:`_Rescue` then tries other constructions within a fixed amount of
work.

Ranks of different speeds make it scheduling on uniform machines (Q||Cmax): part ``r`` takes ``sum / speed_r``, and
the largest time is what to minimise. The same search runs on times. LPT for such machines (each item, largest
first, to the part that would finish it earliest) replaces LDM, whose differencing of sums has no counterpart for
parts of different speeds; the exchange passes aim each trade at equal finishing times; the rescue's bins hold
amounts proportional to their machine's speed; the lower bound is the one for uniform machines
(:func:`_machines_bound`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Sequence

import numpy as np

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
_FEW_COSTLIEST = 16  # with speeds, the crowding of the m costliest items for m up to this (and the pigeonhole's m)
_MANY_PER_PART = 8  # from this many items per part on, LDM is followed by a long exchange pass


def karmarkar_karp(
    costs: Sequence[float], k: int, equal_size: bool = False, speeds: Sequence[float] | None = None
) -> list[list[int]]:
    """Split item indices ``0..len(costs)-1`` into ``k`` parts with nearly equal cost sums, or, given ``speeds``,
    nearly equal times.

    Every index appears in exactly one part and each part's indices are ascending. With ``equal_size`` every part
    gets ``len(costs) // k`` items (``len(costs)`` must be a multiple of ``k``); otherwise counts are free and, with
    fewer items than parts, some parts are empty. Without ``speeds`` parts are sorted by descending cost sum.

    ``speeds`` (``k`` positive numbers, in any unit) makes the parts jobs for machines of those speeds ("uniform
    machines"): part ``r`` runs on the machine of speed ``speeds[r]`` (so parts keep that order), takes time
    ``sum / speeds[r]``, and the largest time is minimised. Equal speeds give exactly the partition of
    ``speeds=None``; ``equal_size`` with unequal speeds is refused.

    The result depends only on the input (ties broken by index), so every rank computes the same partition without
    communicating.
    """
    values = _validated_costs(costs)
    k = _validated_parts(k)
    rates = None if speeds is None else _validated_speeds(speeds, k)
    if rates is not None and len(set(rates)) == 1:
        rates = None  # every part is equally fast: the same problem as without speeds
    if equal_size and rates is not None:
        raise ValueError(
            "karmarkar_karp(equal_size=True) balances parts of equal counts on equally fast machines; with unequal "
            "speeds pass equal_size=False (or speeds=None)."
        )
    if equal_size and len(values) % k:
        raise ValueError(
            f"karmarkar_karp(equal_size=True) needs the number of items ({len(values)}) to be a multiple of k={k}; "
            "drop or add items, or pass equal_size=False."
        )
    order = sorted(range(len(values)), key=values.__getitem__)
    parts = _construct(order, values, k, equal_size, rates)
    if len(values) > k or (values and rates is not None):  # one item per part is optimal only on equal machines
        bound = _lower_bound(order, values, k, equal_size, rates)
        if len(values) >= _MANY_PER_PART * k:  # with fewer, the rescue's packings do better for less
            exchange_pass(
                parts,
                values,
                allow_moves=not equal_size,
                stop_at=bound * (1 + _GOOD_ENOUGH),
                budget=_EXCHANGE_BUDGET * len(values),
                speeds=rates,
            )
        parts = _Rescue(order, values, k, bound, equal_size, rates).run(parts)
    if rates is not None:
        return [sorted(part) for part in parts]
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


def _validated_speeds(speeds: Sequence[float], count: int) -> list[float]:
    """``speeds`` as floats, checked: ``count`` of them (one per part, or per rank), each positive and finite."""
    try:
        rates = None if isinstance(speeds, str) else [float(speed) for speed in speeds]
    except (TypeError, ValueError):
        rates = None
    if rates is None or len(rates) != count or any(not (math.isfinite(rate) and rate > 0) for rate in rates):
        raise ValueError(
            f"speeds must be {count} positive, finite numbers (one per part or rank: how fast it works, in any "
            f"unit), got {speeds!r}; pass speeds=None when all are equally fast."
        )
    return rates


def _lower_bound(
    order: list[int], values: list[float], k: int, equal_size: bool, speeds: list[float] | None = None
) -> float:
    """No partition of the items ``order`` (ascending cost) has a largest part cheaper (or, on machines of
    ``speeds``, faster: see :func:`_machines_bound`) than this.

    The mean part; the part holding the largest item (with equal sizes it also holds ``n/k - 1`` others, at best
    the cheapest ones); and by pigeonhole, of the ``j*k + 1`` most expensive items some part holds ``j + 1``, at
    best the ``j + 1`` cheapest of them. The last one is what makes parts of two to four items measurable.
    """
    if speeds is not None:
        return _machines_bound(order, values, speeds)
    n = len(order)
    companions = n // k - 1 if equal_size else 0
    bound = max(
        math.fsum(values[i] for i in order) / k,
        values[order[-1]] + math.fsum(values[i] for i in order[:companions]),
    )
    for j in range(1, min(_PIGEONHOLE_DEPTH, (n - 1) // k) + 1):
        bound = max(bound, math.fsum(values[i] for i in order[n - j * k - 1 : n - j * k + j]))
    return bound


def _machines_bound(order: list[int], values: list[float], speeds: list[float]) -> float:
    """No assignment of the items ``order`` (ascending cost) to machines of ``speeds`` finishes sooner than this.

    All the work on all the machines; the ``j`` costliest items, which run on at most ``j`` machines, at best the
    ``j`` fastest; and, generalising the pigeonhole bound, the crowding of the ``m`` costliest items
    (:func:`_crowding_bound`): for the few costliest, where a handful of items nearly as large as a part must
    share the fast machines, and for ``m = j*k + 1``, whose ``j + 1`` items on one part made the bound with equal
    speeds (and still do with nearly equal ones).
    """
    n, k, fastest = len(order), len(speeds), sorted(speeds, reverse=True)
    bound = math.fsum(values[i] for i in order) / math.fsum(speeds)
    costliest = speediest = 0.0
    for j in range(min(n, k)):
        costliest += values[order[n - 1 - j]]
        speediest += fastest[j]
        bound = max(bound, costliest / speediest)
    # With m <= k the m-th costliest item alone on the m-th fastest machine meets the crowding bound, so only the m
    # for which that is above the bound so far can raise it.
    crowds = [m for m in range(2, min(n, k, _FEW_COSTLIEST) + 1) if values[order[n - m]] / fastest[m - 1] > bound]
    crowds += [j * k + 1 for j in range(1, min(_PIGEONHOLE_DEPTH, (n - 1) // k) + 1)]
    for m in sorted(set(crowds)):
        bound = max(bound, _crowding_bound([values[i] for i in order[n - m :]], fastest))
    return bound


def _crowding_bound(items: list[float], fastest: list[float]) -> float:
    """No assignment of ``items`` (ascending) to machines of speeds ``fastest`` (descending) finishes before this.

    A machine of speed ``s`` holds ``c`` of the items only by a time ``T >= P(c) / s``, ``P(c)`` the sum of the
    ``c`` cheapest. By time ``T`` machine ``r`` can hold ``#{c : P(c) / s_r <= T}`` of them, so all ``m`` fit only
    once ``m`` of these thresholds are reached: the answer is the ``m``-th smallest threshold over all machines
    and counts. They are taken in order from a heap that holds, per machine, its next count; a machine enters after
    its faster neighbour's first threshold (which is no larger) has been taken.
    """
    sums = list(itertools.accumulate(items))
    thresholds = [(sums[0] / fastest[0], 0, 0)]  # (time, machine, count - 1)
    for _ in range(len(items)):
        time, machine, count = heapq.heappop(thresholds)
        if count + 1 < len(sums):
            heapq.heappush(thresholds, (sums[count + 1] / fastest[machine], machine, count + 1))
        if count == 0 and machine + 1 < len(fastest):
            heapq.heappush(thresholds, (sums[0] / fastest[machine + 1], machine + 1, 0))
    return time


def _construct(
    order: list[int], values: list[float], k: int, equal_size: bool, speeds: list[float] | None
) -> list[list[int]]:
    """The first partition of the items ``order`` (ascending cost): LDM, or on machines of ``speeds`` LPT."""
    if speeds is None:
        return ldm(order, values, k, equal_size)
    parts: list[list[int]] = [[] for _ in range(k)]
    _earliest_finish(order[::-1], values, speeds, parts)
    return parts


def _earliest_finish(items: list[int], values: list[float], speeds: list[float], parts: list[list[int]]) -> None:
    """Each of ``items``, in turn, to the part that would finish it earliest (ties to the lowest index), extending
    ``parts`` in place: LPT for machines of ``speeds`` when the items come largest first."""
    loads = np.array([math.fsum(values[i] for i in part) for part in parts])
    rates = np.array(speeds)
    for i in items:
        best = int(np.argmin((loads + values[i]) / rates))  # the first of equal times
        parts[best].append(i)
        loads[best] += values[i]


def _largest(parts: list[list[int]], values: list[float], speeds: list[float] | None = None) -> float:
    """The largest part's cost sum, or with ``speeds`` its time."""
    if speeds is None:
        return max(math.fsum(values[i] for i in part) for part in parts)
    return max(math.fsum(values[i] for i in part) / speed for part, speed in zip(parts, speeds, strict=True))


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

    With ``speeds`` the largest part is the one that takes longest, the capacities are times (bin ``r`` holds
    ``capacity * speeds[r]``) and what fits nowhere goes where it finishes earliest. In step 3 each lone item takes
    the slowest free machine that runs it within the bound (:meth:`_lone_machines`), and LPT replaces LDM.

    Everything shares ``_RESCUE_WORK`` units per item, at most ``_RESCUE_WORK_CAP`` (a packing costs one per item,
    an LDM ``_LDM_WORK``, the exchange passes one per candidate group), so the rescue is deterministic (no clocks)
    and costs tens of milliseconds at most. On a grid of 540 random sets (2-8 items per part, 64-512 items) it
    brought the partitions more than 1% over the best known (CP-SAT, 10-20 s per set) from 47 to 0.
    """

    def __init__(
        self, order: list[int], values: list[float], k: int, bound: float, equal_size: bool, speeds: list[float] | None
    ):
        self.order, self.values, self.k, self.bound, self.speeds = order, values, k, bound, speeds
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
        self._spend(self.best, self.bound, self.enough, 2, self.speeds)
        self.top = _largest(self.best, self.values, self.speeds)  # the pass edited the best partition in place
        if self.free and self.top > self.enough:
            self._largest_alone()
        return self.best

    def _offer(self, parts: list[list[int]]) -> bool:
        """Keep ``parts`` if its largest part is the smallest so far; True once the search may stop."""
        largest = _largest(parts, self.values, self.speeds)
        if largest < self.top:
            self.best, self.top = parts, largest
        return self.top <= self.enough

    def _spend(
        self, parts: list[list[int]], bound: float, enough: float, group_size: int, speeds: list[float] | None
    ) -> None:
        """One exchange pass on ``parts`` (on machines of ``speeds``) within ``_POLISH_WORK`` per item of the work
        left, charged to it."""
        budget = min(self.work, _POLISH_WORK * len(self.values), _RESCUE_WORK_CAP // 4)
        stop_at = bound * (1 + _GOOD_ENOUGH) if group_size == 1 else enough
        left = exchange_pass(
            parts,
            self.values,
            allow_moves=self.free,
            stop_at=stop_at,
            budget=budget,
            group_size=group_size,
            speeds=speeds,
        )
        self.work -= budget - left

    def _polish(self, parts: list[list[int]], bound: float, enough: float, speeds: list[float] | None) -> None:
        """Single-item trades, then (if still above ``enough``) trades of up to two items."""
        self._spend(parts, bound, enough, 1, speeds)
        if self.work > 0 and _largest(parts, self.values, speeds) > enough:
            self._spend(parts, bound, enough, 2, speeds)

    def _pack(self, capacity: float) -> list[list[int]]:
        """Best-fit decreasing into k bins of ``capacity`` (a time: bin ``r`` holds ``capacity * speeds[r]``); what
        fits nowhere goes to the bins that finish it earliest: the lightest ones, with equal speeds."""
        self.work -= len(self.order)
        if self.speeds is not None:  # bins of capacity * fastest, the slower ones holding the difference already
            fastest = max(self.speeds)
            shortfalls = [capacity * (fastest - speed) for speed in self.speeds]
            parts, overflow = best_fit_decreasing(self.descending, self.values, self.k, capacity * fastest, shortfalls)
            _earliest_finish(overflow, self.values, self.speeds, parts)
            return parts
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
        self._polish(parts, self.bound, self.enough, self.speeds)
        return self._offer(parts)

    def _multifit(self) -> bool:
        """MULTIFIT: bisect the capacity between the bound and the best largest part, keeping the best packing."""
        low, high, best = self.bound, self.top, None
        for _ in range(_MULTIFIT_ROUNDS):
            if high - low <= _MULTIFIT_RESOLUTION * low or high <= self.enough or self.work < len(self.order):
                break
            capacity = (low + high) / 2
            parts = self._pack(capacity)
            largest = _largest(parts, self.values, self.speeds)
            if largest < high:
                best, high = parts, largest
            if largest > capacity:
                low = capacity
        if best is None:
            return False
        self._polish(best, self.bound, self.enough, self.speeds)
        return self._offer(best)

    def _largest_alone(self) -> None:
        """The largest items that cannot share a part within the bound, alone; the first construction and polish
        for the rest."""
        n, order, values, speeds = len(self.order), self.order, self.values, self.speeds
        cheapest, alone = values[order[0]], 0
        fastest = 1.0 if speeds is None else max(speeds)  # where an item finishes soonest, with a companion too
        while alone < min(self.k - 1, _ALONE_MAX) and (values[order[n - 1 - alone]] + cheapest) / fastest > self.bound:
            alone += 1
        if not alone or self.work < _LDM_WORK * n:
            return
        self.work -= _LDM_WORK * n
        lone = order[n - alone :]
        owners = dict(zip(self._lone_machines(lone), lone, strict=True))
        machines = [r for r in range(self.k) if r not in owners]
        rest_speeds = None if speeds is None else [speeds[r] for r in machines]
        rest_order = order[: n - alone]
        rest_bound = _lower_bound(rest_order, values, len(machines), False, rest_speeds)
        rest = _construct(rest_order, values, len(machines), False, rest_speeds)
        # Polished on their own: with the single-item parts in reach, the passes would fill those first.
        self._polish(rest, rest_bound, rest_bound * (1 + _RESCUE_ABOVE), rest_speeds)
        parts = [[owners[r]] if r in owners else [] for r in range(self.k)]
        for r, part in zip(machines, rest, strict=True):
            parts[r] = part
        self._offer(parts)

    def _lone_machines(self, lone: list[int]) -> list[int]:
        """The machine of each of the items ``lone`` (ascending cost): with equal speeds the last ones; else, largest
        item first, the slowest free machine that runs it alone within the bound (keeping the faster ones for the
        rest), or the fastest free one if none does."""
        if self.speeds is None:
            return list(range(self.k - len(lone), self.k))
        speeds, free, machines = self.speeds, set(range(self.k)), {}
        for i in reversed(lone):
            within = [r for r in free if self.values[i] / speeds[r] <= self.bound]
            if within:
                machines[i] = min(within, key=lambda r: (speeds[r], r))
            else:
                machines[i] = max(free, key=lambda r: (speeds[r], -r))
            free.remove(machines[i])
        return [machines[i] for i in lone]
