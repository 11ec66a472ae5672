"""Calibrating the cost model from measured microbatch times, with a speed per rank.

Every microbatch a rank runs is a sample: its features (one microbatch, its sequences, its tokens, the sum of its
sequences' squared lengths and, for a Mixture-of-Experts model, the (layer, expert) pairs its router activated) and
its device time. The model is::

    seconds = (per_microbatch + per_sequence * sequences + linear * tokens + quadratic * sum_sq
               + per_expert * active_experts) / speed[rank]

with non-negative coefficients (a :class:`~hf_odc.packing.CalibratedCost`) and speeds averaging 1. Where a FLOP
count balances the work, this balances what the ranks measure: the fixed costs no per-token formula sees, the real
ratio of attention's kernels to the matmuls', and a rank that runs slower than the others (a throttled GPU, a noisy
neighbour, an older card), which LB-Mini then gives less (``lb_mini(..., speeds=...)``).

The fit minimises the squared *relative* error (long and short microbatches count alike), drops outliers (the first
steps' compilation, a hiccup: more than ``_OUTLIER_MADS`` median absolute deviations off) and alternates between the
coefficients and the speeds, which are each rank's predicted over measured seconds on its recent samples, until the
speeds settle. A rank's speed is then kept only as far from the others' as it stands out of the measurement noise
pooled over every rank's samples (:func:`_within_noise`): a rank that runs one or two short microbatches a step (the
short-row trainers) has too few samples to show its own noise, and their noise, taken for a speed, would move work
off a rank that is not slower; the noise of all ranks' samples together, with a prior where they are too few, still
tells a real straggler, many of its standard errors off, at the first fit.

A plan is made before its microbatches run, so the expert term is planned with a prediction of the active pairs from
the microbatch's tokens, whose one parameter (``expert_scale``, see :class:`~hf_odc.packing.CalibratedCost`) is
fitted to the same samples' measured counts (:func:`_expert_scale`). A dense model's samples have no active pairs:
its ``per_expert`` is zero and its fit is the four-term one.

Every rank fits the same gathered samples and must reach bit-identical numbers, or the ranks would plan differently
and drop or duplicate samples. So nothing here depends on summation order or on the machine: sums are ``math.fsum``
(exactly rounded), the small linear systems are solved in Python floats, and numpy only does element-wise
arithmetic and medians, which are exact per element.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cost import CalibratedCost

__all__ = ["FEATURES", "Calibration", "Calibrator", "microbatch_features"]

FEATURES = ("per_microbatch", "per_sequence", "linear", "quadratic", "per_expert")
"""The coefficients, in the order of :func:`microbatch_features`' columns."""

_FORMAT = "hf_odc.calibration/1"
_CURVE = ("expert_slots", "expert_scale")  # the expert term's prediction of active pairs, saved beside the features
_ROUNDS = 30  # most alternations of coefficients, speeds and outlier trimming
_CONVERGED = 1e-6  # ... stopped once no speed moves by more than this share and the kept samples stay
_OUTLIER_MADS = 4.0  # a sample this many scaled median absolute deviations off the median relative error is dropped
_NOISE_FLOOR = 0.02  # ... but never one within 2% of it
_PRIOR_NOISE = 0.04  # a microbatch's relative time noise assumed before residuals show it (_within_noise)
_PRIOR_WEIGHT = 2.0  # ... counted as this many samples' residuals
_SHRINK_SES = 3.0  # a rank's speed deviation within this many standard errors of the noise is dropped
_SINGULAR = 1e-12  # a pivot this small (relative to the diagonal) makes a subset of the coefficients unidentifiable


def microbatch_features(
    lengths: Sequence[int], active_experts: float = 0.0
) -> tuple[float, float, float, float, float]:
    """The features of one microbatch of sequences of ``lengths`` whose router activated ``active_experts`` (layer,
    expert) pairs (0: a dense model): ``(1, sequences, tokens, sum of squares, active_experts)``."""
    return (1.0, float(len(lengths)), float(sum(lengths)), float(sum(length * length for length in lengths)),
            float(active_experts))  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """A fitted cost model and each rank's speed.

    Attributes:
        cost: seconds of a microbatch on a rank of speed 1 (see :class:`~hf_odc.packing.CalibratedCost`).
        speeds: per rank, its work per second relative to the mean (a rank at 0.5 takes twice as long).
        samples: microbatches the fit kept (outliers dropped).
        error: median absolute relative error of the kept samples' predicted times.
    """

    cost: CalibratedCost
    speeds: tuple[float, ...]
    samples: int = 0
    error: float = 0.0

    @classmethod
    def fit(
        cls,
        features: Sequence[Sequence[float]],
        seconds: Sequence[float],
        ranks: Sequence[int] | None = None,
        *,
        world_size: int = 1,
        recent: Sequence[bool] | None = None,
        speeds: Sequence[float] | None = None,
        expert_slots: int = 0,
    ) -> Calibration:
        """Fit measured microbatches: ``features`` (rows of :func:`microbatch_features`), their ``seconds`` and the
        ``ranks`` that ran them (default: all rank 0 of ``world_size``). ``expert_slots``: a MoE model's (layer,
        expert) pairs, the most a microbatch can activate (0: dense; see :class:`~hf_odc.packing.CalibratedCost`).

        Speeds are estimated from the ``recent`` samples only (default: all), so that a rank that slows down or
        recovers is followed without forgetting the coefficients; a rank with no recent sample keeps its starting
        speed from ``speeds`` (default 1). A rank's speed differs from the others' only by what stands out of the
        noise of all ranks' samples (see the module's docstring): equal devices with a few microbatches each stay at
        1, and with one microbatch a rank, where no residual shows the noise, only a gap well beyond the prior noise
        (a slowed or older device) is kept.
        """
        x = np.asarray(features, dtype=np.float64)
        t = np.asarray(seconds, dtype=np.float64)
        r = np.zeros(len(t), dtype=np.int64) if ranks is None else np.asarray(ranks, dtype=np.int64)
        if x.ndim != 2 or x.shape[1] != len(FEATURES) or not (len(x) == len(t) == len(r)):
            raise ValueError(
                f"Calibration.fit needs one row of {len(FEATURES)} features (microbatch_features), one time and one "
                f"rank per microbatch; got features of shape {x.shape}, {len(t)} times and {len(r)} ranks."
            )
        if not (np.isfinite(x).all() and np.isfinite(t).all() and (x >= 0).all() and (t > 0).all()):
            raise ValueError("Calibration.fit needs finite, non-negative features and positive times.")
        used = int((x > 0).any(axis=0).sum())  # a dense model's samples leave the expert column at zero
        if len(t) < max(used, len(FEATURES) - 1):
            raise ValueError(f"Calibration.fit needs at least {max(used, len(FEATURES) - 1)} measured microbatches, "
                             f"got {len(t)}.")  # fmt: skip
        if expert_slots < 0 or (x[:, -1] > expert_slots).any():
            raise ValueError(f"No microbatch can activate more than expert_slots={expert_slots} (layer, expert) pairs.")
        if world_size < 1 or (r < 0).any() or (r >= world_size).any():
            raise ValueError(f"Every rank must be in [0, world_size={world_size}).")
        recent_rows = np.ones(len(t), dtype=bool) if recent is None else np.asarray(recent, dtype=bool)
        rank_speeds = np.ones(world_size) if speeds is None else np.asarray(speeds, dtype=np.float64)
        if rank_speeds.shape != (world_size,) or not (rank_speeds > 0).all():
            raise ValueError(f"speeds must hold {world_size} positive values, got {list(rank_speeds)}.")
        keep = np.ones(len(t), dtype=bool)
        for _ in range(_ROUNDS):
            coefficients = _nnls(x[keep], t[keep] * rank_speeds[r[keep]])
            predicted = _predict(x, coefficients)  # seconds at speed 1
            settled = rank_speeds
            rank_speeds = _speeds(predicted, t, r, keep & recent_rows, rank_speeds)
            moved = float(np.max(np.abs(rank_speeds / settled - 1.0)))
            relative = predicted / (t * rank_speeds[r]) - 1.0
            centre = float(np.median(relative[keep]))
            spread = float(np.median(np.abs(relative[keep] - centre)))
            kept = np.abs(relative - centre) <= max(_OUTLIER_MADS * 1.4826 * spread, _NOISE_FLOOR)
            if kept.sum() < used or ((kept == keep).all() and moved <= _CONVERGED):
                break
            keep = kept
        coefficients = _nnls(x[keep], t[keep] * rank_speeds[r[keep]])
        rank_speeds = _within_noise(x, coefficients, t, r, keep, keep & recent_rows, rank_speeds)
        coefficients = _nnls(x[keep], t[keep] * rank_speeds[r[keep]])
        relative = _predict(x, coefficients) / (t * rank_speeds[r]) - 1.0
        scale = _expert_scale(x[:, 2], x[:, -1], expert_slots)
        cost = CalibratedCost(
            **dict(zip(FEATURES, coefficients, strict=True)), expert_slots=expert_slots, expert_scale=scale
        )
        error = float(np.median(np.abs(relative[keep])))
        return cls(cost=cost, speeds=tuple(rank_speeds.tolist()), samples=int(keep.sum()), error=error)

    # -- files ------------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        cost = {name: getattr(self.cost, name) for name in (*FEATURES, *_CURVE)}
        return {"format": _FORMAT, "cost": cost, "speeds": list(self.speeds), "samples": self.samples,
                "error": self.error}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(
                f"Not an hf_odc calibration (expected a JSON object with format {_FORMAT!r}, as the ODC trainers "
                "write to output_dir/odc_calibration.json)."
            )
        return cls(
            cost=CalibratedCost(
                **{name: float(data["cost"][name]) for name in FEATURES if name != "per_expert"},
                per_expert=float(data["cost"].get("per_expert", 0.0)),  # absent in files from before the MoE term
                expert_slots=int(data["cost"].get("expert_slots", 0)),
                expert_scale=float(data["cost"].get("expert_scale", 0.0)),
            ),
            speeds=tuple(float(s) for s in data["speeds"]),
            samples=int(data.get("samples", 0)),
            error=float(data.get("error", 0.0)),
        )

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        return cls.from_dict(json.loads(Path(path).read_text()))


class Calibrator:
    """The samples of a run's last ``window`` steps, refitted after every step.

    Every rank feeds it the same gathered samples (:meth:`record`) and so holds the same :attr:`calibration`. The
    first ``warmup`` steps are not recorded (compilation, allocator growth); no fit is made before ``min_steps`` steps
    and ``min_samples`` microbatches. Speeds follow the last ``speed_window`` steps, each rank's kept only as far
    from the others' as it stands out of the noise pooled over all ranks' samples (:meth:`Calibration.fit`), so that
    a rank's noise on one or two microbatches a step is not planned in as a speed while a straggler is caught at the
    first fit. A refit is a few milliseconds
    (exact sums over at most ``window`` steps' microbatches). ``frozen`` keeps ``initial`` as it is.

    Args:
        world_size: the number of ranks.
        initial: the calibration to start from (e.g. :meth:`Calibration.load` of an earlier run's file); its speeds
            are kept only if it has one per rank.
        expert_slots: a Mixture-of-Experts model's (layer, expert) pairs (0: a dense model); its steps are then
            recorded with each microbatch's active pairs, and the cost gains the expert term.
    """

    def __init__(
        self,
        world_size: int,
        *,
        initial: Calibration | None = None,
        frozen: bool = False,
        window: int = 16,
        speed_window: int = 4,
        warmup: int = 1,
        min_steps: int = 2,
        min_samples: int = 8,
        expert_slots: int = 0,
    ):
        if frozen and initial is None:
            raise ValueError("A frozen calibration needs an initial one to keep (e.g. Calibration.load(path)).")
        if not 1 <= speed_window <= window:
            raise ValueError(f"Need 1 <= speed_window <= window, got speed_window={speed_window}, window={window}.")
        self.world_size, self.frozen, self.warmup = world_size, frozen, warmup
        self.min_steps, self.min_samples, self.speed_window = min_steps, max(min_samples, len(FEATURES)), speed_window
        if initial is not None and len(initial.speeds) != world_size:
            initial = Calibration(initial.cost, (1.0,) * world_size, initial.samples, initial.error)
        self.calibration = initial
        self.expert_slots = expert_slots
        self.steps_seen = 0
        # Per recorded step: (features, seconds, ranks) of its microbatches.
        self._steps: deque[tuple[list[tuple[float, ...]], list[float], list[int]]] = deque(maxlen=window)

    def record(
        self,
        microbatch_lengths: Sequence[Sequence[Sequence[int]]],
        seconds: Sequence[Sequence[float]],
        active_experts: Sequence[Sequence[float]] | None = None,
    ) -> bool:
        """Add one step: ``microbatch_lengths[rank][m]`` are the sequence lengths of that rank's microbatch ``m``,
        ``seconds[rank][m]`` its device time and ``active_experts[rank][m]`` the (layer, expert) pairs its router
        activated (every rank's, gathered; needed with ``expert_slots``, else none). Returns whether the calibration
        changed."""
        if len(microbatch_lengths) != self.world_size or len(seconds) != self.world_size:
            raise ValueError(f"record needs every one of the {self.world_size} ranks' microbatches and times.")
        if (active_experts is None) != (self.expert_slots == 0):
            raise ValueError(
                "record needs each microbatch's active experts for a Calibrator with expert_slots, and none without."
            )
        if active_experts is None:
            active_experts = [[0.0] * len(durations) for durations in seconds]
        self.steps_seen += 1
        if self.frozen or self.steps_seen <= self.warmup:
            return False
        features, times, ranks = [], [], []
        for rank, (lengths, durations, active) in enumerate(
            zip(microbatch_lengths, seconds, active_experts, strict=True)
        ):
            if not len(lengths) == len(durations) == len(active):
                raise ValueError(
                    f"Rank {rank} has {len(lengths)} microbatches but {len(durations)} times and {len(active)} expert "
                    "counts."
                )
            for microbatch, duration, experts in zip(lengths, durations, active, strict=True):
                if microbatch and duration > 0:
                    features.append(microbatch_features(microbatch, experts))
                    times.append(float(duration))
                    ranks.append(rank)
        self._steps.append((features, times, ranks))
        rows = sum(len(step[1]) for step in self._steps)
        if len(self._steps) < self.min_steps or rows < self.min_samples:
            return False
        first_recent = len(self._steps) - self.speed_window
        recent = [age >= first_recent for age, step in enumerate(self._steps) for _ in step[1]]
        self.calibration = Calibration.fit(
            [row for step in self._steps for row in step[0]],
            [time for step in self._steps for time in step[1]],
            [rank for step in self._steps for rank in step[2]],
            world_size=self.world_size,
            recent=recent,
            speeds=self.calibration.speeds if self.calibration is not None else None,
            expert_slots=self.expert_slots,
        )
        return True


def _expert_scale(tokens: np.ndarray, active: np.ndarray, slots: int) -> float:
    """The ``expert_scale`` of :meth:`CalibratedCost.active_experts` for microbatches of ``tokens`` that activated
    ``active`` of ``slots`` (layer, expert) pairs: the median of each microbatch's own scale (the one its count
    solves), a microbatch that activated every pair counting as one that left half a pair idle (the most its count
    says). 0 (every microbatch activates every pair) for a dense model or where every count is full, as it is for
    microbatches of many more tokens than experts."""
    seen = active > 0
    if slots == 0 or not (active[seen] < slots).any():
        return 0.0
    idle = np.maximum(slots - active[seen], 0.5)  # the pairs left idle, at least half a pair
    # math.log, not numpy's: its vectorised log may round differently on another CPU, and every rank must agree
    return float(
        np.median([t / math.log(slots / i) for t, i in zip(tokens[seen].tolist(), idle.tolist(), strict=True)])
    )


def _predict(x: np.ndarray, coefficients: Sequence[float]) -> np.ndarray:
    """``x @ coefficients`` column by column: element-wise products and sums, no BLAS reduction order."""
    total = np.zeros(len(x))
    for column, coefficient in enumerate(coefficients):
        total = total + x[:, column] * coefficient
    return total


def _speeds(
    predicted: np.ndarray, seconds: np.ndarray, ranks: np.ndarray, rows: np.ndarray, previous: np.ndarray
) -> np.ndarray:
    """Per rank, its predicted over its measured seconds on ``rows`` (the previous speed where it has none),
    normalised to average 1."""
    speeds = previous.copy()
    for rank in range(len(previous)):
        mine = rows & (ranks == rank)
        if mine.any():
            speeds[rank] = _exact_sum(predicted[mine]) / _exact_sum(seconds[mine])
    return speeds * (len(speeds) / _exact_sum(speeds))


def _within_noise(
    x: np.ndarray,
    coefficients: Sequence[float],
    seconds: np.ndarray,
    ranks: np.ndarray,
    keep: np.ndarray,
    rows: np.ndarray,
    speeds: np.ndarray,
) -> np.ndarray:
    """``speeds`` (each rank's own ratio on ``rows``, :func:`_speeds`) with each rank's log-speed deviation from the
    ranks' median kept only as far as it stands out of the measurement noise pooled over every rank's samples,
    normalised to average 1.

    The noise ``sigma`` of a microbatch's log-time is the residual variance of ``rows`` against the model at each
    rank's own speed (so that a slow rank's slowness is not counted as noise), over their degrees of freedom (less
    one per rank's speed and the coefficients' share of them), with the prior :data:`_PRIOR_NOISE` counted as
    :data:`_PRIOR_WEIGHT` residuals: with one microbatch a rank, or as many samples as parameters, residuals cannot
    tell noise from speed and the prior alone sets ``sigma``. A deviation's standard error ``se`` is ``sigma`` times
    that of a rank's log-speed less the ranks' mean in the fit linearised about its solution (:func:`_speed_error`):
    it grows where the coefficients could explain the same times, as when one rank ran the small microbatches. The
    deviation ``d`` is kept as ``d * max(0, 1 - (_SHRINK_SES * se / d) ** 4)``: none of it within :data:`_SHRINK_SES`
    standard errors, and nearly whole beyond twice that (the fourth power, not a garrote's square, so that a straggler
    on noisy times is not planned as less slow than it is). Where the samples cannot tell the speeds from the
    coefficients at all (a singular system), every rank gets the median."""
    measured = [rank for rank in range(len(speeds)) if (rows & (ranks == rank)).any()]
    if len(measured) < 2:
        return speeds
    predicted = _predict(x, coefficients)
    residuals = [math.log(p / (t * speeds[rank])) for p, t, rank in
                 zip(predicted[rows].tolist(), seconds[rows].tolist(), ranks[rows].tolist(), strict=True)]  # fmt: skip
    active = [column for column, coefficient in enumerate(coefficients) if coefficient > 0]
    parameters = len(measured) - 1 + len(active) * len(residuals) / int(keep.sum())
    degrees = max(0.0, len(residuals) - parameters)
    variance = (_PRIOR_WEIGHT * _PRIOR_NOISE**2 + math.fsum(e * e for e in residuals)) / (_PRIOR_WEIGHT + degrees)
    logs = [math.log(speeds[rank]) for rank in measured]
    centre = float(np.median(logs))
    gradients = x[:, active] * np.asarray(coefficients)[active] / predicted[:, None]
    errors = _speed_error(gradients, ranks, keep, rows, measured)
    shrunk = speeds.copy()
    for rank, log, error in zip(measured, logs, errors, strict=True):
        deviation = log - centre
        if error is None:  # the samples cannot tell the speeds from the coefficients: every rank keeps the median
            shrunk[rank] = math.exp(centre)
        elif deviation != 0.0:
            se = math.sqrt(variance * error)
            shrunk[rank] = math.exp(centre + deviation * max(0.0, 1.0 - (_SHRINK_SES * se / deviation) ** 4))
    return shrunk * (len(shrunk) / _exact_sum(shrunk))


def _speed_error(
    gradients: np.ndarray, ranks: np.ndarray, keep: np.ndarray, rows: np.ndarray, measured: list[int]
) -> list[float | None]:
    """Per rank of ``measured``, the variance (in units of one sample's) of its log-speed less the ranks' mean, in the
    least squares of the log-times linearised about the fit: ``gradients`` (a row's derivatives of its log-time by the
    active coefficients' logs) on the ``keep`` rows, and a log-speed per rank on ``rows``, the first rank's pinned at
    0 (only differences are measured). ``None`` for every rank where the system is singular.

    The speeds' block of the normal equations is diagonal (a rank's count of rows), so they are eliminated in closed
    form (the Schur complement) and only a system of the coefficients' size is solved, whatever the world size."""
    free = measured[1:]
    kept = gradients[keep]
    coefficients = range(gradients.shape[1])
    mine = {rank: gradients[rows & (ranks == rank)] for rank in free}
    counts = {rank: float(len(mine[rank])) for rank in free}
    sums = {rank: [_exact_sum(mine[rank][:, j]) for j in coefficients] for rank in free}
    # the coefficients' block less what the speeds explain: A - sum_r b_r b_r^T / n_r, b_r = -sums[rank]
    schur = [[_exact_sum(kept[:, i] * kept[:, j]) - math.fsum(sums[r][i] * sums[r][j] / counts[r] for r in free)
              for j in coefficients] for i in coefficients]  # fmt: skip
    errors = []
    for rank in measured:
        contrast = {other: (other == rank) - 1.0 / len(measured) for other in free}
        coupling = [-math.fsum(sums[r][j] * contrast[r] / counts[r] for r in free) for j in coefficients]
        solution = _solve(schur, coupling) if coupling else []
        if solution is None:
            return [None] * len(measured)
        own = math.fsum(contrast[r] ** 2 / counts[r] for r in free)
        errors.append(max(0.0, own + math.fsum(c * v for c, v in zip(coupling, solution, strict=True))))
    return errors


def _nnls(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Non-negative least squares of ``y ~ x @ c`` in relative terms (each row weighted by ``1 / y**2``).

    With five coefficients the exact answer is found by trying every subset of them (the others pinned to zero)
    and keeping the best feasible one. Columns are scaled to a maximum of 1 first, for conditioning.
    """
    scale = [float(np.max(x[:, j])) if len(x) else 0.0 for j in range(x.shape[1])]
    xs = np.stack([x[:, j] / s if s > 0 else np.zeros(len(x)) for j, s in enumerate(scale)], axis=1) / y[:, None]
    n = x.shape[1]
    gram = [[_exact_sum(xs[:, i] * xs[:, j]) for j in range(n)] for i in range(n)]
    rhs = [_exact_sum(xs[:, i]) for i in range(n)]  # the targets, divided by themselves, are 1
    best, best_objective = None, math.inf
    for size in range(1, n + 1):
        for subset in itertools.combinations([j for j in range(n) if scale[j] > 0], size):
            solution = _solve([[gram[i][j] for j in subset] for i in subset], [rhs[i] for i in subset])
            if solution is None or min(solution) < 0:
                continue
            objective = math.fsum(
                [solution[a] * solution[b] * gram[i][j] for a, i in enumerate(subset) for b, j in enumerate(subset)]
                + [-2 * solution[a] * rhs[i] for a, i in enumerate(subset)]
            )
            if objective < best_objective:
                best, best_objective = dict(zip(subset, solution, strict=True)), objective
    if best is None:
        raise ValueError("Calibration.fit: the measured microbatches have no usable features (all zero).")
    return [best.get(j, 0.0) / scale[j] if scale[j] > 0 else 0.0 for j in range(n)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting in Python floats; ``None`` if the system is (nearly) singular."""
    n = len(b)
    a = [[*row, b[i]] for i, row in enumerate(a)]
    largest = max(abs(a[i][i]) for i in range(n))
    for column in range(n):
        pivot = max(range(column, n), key=lambda row: abs(a[row][column]))
        if abs(a[pivot][column]) <= _SINGULAR * largest:
            return None
        a[column], a[pivot] = a[pivot], a[column]
        for row in range(column + 1, n):
            factor = a[row][column] / a[column][column]
            a[row] = [value - factor * pivot_value for value, pivot_value in zip(a[row], a[column], strict=True)]
    solution = [0.0] * n
    for row in reversed(range(n)):
        known = math.fsum(a[row][j] * solution[j] for j in range(row + 1, n))
        solution[row] = (a[row][n] - known) / a[row][row]
    return solution


def _exact_sum(values: np.ndarray) -> float:
    return math.fsum(values.tolist())
