"""Planning with group microbatches (``hf_odc.packing.sequence_parallel``): documents longer than a microbatch are
placed on a group of ranks and counted on each of them, the other documents balanced around that work."""

from __future__ import annotations

import numpy as np
import pytest

from hf_odc.packing import (
    CapacityError,
    GroupPlan,
    MinibatchPlanner,
    TokenCost,
    lb_mini,
    lb_mini_groups,
    shard_sizes,
    split_costs,
)


def test_without_a_long_document_the_plan_is_lb_minis():
    lengths = np.random.default_rng(0).integers(5, 64, size=24).tolist()
    plan = lb_mini_groups(lengths, 4, 64, group_size=2)
    assert plan.plan == lb_mini(lengths, 4, 64) and plan.groups == [[], []]


def test_a_groups_work_is_counted_on_each_of_its_ranks():
    """One 120-token document on 64-token microbatches: ranks 0 and 1 each run 60 of its tokens, so with 8 documents
    of 30 tokens each rank's share is 90 tokens: one short document beside the group's, three elsewhere. A planner
    that did not count the group's work on its ranks would give every rank two."""
    lengths = [30, 30, 30, 120, 30, 30, 30, 30, 30]
    plan = lb_mini_groups(lengths, 4, 64, group_size=2, exchange=0.0)
    assert plan.groups == [[3], []] and plan.shared(0) == plan.shared(1) == [3] and plan.shared(2) == []
    loads = [sum(rank) for rank in plan.rank_costs(lengths, "tokens", exchange=0.0)]
    assert loads == [90.0] * 4
    assert [sum(len(mb) for mb in rank) for rank in plan.plan] == [1, 1, 3, 3]


def test_every_document_runs_once_and_long_ones_are_spread_over_the_groups():
    rng = np.random.default_rng(1)
    lengths = [*rng.integers(4, 64, size=40).tolist(), 100, 90, 80, 70, 128]
    plan = lb_mini_groups(lengths, 8, 64, "attention", group_size=2)
    own = [i for rank in plan.plan for microbatch in rank for i in microbatch]
    shared = [i for group in plan.groups for i in group]
    assert sorted(own + shared) == list(range(len(lengths)))
    assert sorted(shared) == [40, 41, 42, 43, 44]  # the documents over 64 tokens, and only those
    assert all(sum(lengths[i] for i in microbatch) <= 64 for rank in plan.plan for microbatch in rank)
    assert all(group == sorted(group, key=lambda i: -lengths[i]) for group in plan.groups)  # longest first
    assert max(map(len, plan.groups)) <= 2  # five over four groups
    finish = [sum(rank) for rank in plan.rank_costs(lengths, "attention")]
    assert max(finish) <= 1.1 * sum(finish) / len(finish)


def test_what_no_group_holds_is_refused():
    with pytest.raises(CapacityError, match=r"Sample 1 has 130 tokens, more than sp_size=2 ranks x max_tokens=64"):
        lb_mini_groups([10, 130], 4, 64, group_size=2)
    with pytest.raises(ValueError, match=r"sp_size=3 must divide the number of processes \(4\)"):
        lb_mini_groups([10, 100], 4, 64, group_size=3)
    with pytest.raises(ValueError, match="runs with ODC and balance='lb-mini'"):
        MinibatchPlanner("lb-micro", 4, "layer", TokenCost(), group_size=2)


def test_a_split_document_costs_its_share_and_the_all_to_all():
    """Per rank: half of a 100-token document and a quarter of a token per token sent (25 of its 50 go to the other
    rank); with one rank, the document's cost."""
    assert split_costs([100], 2, "tokens", exchange=0.25).tolist() == [50 + 0.25 * 25]
    assert split_costs([100, 7], 1, "tokens").tolist() == [100, 7]
    assert shard_sizes(10, 3) == (4, 3, 3) and shard_sizes(6, 2) == (3, 3)


def test_the_run_planner_plans_groups_and_predicts_their_bubble():
    planner = MinibatchPlanner("lb-mini", 4, "minibatch", TokenCost(), group_size=2)
    lengths = [30, 30, 30, 120, 30, 30, 30, 30, 30]
    plan = planner.plan_groups(lengths, 64)
    assert isinstance(plan, GroupPlan) and plan.groups[0] == [3]
    assert 0 <= planner.predicted_bubble(plan, lengths, 64) < 0.1
    alone = MinibatchPlanner("lb-mini", 4, "minibatch", TokenCost()).plan_groups(lengths[:3], 64)
    assert alone.group_size == 1 and alone.groups == [[], [], [], []]
