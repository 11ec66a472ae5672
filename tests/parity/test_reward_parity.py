"""ODCRewardTrainer on 2 CPU processes against stock TRL RewardTrainer on one process holding the whole minibatch:
the pairwise loss, with a margin column and centred rewards, with gradient accumulation, and with LoRA (and PEFT's
trained copy of the score head). The loss, the gradient norm, TRL's metrics and the parameters after each of two steps
must agree (fp32), in steps where the ranks run different numbers of microbatches. (The example script, with no
argument: ``hf-odc reward``'s test, tests/unit/test_cli_train.py.)"""

from __future__ import annotations

import pytest
from _parity import assert_same_case, assert_unequal_microbatches, parity_fixture
from _reward_parity import CASES
from transformers import Qwen2ForSequenceClassification

pytestmark = pytest.mark.slow  # every test starts processes

QUIET = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
TIMINGS = ("step_time",)
PER_SLICE = ("min_reward", "max_reward")  # with accumulation TRL averages each slice's extreme (ODCRewardConfig)


runs = parity_fixture("_reward_parity.py", CASES, model_class=Qwen2ForSequenceClassification, env=QUIET, num_labels=1)


@pytest.mark.parametrize("case", list(CASES))
def test_odc_reward_matches_stock_trl_on_one_process(runs, case):
    reference, ours = assert_same_case(runs, CASES, case, skip=TIMINGS, per_slice=PER_SLICE)
    assert len(ours["logs"]) == 2
    assert reference["logs"][1]["margin"] != reference["logs"][0]["margin"]  # the first step moved the rewards
    assert_unequal_microbatches([ours])
