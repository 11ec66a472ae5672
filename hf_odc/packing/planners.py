"""Minibatch planners: which rank runs which samples, grouped into which microbatches.

A plan is ``plan[rank][microbatch] -> sample indices``. Every planner is a pure function of its arguments (no
communication, no unseeded randomness, ties broken by index), so all ranks compute the same plan independently.

* :func:`local_sort`: the usual baseline. Samples are dealt round-robin, each rank runs its own one per microbatch,
  longest first. Nothing is balanced across ranks.
* :func:`lb_micro`: what collective FSDP allows. Every rank must run the same number of microbatches (each one a
  round of per-layer collectives), so the best one can do is balance each microbatch *step* across ranks.
* :func:`lb_mini`: what ODC allows. Ranks meet once per minibatch, so only each rank's *total* has to be balanced;
  ranks may run different numbers of samples and microbatches. Given the ranks' speeds, it balances their predicted
  times instead (total cost / speed), so a slow rank gets less work. The other two take no speeds: they plan for
  per-layer collectives, which run every step at the slowest rank's pace.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ._bin_packing import best_fit_decreasing
from .cost import CostLike, evaluate_costs
from .partition import karmarkar_karp

__all__ = [
    "PLANNERS",
    "MicrobatchCost",
    "Plan",
    "Planner",
    "get_planner",
    "lb_micro",
    "lb_mini",
    "local_sort",
    "max_tokens_for",
]

Plan = list[list[list[int]]]
"""``plan[rank][microbatch]`` is the list of sample indices that rank runs in that microbatch."""

Planner = Callable[[Sequence[int], int, int | None, CostLike], Plan]
"""Every planner's signature: ``(lengths, world_size, max_tokens, cost) -> Plan``. :func:`lb_mini` also takes the
ranks' ``speeds`` (a keyword with a default, so it is still a ``Planner``); callers that have speeds call it by
name."""

MicrobatchCost = float | Callable[[int], float]
"""What :func:`lb_mini` takes as the fixed cost of a microbatch: a constant, or a function of the microbatch's tokens
(a Mixture-of-Experts model's, whose expert term grows with the experts its tokens activate:
:meth:`~hf_odc.packing.CalibratedCost.microbatch`)."""


def local_sort(
    lengths: Sequence[int], world_size: int, max_tokens: int | None = None, cost: CostLike = "tokens"
) -> Plan:
    """Rank ``r`` gets samples ``r, r + world_size, ...``, one per microbatch, longest first.

    ``cost`` is not used (nothing is balanced); ``max_tokens``, if given, is checked: every sample must fit alone.
    """
    lengths = _checked_lengths(lengths)
    _check_world_size(world_size)
    if max_tokens is not None:
        _check_max_tokens(lengths, max_tokens)
    return [
        [[i] for i in sorted(range(rank, len(lengths), world_size), key=lambda i: (-lengths[i], i))]
        for rank in range(world_size)
    ]


def lb_mini(
    lengths: Sequence[int],
    world_size: int,
    max_tokens: int,
    cost: CostLike = "tokens",
    speeds: Sequence[float] | None = None,
    per_microbatch: MicrobatchCost = 0.0,
) -> Plan:
    """LB-Mini: balance the whole minibatch across ranks, each rank's share packed into microbatches.

    Under ODC a rank's time is the sum of its samples' costs plus a fixed cost per microbatch it runs
    (``per_microbatch``, in the cost's unit: the parameter reads, gradient pushes and launches every microbatch pays,
    which a calibrated cost measures), so two things matter: balance, and few microbatches. Two constructions trade
    them differently, and LB-Mini takes whichever plan finishes first under that model (the first on a tie):

    * *share, then pack*: Karmarkar–Karp splits the samples' costs (the microbatch term spread over a full
      microbatch's tokens) across ranks, then each share is split into as few microbatches as ``max_tokens``
      allows (:func:`_pack_share`). The best balance of the samples themselves.
    * *pack, then share*: the whole minibatch is split into the fewest microbatches the cap allows (and a few
      counts above it), balanced by tokens, then Karmarkar–Karp deals whole microbatches to ranks. The fewest
      microbatches; a rank may get any number of them. LB-Micro's plan is among these constructions (equal counts
      per rank), so under the same cost LB-Mini never predicts a slower minibatch than LB-Micro's plan run with ODC.
      Tried up to 16 samples per rank: with more, a rank's share packs about as tight as the whole minibatch, and
      the time these searches take grows with the number of microbatches.

    Within a share, microbatches are balanced by tokens (memory: what lets the fewest fit the cap) and ordered by
    descending cost. Ranks may get different numbers of samples and of microbatches; with fewer samples than ranks,
    some ranks get none.

    With ``speeds`` (``world_size`` positive numbers, rank ``r``'s relative speed: it runs a cost ``c`` in time
    ``c / speeds[r]``) the ranks' predicted times are balanced instead of their costs, so that with ODC's one sync
    per minibatch the faster ranks take on more and all finish together; rank ``r`` gets the share made for
    ``speeds[r]``. Equal speeds give the plan of ``speeds=None``.

    ``per_microbatch`` may be a function of a microbatch's tokens (:data:`MicrobatchCost`): the plans are then
    compared with each microbatch's own fixed cost, and a full microbatch's is what the shares spread.
    """
    lengths = _checked_lengths(lengths)
    _check_world_size(world_size)
    _check_max_tokens(lengths, max_tokens)
    full = per_microbatch(max_tokens) if callable(per_microbatch) else per_microbatch
    if not full >= 0:
        raise ValueError(f"per_microbatch must be a non-negative cost, got {full!r}.")
    costs = evaluate_costs(lengths, cost)
    spread = costs + full * np.asarray(lengths, dtype=np.float64) / max_tokens
    shares = karmarkar_karp(spread, world_size, speeds=speeds)  # with speeds, share r is rank r's
    candidates = [[_pack_share(share, lengths, costs, max_tokens) for share in shares]]
    if len(lengths) > _PACK_FIRST_PER_RANK * world_size:  # a share of many samples packs about as tight
        return candidates[0]
    fewest = max(1, math.ceil(sum(lengths) / max_tokens))
    for count in range(fewest, min(len(lengths), fewest + _PACK_FIRST_COUNTS) + 1):
        microbatches = _by_tokens(lengths, count, max_tokens)
        if microbatches is not None:
            candidates.append(_deal_whole(microbatches, lengths, costs, world_size, per_microbatch, speeds))
    if len(lengths) >= world_size and (in_steps := _in_steps(lengths, spread, world_size, max_tokens)) is not None:
        candidates.append(in_steps)
    return min(candidates, key=lambda plan: _finish(plan, lengths, costs, per_microbatch, speeds))


_PACK_FIRST_COUNTS = 3  # microbatch counts above the fewest that "pack, then share" tries
_PACK_FIRST_PER_RANK = 16  # samples per rank up to which the other constructions are tried


def lb_micro(lengths: Sequence[int], world_size: int, max_tokens: int, cost: CostLike = "tokens") -> Plan:
    """LB-Micro: the same number of microbatches on every rank, each microbatch step balanced across ranks.

    The number of steps is the smallest, starting from the token lower bound, for which the minibatch splits into
    ``steps * world_size`` non-empty microbatches under ``max_tokens``: balanced by cost if that split fits, else by
    tokens (the LPT packer of :func:`lb_mini`), which fits more often: with a superlinear cost, a cost-balanced
    split crowds short samples together; else packed tight by best-fit decreasing (:func:`_best_fit`), which
    finds the packings that balancing misses, e.g. where pairs overflow and some microbatches need three. The
    microbatches are then grouped into steps by descending cost, so each step holds ``world_size`` near-equal ones,
    and within a step the heaviest goes to the rank with the least work so far, which also evens out the ranks'
    totals.
    """
    lengths = _checked_lengths(lengths)
    _check_world_size(world_size)
    _check_max_tokens(lengths, max_tokens)
    if len(lengths) < world_size:
        raise ValueError(
            f"lb_micro needs at least one sample per rank, got {len(lengths)} samples for world_size={world_size}; "
            "pass more samples per minibatch, or use lb_mini, which leaves ranks without samples idle."
        )
    plan = _in_steps(lengths, evaluate_costs(lengths, cost), world_size, max_tokens)
    if plan is None:
        raise ValueError(
            f"lb_micro cannot keep every microbatch under max_tokens={max_tokens} with at most "
            f"{len(lengths) // world_size} non-empty microbatches per rank ({len(lengths)} samples, "
            f"world_size={world_size}); raise max_tokens, use a multiple of world_size samples per minibatch, or use "
            "lb_mini."
        )
    return plan


def _in_steps(lengths: list[int], costs: np.ndarray, world_size: int, max_tokens: int) -> Plan | None:
    """LB-Micro's plan (at least ``world_size`` samples), or ``None`` if no step count fits the cap."""
    fewest_steps = max(1, math.ceil(sum(lengths) / (world_size * max_tokens)))
    for steps in range(fewest_steps, len(lengths) // world_size + 1):
        microbatches = _split(lengths, costs, steps * world_size, max_tokens)
        if microbatches is not None:
            microbatches.sort(key=lambda microbatch: -math.fsum(costs[microbatch]))  # already so if by cost
            return _deal_steps(microbatches, costs, world_size)
    return None


def _split(lengths: list[int], costs: np.ndarray, count: int, max_tokens: int) -> list[list[int]] | None:
    """The minibatch in ``count`` non-empty microbatches under the cap: balanced by cost if that split fits, else by
    tokens (LPT), else packed tight by best-fit decreasing; ``None`` if none fits."""
    microbatches = karmarkar_karp(costs, count)
    if _fits(microbatches, lengths, max_tokens):
        return microbatches
    return _by_tokens(lengths, count, max_tokens)


def _by_tokens(lengths: list[int], count: int, max_tokens: int) -> list[list[int]] | None:
    """The minibatch in ``count`` non-empty microbatches under the cap, balanced by tokens (LPT), else packed tight by
    best-fit decreasing; ``None`` if neither fits."""
    return _lpt(range(len(lengths)), lengths, count, max_tokens) or _best_fit(lengths, count, max_tokens)


def _deal_whole(
    microbatches: list[list[int]],
    lengths: list[int],
    costs: np.ndarray,
    world_size: int,
    per_microbatch: MicrobatchCost,
    speeds: Sequence[float] | None,
) -> Plan:
    """Whole microbatches to ranks, balanced by Karmarkar–Karp on their costs (each with its fixed cost), each rank's
    by descending cost."""
    loads = [float(costs[mb].sum()) + _fixed(per_microbatch, [mb], lengths) for mb in microbatches]
    shares = karmarkar_karp(loads, world_size, speeds=speeds)
    return [sorted((microbatches[i] for i in share), key=lambda mb: -costs[mb].sum()) for share in shares]


def _finish(
    plan: Plan, lengths: list[int], costs: np.ndarray, per_microbatch: MicrobatchCost, speeds: Sequence[float] | None
) -> float:
    """When the last rank finishes ``plan`` under ODC: each rank's samples' costs plus its microbatches' fixed
    costs, over its speed."""
    rates = speeds if speeds is not None else [1.0] * len(plan)
    return max(
        (sum(float(costs[mb].sum()) for mb in rank) + _fixed(per_microbatch, rank, lengths)) / rate
        for rank, rate in zip(plan, rates, strict=True)
    )


def _fixed(per_microbatch: MicrobatchCost, microbatches: list[list[int]], lengths: list[int]) -> float:
    """The fixed costs of ``microbatches`` (sample indices into ``lengths``): a constant's times their number, else
    each one's of its tokens."""
    if not callable(per_microbatch):
        return per_microbatch * len(microbatches)
    return math.fsum(per_microbatch(sum(lengths[i] for i in mb)) for mb in microbatches)


def _pack_share(share: list[int], lengths: list[int], costs: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Fewest token-balanced microbatches under the cap, by descending cost.

    Longest-processing-time-first: samples, longest first, each go to the microbatch with the fewest tokens; if
    even that one would overflow the cap, retry with one more microbatch (one sample each always fits, so the
    search ends). With tens of samples per rank LPT is within a few percent of the best balance and costs
    microseconds, which matters because every rank is packed on every rank.
    """
    if not share:
        return []
    for count in range(math.ceil(sum(lengths[i] for i in share) / max_tokens), len(share) + 1):
        microbatches = _lpt(share, lengths, count, max_tokens)
        if microbatches is not None:
            return sorted(microbatches, key=lambda mb: -costs[mb].sum())
    raise AssertionError("unreachable: one sample per microbatch always fits the cap")


def _lpt(samples: Iterable[int], lengths: list[int], count: int, max_tokens: int) -> list[list[int]] | None:
    """``count`` microbatches (indices ascending), longest sample first to the one with the fewest tokens; ``None``
    if a sample would overflow even that one. Given at least ``count`` samples, none is left empty."""
    loads = [(0, slot) for slot in range(count)]  # a heap of (tokens, microbatch), lightest first
    microbatches: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(samples, key=lambda i: (-lengths[i], i)):
        tokens, slot = loads[0]
        if tokens + lengths[i] > max_tokens:
            return None
        heapq.heapreplace(loads, (tokens + lengths[i], slot))
        microbatches[slot].append(i)
    return [sorted(microbatch) for microbatch in microbatches]


def _best_fit(lengths: list[int], count: int, max_tokens: int) -> list[list[int]] | None:
    """Best-fit decreasing into at most ``count`` microbatches, ``None`` if they do not suffice; any left empty
    then each take the shortest sample of the one holding the most (leaving keeps that one under the cap, and with
    at least ``count`` samples a donor with two or more always exists). Indices ascending in each."""
    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    microbatches, overflow = best_fit_decreasing(longest_first, lengths, count, max_tokens)
    if overflow:
        return None
    # A heap of the filled microbatches, most samples first.
    donors = [(-len(microbatch), slot) for slot, microbatch in enumerate(microbatches) if microbatch]
    heapq.heapify(donors)
    for empty in (microbatch for microbatch in microbatches if not microbatch):
        size, slot = heapq.heappop(donors)
        empty.append(microbatches[slot].pop())  # its shortest: samples went in longest first
        heapq.heappush(donors, (size + 1, slot))
    return [sorted(microbatch) for microbatch in microbatches]


def _fits(microbatches: list[list[int]], lengths: list[int], max_tokens: int) -> bool:
    return all(sum(lengths[i] for i in microbatch) <= max_tokens for microbatch in microbatches)


def _deal_steps(microbatches: list[list[int]], costs: np.ndarray, world_size: int) -> Plan:
    """Cut microbatches (sorted by descending cost) into steps of ``world_size``; in each step, heaviest first to
    the rank with the least total so far (ties to the lower rank)."""
    plan: Plan = [[] for _ in range(world_size)]
    totals = [0.0] * world_size
    for start in range(0, len(microbatches), world_size):
        lightest_first = sorted(range(world_size), key=lambda rank: (totals[rank], rank))
        for rank, microbatch in zip(lightest_first, microbatches[start : start + world_size], strict=True):
            plan[rank].append(microbatch)
            totals[rank] += float(costs[microbatch].sum())
    return plan


def _checked_lengths(lengths: Sequence[int]) -> list[int]:
    checked = []
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not float(length).is_integer() or length <= 0:
            raise ValueError(
                f"Sample {index} has length {length!r}; lengths must be positive integers (token counts). "
                "Drop empty samples before planning."
            )
        checked.append(int(length))
    return checked


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (the number of ranks), got {world_size!r}.")


class CapacityError(ValueError):
    """A sample longer than a microbatch (or a sequence-parallel group's microbatches) holds: the planner never
    truncates. Every rank plans the same global minibatch, so every rank meets it at once: a trainer can end the run
    with its one line instead of a traceback per process."""


def _check_max_tokens(lengths: list[int], max_tokens: int) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer (tokens per microbatch), got {max_tokens!r}.")
    too_long = [index for index, length in enumerate(lengths) if length > max_tokens]
    if too_long:
        index = too_long[0]
        raise CapacityError(
            f"Sample {index} has {lengths[index]} tokens, more than max_tokens={max_tokens} "
            f"({len(too_long)} sample(s) exceed it, the longest has {max(lengths)}); raise max_tokens to at least "
            f"{max(lengths)} or truncate or drop those samples first: the planner never truncates."
        )


PLANNERS: dict[str, Planner] = {"local-sort": local_sort, "lb-micro": lb_micro, "lb-mini": lb_mini}
"""The planners by the name the trainers' ``balance``, the simulator and the CLI use."""


def get_planner(name: str) -> Planner:
    """The planner called ``name`` (see :data:`PLANNERS`); a clear error naming the choices otherwise."""
    if name not in PLANNERS:
        raise ValueError(f"Unknown planner {name!r}: use one of {sorted(PLANNERS)}.")
    return PLANNERS[name]


def max_tokens_for(longest: int, packing_ratio: float = 1.0) -> int:
    """Tokens one microbatch may hold when it is ``packing_ratio`` times the longest sample (``1.0`` fits exactly
    one longest sample)."""
    if not packing_ratio > 0:
        raise ValueError(f"packing_ratio must be > 0, got {packing_ratio}.")
    return max(1, int(packing_ratio * longest))
