"""ODCKTOTrainer on 2 CPU processes against stock TRL KTOTrainer on one process holding the whole minibatch: the KTO
loss with its KL estimate from mismatched completions (a reference model; precomputed reference log-probabilities of
both sequences and no reference model, with desirable/undesirable weights; gradient accumulation, one estimate per
accumulation call; LoRA, the reference being the policy with its adapter disabled) and the `apo_zero_unpaired` loss.
The loss, the gradient norm, TRL's metrics and the parameters after each of two steps must agree (fp32), in steps
where the ranks run different numbers of microbatches. (The example script, with no argument: ``hf-odc kto``'s test,
tests/unit/test_cli_train.py.)"""

from __future__ import annotations

import pytest
from _kto_parity import CASES
from _parity import assert_same_case, assert_unequal_microbatches, parity_fixture

pytestmark = pytest.mark.slow  # every test starts processes

QUIET = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
TIMINGS = ("step_time",)
# With accumulation TRL averages these per accumulation call; ODC's are over the whole minibatch (ODCKTOConfig).
PER_CALL = ("entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "logps/chosen", "logps/rejected")  # fmt: skip
# beta x the difference of two sums of fp32 log-probabilities: a few 1e-6 apart however they are summed
DIFFERENCES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")


runs = parity_fixture("_kto_parity.py", CASES, env=QUIET)


@pytest.mark.parametrize("case", list(CASES))
def test_odc_kto_matches_stock_trl_on_one_process(runs, case):
    absolute = dict.fromkeys(DIFFERENCES, 2e-5)
    reference, ours = assert_same_case(runs, CASES, case, skip=TIMINGS, per_slice=PER_CALL, absolute=absolute)
    assert len(ours["logs"]) == 2
    assert reference["logs"][1]["rewards/chosen"] != 0.0  # the policy left the reference in the first step
    if CASES[case].get("loss_type", "kto") == "kto":
        assert reference["logs"][1]["kl"] > 0.0  # the estimate is not the clamped zero
    assert_unequal_microbatches([ours])
