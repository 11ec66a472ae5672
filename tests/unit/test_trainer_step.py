"""The pieces of the one step loop every ODC trainer shares: :class:`PlannedStep` and :class:`StepMetrics`."""

from __future__ import annotations

import math

import pytest
import torch

from hf_odc.trainer import PlannedStep, StepMetrics


def metrics() -> StepMetrics:
    return StepMetrics("cpu", sums=["loss"], means=["entropy"], minima=["low"], maxima=["high"])


def test_each_kind_reduces_over_the_ranks_as_its_name_says():
    ranks = []
    for values in ([1.0, 2.0, 0.5], [3.0, 4.0, float("nan")]):  # the second rank's first rollout trained nothing
        m = metrics()
        m.add("loss", torch.tensor(values[0]))
        m.add_mean("entropy", torch.tensor(values[1] * 10), torch.tensor(10.0))
        m.add_extreme("low", torch.tensor([values[2], 0.9]))
        m.add_extreme("high", torch.tensor([values[2], 0.25]))
        ranks.append(m.local().tolist())
    reduced = metrics().reduce(ranks)
    assert reduced["loss"] == 4.0
    assert reduced["entropy"] == pytest.approx(3.0)  # (20 + 40) / (10 + 10): a mean over every item, not over ranks
    assert reduced["low"] == 0.5 and reduced["high"] == 0.5  # the NaN is skipped, not propagated


def test_a_rank_without_microbatches_takes_its_place_and_changes_nothing():
    busy, idle = metrics(), metrics()
    busy.add_mean("entropy", 6.0, 3.0)
    busy.add_extreme("low", torch.tensor([0.2]))
    assert len(idle.local()) == len(busy.local()) == len(busy)  # the same layout in the one gather
    reduced = metrics().reduce([busy.local().tolist(), idle.local().tolist()])
    assert reduced["entropy"] == 2.0 and reduced["low"] == pytest.approx(0.2) and math.isnan(reduced["high"])


def test_nothing_counted_logs_zero_and_reset_empties_the_step():
    m = metrics()
    m.add("loss", 5.0)
    m.reset()
    assert metrics().reduce([m.local().tolist()]) | {"low": 0, "high": 0} == {
        "loss": 0.0, "entropy": 0.0, "low": 0, "high": 0
    }  # fmt: skip


def test_undeclared_or_mistyped_names_are_refused():
    m = metrics()
    with pytest.raises(KeyError, match="'kl' is not a declared metric"):
        m.add_mean("kl", 1.0, 1.0)
    with pytest.raises(KeyError, match="'entropy' is not a declared metric of this kind"):
        m.add("entropy", 1.0)
    with pytest.raises(ValueError, match="unique"):
        StepMetrics("cpu", sums=["x"], means=["x"])


def test_a_planned_step_counts_each_rank_share():
    step = PlannedStep(
        microbatches=[], microbatch_lengths=[[[3, 4], [5]], []], num_samples=3, num_tokens=12, num_loss_tokens=9,
        predicted_bubble_rate=0.5,
    )  # fmt: skip
    assert step.rank_tokens(0) == 12 and step.rank_tokens(1) == 0 and step.metrics == {}
    assert step.rank_documents(0) == 3 and step.rank_documents(1) == 0
    shared = PlannedStep(
        microbatches=[], microbatch_lengths=[[[3]], [[2, 2]]], num_samples=4, num_tokens=27, num_loss_tokens=27,
        predicted_bubble_rate=0.0, shared_lengths=[[20], [20]], sp_size=2,
    )  # fmt: skip
    assert [shared.rank_documents(rank) for rank in (0, 1)] == [2, 3]  # a group microbatch's document on both ranks
