"""Calibration: the fit recovers known costs and speeds through noise and outliers, is bit-identical whatever the
order and process, and ``Calibrator`` / ``MinibatchPlanner`` turn it into plans that give a slow rank less."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_odc.packing import (
    CalibratedCost,
    Calibration,
    Calibrator,
    MinibatchPlanner,
    TokenCost,
    lb_mini,
    microbatch_features,
    sample_lengths,
)

TRUE = CalibratedCost(linear=2e-5, quadratic=3e-10, per_sequence=1e-3, per_microbatch=0.02)


def _microbatches(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(64, 32768, size=rng.integers(1, 9)).tolist() for _ in range(n)]


def _seconds(lengths: list[int], speed: float = 1.0) -> float:
    return (TRUE.per_microbatch + sum(TRUE(lengths))) / speed


def _samples(speeds, n=400, noise=0.02, outliers=0.05, seed=0):
    """``n`` microbatches dealt round-robin to ranks of ``speeds``, with multiplicative noise and a share of
    ``outliers`` taking 2-5x longer (a compilation, a hiccup)."""
    rng = np.random.default_rng(seed)
    features, seconds, ranks = [], [], []
    for i, lengths in enumerate(_microbatches(n, seed)):
        rank = i % len(speeds)
        time = _seconds(lengths, speeds[rank]) * (1 + noise * rng.standard_normal())
        if rng.random() < outliers:
            time *= rng.uniform(2, 5)
        features.append(microbatch_features(lengths))
        seconds.append(time)
        ranks.append(rank)
    return features, seconds, ranks


def test_features_of_a_microbatch():
    assert microbatch_features([3, 4]) == (1.0, 2.0, 7.0, 25.0, 0.0)
    assert microbatch_features([3, 4], active_experts=6) == (1.0, 2.0, 7.0, 25.0, 6.0)


def test_the_fit_is_exact_on_exact_times():
    features, seconds, ranks = _samples([1.0], n=60, noise=0.0, outliers=0.0)
    fitted = Calibration.fit(features, seconds, ranks)
    for name in ("linear", "quadratic", "per_sequence", "per_microbatch"):
        assert getattr(fitted.cost, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert fitted.samples == 60 and fitted.error < 1e-9


@pytest.mark.parametrize("speeds", [[1.0, 1.0], [1.0, 0.5], [1.0, 0.8, 0.6, 1.0]])
def test_the_fit_recovers_costs_and_speeds_through_noise_and_outliers(speeds):
    features, seconds, ranks = _samples(speeds)
    fitted = Calibration.fit(features, seconds, ranks, world_size=len(speeds))
    relative = np.asarray(speeds) / np.mean(speeds)  # speeds average 1; the costs absorb the scale
    assert fitted.speeds == pytest.approx(relative.tolist(), rel=0.02)
    scale = 1 / np.mean(speeds)
    assert fitted.cost.linear == pytest.approx(TRUE.linear * scale, rel=0.1)
    assert fitted.cost.quadratic == pytest.approx(TRUE.quadratic * scale, rel=0.1)
    assert fitted.cost.per_microbatch == pytest.approx(TRUE.per_microbatch * scale, rel=0.25)
    lengths = _microbatches(50, seed=99)
    predicted = [(fitted.cost.per_microbatch + sum(fitted.cost(mb))) / scale for mb in lengths]
    assert predicted == pytest.approx([_seconds(mb) for mb in lengths], rel=0.03)
    assert 0.88 * len(seconds) <= fitted.samples <= 0.97 * len(seconds), "the outliers (5%) are dropped"
    assert fitted.error < 0.03


def test_a_fit_without_outlier_rejection_would_be_off():
    """The outliers of the test above matter: fitted on the inliers' times scaled by a least-squares through them,
    the per-microbatch cost would be far off (this guards the test, not the code)."""
    features, seconds, ranks = _samples([1.0], outliers=0.0)
    clean = Calibration.fit(features, seconds, ranks)
    dirty_features, dirty_seconds, dirty_ranks = _samples([1.0], outliers=0.3)
    dirty = Calibration.fit(dirty_features, dirty_seconds, dirty_ranks)
    assert dirty.cost.linear == pytest.approx(clean.cost.linear, rel=0.1), "30% outliers are still dropped"


def test_the_fit_is_bit_identical_in_any_order():
    features, seconds, ranks = _samples([1.0, 0.7, 0.9])
    fitted = Calibration.fit(features, seconds, ranks, world_size=3)
    order = np.random.default_rng(1).permutation(len(seconds))
    shuffled = Calibration.fit(
        [features[i] for i in order], [seconds[i] for i in order], [ranks[i] for i in order], world_size=3
    )
    assert shuffled == fitted  # exact equality: every rank must plan the same


_PLAN_IN_A_SUBPROCESS = """
import json, sys
from hf_odc.packing import Calibration, MinibatchPlanner, Calibrator, TokenCost
data = json.loads(sys.stdin.read())
calibrator = Calibrator(3, initial=Calibration.fit(data["features"], data["seconds"], data["ranks"], world_size=3))
planner = MinibatchPlanner("lb-mini", 3, "minibatch", TokenCost(), calibrator)
print(json.dumps({"calibration": calibrator.calibration.to_dict(), "plan": planner.plan(data["lengths"], 65536)}))
"""


def test_two_processes_plan_identically_from_the_same_samples():
    features, seconds, ranks = _samples([1.0, 0.6, 0.9], seed=3)
    data = json.dumps({"features": features, "seconds": seconds, "ranks": ranks,
                       "lengths": sample_lengths("longalign", 48, seed=5)})  # fmt: skip
    outputs = [
        subprocess.run([sys.executable, "-c", _PLAN_IN_A_SUBPROCESS], input=data, text=True,
                       capture_output=True, check=True, env={**os.environ, "PYTHONHASHSEED": str(hash_seed)}).stdout
        for hash_seed in (1, 2)
    ]  # fmt: skip
    assert outputs[0] == outputs[1]
    result = json.loads(outputs[0])
    assert result["calibration"]["speeds"][1] < 0.8, "rank 1 is the slow one"


@pytest.mark.parametrize(
    ("features", "seconds", "message"),
    [
        ([(1, 1, 1, 1, 0)] * 3, [1.0] * 3, "at least 4 measured microbatches"),
        ([(1, 1, 1, 1, 1)] * 4, [1.0] * 4, "at least 5 measured microbatches"),  # a MoE's: five terms
        ([(1, 1, 1, 1)] * 4, [1.0] * 4, "one row of 5 features"),
        ([(1, 1, 1, 1, 0)] * 4, [1.0, 1.0, 0.0, 1.0], "positive times"),
        ([(1, 1, float("nan"), 1, 0)] * 4, [1.0] * 4, "finite, non-negative"),
        ([(0, 0, 0, 0, 0)] * 4, [1.0] * 4, "no usable features"),
        ([(1, 1, 1, 1, 3)] * 5, [1.0] * 5, "more than expert_slots=0"),
    ],
)
def test_bad_measurements_are_refused(features, seconds, message):
    with pytest.raises(ValueError, match=message):
        Calibration.fit(features, seconds)


def test_ranks_and_speeds_are_checked():
    features, seconds, _ = _samples([1.0], n=8)
    with pytest.raises(ValueError, match=r"in \[0, world_size=2\)"):
        Calibration.fit(features, seconds, [2] * 8, world_size=2)
    with pytest.raises(ValueError, match="speeds must hold 2 positive values"):
        Calibration.fit(features, seconds, [0] * 8, world_size=2, speeds=[1.0])


def test_a_calibration_round_trips_through_its_file(tmp_path):
    features, seconds, ranks = _samples([1.0, 0.5])
    fitted = Calibration.fit(features, seconds, ranks, world_size=2)
    fitted.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == fitted
    (tmp_path / "bad.json").write_text(json.dumps({"linear": 1.0}))
    with pytest.raises(ValueError, match="Not an hf_odc calibration"):
        Calibration.load(tmp_path / "bad.json")


def test_amortised_cost_spreads_the_microbatch_term_over_the_cap():
    cost = TRUE.amortised(1000)
    assert cost.per_microbatch == 0.0
    assert cost([10]) == pytest.approx([TRUE([10])[0] + TRUE.per_microbatch * 10 / 1000])
    with pytest.raises(ValueError, match="non-negative coefficients, not all zero"):
        CalibratedCost(linear=1.0, quadratic=0.0, per_sequence=-1.0)
    with pytest.raises(ValueError, match="non-negative coefficients, not all zero"):
        CalibratedCost(linear=0.0, quadratic=0.0)
    assert CalibratedCost(linear=0.0, quadratic=0.0, per_microbatch=0.1).amortised(100)([50]) == [0.05]


def test_times_flat_in_the_length_fit_a_fixed_cost_and_still_plan():
    """A launch-bound device: every microbatch takes the same time. Only the per-microbatch cost is fitted, and
    planning with it (spread over the cap) still works (it failed in CI once: a fit with no per-token term)."""
    lengths = _microbatches(20, seed=4)
    fitted = Calibration.fit([microbatch_features(mb) for mb in lengths], [0.05] * 20)
    assert fitted.cost.per_microbatch == pytest.approx(0.05) and fitted.cost([32768])[0] < 1e-12
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost(), Calibrator(2, initial=fitted))
    plan = planner.plan([100, 200, 300, 400], 1000)
    assert sorted(i for rank in plan for mb in rank for i in mb) == [0, 1, 2, 3]


# --- Calibrator and MinibatchPlanner ---------------------------------------------------------------------------


def _step(plan_lengths, speeds):
    return [[_seconds(mb, speeds[rank]) for mb in rank_mbs] for rank, rank_mbs in enumerate(plan_lengths)]


def _planned_step(planner, seed, cap=40000):
    lengths = sample_lengths("longalign", 16 * planner.world_size, seed=seed)
    lengths = [min(length, cap) for length in lengths]
    plan = planner.plan(lengths, cap)
    return [[[lengths[i] for i in mb] for mb in rank] for rank in plan]


def test_the_calibrator_waits_skips_warmup_follows_speeds_and_can_be_frozen():
    calibrator = Calibrator(2, warmup=1, min_steps=2, window=8, speed_window=2)
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost(), calibrator)
    assert planner.speeds is None and planner.cost_for(40000) == TokenCost()
    # The warmup step is far off (compilation); it must not be recorded.
    assert not planner.record(_planned_step(planner, 0), _step(_planned_step(planner, 0), [0.1, 0.1]))
    assert not planner.record(_planned_step(planner, 1), _step(_planned_step(planner, 1), [1.0, 1.0]))
    assert planner.record(_planned_step(planner, 2), _step(_planned_step(planner, 2), [1.0, 1.0]))
    assert planner.speeds == pytest.approx((1.0, 1.0))
    assert planner.calibration.cost.linear == pytest.approx(TRUE.linear, rel=1e-6)
    for seed in range(3, 6):  # rank 1 slows down to half speed: the last two steps decide the speeds
        planner.record(_planned_step(planner, seed), _step(_planned_step(planner, seed), [1.0, 0.5]))
    # Not exact: the window still holds the steps at equal speeds, which the coefficients fit with today's speeds.
    assert planner.speeds == pytest.approx((4 / 3, 2 / 3), rel=2e-3)
    frozen = Calibrator(2, initial=planner.calibration, frozen=True)
    assert not frozen.record(_planned_step(planner, 7), _step(_planned_step(planner, 7), [1.0, 1.0]))
    assert frozen.calibration == planner.calibration
    with pytest.raises(ValueError, match="frozen calibration needs an initial one"):
        Calibrator(2, frozen=True)
    assert Calibrator(4, initial=planner.calibration).calibration.speeds == (1.0,) * 4, "other world size: speeds 1"


def test_a_slow_rank_gets_work_in_proportion_to_its_speed():
    calibration = Calibration(TRUE, speeds=(4 / 3, 2 / 3))
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost(), Calibrator(2, initial=calibration))
    lengths = sample_lengths("longalign", 64, seed=11)
    plan = planner.plan(lengths, 65536)
    work = [sum(TRUE.amortised(65536)([lengths[i] for mb in rank for i in mb])) for rank in plan]
    assert work[1] / sum(work) == pytest.approx(1 / 3, abs=0.02)
    assert planner.predicted_bubble(plan, lengths, 65536) < 0.02
    unaware = lb_mini(lengths, 2, 65536, TRUE.amortised(65536))
    assert planner.predicted_bubble(unaware, lengths, 65536) > 0.2, "balancing cost alone leaves the fast rank idle"


@pytest.mark.parametrize(("balance", "sync"), [("lb-micro", "layer"), ("lb-micro", "minibatch"), ("lb-mini", "layer")])
def test_speeds_are_only_used_by_lb_mini_under_odc(balance, sync):
    planner = MinibatchPlanner(balance, 2, sync, TokenCost(), Calibrator(2, initial=Calibration(TRUE, (1.5, 0.5))))
    assert planner.speeds is None
    assert planner.cost_for(1000) == TRUE.amortised(1000), "the calibrated cost is used all the same"


# --- speeds within noise ---------------------------------------------------------------------------------------------


def _short_rows(speeds, per_rank, noise, seed):
    """``per_rank`` short-row microbatches a rank (4-12 sequences of 100-600 tokens, as the preference and reward
    trainers pack them): ``lengths[rank][m]`` and ``seconds[rank][m]``, with multiplicative noise ``noise``."""
    rng = np.random.default_rng(seed)
    lengths = [[rng.integers(100, 600, size=rng.integers(4, 13)).tolist() for _ in range(per_rank)] for _ in speeds]
    seconds = [[_seconds(mb, speed) * (1 + noise * rng.standard_normal()) for mb in mbs]
               for mbs, speed in zip(lengths, speeds, strict=True)]  # fmt: skip
    return lengths, seconds


@pytest.mark.parametrize(
    ("world_size", "per_rank", "noise"), [(2, 3, 0.03), (4, 1, 0.05), (4, 2, 0.02), (8, 1, 0.03), (8, 3, 0.02)]
)
def test_equal_ranks_with_few_noisy_microbatches_keep_equal_speeds(world_size, per_rank, noise):
    """Identical devices with one to three short microbatches a rank, as the short-row trainers run: each rank's own
    ratio is off by its noise, which a plan that believed it would move off a rank that is not slower. Judged against
    the noise pooled over every rank's samples, the speeds stay 1."""
    for seed in range(4):
        lengths, seconds = _short_rows([1.0] * world_size, per_rank, noise, seed)
        features = [microbatch_features(mb) for mbs in lengths for mb in mbs]
        ranks = [rank for rank, mbs in enumerate(lengths) for _ in mbs]
        fitted = Calibration.fit(features, [time for times in seconds for time in times], ranks, world_size=world_size)
        assert fitted.speeds == pytest.approx([1.0] * world_size, abs=0.01), seed


@pytest.mark.parametrize("seed", range(4))
def test_a_straggler_is_caught_at_the_first_fit(seed):
    """Four ranks, one slowed to a third and one to 1/1.3, one short microbatch a rank a step with 2% noise: the
    Calibrator's first fit (after the warm-up step and two steps: two microbatches a rank) gives each rank its speed
    within 10%. Two samples cannot show their own noise; the slow ranks are many standard errors of the noise pooled
    over all ranks off the others."""
    truth = np.asarray([1.0, 1.0, 1 / 3, 1 / 1.3])
    calibrator = Calibrator(4)
    for step in range(3):
        assert calibrator.record(*_short_rows(truth.tolist(), 1, 0.02, seed=10 * seed + step)) == (step == 2)
    assert calibrator.calibration.speeds == pytest.approx((truth / truth.mean()).tolist(), rel=0.1)
