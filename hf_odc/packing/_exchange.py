"""Local search on a k-way partition: trade items between the slowest part and faster ones.

Part ``p`` runs on a machine of speed ``s_p`` and takes time ``L_p / s_p`` for its cost sum ``L_p`` (all speeds 1:
the time is the cost sum). A trade moves a group of items of the top part ``t`` (time ``T``) to another part ``o``
and a group of that part's items back. If the groups' cost difference is ``d``, the trade lowers the top part iff
``0 < d < T * s_o - L_o`` (``o`` must finish before ``T`` afterwards), and a ``d`` nearest
``(L_t * s_o - L_o * s_t) / (s_t + s_o)``, where both finish together, lowers it most. With equal speeds these are
``gap`` and ``gap / 2``, ``gap`` the difference of the two parts' sums. Each accepted trade strictly lowers the top
part or the number of parts tied at the top, so a pass terminates; a budget of candidate groups bounds its cost.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
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
    speeds: Sequence[float] | None = None,
) -> int:
    """Lower the slowest part of ``parts`` (edited in place) by trades of groups of up to ``group_size`` (1 or 2)
    items.

    Part ``p`` takes time ``sum / speeds[p]`` (``None``: speed 1 each, so the time is the sum; multiplying and
    dividing by 1.0 is exact, so the arithmetic is that of sums). The best trade with the earliest-finishing part
    that has one is taken, until the top part takes at most ``stop_at``, no trade lowers it, or ``budget``
    candidate groups of the top part have been tried. Without ``allow_moves`` both groups of a trade have the same
    number of items (the parts keep their sizes); with it a group may also be smaller, or empty (a plain move).
    Returns the unused budget.
    """
    if group_size not in (1, 2):
        raise ValueError(f"exchange_pass trades groups of 1 or 2 items, not {group_size}")
    rates = [1.0] * len(parts) if speeds is None else speeds
    loads = [math.fsum(values[i] for i in part) for part in parts]
    ranked = sorted((loads[p] / rates[p], p) for p in range(len(parts)))  # ascending times
    partners: dict[int, _Groups] = {}  # per part, rebuilt only when the part changes
    while budget > 0:
        top_time, top = ranked[-1]
        if top_time <= stop_at:
            return budget
        tolerance, trade = 1e-9 * top_time, None
        mine = _groups(parts[top], values, group_size, with_empty=False, by_size=False)
        candidates = len(mine[None][0])
        for position in range(len(ranked) - 1):
            other_time, other = ranked[position]
            if top_time - other_time <= tolerance:
                return budget
            if other not in partners:
                partners[other] = _groups(parts[other], values, group_size, allow_moves, by_size=not allow_moves)
            speed_top, speed_other = rates[top], rates[other]
            trade = _best_trade(
                mine,
                partners[other],
                even=(loads[top] * speed_other - loads[other] * speed_top) / (speed_top + speed_other),
                limit=top_time * speed_other - loads[other],
                tolerance=tolerance * speed_other,
            )
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
        loads[top] -= delta
        loads[other] += delta
        del ranked[-1], ranked[position]
        for moved in (top, other):
            bisect.insort(ranked, (loads[moved] / rates[moved], moved))
            partners.pop(moved, None)
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
    mine: _Groups, theirs: _Groups, even: float, limit: float, tolerance: float
) -> tuple[tuple[int, ...], tuple[int, ...], float] | None:
    """``(group of the top part, group of the other, cost difference)`` with the difference nearest ``even``
    within ``(0, limit)`` (``tolerance`` inside both ends), or ``None``. ``theirs`` in one list trades any sizes, by
    size only equal sizes. For each group of the top part only the two candidates around ``cost - even`` (found by
    bisection) can be nearest."""
    best, best_distance, highest = None, math.inf, limit - tolerance
    any_size = theirs.get(None)
    my_costs, my_groups = mine[None]
    for m, cost in enumerate(my_costs):
        costs, groups = any_size or theirs.get(len(my_groups[m]), ([], []))
        position = bisect.bisect_left(costs, cost - even)
        for j in (position - 1, position) if position else (position,):
            if j < len(costs):
                difference = cost - costs[j]
                distance = abs(difference - even)
                if distance < best_distance and tolerance < difference < highest:
                    best, best_distance = (my_groups[m], groups[j], difference), distance
    return best
