"""ODCKTOTrainer on 2 CPU processes against stock TRL KTOTrainer on one process holding the whole minibatch: the KTO
loss with its KL estimate from mismatched completions (a reference model; precomputed reference log-probabilities of
both sequences and no reference model, with desirable/undesirable weights; gradient accumulation, one estimate per
accumulation call; LoRA, the reference being the policy with its adapter disabled) and the `apo_zero_unpaired` loss.
The loss, the gradient norm, TRL's metrics and the parameters after each of two steps must agree (fp32), in steps
where the ranks run different numbers of microbatches. And the example script, with no argument, on two processes."""

from __future__ import annotations

import pytest
import torch
from _kto_parity import CASES
from _models import tiny_qwen2_config
from _parity import assert_same_training, run_checked
from _trainer_launch import logged_steps, run
from transformers import Qwen2ForCausalLM

pytestmark = pytest.mark.slow  # every test starts processes

QUIET = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
TIMINGS = ("step_time",)
# With accumulation TRL averages these per accumulation call; ODC's are over the whole minibatch (ODCKTOConfig).
PER_CALL = ("entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "logps/chosen", "logps/rejected")  # fmt: skip
# beta x the difference of two sums of fp32 log-probabilities: a few 1e-6 apart however they are summed
DIFFERENCES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kto_parity")
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=507, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                               pad_token_id=0, eos_token_id=3)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory / "model")
    model, names = str(directory / "model"), list(CASES)
    run_checked("_kto_parity.py", "trl", model, str(directory / "trl.pt"), *names, env=QUIET)
    run_checked("_kto_parity.py", "odc", model, str(directory / "odc.pt"), *names, processes=2, env=QUIET)
    return torch.load(directory / "trl.pt"), torch.load(directory / "odc.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_odc_kto_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert len(ours["logs"]) == len(reference["logs"]) == 2
    accumulating = CASES[case].get("gradient_accumulation_steps", 1) > 1
    skip = TIMINGS + (PER_CALL if accumulating else ())
    assert_same_training(reference, ours, skip=skip, absolute=dict.fromkeys(DIFFERENCES, 2e-5))
    assert reference["logs"][1]["rewards/chosen"] != 0.0  # the policy left the reference in the first step
    if CASES[case].get("loss_type", "kto") == "kto":
        assert reference["logs"][1]["kl"] > 0.0  # the estimate is not the clamped zero
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in ours["logs"])


def test_the_default_example_trains_on_two_processes(tmp_path):
    """No argument but the output: the built-in examples, a reference model built from the same seed; ODC + LB-Mini."""
    run("kto.py", "--max_steps", "2", "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2)
    logs = logged_steps(tmp_path)
    assert sorted(logs) == [1, 2]
    assert all(entry["reference_s"] > 0 and entry["kl_s"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert logs[2]["kl"] != logs[1]["kl"]
