"""``karmarkar_karp``: every index once, equal-size counts, balance within 1% of the lower bound, input checks."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hf_odc.packing import karmarkar_karp, sample_lengths
from hf_odc.packing.partition import _lower_bound as _search_bound


def _part_sums(costs, parts) -> list[float]:
    return [math.fsum(costs[i] for i in part) for part in parts]


def _lower_bound(costs, k: int) -> float:
    """No k-partition has a smaller largest part: the mean part, and the part holding the largest item."""
    return max(math.fsum(costs) / k, max(costs))


def _assert_partition(parts, n: int, k: int) -> None:
    assert len(parts) == k
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(n)), "every index exactly once"


@pytest.mark.parametrize(("n", "k"), [(0, 3), (1, 1), (2, 5), (7, 3), (64, 8), (300, 64)])
def test_every_index_exactly_once_and_parts_ordered(n, k):
    costs = np.random.default_rng([n, k]).lognormal(0.0, 1.0, n).tolist()
    parts = karmarkar_karp(costs, k)
    _assert_partition(parts, n, k)
    assert all(part == sorted(part) for part in parts), "indices ascending within a part"
    sums = _part_sums(costs, parts)
    assert sums == sorted(sums, reverse=True), "parts by descending cost"
    if n >= k:
        assert all(parts), "with at least k items no part is left empty"
    else:
        assert sum(1 for part in parts if part) == n


def test_near_the_brute_force_optimum_on_tiny_sets():
    """Against the enumerated optimum of 8 items: never better (sanity of the sums), never worse than the
    differencing method's worst-case ratio 4/3 - 1/(3k) (Michiels, Korst, Aarts, van Leeuwen, Spieksma, 2007)."""
    rng = np.random.default_rng(7)
    for _ in range(12):
        costs = rng.integers(1, 50, size=8).tolist()
        for k in (2, 3):
            best = min(
                max(math.fsum(c for c, label in zip(costs, labels, strict=True) if label == part) for part in range(k))
                for labels in itertools.product(range(k), repeat=len(costs))
            )
            got = max(_part_sums(costs, karmarkar_karp(costs, k)))
            assert best <= got <= best * (4 / 3 - 1 / (3 * k)), (costs, k, got, best)
            assert _pigeonhole_bound(costs, k) <= best, "the test's bound is a valid lower bound"
            order = sorted(range(len(costs)), key=costs.__getitem__)
            assert _search_bound(order, [float(c) for c in costs], k, False) <= best, "so is the one the search aims at"


@pytest.mark.parametrize(("n", "k"), [(12, 3), (64, 8), (256, 64), (512, 16)])
def test_equal_size_gives_every_part_the_same_count(n, k):
    costs = np.random.default_rng([n, k, 1]).lognormal(0.0, 1.5, n).tolist()
    parts = karmarkar_karp(costs, k, equal_size=True)
    _assert_partition(parts, n, k)
    assert {len(part) for part in parts} == {n // k}
    # Still balanced: at most 2% above the bound that equal sizes allow (largest item + the n/k - 1 cheapest).
    order = sorted(costs)
    bound = max(math.fsum(costs) / k, order[-1] + math.fsum(order[: n // k - 1]))
    assert max(_part_sums(costs, parts)) <= bound * 1.02


# The spec's quality target: on random long-tailed sets of >= 64 items, the largest part is within 1% of
# max(sum / k, largest item). Log-normal costs with a heavy tail (sigma 1 and 1.5), several seeds, k from 2 to 128
# with at least 8 items per part (fewer per part: see the tests at the end).
@pytest.mark.parametrize(
    ("n", "k"), [(64, 2), (64, 4), (64, 8), (256, 3), (256, 16), (256, 32), (1024, 64), (1024, 128)]
)
@pytest.mark.parametrize("sigma", [1.0, 1.5])
def test_within_one_percent_of_the_lower_bound_on_lognormal_sets(n, k, sigma):
    for seed in range(5):
        costs = np.random.default_rng([seed, n, k, int(10 * sigma)]).lognormal(0.0, sigma, n).tolist()
        worst = max(_part_sums(costs, karmarkar_karp(costs, k)))
        assert worst <= 1.01 * _lower_bound(costs, k), (seed, worst / _lower_bound(costs, k))


@pytest.mark.parametrize(("name", "k"), [("longalign", 8), ("swe-smith", 16), ("uniform", 64)])
def test_within_one_percent_on_the_synthetic_length_sets(name, k):
    """16 samples per part, as in a minibatch of 16 samples per rank."""
    for seed in range(3):
        costs = sample_lengths(name, 16 * k, seed=[seed, k])
        worst = max(_part_sums(costs, karmarkar_karp(costs, k)))
        assert worst <= 1.01 * _lower_bound(costs, k)


# With about four items per part or fewer, LDM and single-item exchanges alone ended up to 7.5% above an attainable
# bound (the previous shortfall: 128 LongAlign-like lengths over 32 parts, where a sample of 64141 tokens, about 0.94
# of the mean part, got a companion). The rescue search (best-fit packings, two-item trades, the largest items alone)
# closes it.
_SHORTFALL = ("longalign", 128, [4, 32], 32)


def test_within_one_percent_on_the_former_shortfall_instance():
    name, n, seed, k = _SHORTFALL
    lengths = sample_lengths(name, n, seed=seed)
    assert max(_part_sums(lengths, karmarkar_karp(lengths, k))) <= 1.01 * _lower_bound(lengths, k)


def _pigeonhole_bound(costs, k: int) -> float:
    """A tighter valid bound: of the ``j*k + 1`` largest items some part holds ``j + 1``, at best the cheapest."""
    order, n = sorted(costs), len(costs)
    bounds = [math.fsum(order[n - j * k - 1 : n - j * k + j]) for j in range(1, (n - 1) // k + 1)]
    return max([_lower_bound(costs, k), *bounds])


def test_few_items_per_part_on_the_long_tailed_sets():
    """2 to 8 items per part, 64 to 256 items, both long-tailed distributions, 5 seeds: 150 partitions.

    Measured against a CP-SAT solver on such grids, every result was within 1% of the best partition known; the
    lower bound here is looser than that optimum, so one case of the 150 (swe-smith, 64 items over 16 parts, 1.0102x
    the bound, with a 1.003x partition known) is above 1%.
    """
    ratios = []
    for name, n, per_part, seed in itertools.product(
        ("longalign", "swe-smith"), (64, 128, 256), (2, 3, 4, 6, 8), range(5)
    ):
        k = n // per_part
        costs = sample_lengths(name, n, seed=[seed, k])
        ratios.append(max(_part_sums(costs, karmarkar_karp(costs, k))) / _pigeonhole_bound(costs, k))
    assert max(ratios) <= 1.02
    assert sum(ratio <= 1.01 for ratio in ratios) >= 0.98 * len(ratios)


def test_ties_are_broken_by_index():
    assert karmarkar_karp([5, 5, 5, 5], 2) == karmarkar_karp([5.0, 5.0, 5.0, 5.0], 2)
    parts = karmarkar_karp([1.0] * 6, 3)
    _assert_partition(parts, 6, 3)
    assert {len(part) for part in parts} == {2}


@pytest.mark.parametrize("k", [0, -2, 1.5, True, "3"])
def test_rejects_a_bad_number_of_parts(k):
    with pytest.raises(ValueError, match="positive integer number of parts k"):
        karmarkar_karp([1.0, 2.0], k)


@pytest.mark.parametrize("costs", [[1.0, -1.0], [1.0, math.nan], [math.inf]])
def test_rejects_negative_or_non_finite_costs(costs):
    with pytest.raises(ValueError, match="finite, non-negative costs"):
        karmarkar_karp(costs, 2)


def test_equal_size_needs_a_multiple_of_k():
    with pytest.raises(ValueError, match=r"number of items \(10\) to be a multiple of k=3"):
        karmarkar_karp(list(range(1, 11)), 3, equal_size=True)


def test_best_fit_decreasing_fills_the_fullest_bin_that_fits_and_reports_overflow():
    from hf_odc.packing._bin_packing import best_fit_decreasing

    sizes = [5, 4, 3, 1]  # largest first: 5 and 4 open two bins, 3 fits neither and opens the third,
    packed, overflow = best_fit_decreasing([0, 1, 2, 3], sizes, bins=3, capacity=6)
    assert sorted(packed) == [[0, 3], [1], [2]]  # and 1 goes to the fullest that fits: the 5
    assert overflow == []
    packed, overflow = best_fit_decreasing([0, 1, 2, 3], sizes, bins=2, capacity=6)
    assert sorted(packed) == [[0, 3], [1]] and overflow == [2]  # with two bins the 3 fits nowhere


def test_two_item_trades_keep_part_sizes_without_moves():
    """22 vs 20 where no single swap helps (differences 4 and 6 against a gap of 2) but trading {10, 1} for {6, 4}
    evens the parts; without moves every part keeps its four items."""
    from hf_odc.packing._exchange import exchange_pass

    values = [10.0, 10.0, 1.0, 1.0, 6.0, 6.0, 4.0, 4.0]
    for group_size, expected in ((1, [20.0, 22.0]), (2, [21.0, 21.0])):
        parts = [[0, 1, 2, 3], [4, 5, 6, 7]]
        exchange_pass(parts, values, allow_moves=False, stop_at=0.0, budget=100, group_size=group_size)
        assert sorted(len(part) for part in parts) == [4, 4]
        assert sorted(sum(values[i] for i in part) for part in parts) == expected


# --- machines of different speeds ---------------------------------------------------------------------------------


def _times(costs, parts, speeds) -> list[float]:
    return [total / speed for total, speed in zip(_part_sums(costs, parts), speeds, strict=True)]


def _machines_bound(costs, speeds) -> float:
    """No assignment to machines of ``speeds`` finishes sooner: all the work on all the machines; the ``j``
    costliest items on at most ``j`` machines, at best the fastest; and the crowding of the ``m`` costliest items:
    a machine of speed ``s`` holds ``c`` of them only by ``(sum of the c cheapest) / s``, so all ``m`` are placed
    only once ``m`` of these thresholds have passed (``m`` up to ``k``, ``j*k + 1`` and ``n``)."""
    descending, fastest = np.sort(costs)[::-1], np.sort(speeds)[::-1]
    n, k = len(costs), len(speeds)
    j = min(n, k)
    bound = max(math.fsum(costs) / math.fsum(speeds), max(np.cumsum(descending[:j]) / np.cumsum(fastest[:j])))
    for m in {*range(1, j + 1), *(j * k + 1 for j in range(1, (n - 1) // k + 1)), n}:
        thresholds = np.outer(np.cumsum(descending[:m][::-1]), 1 / fastest).ravel()
        bound = max(bound, np.partition(thresholds, m - 1)[m - 1])
    return float(bound)


def _straggler(k: int, seed: int, speed: float) -> list[float]:
    speeds = [1.0] * k
    speeds[seed % k] = speed
    return speeds


def _speed_vectors(k: int, seed: int) -> dict[str, list[float]]:
    """Random speeds in [0.5, 1], and a single straggler at 0.5 or 0.7 of the others' speed."""
    return {
        "random": np.random.default_rng([seed, k, 99]).uniform(0.5, 1.0, k).tolist(),
        "straggler-0.5": _straggler(k, seed, 0.5),
        "straggler-0.7": _straggler(k, seed, 0.7),
    }


@pytest.mark.parametrize(
    "speeds", [[1.0], [1.0, 2.0, 3.0], [1.0, 0.0], [1.0, -1.0], [1.0, math.nan], [1.0, math.inf], "12", 2, [1.0, None]]
)
def test_rejects_bad_speeds(speeds):
    with pytest.raises(ValueError, match=r"speeds must be 2 positive, finite numbers .* pass speeds=None"):
        karmarkar_karp([1.0, 2.0, 3.0], 2, speeds=speeds)


def test_equal_size_with_unequal_speeds_is_refused():
    with pytest.raises(ValueError, match=r"equal_size=True\) balances parts of equal counts on equally fast machines"):
        karmarkar_karp([1.0, 2.0, 3.0, 4.0], 2, equal_size=True, speeds=[1.0, 0.5])


@pytest.mark.parametrize(("n", "k"), [(0, 3), (2, 5), (7, 3), (64, 8), (300, 64)])
@pytest.mark.parametrize("speed", [1.0, 0.3, 2])
def test_equal_speeds_give_the_partition_without_speeds(n, k, speed):
    costs = np.random.default_rng([n, k, 2]).lognormal(0.0, 1.0, n).tolist()
    assert karmarkar_karp(costs, k, speeds=[speed] * k) == karmarkar_karp(costs, k)
    if n % k == 0:
        assert karmarkar_karp(costs, k, True, [speed] * k) == karmarkar_karp(costs, k, equal_size=True)


@pytest.mark.parametrize(("n", "k"), [(0, 3), (1, 2), (2, 5), (7, 3), (64, 8), (300, 64)])
def test_with_speeds_every_index_exactly_once_and_part_r_for_speed_r(n, k):
    costs = np.random.default_rng([n, k, 3]).lognormal(0.0, 1.0, n).tolist()
    speeds = np.random.default_rng([n, k, 4]).uniform(0.5, 1.0, k).tolist()
    parts = karmarkar_karp(costs, k, speeds=speeds)
    _assert_partition(parts, n, k)
    assert all(part == sorted(part) for part in parts), "indices ascending within a part"
    if n:  # part r is balanced for speed r (sorted by sum, the heaviest part could land on the slowest machine)
        assert max(_times(costs, parts, speeds)) <= _machines_bound(costs, speeds) * 1.25


@pytest.mark.parametrize("speeds", [[1.0, 0.5], [0.5, 1.0], [3.0, 1.5]])
def test_a_twice_as_fast_machine_gets_two_thirds_of_the_work(speeds):
    costs = np.random.default_rng(5).lognormal(0.0, 1.0, 60).tolist()
    parts = karmarkar_karp(costs, 2, speeds=speeds)
    fast = speeds.index(max(speeds))
    assert _part_sums(costs, parts)[fast] / math.fsum(costs) == pytest.approx(2 / 3, abs=1e-3)
    times = _times(costs, parts, speeds)
    assert max(times) <= 1.001 * min(times)


def test_a_large_item_goes_where_it_finishes_first():
    """Two big items and small ones on machines of speeds 0.5, 1 and 0.8: the 24 must run alone on the fastest
    (anywhere else it takes at least 30), so the 20 finishes at 25 at the earliest, alone on the 0.8 one; the small
    ones take 24 on the slowest. The search's bound proves it: of the two largest items, either both run on one
    machine (44 at the earliest) or the 20 finishes at 25 at the earliest (the crowding of the two costliest)."""
    costs, speeds = [24.0, 20.0, 4.0, 4.0, 4.0], [0.5, 1.0, 0.8]
    parts = karmarkar_karp(costs, 3, speeds=speeds)
    assert parts == [[2, 3, 4], [0], [1]]
    assert _times(costs, parts, speeds) == [24.0, 24.0, 25.0]
    assert _search_bound([2, 3, 4, 1, 0], costs, 3, False, speeds) == 25.0


def _brute_force(costs, speeds) -> float:
    k = len(speeds)
    labels = np.array(list(itertools.product(range(k), repeat=len(costs))))
    times = [((labels == part) * np.array(costs, dtype=float)).sum(axis=1) / speed for part, speed in enumerate(speeds)]
    return float(np.max(times, axis=0).min())


def test_with_speeds_near_the_brute_force_optimum_on_tiny_sets():
    """8 and 9 items on 2 and 3 machines of three speed vectors each: never better than the enumerated optimum (and
    both bounds no better), at most 5% worse; most are optimal."""
    rng = np.random.default_rng(7)
    speed_vectors = {2: [[1.0, 0.5], [0.6, 1.0], [1.0, 0.9]], 3: [[1.0, 0.5, 0.75], [0.7, 1.0, 1.0], [1.0, 1.0, 0.3]]}
    ratios = []
    for trial in range(16):
        n = 8 + trial % 2
        costs = (rng.integers(1, 50, size=n) if trial % 3 else rng.lognormal(0.0, 1.0, n)).tolist()
        for k, vectors in speed_vectors.items():
            for speeds in vectors:
                best = _brute_force(costs, speeds)
                got = max(_times(costs, karmarkar_karp(costs, k, speeds=speeds), speeds))
                assert best * (1 - 1e-12) <= got <= best * 1.05, (costs, speeds, got, best)
                assert _machines_bound(costs, speeds) <= best * (1 + 1e-12), "the test's bound is a valid bound"
                order = sorted(range(n), key=costs.__getitem__)
                floats = [float(c) for c in costs]
                assert _search_bound(order, floats, k, False, speeds) <= best * (1 + 1e-12), "so is the search's"
                ratios.append(got / best)
    assert sum(ratio <= 1 + 1e-9 for ratio in ratios) >= 0.7 * len(ratios)


@pytest.mark.parametrize(
    ("n", "k"), [(64, 2), (64, 4), (64, 8), (256, 3), (256, 16), (256, 32), (1024, 64), (1024, 128)]
)
@pytest.mark.parametrize("sigma", [1.0, 1.5])
def test_with_speeds_within_one_percent_of_the_lower_bound_on_lognormal_sets(n, k, sigma):
    for seed in range(5):
        costs = np.random.default_rng([seed, n, k, int(10 * sigma)]).lognormal(0.0, sigma, n).tolist()
        for kind, speeds in _speed_vectors(k, seed).items():
            worst = max(_times(costs, karmarkar_karp(costs, k, speeds=speeds), speeds))
            assert worst <= 1.01 * _machines_bound(costs, speeds), (seed, kind, worst / _machines_bound(costs, speeds))


@pytest.mark.parametrize(("name", "k"), [("longalign", 8), ("swe-smith", 16), ("uniform", 64)])
def test_with_speeds_within_one_percent_on_the_synthetic_length_sets(name, k):
    for seed in range(3):
        costs = sample_lengths(name, 16 * k, seed=[seed, k])
        for speeds in _speed_vectors(k, seed).values():
            assert max(_times(costs, karmarkar_karp(costs, k, speeds=speeds), speeds)) <= 1.01 * _machines_bound(
                costs, speeds
            )


def test_with_speeds_few_items_per_part_on_the_long_tailed_sets():
    """The grid of :func:`test_few_items_per_part_on_the_long_tailed_sets` on machines of each speed vector: 450
    partitions.

    Against the best assignments known (OR-Tools CP-SAT seeded with these results, 4 s per set) every result was
    within 0.9% (288 of 450 the best known, 3 above 0.5%). The lower bound is looser than those, which are up to
    1.5% above it (and the solver proved no better bound). Against the bound the results were at most 1.73% above
    (median 0.2%, 16 of 450 above 1%), hence the tolerances here.
    """
    ratios = []
    for name, n, per_part, seed in itertools.product(
        ("longalign", "swe-smith"), (64, 128, 256), (2, 3, 4, 6, 8), range(5)
    ):
        k = n // per_part
        costs = sample_lengths(name, n, seed=[seed, k])
        for speeds in _speed_vectors(k, seed).values():
            worst = max(_times(costs, karmarkar_karp(costs, k, speeds=speeds), speeds))
            ratios.append(worst / _machines_bound(costs, speeds))
    assert max(ratios) <= 1.02
    assert sum(ratio <= 1.01 for ratio in ratios) >= 0.95 * len(ratios)


def test_exchange_pass_with_speeds_aims_at_equal_times():
    """Sums 16 and 13 on speeds 1 and 0.25 take 16 and 52. Moving ``d`` from the slow part to the fast one lowers the
    top iff ``0 < d < 52 * 1 - 16 = 36``, best near ``(13 * 1 - 16 * 0.25) / 1.25 = 7.2``: moving a 9 gives 25 and
    16, the optimum. Aiming at half the gap of the sums (-1.5) would swap the 9 for the 7 first and end at 36."""
    from hf_odc.packing._exchange import exchange_pass

    values = [9.0, 7.0, 9.0, 4.0]
    parts = [[0, 1], [2, 3]]
    exchange_pass(parts, values, allow_moves=True, stop_at=0.0, budget=100, speeds=[1.0, 0.25])
    assert [sorted(part) for part in parts] == [[0, 1, 2], [3]]


def test_best_fit_decreasing_into_bins_of_different_sizes():
    from hf_odc.packing._bin_packing import best_fit_decreasing

    # Bins of 10 and 5 (10 holding 5 less): the 6 fits only the first; the 5 then fits both, the second exactly
    # (least room left: best fit); the 4 fits only what is left of the first.
    packed, overflow = best_fit_decreasing([0, 1, 2], [6, 5, 4], bins=2, capacity=10, shortfalls=[0, 5])
    assert packed == [[0, 2], [1]] and overflow == []
    packed, overflow = best_fit_decreasing([0, 1, 2], [6, 5, 5], bins=2, capacity=10, shortfalls=[0, 5])
    assert packed == [[0], [1]] and overflow == [2]
