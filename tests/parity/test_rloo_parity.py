"""ODCRLOOTrainer on 2 CPU processes against stock TRL RLOOTrainer on one process holding the whole minibatch, on
fixed rollouts (the GRPO example's synthetic completions, returned in place of the decoding): RLOO's objective, the
KL penalty in the rewards with standardised and clipped advantages, a second iteration on old log-probabilities,
gradient accumulation and LoRA (with the KL too: its reference is the same model with the adapter disabled). The
loss, the gradient norm, TRL's metrics and the parameters after each step must agree (fp32). One launch of each
side covers every case (``tests/support/_grpo_parity.py``)."""

from __future__ import annotations

import pytest
from _grpo_parity import RLOO_CASES
from _parity import assert_same_case, assert_unequal_microbatches, parity_fixture

pytestmark = pytest.mark.slow  # every test starts processes
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
PER_SLICE = ("entropy", "clip_ratio/low_min", "clip_ratio/high_max")  # TRL's per accumulation slice


runs = parity_fixture("_grpo_parity.py", RLOO_CASES)


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_odc_rloo_matches_stock_trl_on_one_process(runs, case):
    reference, _ = assert_same_case(runs, RLOO_CASES, case, skip=TIMINGS, per_slice=PER_SLICE)
    assert len(reference["logs"]) == RLOO_CASES[case].get("max_steps", 1)


def test_the_kl_case_penalised_and_the_iterations_case_clipped(runs):
    """The cases exercise what they are for: a non-zero KL in the rewards, clipped ratios in the second iteration."""
    assert all(entry["kl"] != 0.0 for entry in runs[0]["rloo-kl"]["logs"][1:])
    assert runs[0]["rloo-iterations"]["logs"][1]["clip_ratio/region_mean"] > 0


def test_some_step_gave_the_ranks_different_microbatch_counts(runs):
    assert_unequal_microbatches(runs[1].values())
