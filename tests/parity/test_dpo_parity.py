"""ODCDPOTrainer on 2 CPU processes against stock TRL DPOTrainer on one process holding the whole minibatch: with a
reference model, with precomputed reference log-probabilities and no reference model, with gradient accumulation,
with every supported loss type at once (weighted, with LD-DPO's weighting), with an f-divergence, and with LoRA (the
reference is the policy with its adapter disabled). The loss, the gradient norm, TRL's metrics and the parameters
after each of two steps must agree (fp32), in steps where the ranks run different numbers of microbatches."""

from __future__ import annotations

import pytest
from _dpo_parity import CASES, DIFFERENCES, PER_SLICE, QUIET, TIMINGS
from _parity import assert_same_case, assert_unequal_microbatches, parity_fixture

pytestmark = pytest.mark.slow  # every test starts processes


runs = parity_fixture("_dpo_parity.py", CASES, env=QUIET)


@pytest.mark.parametrize("case", list(CASES))
def test_odc_dpo_matches_stock_trl_on_one_process(runs, case):
    # With accumulation TRL averages per-slice token means; ODC's mean is over the whole minibatch (ODCDPOConfig).
    absolute = dict.fromkeys(DIFFERENCES, 2e-5)
    reference, ours = assert_same_case(runs, CASES, case, skip=TIMINGS, per_slice=PER_SLICE, absolute=absolute)
    assert len(ours["logs"]) == 2
    # The policy left the reference in the first step: the second step's rewards are not the trivial zeros.
    assert reference["logs"][1]["rewards/margins"] != 0.0
    assert_unequal_microbatches([ours])
