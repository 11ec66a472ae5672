"""Predict what ODC + LB-Mini buys over collective FSDP for a length distribution: the logic of ``hf-odc plan``.

For each world size, minibatches of ``samples_per_rank * world_size`` lengths are drawn from a source and planned
by each scheme; the schemes' predicted times (:func:`~hf_odc.packing.bubble.sync_time`) are summed over the
minibatches. Bubble rates and speedups are ratios of those sums, so long minibatches weigh more, as in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ..bubble import Sync, idle_fraction, plan_costs, sync_time
from ..cost import CostLike
from ..schemes import BASELINE, SCHEMES
from .sources import LengthSource

__all__ = ["SchemeResult", "Simulation", "simulate"]


@dataclass(frozen=True)
class SchemeResult:
    """One scheme at one world size, over all simulated minibatches."""

    world_size: int
    scheme: str
    sync: Sync
    bubble_rate: float
    speedup: float
    time: float
    """Summed predicted minibatch time, in cost units."""
    min_microbatches: int
    max_microbatches: int
    """Fewest and most microbatches any rank ran in any minibatch."""


@dataclass(frozen=True)
class Simulation:
    config: dict[str, object]
    results: list[SchemeResult]
    timelines: dict[int, dict[str, list[list[float]]]] = field(repr=False)
    """``timelines[world_size][scheme][rank]``: microbatch costs of the first minibatch, for plotting."""

    def to_dict(self) -> dict[str, object]:
        return {"config": self.config, "results": [asdict(result) for result in self.results]}


def simulate(
    source: LengthSource,
    world_sizes: Sequence[int],
    samples_per_rank: int,
    max_tokens: int,
    cost: CostLike = "attention",
    num_minibatches: int = 10,
    seed: int = 0,
) -> Simulation:
    """Plan ``num_minibatches`` minibatches per world size with every scheme and compare predicted times.

    Minibatches for world size ``w`` come from ``numpy.random.default_rng([seed, w])``, so results are
    reproducible and adding a world size does not change the others.
    """
    if samples_per_rank < 1 or num_minibatches < 1:
        raise ValueError(
            f"samples_per_rank and num_minibatches must be >= 1, got {samples_per_rank} and {num_minibatches}."
        )
    results: list[SchemeResult] = []
    timelines: dict[int, dict[str, list[list[float]]]] = {}
    for world_size in world_sizes:
        rng = np.random.default_rng([seed, world_size])
        times = dict.fromkeys((scheme.name for scheme in SCHEMES), 0.0)
        counts: dict[str, list[int]] = {scheme.name: [] for scheme in SCHEMES}
        total_cost = 0.0
        for minibatch in range(num_minibatches):
            lengths = source.draw(samples_per_rank * world_size, rng)
            costs_by_planner: dict[str, list[list[float]]] = {}  # two schemes share the LB-Micro plan
            for scheme in SCHEMES:
                if scheme.balance not in costs_by_planner:
                    plan = scheme.planner(lengths, world_size, max_tokens, cost)
                    costs_by_planner[scheme.balance] = plan_costs(plan, lengths, cost)
                per_rank = costs_by_planner[scheme.balance]
                times[scheme.name] += sync_time(per_rank, scheme.sync)
                counts[scheme.name] += map(len, per_rank)
                if minibatch == 0:
                    timelines.setdefault(world_size, {})[scheme.name] = per_rank
            total_cost += sum(map(sum, per_rank))  # the same for every scheme: they all run every sample once
        results += [
            SchemeResult(
                world_size=world_size,
                scheme=scheme.name,
                sync=scheme.sync,
                bubble_rate=idle_fraction([total_cost / world_size] * world_size, times[scheme.name]),
                speedup=times[BASELINE] / times[scheme.name],
                time=times[scheme.name],
                min_microbatches=min(counts[scheme.name]),
                max_microbatches=max(counts[scheme.name]),
            )
            for scheme in SCHEMES
        ]
    config = {
        "source": source.name,
        "world_sizes": list(world_sizes),
        "samples_per_rank": samples_per_rank,
        "max_tokens": max_tokens,
        "cost": cost if isinstance(cost, str) else repr(cost),
        "num_minibatches": num_minibatches,
        "seed": seed,
    }
    return Simulation(config=config, results=results, timelines=timelines)
