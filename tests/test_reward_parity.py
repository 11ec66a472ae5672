"""ODCRewardTrainer on 2 CPU processes against stock TRL RewardTrainer on one process holding the whole minibatch:
the pairwise loss, with a margin column and centred rewards, with gradient accumulation, and with LoRA (and PEFT's
trained copy of the score head). The loss, the gradient norm, TRL's metrics and the parameters after each of two steps
must agree (fp32), in steps where the ranks run different numbers of microbatches. And the example script, with no
argument, on two processes."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_qwen2_config
from _parity import assert_same_training, run_checked
from _reward_parity import CASES
from _trainer_launch import logged_steps, run
from transformers import Qwen2ForSequenceClassification

pytestmark = pytest.mark.slow  # every test starts processes

QUIET = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
TIMINGS = ("step_time",)
PER_SLICE = ("min_reward", "max_reward")  # with accumulation TRL averages each slice's extreme (ODCRewardConfig)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reward_parity")
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=507, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                               pad_token_id=0, eos_token_id=3, num_labels=1)  # fmt: skip
    Qwen2ForSequenceClassification(config).save_pretrained(directory / "model")
    model, names = str(directory / "model"), list(CASES)
    run_checked("_reward_parity.py", "trl", model, str(directory / "trl.pt"), *names, env=QUIET)
    run_checked("_reward_parity.py", "odc", model, str(directory / "odc.pt"), *names, processes=2, env=QUIET)
    return torch.load(directory / "trl.pt"), torch.load(directory / "odc.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_odc_reward_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert len(ours["logs"]) == len(reference["logs"]) == 2
    accumulating = CASES[case].get("gradient_accumulation_steps", 1) > 1
    assert_same_training(reference, ours, skip=TIMINGS + (PER_SLICE if accumulating else ()))
    assert reference["logs"][1]["margin"] != reference["logs"][0]["margin"]  # the first step moved the rewards
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in ours["logs"])


def test_the_default_example_trains_on_two_processes(tmp_path):
    """No argument but the output: the built-in pairs and a tiny reward model built from a config; ODC + LB-Mini."""
    run("reward.py", "--max_steps", "2", "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2)
    logs = logged_steps(tmp_path)
    assert sorted(logs) == [1, 2]
    assert all(entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert logs[2]["margin"] != logs[1]["margin"]
