"""Local search on a k-way partition: trade items between the most expensive part and lighter ones.

A trade moves a group of items of the top part to a lighter part and a group of that part's items back. If the
groups' cost difference is ``d`` and the lighter part is ``gap`` below the top, the trade lowers the top part iff
``0 < d < gap``, and a ``d`` nearest ``gap / 2`` lowers it most. Each accepted trade strictly lowers the top part
or the number of parts tied at the top, so a pass terminates; a budget of candidate groups bounds its cost.
"""

from __future__ import annotations

import bisect
import math
from itertools import combinations

# A part's candidate groups: size (or None: any size) -> (costs ascending, the groups of item indices in that order).
_Groups = dict[int | None, tuple[list[float], list[tuple[int, ...]]]]


def exchange_pass(
    parts: list[list[int]],
    values: list[float],
    *,
    allow_moves: bool,
    stop_at: float,
    budget: int,
    group_size: int = 1,
) -> int:
    """Lower the largest part of ``parts`` (edited in place) by trades of groups of up to ``group_size`` (1 or 2)
    items.

    The best trade with the heaviest lighter part that has one is taken, until the top part costs at most
    ``stop_at``, no trade lowers it, or ``budget`` candidate groups of the top part have been tried. Without
    ``allow_moves`` both groups of a trade have the same number of items (the parts keep their sizes); with it a
    group may also be smaller, or empty (a plain move). Returns the unused budget.
    """
    if group_size not in (1, 2):
        raise ValueError(f"exchange_pass trades groups of 1 or 2 items, not {group_size}")
    ranked = sorted((math.fsum(values[i] for i in part), p) for p, part in enumerate(parts))  # ascending sums
    partners: dict[int, _Groups] = {}  # per part, rebuilt only when the part changes
    while budget > 0:
        top_sum, top = ranked[-1]
        if top_sum <= stop_at:
            return budget
        tolerance, trade = 1e-9 * top_sum, None
        mine = _groups(parts[top], values, group_size, with_empty=False, by_size=False)
        candidates = len(mine[None][0])
        for position in range(len(ranked) - 1):
            other_sum, other = ranked[position]
            gap = top_sum - other_sum
            if gap <= tolerance:
                return budget
            if other not in partners:
                partners[other] = _groups(parts[other], values, group_size, allow_moves, by_size=not allow_moves)
            trade = _best_trade(mine, partners[other], gap, tolerance)
            budget -= candidates
            if trade is not None or budget <= 0:
                break
        if trade is None:
            return budget
        given, taken, delta = trade
        for i in given:
            parts[top].remove(i)
        parts[other].extend(given)
        for i in taken:
            parts[other].remove(i)
        parts[top].extend(taken)
        del ranked[-1], ranked[position]
        for moved in ((top_sum - delta, top), (other_sum + delta, other)):
            bisect.insort(ranked, moved)
            partners.pop(moved[1], None)
    return 0


def _groups(part: list[int], values: list[float], group_size: int, with_empty: bool, by_size: bool) -> _Groups:
    """The part's groups of one or two items (and the empty group, for moves), by ascending cost: all in one list
    (key ``None``), or ``by_size`` in one list per size."""
    items = sorted(part)
    entries = [(0.0, ())] if with_empty else []
    entries += [(values[i], (i,)) for i in items]
    if group_size >= 2:
        entries += [(values[i] + values[j], (i, j)) for i, j in combinations(items, 2)]
    entries.sort()
    groups: _Groups = {}
    for cost, group in entries:
        costs, members = groups.setdefault(len(group) if by_size else None, ([], []))
        costs.append(cost)
        members.append(group)
    return groups


def _best_trade(
    mine: _Groups, theirs: _Groups, gap: float, tolerance: float
) -> tuple[tuple[int, ...], tuple[int, ...], float] | None:
    """``(group of the top part, group of the other, cost difference)`` with the difference nearest ``gap / 2``
    within ``(0, gap)``, or ``None``. ``theirs`` in one list trades any sizes, by size only equal sizes. For each
    group of the top part only the two candidates around ``cost - gap / 2`` (found by bisection) can be nearest."""
    best, best_distance, half, highest = None, math.inf, gap / 2, gap - tolerance
    any_size = theirs.get(None)
    my_costs, my_groups = mine[None]
    for m, cost in enumerate(my_costs):
        costs, groups = any_size or theirs.get(len(my_groups[m]), ([], []))
        position = bisect.bisect_left(costs, cost - half)
        for j in (position - 1, position) if position else (position,):
            if j < len(costs):
                difference = cost - costs[j]
                distance = abs(difference - half)
                if distance < best_distance and tolerance < difference < highest:
                    best, best_distance = (my_groups[m], groups[j], difference), distance
    return best
