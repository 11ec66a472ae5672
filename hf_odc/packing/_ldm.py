"""The largest differencing method (Karmarkar–Karp) for k-way number partitioning.

Partial k-partitions are kept in a heap keyed by their spread (largest minus smallest part sum); the two with the
largest spread are merged, the largest part of one joining the smallest of the other, until one partition is left.

A part is a mutable ``[cost_sum, item_indices]`` pair; a state is a list of at most k parts sorted by ascending sum,
the missing (empty, sum 0) parts implicitly in front. Lists rather than objects keep the inner loop cheap: planning
thousands of samples must take milliseconds.
"""

from __future__ import annotations

import bisect
import heapq
from operator import itemgetter

_part_sum = itemgetter(0)


def ldm(order: list[int], values: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """k parts of the items ``order`` (indices into ``values``, by ascending cost, ties by index).

    With ``equal_size`` (``len(order)`` a multiple of k) every part gets the same number of items.
    """
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
    parts = [part[1] for part in heap[0][2]] if heap else []
    return parts + [[] for _ in range(k - len(parts))]


def _spread(state: list[list], k: int) -> float:
    smallest = state[0][0] if len(state) == k else 0.0
    return state[-1][0] - smallest


def _merge(first: list[list], second: list[list], k: int) -> list[list]:
    """Combine two partial partitions, joining ``first``'s i-th smallest part with ``second``'s i-th largest.

    Counting the implicit empty parts, both have k parts; only the ``overlap`` smallest real parts of ``first``
    meet real parts of ``second`` (its ``overlap`` smallest, in reverse order); ``second``'s other parts fill
    ``first``'s empty slots. A few changed parts are re-inserted by bisection (O(k) each); many (over a quarter of
    k) are appended and the list re-sorted, which Timsort does in linear time over its sorted runs. Both keep equal
    sums in the same order, so the result does not depend on the choice. ``first`` is consumed and returned.
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
    changed = joined + second[overlap:]
    if 4 * len(changed) > k:
        first += changed
        first.sort(key=_part_sum)
    else:
        for part in changed:
            bisect.insort(first, part, key=_part_sum)
    return first
