"""The bubble model on hand-computed plans, and what it predicts for the four schemes on the synthetic sets."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from hf_odc.cli.plan import CrossHost, simulate
from hf_odc.packing import (
    DISTRIBUTIONS,
    bubble_rate,
    lb_micro,
    lb_mini,
    local_sort,
    plan_costs,
    predicted_time,
    sample_lengths,
    sync_time,
)
from hf_odc.packing.bubble import step_times
from hf_odc.packing.cost import AttentionCost, CalibratedCost
from hf_odc.packing.schemes import SCHEMES

# Four ranks: rank 0 runs two microbatches, rank 1 two, rank 2 one, rank 3 none.
LENGTHS = [5, 3, 2, 4, 1, 6]
PLAN = [[[0], [1, 2]], [[3], [4]], [[5]], []]


def _squares(lengths):
    return [length * length for length in lengths]


def test_plan_costs_sum_each_microbatch():
    assert plan_costs(PLAN, LENGTHS) == [[5, 5], [4, 1], [6], []]
    assert plan_costs(PLAN, LENGTHS, _squares) == [[25, 13], [16, 1], [36], []]


# tokens: layer sync = max(5, 4, 6, 0) + max(5, 1, -, -) = 11, minibatch sync = max(10, 5, 6, 0) = 10; total 21.
# squares: layer = max(25, 16, 36) + max(13, 1) = 49, minibatch = max(38, 17, 36, 0) = 38; total 91.
@pytest.mark.parametrize(
    ("cost", "sync", "time", "bubble"),
    [
        ("tokens", "layer", 11, 1 - Fraction(21, 4 * 11)),
        ("tokens", "minibatch", 10, 1 - Fraction(21, 4 * 10)),
        (_squares, "layer", 49, 1 - Fraction(91, 4 * 49)),
        (_squares, "minibatch", 38, 1 - Fraction(91, 4 * 38)),
    ],
)
def test_bubble_on_a_hand_computed_plan(cost, sync, time, bubble):
    assert predicted_time(PLAN, LENGTHS, cost, sync) == time
    assert bubble_rate(PLAN, LENGTHS, cost, sync) == pytest.approx(float(bubble), abs=1e-15)


# With speeds 1, 2, 0.5, 1 the microbatches take [5, 5], [2, 0.5], [12], []: layer sync max(5, 2, 12) + max(5, 0.5)
# = 17, minibatch sync max(10, 2.5, 12, 0) = 12; the ranks are busy 10 + 2.5 + 12 + 0 = 24.5 in all.
@pytest.mark.parametrize(("sync", "time"), [("layer", 17), ("minibatch", 12)])
def test_bubble_with_speeds_on_a_hand_computed_plan(sync, time):
    speeds = [1, 2, 0.5, 1]
    assert step_times(plan_costs(PLAN, LENGTHS), speeds) == [12, 5]
    assert sync_time(plan_costs(PLAN, LENGTHS), sync, speeds) == time
    assert predicted_time(PLAN, LENGTHS, "tokens", sync, speeds) == time
    assert bubble_rate(PLAN, LENGTHS, "tokens", sync, speeds) == pytest.approx(1 - 24.5 / (4 * time), abs=1e-15)
    # Equal speeds of 1 are no speeds at all.
    for predict in (predicted_time, bubble_rate):
        assert predict(PLAN, LENGTHS, _squares, sync, [1.0] * 4) == predict(PLAN, LENGTHS, _squares, sync)


def test_planning_for_the_speeds_removes_the_bubble_that_ignoring_them_leaves():
    """A straggler at half speed: LB-Mini planned for the speeds keeps ODC's bubble small; planned without them, the
    straggler takes twice as long over its equal share and the others idle half the time: 1 - (7 + 2) / (8 * 2)."""
    lengths = sample_lengths("longalign", 128, seed=3)
    speeds = [1.0] * 7 + [0.5]
    cap = DISTRIBUTIONS["longalign"].max_length
    aware = bubble_rate(lb_mini(lengths, 8, cap, "attention", speeds), lengths, "attention", "minibatch", speeds)
    blind = bubble_rate(lb_mini(lengths, 8, cap, "attention"), lengths, "attention", "minibatch", speeds)
    assert aware < 0.01
    assert blind == pytest.approx(7 / 16, abs=0.01)


@pytest.mark.parametrize("speeds", [[1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
def test_bubble_needs_one_positive_speed_per_rank(speeds):
    with pytest.raises(ValueError, match=r"speeds must be 4 positive, finite numbers"):
        bubble_rate(PLAN, LENGTHS, speeds=speeds)


def test_a_balanced_plan_has_no_bubble_and_layer_sync_never_beats_minibatch_sync():
    lengths = [3, 1, 2, 2, 4]
    plan = [[[0], [1]], [[2], [3]], [[4]]]  # every step equal: 3+1 | 2+2 | 4
    assert bubble_rate(plan, lengths, sync="minibatch") == 0.0
    assert bubble_rate(plan, lengths, sync="layer") == pytest.approx(1 - 12 / (3 * (4 + 2)))
    for cost in ("tokens", _squares):
        assert predicted_time(PLAN, LENGTHS, cost, "layer") >= predicted_time(PLAN, LENGTHS, cost, "minibatch")


def test_empty_plans_and_a_bad_sync():
    assert bubble_rate([[], []], [], sync="layer") == 0.0
    assert bubble_rate([[], []], [], sync="minibatch") == 0.0
    assert sync_time([[], [2.0]], "layer") == 2.0
    with pytest.raises(ValueError, match=r"sync must be 'layer' .* or 'minibatch' .*, got 'step'"):
        bubble_rate(PLAN, LENGTHS, sync="step")


@pytest.mark.parametrize("cost", ["attention", "tokens"])
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_odc_lb_mini_bubble_is_at_most_collective_lb_micro_bubble(name, cost):
    """ODC + LB-Mini (minibatch sync) idles no more than Collective + LB-Micro (layer sync), and both beat
    Collective + LocalSort, on every synthetic set and world size."""
    cap = DISTRIBUTIONS[name].max_length
    for world_size in (2, 8, 32):
        for seed in range(2):
            lengths = sample_lengths(name, 8 * world_size, seed=[seed, world_size])
            mini = bubble_rate(lb_mini(lengths, world_size, cap, cost), lengths, cost, "minibatch")
            micro = bubble_rate(lb_micro(lengths, world_size, cap, cost), lengths, cost, "layer")
            local = bubble_rate(local_sort(lengths, world_size), lengths, cost, "layer")
            assert 0 <= mini <= micro <= local, (world_size, seed, mini, micro, local)
            assert mini < 0.05  # one sync per minibatch, 8 samples per rank: nearly no idle time


def test_simulate_reports_every_scheme_consistently():
    simulation = simulate(DISTRIBUTIONS["swe-smith"], [2, 8], 8, 131072, "attention", num_minibatches=3, seed=5)
    results = {(result.world_size, result.scheme): result for result in simulation.results}
    assert len(results) == 8
    for world_size in (2, 8):
        baseline = results[world_size, "Collective+LB-Micro"]
        assert baseline.speedup == 1.0
        total = None
        for scheme in ("Collective+LocalSort", "Collective+LB-Micro", "ODC+LB-Micro", "ODC+LB-Mini"):
            result = results[world_size, scheme]
            assert result.speedup == pytest.approx(baseline.time / result.time)
            # bubble = 1 - work / (ranks * time), and the work is the same for every scheme
            work = (1 - result.bubble_rate) * world_size * result.time
            total = work if total is None else total
            assert work == pytest.approx(total, rel=1e-9)
        assert results[world_size, "ODC+LB-Micro"].time <= baseline.time  # the same plan, synced less often
        assert results[world_size, "ODC+LB-Mini"].speedup >= 1.0
        assert results[world_size, "Collective+LocalSort"].min_microbatches == 8
    assert simulation.to_dict()["config"]["num_minibatches"] == 3
    # Reproducible, and a world size's minibatches do not depend on the other world sizes simulated.
    again = simulate(DISTRIBUTIONS["swe-smith"], [8], 8, 131072, "attention", num_minibatches=3, seed=5)
    assert again.results == [result for result in simulation.results if result.world_size == 8]


def test_cross_host_all_reduce_is_one_ring_over_the_gradient_shards():
    # 1.5e9 fp32 parameters over 8 GPUs/host: 0.75 GB shards. 4 hosts: 2 * 3/4 * 0.75e9 B / 50e9 B/s = 22.5 ms.
    layout = CrossHost(gpus_per_host=8, gradient_bytes=6e9, bandwidth=50e9, seconds_per_unit=1e-3)
    assert layout.all_reduce_time(32) == pytest.approx(22.5)  # in cost units of a millisecond
    assert layout.all_reduce_time(16) == pytest.approx(15.0)  # 2 hosts: 2 * 1/2 * 0.75e9 / 50e9 = 15 ms
    assert layout.all_reduce_time(8) == 0.0
    assert [size for size in (4, 8, 12, 16, 32) if layout.spans_hosts(size)] == [16, 32]
    with pytest.raises(ValueError, match="world_size=12 is not a multiple of gpus_per_host=8"):
        layout.all_reduce_time(12)
    for bad in ({"gpus_per_host": 0}, {"gradient_bytes": 0.0}, {"bandwidth": -1.0}, {"seconds_per_unit": math.inf}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            CrossHost(**{"gpus_per_host": 8, "gradient_bytes": 6e9, "bandwidth": 50e9, "seconds_per_unit": 1.0, **bad})


def test_cross_host_takes_its_time_scale_from_the_cost_model():
    flops = AttentionCost(linear=3e9, quadratic=1e5)  # 2 FLOPs per weight: 1.5e9 parameters
    by_flops = CrossHost.for_cost(flops, 8, cross_host_gbps=25, tflops=300)
    assert by_flops == CrossHost(8, 6e9, 25e9, 3 / 300e12)  # a step is 3x the forward FLOPs
    assert CrossHost.for_cost(flops, 8, params=7e9).gradient_bytes == 28e9
    assert CrossHost.for_cost("attention", 8).seconds_per_unit == 3 / 200e12  # default 200 TFLOP/s
    seconds = CalibratedCost(linear=1e-5, quadratic=1e-10)
    assert CrossHost.for_cost(seconds, 4, params=1e9) == CrossHost(4, 4e9, 50e9, 1.0)  # default 50 GB/s
    with pytest.raises(ValueError, match="--params is required with --calibration"):
        CrossHost.for_cost(seconds, 4)
    with pytest.raises(ValueError, match="--tflops does not apply to --calibration"):
        CrossHost.for_cost(seconds, 4, params=1e9, tflops=100)
    with pytest.raises(ValueError, match="cost='tokens' has no time scale"):
        CrossHost.for_cost("tokens", 4)


def test_simulate_adds_hybrid_rows_from_the_same_plans():
    source, args = DISTRIBUTIONS["swe-smith"], ([4, 8, 16], 4, 131072, "attention")
    compute_names = {scheme.name for scheme in SCHEMES}
    compute_only = simulate(source, *args, num_minibatches=2, seed=3)
    assert "cross_host" not in compute_only.config

    def hybrid(gbps):
        layout = CrossHost.for_cost("attention", gpus_per_host=4, cross_host_gbps=gbps)
        simulation = simulate(source, *args, num_minibatches=2, seed=3, cross_host=layout)
        # The compute rows are untouched; every world size above one host gets the two hybrid rows after them.
        assert [r for r in simulation.results if r.scheme in compute_names] == compute_only.results
        assert [(r.world_size, r.scheme) for r in simulation.results if r.scheme not in compute_names] == [
            (size, name) for size in (8, 16) for name in ("HSDP+LB-Micro", "Hybrid ODC+LB-Mini")
        ]
        assert simulation.config["cross_host"]["bandwidth"] == gbps * 1e9
        return layout, {(r.world_size, r.scheme): r for r in simulation.results}

    layout, results = hybrid(50)
    for world_size in (8, 16):
        all_reduces = 2 * layout.all_reduce_time(world_size)  # one per minibatch
        mini = results[world_size, "ODC+LB-Mini"]
        work = world_size * mini.time * (1 - mini.bubble_rate)
        for name, compute in (("HSDP+LB-Micro", "Collective+LB-Micro"), ("Hybrid ODC+LB-Mini", "ODC+LB-Mini")):
            row, base = results[world_size, name], results[world_size, compute]
            assert row.time == pytest.approx(base.time + all_reduces, rel=1e-12)
            assert row.sync == base.sync
            assert (row.min_microbatches, row.max_microbatches) == (base.min_microbatches, base.max_microbatches)
            assert row.speedup == pytest.approx(results[world_size, "Collective+LB-Micro"].time / row.time)
            assert row.bubble_rate == pytest.approx(1 - work / (world_size * row.time))  # the all-reduce is idle
            assert row.bubble_rate > base.bubble_rate
    # 4 hosts move 2 * 3/4 of a shard, 2 hosts 2 * 1/2: the all-reduce grows with H at a fixed shard size.
    assert layout.all_reduce_time(16) == pytest.approx(1.5 * layout.all_reduce_time(8))

    _, fast = hybrid(1e9)
    _, slow = hybrid(1e-3)
    for world_size in (8, 16):
        assert fast[world_size, "Hybrid ODC+LB-Mini"].speedup == pytest.approx(
            fast[world_size, "ODC+LB-Mini"].speedup, rel=1e-6
        )
        assert slow[world_size, "Hybrid ODC+LB-Mini"].speedup < 1.0
        assert slow[world_size, "HSDP+LB-Micro"].speedup < slow[world_size, "Hybrid ODC+LB-Mini"].speedup
