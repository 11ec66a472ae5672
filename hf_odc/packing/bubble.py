"""Predicted step time and idle fraction ("bubble") of a plan, under per-layer or per-minibatch synchronisation.

With collectives (``sync="layer"``), every layer of every microbatch is an all-gather/reduce-scatter that all
ranks join, so each microbatch *step* lasts as long as its slowest rank. With ODC (``sync="minibatch"``), ranks
only meet at the end of the minibatch, so the minibatch lasts as long as the rank with the most total work.
A microbatch's time is the sum of its samples' costs, divided by its rank's speed where ranks differ in speed
(``speeds``, one per rank, in any unit: the times are then in cost units per speed unit); communication is
assumed hidden behind compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .cost import CostLike, evaluate_costs
from .partition import _validated_speeds
from .planners import Plan

__all__ = [
    "Sync",
    "bubble_of_costs",
    "bubble_rate",
    "idle_fraction",
    "plan_costs",
    "predicted_time",
    "step_times",
    "sync_time",
]

Sync = Literal["layer", "minibatch"]


def predicted_time(
    plan: Plan,
    lengths: Sequence[int],
    cost: CostLike = "tokens",
    sync: Sync = "layer",
    speeds: Sequence[float] | None = None,
) -> float:
    """Wall time of one minibatch, in cost units, or per speed unit with ``speeds`` (see :func:`sync_time`)."""
    return sync_time(plan_costs(plan, lengths, cost), sync, speeds)


def bubble_rate(
    plan: Plan,
    lengths: Sequence[int],
    cost: CostLike = "tokens",
    sync: Sync = "layer",
    speeds: Sequence[float] | None = None,
) -> float:
    """Predicted idle fraction: ``1 - sum of the ranks' busy times / (world_size * predicted_time)``, a rank's busy
    time being its total cost (divided by its speed, with ``speeds``); 0 for a plan with no work."""
    return bubble_of_costs(plan_costs(plan, lengths, cost), sync, speeds)


def bubble_of_costs(per_rank: list[list[float]], sync: Sync = "layer", speeds: Sequence[float] | None = None) -> float:
    """:func:`bubble_rate` of a plan given as each rank's microbatch costs (``[rank][microbatch]``)."""
    timed = _timed(per_rank, speeds)
    return idle_fraction([sum(rank) for rank in timed], sync_time(timed, sync))


def idle_fraction(work: Sequence[float], time: float) -> float:
    """``1 - sum(work) / (len(work) * time)``: the fraction of the ranks' time not spent on ``work`` (each rank's,
    predicted or measured) during a minibatch of ``time``; 0 for an empty one. The one formula every bubble uses."""
    if time <= 0 or not work:
        return 0.0
    return max(0.0, 1.0 - sum(work) / (len(work) * time))


def plan_costs(plan: Plan, lengths: Sequence[int], cost: CostLike = "tokens") -> list[list[float]]:
    """``[rank][microbatch]`` -> cost of that microbatch (the sum of its samples' costs)."""
    costs = evaluate_costs(lengths, cost)
    return [[float(costs[microbatch].sum()) for microbatch in rank] for rank in plan]


def sync_time(per_rank: list[list[float]], sync: Sync, speeds: Sequence[float] | None = None) -> float:
    """Minibatch time given each rank's microbatch costs (and, with ``speeds``, rank ``r``'s speed: its microbatch
    of cost ``c`` takes ``c / speeds[r]``; without, ``c``).

    ``layer``: the sum over microbatch steps of the slowest rank's microbatch (a rank with fewer microbatches adds
    nothing to the later steps). ``minibatch``: the largest per-rank total.
    """
    if sync == "layer":
        return sum(step_times(per_rank, speeds))
    if sync == "minibatch":
        return max(map(sum, _timed(per_rank, speeds)), default=0.0)
    raise ValueError(f"sync must be 'layer' (collective FSDP) or 'minibatch' (ODC), got {sync!r}.")


def step_times(per_rank: list[list[float]], speeds: Sequence[float] | None = None) -> list[float]:
    """Under layer sync, the duration of each microbatch step: its slowest rank's microbatch (cost, or cost divided
    by the rank's speed with ``speeds``)."""
    times = _timed(per_rank, speeds)
    steps = max(map(len, times), default=0)
    return [max(rank[step] if step < len(rank) else 0.0 for rank in times) for step in range(steps)]


def _timed(per_rank: list[list[float]], speeds: Sequence[float] | None) -> list[list[float]]:
    """Each rank's microbatch costs divided by its speed; the costs themselves without ``speeds``."""
    if speeds is None:
        return per_rank
    rates = _validated_speeds(speeds, len(per_rank))
    return [[cost / rate for cost in rank] for rank, rate in zip(per_rank, rates, strict=True)]
