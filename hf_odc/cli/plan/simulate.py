"""Predict what ODC + LB-Mini buys over collective FSDP for a length distribution: the logic of ``hf-odc plan``.

For each world size, minibatches of ``samples_per_rank * world_size`` lengths are drawn from a source and planned
by each scheme; the schemes' predicted times (:func:`~hf_odc.packing.bubble.sync_time`) are summed over the
minibatches. Bubble rates and speedups are ratios of those sums, so long minibatches weigh more, as in training.

With a :class:`CrossHost` layout, world sizes that span several whole hosts get two more rows, hybrid ODC and its
collective counterpart HSDP: the compute of ODC+LB-Mini and Collective+LB-Micro plus the one cross-host all-reduce
of the gradient shards that both run per minibatch.

With sequence parallelism (``sp_size`` above 1) documents of up to ``sp_size`` microbatches are planned too, as
training runs them (:mod:`hf_odc.packing.sequence_parallel`): ODC+LB-Mini runs each document longer than a microbatch
as a group microbatch of ``sp_size`` ranks and every other one on a single rank; the other schemes, whose ranks run
microbatches in step, split every microbatch over a group, as Accelerate's Ulysses does (the groups plan as ranks
with ``sp_size`` times the cap). A split document costs each rank of its group its share plus the all-to-alls
(:func:`~hf_odc.packing.split_costs`). For the first minibatch of each world size the simulation also keeps where
ODC+LB-Mini placed the split documents (:class:`GroupPlacement`): which group's ranks run them, and every rank's load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ...packing.bubble import Sync, idle_fraction, plan_costs, sync_time
from ...packing.cost import AttentionCost, CalibratedCost, CostLike, resolve_cost
from ...packing.schemes import BASELINE, SCHEMES, Scheme
from ...packing.sequence_parallel import check_group_size, lb_mini_groups, split_costs
from .sources import LengthSource

__all__ = ["HYBRID_SCHEMES", "CrossHost", "GroupPlacement", "SchemeResult", "Simulation", "simulate"]

HYBRID_SCHEMES: dict[str, str] = {"HSDP+LB-Micro": "Collective+LB-Micro", "Hybrid ODC+LB-Mini": "ODC+LB-Mini"}
"""Each cross-host row and the compute-only row whose plans and time it extends by the cross-host all-reduce. Both
defer that all-reduce to the minibatch's end (HSDP's trainers to the last microbatch), so it costs them the same."""

_DEFAULT_GBPS = 50.0  # one 400 Gb/s NIC per GPU
_DEFAULT_TFLOPS = 200.0


@dataclass(frozen=True)
class CrossHost:
    """A job spread over hosts of ``gpus_per_host`` GPUs, parameters sharded within a host and replicated across.

    Per minibatch each GPU all-reduces its shard of the gradient (``gradient_bytes / gpus_per_host``) with its
    replicas on the other ``H - 1`` hosts, a ring over ``bandwidth`` bytes/s per GPU. ``seconds_per_unit`` turns
    that time into the cost model's units, so that it adds to the planned compute.
    """

    gpus_per_host: int
    gradient_bytes: float
    """The whole model's gradient, as all-reduced (fp32: 4 bytes per parameter)."""
    bandwidth: float
    """Cross-host bytes/s each GPU gets."""
    seconds_per_unit: float

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise ValueError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}.")
        for name in ("gradient_bytes", "bandwidth", "seconds_per_unit"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}.")

    @classmethod
    def for_cost(
        cls,
        cost: CostLike,
        gpus_per_host: int,
        cross_host_gbps: float | None = None,
        params: float | None = None,
        tflops: float | None = None,
    ) -> CrossHost:
        """The layout as ``hf-odc plan``'s options give it (``None``: the default), for ``cost``, which sets the
        time scale. ``cross_host_gbps`` is in GB/s per GPU (default 50, one 400 Gb/s NIC per GPU).

        A :class:`CalibratedCost` is in seconds already but knows nothing of the model's size, so it needs
        ``params``. An :class:`AttentionCost` counts forward FLOPs: a training step's 3x that runs at ``tflops``
        (default 200) TFLOP/s, and ``linear / 2`` (2 FLOPs per weight and token) is the parameter count unless
        ``params`` says otherwise. Token counts have no time scale to weigh an all-reduce against.
        """
        model = resolve_cost(cost)
        if isinstance(model, CalibratedCost):
            if params is None:
                raise ValueError(
                    "--params is required with --calibration: a calibration times the model, not its size."
                )
            if tflops is not None:
                raise ValueError("--tflops does not apply to --calibration, whose costs are seconds already.")
            seconds_per_unit = 1.0
        elif isinstance(model, AttentionCost):
            params = model.linear / 2 if params is None else params
            seconds_per_unit = 3.0 / ((_DEFAULT_TFLOPS if tflops is None else tflops) * 1e12)
        else:
            raise ValueError(
                f"--gpus-per-host weighs the cross-host all-reduce against compute time, and cost={cost!r} has no "
                "time scale: give --calibration FILE (seconds) or an attention cost (--cost attention or "
                "--model-config) with --tflops."
            )
        gbps = _DEFAULT_GBPS if cross_host_gbps is None else cross_host_gbps
        return cls(gpus_per_host, 4.0 * params, gbps * 1e9, seconds_per_unit)

    def spans_hosts(self, world_size: int) -> bool:
        """Whether ``world_size`` ranks fill two or more whole hosts: only then is there a cross-host all-reduce."""
        return world_size % self.gpus_per_host == 0 and world_size > self.gpus_per_host

    def all_reduce_time(self, world_size: int) -> float:
        """One ring all-reduce of each GPU's gradient shard across the ``H = world_size / gpus_per_host`` hosts:
        ``2 * (H - 1) / H * shard_bytes / bandwidth`` seconds, in cost units."""
        if world_size % self.gpus_per_host:
            raise ValueError(f"world_size={world_size} is not a multiple of gpus_per_host={self.gpus_per_host}.")
        hosts = world_size // self.gpus_per_host
        shard_bytes = self.gradient_bytes / self.gpus_per_host
        return 2 * (hosts - 1) / hosts * shard_bytes / self.bandwidth / self.seconds_per_unit


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
class GroupPlacement:
    """One sequence-parallel group in ODC+LB-Mini's plan of a minibatch: the documents longer than the cap that its
    ranks run together, and what each of its ranks runs in all (its share of those plus its own microbatches)."""

    ranks: tuple[int, ...]
    """The group's ranks (consecutive)."""
    documents: tuple[int, ...]
    """The lengths of its group microbatches' documents, in the order its ranks run them (first in the minibatch)."""
    shared_cost: float
    """What the group microbatches cost each of its ranks (its share of every document plus the all-to-alls)."""
    loads: tuple[float, ...]
    """Each rank's whole planned cost in the minibatch, in :attr:`ranks`' order."""


@dataclass(frozen=True)
class Simulation:
    config: dict[str, object]
    results: list[SchemeResult]
    timelines: dict[int, dict[str, list[list[float]]]] = field(repr=False)
    """``timelines[world_size][scheme][rank]``: microbatch costs of the first minibatch, for plotting."""
    groups: dict[int, list[GroupPlacement]] = field(default_factory=dict)
    """``groups[world_size]``: with sequence parallelism, ODC+LB-Mini's groups in the first minibatch (empty
    without)."""

    def to_dict(self) -> dict[str, object]:
        result: dict[str, object] = {"config": self.config, "results": [asdict(result) for result in self.results]}
        if self.groups:
            result["groups"] = {str(size): [asdict(group) for group in groups] for size, groups in self.groups.items()}
        return result


def simulate(
    source: LengthSource,
    world_sizes: Sequence[int],
    samples_per_rank: int,
    max_tokens: int,
    cost: CostLike = "attention",
    num_minibatches: int = 10,
    seed: int = 0,
    cross_host: CrossHost | None = None,
    sp_size: int = 1,
) -> Simulation:
    """Plan ``num_minibatches`` minibatches per world size with every scheme and compare predicted times.

    Minibatches for world size ``w`` come from ``numpy.random.default_rng([seed, w])``, so results are
    reproducible and adding a world size does not change the others. With ``cross_host``, each world size that
    spans several hosts also gets the :data:`HYBRID_SCHEMES` rows: their compute rows' plans and times plus one
    all-reduce per minibatch, counted as idle time; their speedups are over the compute-only baseline too. With
    ``sp_size`` above 1 (a divisor of every world size), documents longer than ``max_tokens`` are split over groups
    of that many ranks (see the module's docstring).
    """
    if samples_per_rank < 1 or num_minibatches < 1:
        raise ValueError(
            f"samples_per_rank and num_minibatches must be >= 1, got {samples_per_rank} and {num_minibatches}."
        )
    for world_size in world_sizes:
        check_group_size(world_size, sp_size)
    results: list[SchemeResult] = []
    timelines: dict[int, dict[str, list[list[float]]]] = {}
    groups: dict[int, list[GroupPlacement]] = {}
    for world_size in world_sizes:
        rng = np.random.default_rng([seed, world_size])
        times = dict.fromkeys((scheme.name for scheme in SCHEMES), 0.0)
        work = dict.fromkeys(times, 0.0)
        counts: dict[str, list[int]] = {scheme.name: [] for scheme in SCHEMES}
        for minibatch in range(num_minibatches):
            lengths = source.draw(samples_per_rank * world_size, rng)
            if minibatch == 0 and sp_size > 1:
                groups[world_size] = _group_placements(lengths, world_size, max_tokens, cost, sp_size)
            costs_by_planner: dict[str, list[list[float]]] = {}  # two schemes share the LB-Micro plan
            for scheme in SCHEMES:
                if scheme.balance not in costs_by_planner:
                    costs_by_planner[scheme.balance] = _planned_costs(
                        scheme, lengths, world_size, max_tokens, cost, sp_size
                    )
                per_rank = costs_by_planner[scheme.balance]
                times[scheme.name] += sync_time(per_rank, scheme.sync)
                work[scheme.name] += sum(map(sum, per_rank))  # split documents cost their all-to-alls besides
                counts[scheme.name] += map(len, per_rank)
                if minibatch == 0:
                    timelines.setdefault(world_size, {})[scheme.name] = per_rank
        syncs = {scheme.name: scheme.sync for scheme in SCHEMES}
        if cross_host is not None and cross_host.spans_hosts(world_size):
            all_reduces = num_minibatches * cross_host.all_reduce_time(world_size)
            for hybrid, compute in HYBRID_SCHEMES.items():
                times[hybrid] = times[compute] + all_reduces
                work[hybrid] = work[compute]
                counts[hybrid] = counts[compute]
                syncs[hybrid] = syncs[compute]
        results += [
            SchemeResult(
                world_size=world_size,
                scheme=name,
                sync=syncs[name],
                bubble_rate=idle_fraction([work[name] / world_size] * world_size, time),
                speedup=times[BASELINE] / time,
                time=time,
                min_microbatches=min(counts[name]),
                max_microbatches=max(counts[name]),
            )
            for name, time in times.items()
        ]
    config: dict[str, object] = {
        "source": source.name,
        "world_sizes": list(world_sizes),
        "samples_per_rank": samples_per_rank,
        "max_tokens": max_tokens,
        "cost": cost if isinstance(cost, str) else repr(cost),
        "num_minibatches": num_minibatches,
        "seed": seed,
    }
    if sp_size > 1:
        config["sp_size"] = sp_size
    if cross_host is not None:
        config["cross_host"] = asdict(cross_host)
    return Simulation(config=config, results=results, timelines=timelines, groups=groups)


def _planned_costs(
    scheme: Scheme, lengths: list[int], world_size: int, max_tokens: int, cost: CostLike, sp_size: int
) -> list[list[float]]:
    """``[rank][microbatch]`` -> cost: the minibatch as ``scheme`` plans it, with groups of ``sp_size`` ranks."""
    if sp_size == 1:
        return plan_costs(scheme.planner(lengths, world_size, max_tokens, cost), lengths, cost)
    if scheme.balance == "lb-mini":
        return lb_mini_groups(lengths, world_size, max_tokens, cost, group_size=sp_size).rank_costs(lengths, cost)
    plan = scheme.planner(lengths, world_size // sp_size, max_tokens * sp_size, cost)  # every microbatch split
    split = split_costs(lengths, sp_size, cost)
    return [[float(split[microbatch].sum()) for microbatch in group] for group in plan for _ in range(sp_size)]


def _group_placements(
    lengths: list[int], world_size: int, max_tokens: int, cost: CostLike, sp_size: int
) -> list[GroupPlacement]:
    """ODC+LB-Mini's groups in a minibatch's plan (:func:`~hf_odc.packing.lb_mini_groups`), as
    one :class:`GroupPlacement` per group."""
    plan = lb_mini_groups(lengths, world_size, max_tokens, cost, group_size=sp_size)
    costs = plan.rank_costs(lengths, cost)  # each rank's group microbatches first
    placements = []
    for start in range(0, world_size, sp_size):
        shared = plan.shared(start)
        placements.append(
            GroupPlacement(
                ranks=tuple(range(start, start + sp_size)),
                documents=tuple(lengths[i] for i in shared),
                shared_cost=float(sum(costs[start][: len(shared)])),
                loads=tuple(float(sum(costs[rank])) for rank in range(start, start + sp_size)),
            )
        )
    return placements
