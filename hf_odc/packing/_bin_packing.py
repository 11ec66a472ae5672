"""Best-fit decreasing: the bin packing that both the partitioner (MULTIFIT) and LB-Micro's token packing use."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def best_fit_decreasing(
    items: Sequence[int],
    sizes: Sequence[float],
    bins: int,
    capacity: float,
    shortfalls: Sequence[float] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Pack ``items`` (indices into ``sizes``, given largest first) into ``bins`` bins of ``capacity``.

    Each item goes to the fullest bin it fits in (an empty bin only when no used one has room, so bins fill up in
    turn). Bins of different sizes (the MULTIFIT bins of machines of different speeds) are bins of ``capacity``
    already holding ``shortfalls[b]``: what bin ``b`` holds less. "Fullest" then means least room left, which is
    what best fit is. Returns the bins' items, in packing order, and the items that fit nowhere, for the caller to
    place.
    """
    loads = [0] * bins if shortfalls is None else list(shortfalls)
    slots = sorted(range(bins), key=lambda b: (loads[b], b))  # the bin at each position of ``loads``
    loads.sort()  # ascending: bisection finds the fullest bin an item fits in
    packed: list[list[int]] = [[] for _ in range(bins)]
    overflow = []
    for i in items:
        position = bisect.bisect_right(loads, capacity - sizes[i]) - 1
        if position < 0:
            overflow.append(i)
            continue
        load, slot = loads.pop(position) + sizes[i], slots.pop(position)
        packed[slot].append(i)
        position = bisect.bisect_left(loads, load)
        loads.insert(position, load)
        slots.insert(position, slot)
    return packed, overflow
