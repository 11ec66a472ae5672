"""Balanced k-way number partitioning: Karmarkar–Karp's largest differencing method plus a local exchange pass.

Balancing a minibatch across ranks (or a rank's share across microbatches) is k-way partitioning of per-sample
costs, minimising the largest part. The largest differencing method (LDM) is the standard heuristic: it beats
greedy LPT on the ragged, long-tailed cost sets of variable-length training, and a short pairwise-exchange pass
afterwards removes most of what LDM leaves on the table when there are few items per part.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from collections.abc import Sequence
from operator import itemgetter

__all__ = ["karmarkar_karp"]

# A part is a mutable ``[cost_sum, item_indices]`` pair; a state is a list of at most k parts sorted by ascending
# sum, the missing (empty, sum 0) parts implicitly in front. Lists rather than objects keep the inner loop cheap:
# planning thousands of samples must take milliseconds.
_part_sum = itemgetter(0)
_GOOD_ENOUGH = 1e-4
_EXCHANGE_BUDGET = 16


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split item indices ``0..len(costs)-1`` into ``k`` parts with nearly equal cost sums.

    Every index appears in exactly one part; parts are sorted by descending cost sum and each part's indices are
    ascending. With ``equal_size`` every part gets ``len(costs) // k`` items (``len(costs)`` must be a multiple of
    ``k``); otherwise counts are free and, with fewer items than parts, some parts are empty. The result depends
    only on the input (ties broken by index), so every rank computes the same partition without communicating.

    LDM keeps partial k-partitions in a heap keyed by their spread (largest minus smallest sum) and repeatedly
    merges the two with the largest spread, joining the largest part of one with the smallest of the other.
    """
    values = _validated_costs(costs)
    k = _validated_parts(k)
    if equal_size and len(values) % k:
        raise ValueError(
            f"karmarkar_karp(equal_size=True) needs the number of items ({len(values)}) to be a multiple of k={k}; "
            "drop or add items, or pass equal_size=False."
        )
    if not values:
        return [[] for _ in range(k)]

    order = sorted(range(len(values)), key=values.__getitem__)
    if equal_size:
        # Each initial state already has k singleton parts, and merges pair part i with part k-1-i, so every part
        # keeps the same count throughout.
        states = [[[values[i], [i]] for i in order[start : start + k]] for start in range(0, len(order), k)]
    else:
        states = [[[values[i], [i]]] for i in order]
    heap = [(-_spread(state, k), tiebreak, state) for tiebreak, state in enumerate(states)]
    heapq.heapify(heap)
    tiebreak = len(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)[2]
        second = heapq.heappop(heap)[2]
        merged = _merge(first, second, k)
        heapq.heappush(heap, (-_spread(merged, k), tiebreak, merged))
        tiebreak += 1

    parts = [part[1] for part in heap[0][2]]
    parts += [[] for _ in range(k - len(parts))]
    _exchange_pass(parts, values, allow_moves=not equal_size, target=_lower_bound(order, values, k, equal_size))
    sums = [math.fsum(values[i] for i in part) for part in parts]
    ranked = sorted(range(k), key=lambda p: (-sums[p], p))
    return [sorted(parts[p]) for p in ranked]


def _validated_costs(costs: Sequence[float]) -> list[float]:
    values = [float(cost) for cost in costs]
    if any(not math.isfinite(value) or value < 0 for value in values):
        raise ValueError("karmarkar_karp needs finite, non-negative costs.")
    return values


def _lower_bound(order: list[int], values: list[float], k: int, equal_size: bool) -> float:
    """No partition has a part cheaper than this: the mean, and the part holding the largest item (which, with
    equal sizes, also holds at least ``n/k - 1`` others, at best the cheapest ones)."""
    companions = len(values) // k - 1 if equal_size else 0
    largest_part = values[order[-1]] + math.fsum(values[i] for i in order[:companions])
    return max(math.fsum(values) / k, largest_part)


def _validated_parts(k: int) -> int:
    try:
        if not isinstance(k, bool) and operator.index(k) >= 1:
            return operator.index(k)
    except TypeError:
        pass
    raise ValueError(f"karmarkar_karp needs a positive integer number of parts k, got {k!r}.")


def _spread(state: list[list], k: int) -> float:
    smallest = state[0][0] if len(state) == k else 0.0
    return state[-1][0] - smallest


def _merge(first: list[list], second: list[list], k: int) -> list[list]:
    """Combine two partial partitions, joining ``first``'s i-th smallest part with ``second``'s i-th largest.

    Counting the implicit empty parts, both have k parts; only the ``overlap`` smallest real parts of ``first``
    meet real parts of ``second`` (its ``overlap`` smallest, in reverse order); ``second``'s other parts fill
    ``first``'s empty slots. The changed parts are re-inserted by bisection, which costs O(k) per part instead of a
    sort. ``first`` is consumed and returned.
    """
    overlap = max(0, len(first) + len(second) - k)
    joined = first[:overlap]
    del first[:overlap]
    for j, target in enumerate(joined):
        source = second[overlap - 1 - j]
        target[0] += source[0]
        if len(target[1]) < len(source[1]):
            target[1], source[1] = source[1], target[1]
        target[1].extend(source[1])
    for part in joined + second[overlap:]:
        bisect.insort(first, part, key=_part_sum)
    return first


def _exchange_pass(parts: list[list[int]], values: list[float], allow_moves: bool, target: float) -> None:
    """Lower the largest part by swapping one of its items with a cheaper item of a lighter part (or, when part
    sizes are free, moving it there), best exchange first, until no exchange lowers it. Edits ``parts`` in place.

    An exchange of cost difference ``d`` between the top part and a part ``gap`` lighter helps iff ``0 < d < gap``;
    ``d`` nearest ``gap / 2`` helps most. Each accepted exchange strictly lowers the top part or the number of parts
    tied at the top, so the pass terminates. It stops early once the top part is within ``_GOOD_ENOUGH`` of the
    lower bound ``target`` (closer cannot matter next to the noise of step times, and LDM alone usually gets there
    when parts hold many items), and after ``_EXCHANGE_BUDGET`` candidate items per item, so that it never costs
    much more than LDM itself, even with thousands of parts of a few items each.
    """
    ranked = sorted((math.fsum(values[i] for i in part), p) for p, part in enumerate(parts))  # ascending sums
    partners: dict[int, tuple[list[float], list[int | None]]] = {}  # sorted per part, rebuilt only when it changes
    budget = _EXCHANGE_BUDGET * len(values)
    while budget > 0:
        top_sum, top = ranked[-1]
        if top_sum <= target * (1 + _GOOD_ENOUGH):
            return
        tolerance, exchange = 1e-9 * top_sum, None
        for position in range(len(ranked) - 1):
            other_sum, other = ranked[position]
            gap = top_sum - other_sum
            if gap <= tolerance:
                return
            if other not in partners:
                partners[other] = _partners(parts[other], values, allow_moves)
            exchange = _best_exchange(parts[top], partners[other], values, gap, tolerance)
            budget -= len(parts[top])
            if exchange is not None or budget <= 0:
                break
        if exchange is None:
            return
        x, y = exchange
        parts[top].remove(x)
        parts[other].append(x)
        delta = values[x]
        if y is not None:
            parts[other].remove(y)
            parts[top].append(y)
            delta -= values[y]
        del ranked[-1], ranked[position]
        for moved in ((top_sum - delta, top), (other_sum + delta, other)):
            bisect.insort(ranked, moved)
            partners.pop(moved[1], None)


def _partners(part: list[int], values: list[float], allow_moves: bool) -> tuple[list[float], list[int | None]]:
    """A part's items by ascending cost, as exchange partners; ``None`` (cost 0) stands for a plain move."""
    items: list[int | None] = sorted(part, key=lambda i: (values[i], i))
    costs = [values[i] for i in items]
    return ([0.0, *costs], [None, *items]) if allow_moves else (costs, items)


def _best_exchange(
    top: list[int], partners: tuple[list[float], list[int | None]], values: list[float], gap: float, tolerance: float
) -> tuple[int, int | None] | None:
    """The pair ``(x in top, partner)`` whose cost difference is nearest ``gap / 2`` within ``(0, gap)``, or
    ``None`` if no exchange lowers the top part. For each ``x`` only the two partners around ``x - gap / 2``
    (found by bisection) can be nearest."""
    costs, items = partners
    best, best_distance = None, math.inf
    for x in top:
        position = bisect.bisect_left(costs, values[x] - gap / 2)
        for j in (position - 1, position):
            if 0 <= j < len(costs):
                difference = values[x] - costs[j]
                distance = abs(difference - gap / 2)
                if tolerance < difference < gap - tolerance and distance < best_distance:
                    best, best_distance = (x, items[j]), distance
    return best
