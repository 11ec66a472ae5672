"""ODCRLOOTrainer on 2 CPU processes against stock TRL RLOOTrainer on one process holding the whole minibatch, on
fixed rollouts (the GRPO example's synthetic completions, returned in place of the decoding): RLOO's objective, the
KL penalty in the rewards with standardised and clipped advantages, a second iteration on old log-probabilities,
gradient accumulation and LoRA (with the KL too: its reference is the same model with the adapter disabled). The
loss, the gradient norm, TRL's metrics and the parameters after each step must agree (fp32). One launch of each
side covers every case (``tests/_grpo_parity.py``)."""

from __future__ import annotations

import pytest
import torch
from _grpo_parity import RLOO_CASES
from _models import tiny_qwen2_config
from _parity import assert_same_training, run_checked
from _trainer_launch import logged_steps, run
from transformers import Qwen2ForCausalLM

pytestmark = pytest.mark.slow  # every test starts processes
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
PER_SLICE = ("entropy", "clip_ratio/low_min", "clip_ratio/high_max")  # TRL's per accumulation slice


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rloo_parity")
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=507, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                               pad_token_id=0, eos_token_id=3)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory / "model")
    model, names = str(directory / "model"), list(RLOO_CASES)
    run_checked("_grpo_parity.py", "trl", model, str(directory / "trl.pt"), *names)
    run_checked("_grpo_parity.py", "odc", model, str(directory / "odc.pt"), *names, processes=2)
    return torch.load(directory / "trl.pt"), torch.load(directory / "odc.pt")


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_odc_rloo_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert len(reference["logs"]) == RLOO_CASES[case].get("max_steps", 1)
    accumulating = RLOO_CASES[case].get("gradient_accumulation_steps", 1) > 1
    assert_same_training(reference, ours, skip=TIMINGS + (PER_SLICE if accumulating else ()))


def test_the_kl_case_penalised_and_the_iterations_case_clipped(runs):
    """The cases exercise what they are for: a non-zero KL in the rewards, clipped ratios in the second iteration."""
    assert all(entry["kl"] != 0.0 for entry in runs[0]["rloo-kl"]["logs"][1:])
    assert runs[0]["rloo-iterations"]["logs"][1]["clip_ratio/region_mean"] > 0


def test_some_step_gave_the_ranks_different_microbatch_counts(runs):
    entries = [entry for result in runs[1].values() for entry in result["logs"]]
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in entries)


def test_the_default_example_generates_and_trains_on_two_processes(tmp_path):
    """``examples/rloo.py`` with no argument but the output and fewer steps: transformers generation on each rank,
    TRL's default ``beta`` (the reference model loaded from the saved initial policy and sharded), ODC updates."""
    run("rloo.py", "--max_steps", "2", "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2)
    logs = logged_steps(tmp_path)
    assert sorted(logs) == [1, 2]
    assert all(entry["completions/mean_length"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert all("kl" in entry and entry["scoring_s"] > 0 for entry in logs.values())
    assert (tmp_path / "model.safetensors").is_file()
