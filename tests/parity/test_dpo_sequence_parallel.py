"""Preference pairs longer than a microbatch, with Accelerate's sequence parallelism taken over by hf_odc:
ODCDPOTrainer on 2 CPU processes launched with ``parallelism_config: {parallelism_config_sp_size: 2}`` trains pairs of
up to twice its microbatch's tokens as group microbatches of both ranks (each rank holds a slice of the pair's chosen
and rejected tokens; the pair's log-probability sums are the group's), beside short pairs on one rank each, exactly as
stock TRL ``DPOTrainer`` does on one process without a token budget: loss, gradient norm, TRL's metrics and the
parameters, with a reference model, with precomputed reference log-probabilities, with gradient accumulation and with
LoRA (the reference is the policy with its adapter disabled)."""

from __future__ import annotations

import pytest
from _dpo_parity import DIFFERENCES, LONG_PAIR_CASES, PER_SLICE, QUIET, TIMINGS
from _parity import SEQUENCE_PARALLEL, assert_same_case, assert_unequal_microbatches, parity_fixture

pytestmark = pytest.mark.slow  # every test starts processes

runs = parity_fixture("_dpo_parity.py", LONG_PAIR_CASES, env=QUIET, accelerate=SEQUENCE_PARALLEL)


@pytest.mark.parametrize("case", list(LONG_PAIR_CASES))
def test_long_pairs_train_as_on_one_process(runs, case):
    absolute = dict.fromkeys(DIFFERENCES, 2e-5)
    reference, ours = assert_same_case(
        runs, LONG_PAIR_CASES, case, skip=TIMINGS, per_slice=PER_SLICE, absolute=absolute
    )
    assert reference["logs"][1]["rewards/margins"] != 0.0
    # every step split pairs over both ranks (pairs of up to 96 tokens on 56-token microbatches), beside short ones
    assert all(entry["group_microbatches"] >= 1 for entry in ours["logs"]), ours["logs"]


def test_the_ranks_keep_unequal_microbatch_counts_beside_group_microbatches(runs):
    assert_unequal_microbatches(runs[1].values())
