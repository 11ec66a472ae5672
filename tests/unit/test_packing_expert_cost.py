"""The calibrated cost's expert term (Mixture-of-Experts models): a microbatch pays for each (layer, expert) pair its
tokens activate, which the calibration fits from the routers' counts and predicts from a microbatch's tokens; a dense
model's fit and plans are the four-term ones."""

from __future__ import annotations

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

EXPERTS, TOP_K, LAYERS = 64, 2, 2
SLOTS = EXPERTS * LAYERS
TRUE = CalibratedCost(linear=1e-4, quadratic=0.0, per_sequence=2e-3, per_microbatch=0.03, per_expert=4e-3)


def _active(tokens: int, rng: np.random.Generator, skew: float = 0.0) -> int:
    """The (layer, expert) pairs a microbatch of ``tokens`` tokens activates under simulated top-k routing: each token
    of each layer picks ``TOP_K`` distinct experts, favouring low-numbered ones by ``skew`` (0: uniform)."""
    preference = -skew * np.arange(EXPERTS) / EXPERTS
    pairs = 0
    for _ in range(LAYERS):
        scores = preference + rng.gumbel(size=(tokens, EXPERTS))
        pairs += len(np.unique(np.argsort(-scores, axis=1)[:, :TOP_K]))
    return pairs


def _simulated_seconds(lengths: list[int], active: float) -> float:
    return TRUE.per_microbatch + sum(TRUE(lengths)) + TRUE.per_expert * active


def _measured_steps(steps: int, seed: int, skew: float = 0.0):
    """Steps of one rank's microbatches of short rows (few enough tokens that they leave experts idle), with their
    simulated active pairs and exact times."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        microbatches = [rng.integers(1, 24, size=rng.integers(1, 5)).tolist() for _ in range(6)]
        active = [_active(sum(mb), rng, skew) for mb in microbatches]
        yield (
            [microbatches],
            [[_simulated_seconds(mb, a) for mb, a in zip(microbatches, active, strict=True)]],
            [active],
        )


def _fitted(skew: float = 0.0) -> Calibration:
    calibrator = Calibrator(1, warmup=0, min_steps=1, expert_slots=SLOTS)
    for lengths, seconds, active in _measured_steps(6, seed=0, skew=skew):
        calibrator.record(lengths, seconds, active)
    return calibrator.calibration


def test_the_calibrator_recovers_the_expert_coefficient():
    """Times generated with a known cost per active pair: the fit recovers it (and the other terms) exactly, and the
    predicted active pairs follow top-k routing's curve (uniform routing: ``E / k`` tokens per e-fold)."""
    calibration = _fitted()
    cost = calibration.cost
    assert cost.per_expert == pytest.approx(TRUE.per_expert, rel=1e-6)
    assert cost.per_microbatch == pytest.approx(TRUE.per_microbatch, rel=1e-6)
    assert cost.linear == pytest.approx(TRUE.linear, rel=1e-6)
    assert cost.per_sequence == pytest.approx(TRUE.per_sequence, rel=1e-6)
    assert cost.expert_slots == SLOTS and cost.has_expert_term
    assert cost.expert_scale == pytest.approx(EXPERTS / TOP_K, rel=0.1)
    rng = np.random.default_rng(5)
    for tokens in (4, 16, 48):
        simulated = np.mean([_active(tokens, rng) for _ in range(50)])
        assert cost.active_experts(tokens) == pytest.approx(simulated, rel=0.05)
    assert Calibration.from_dict(calibration.to_dict()) == calibration


def test_routing_that_concentrates_tokens_predicts_fewer_active_experts():
    uniform, skewed = _fitted().cost, _fitted(skew=4.0).cost
    assert skewed.expert_scale > 1.3 * uniform.expert_scale
    assert skewed.active_experts(16) < uniform.active_experts(16)


def test_the_expert_term_orders_plans_as_the_experts_work_where_tokens_do_not():
    """Two ranks' microbatches of equal tokens, equal counts and equal sequences: ``[48], [16]`` against ``[32],
    [32]``. Every term of a token cost or of the four-term calibration rates them equal; the experts' work does not,
    as two half-full microbatches activate more pairs than a full and a near-empty one (the term is concave), and
    the fitted cost with its expert term orders them as the simulated routing does."""
    cost = _fitted().cost
    plans = {"skewed": [[48], [16]], "even": [[32], [32]]}
    rng = np.random.default_rng(7)
    simulated = {
        name: np.mean([sum(_simulated_seconds(mb, _active(sum(mb), rng)) for mb in plan) for _ in range(40)])
        for name, plan in plans.items()
    }
    assert simulated["even"] > simulated["skewed"] * 1.01

    def predicted(name, with_experts):
        return sum(
            sum(cost(mb)) + (cost.microbatch(sum(mb)) if with_experts else cost.per_microbatch) for mb in plans[name]
        )

    assert predicted("even", with_experts=True) > predicted("skewed", with_experts=True) * 1.01
    assert predicted("even", with_experts=False) == pytest.approx(predicted("skewed", with_experts=False), rel=1e-12)
    assert sum(TokenCost()([32, 32])) == sum(TokenCost()([48, 16]))
    assert predicted("even", True) / predicted("skewed", True) == pytest.approx(
        simulated["even"] / simulated["skewed"], rel=0.01
    )


def test_lb_mini_weighs_each_microbatch_by_its_own_expert_term():
    """LB-Mini picks, among its constructions, the plan that finishes first with each microbatch's fixed cost
    evaluated at its own tokens; a full microbatch's is what the shares spread."""
    cost = _fitted().cost
    lengths = [44, 12, 37, 31, 3, 55, 43]
    assert lb_mini(lengths, 2, 73, cost, per_microbatch=cost.microbatch) != lb_mini(
        lengths, 2, 73, cost, per_microbatch=cost.per_microbatch
    )
    assert lb_mini(lengths, 2, 73, cost, per_microbatch=lambda tokens: cost.per_microbatch) == lb_mini(
        lengths, 2, 73, cost, per_microbatch=cost.per_microbatch
    ), "a constant function plans as the constant"
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost(), Calibrator(2, initial=Calibration(cost, (1, 1))))
    assert planner.plan(lengths, 73) == lb_mini(lengths, 2, 73, cost, speeds=(1, 1), per_microbatch=cost.microbatch)
    assert planner.cost_for(73)([10]) == pytest.approx([sum(cost([10])) + cost.microbatch(73) * 10 / 73])


def test_bad_expert_counts_are_refused():
    with pytest.raises(ValueError, match="active experts for a Calibrator with expert_slots"):
        Calibrator(1, expert_slots=SLOTS).record([[[4]]], [[1.0]])
    with pytest.raises(ValueError, match="and none without"):
        Calibrator(1).record([[[4]]], [[1.0]], [[3]])
    with pytest.raises(ValueError, match="1 microbatches but 1 times and 2 expert counts"):
        Calibrator(1, warmup=0, expert_slots=SLOTS).record([[[4]]], [[1.0]], [[3, 4]])
    with pytest.raises(ValueError, match="expert_slots >= 0"):
        CalibratedCost(linear=1.0, quadratic=0.0, expert_slots=-1)


# A dense model's calibrated planning, as the four-term code plans it (before the expert term; since the speeds settle
# before the fit stops and a rank's speed is kept only beyond the noise pooled over all ranks, which leaves the three
# equal ranks' speeds equal): the same measured steps give the same coefficients, speeds and plans, bit for bit.
_DENSE_COEFFICIENTS = {
    "linear": 1.9200481538649622e-05,
    "quadratic": 3.9883910589736356e-10,
    "per_sequence": 0.010519883396633001,
    "per_microbatch": 0.023329412493103868,
}
_DENSE_SPEEDS = (0.8091725423674331, 1.063609152544189, 1.063609152544189, 1.063609152544189)
_DENSE_LAST_PLAN = [
    [[10], [21], [8], [9], [5]],
    [[15], [16, 19], [0], [3], [13], [22]],
    [[7], [18, 20], [23], [6], [14]],
    [[11], [1], [12], [2], [4], [17]],
]


def test_a_dense_models_fit_and_plans_are_unchanged():
    dense = CalibratedCost(linear=2e-5, quadratic=3e-10, per_sequence=1e-3, per_microbatch=0.02)
    planner = MinibatchPlanner("lb-mini", 4, "minibatch", TokenCost(), Calibrator(4, warmup=0, min_steps=1))
    rng = np.random.default_rng(0)
    for seed in range(8):
        lengths = [min(length, 20000) for length in sample_lengths("longalign", 24, seed=seed)]
        plan = planner.plan(lengths, 20000)
        microbatches = [[[lengths[i] for i in mb] for mb in rank] for rank in plan]
        seconds = [[(dense.per_microbatch + sum(dense(mb))) * (1 + 0.03 * rng.standard_normal()) * (1.3 if r == 0
                     else 1.0) for mb in rank] for r, rank in enumerate(microbatches)]  # fmt: skip
        planner.record(microbatches, seconds)
    cost = planner.calibration.cost
    assert {name: getattr(cost, name) for name in _DENSE_COEFFICIENTS} == _DENSE_COEFFICIENTS
    assert planner.calibration.speeds == _DENSE_SPEEDS
    assert plan == _DENSE_LAST_PLAN
    assert cost.per_expert == 0.0 and not cost.has_expert_term and cost.microbatch(1) == cost.per_microbatch
    assert microbatch_features([5, 6])[-1] == 0.0
