"""ODCDistillationTrainer on 2 CPU processes against stock TRL DistillationTrainer on one process holding the whole
step, on fixed completions (the GRPO example's synthetic ones, returned in place of the student's decoding) and a
teacher of the student's shape with other weights: TRL's reverse KL (its default), the forward KL, the generalized JSD
at another temperature, gradient accumulation and LoRA. The loss, the gradient norm, TRL's metrics and the parameters
after each step must agree (fp32). One launch of each side covers every case (``tests/support/_grpo_parity.py``)."""

from __future__ import annotations

import pytest
from _grpo_parity import DISTILLATION_CASES
from _parity import assert_same_case, assert_unequal_microbatches, parity_fixture

from hf_odc.trainer import PACKED_ATTENTION

pytestmark = pytest.mark.slow  # every test starts processes
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
PER_SLICE = ("entropy",)  # TRL's per accumulation slice


runs = parity_fixture("_grpo_parity.py", DISTILLATION_CASES)


@pytest.mark.parametrize("case", list(DISTILLATION_CASES))
def test_odc_distillation_matches_stock_trl_on_one_process(runs, case):
    reference, _ = assert_same_case(runs, DISTILLATION_CASES, case, skip=TIMINGS, per_slice=PER_SLICE)
    assert len(reference["logs"]) == DISTILLATION_CASES[case].get("max_steps", 1)


def test_the_teacher_runs_packed_attention(runs):
    assert all(runs[0][case]["ref_attention"] == "sdpa" for case in DISTILLATION_CASES)
    assert all(runs[1][case]["ref_attention"] == PACKED_ATTENTION for case in DISTILLATION_CASES)


def test_some_step_gave_the_ranks_different_microbatch_counts(runs):
    assert_unequal_microbatches(runs[1].values())
