"""ODCDistillationTrainer on 2 CPU processes against stock TRL DistillationTrainer on one process holding the whole
step, on fixed completions (the GRPO example's synthetic ones, returned in place of the student's decoding) and a
teacher of the student's shape with other weights: TRL's reverse KL (its default), the forward KL, the generalized JSD
at another temperature, gradient accumulation and LoRA. The loss, the gradient norm, TRL's metrics and the parameters
after each step must agree (fp32). One launch of each side covers every case (``tests/_grpo_parity.py``)."""

from __future__ import annotations

import pytest
import torch
from _grpo_parity import DISTILLATION_CASES
from _models import tiny_qwen2_config
from _parity import assert_same_training, run_checked
from _trainer_launch import logged_steps, run
from transformers import Qwen2ForCausalLM

from hf_odc.trainer import PACKED_ATTENTION

pytestmark = pytest.mark.slow  # every test starts processes
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
PER_SLICE = ("entropy",)  # TRL's per accumulation slice


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("distillation_parity")
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=507, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                               pad_token_id=0, eos_token_id=3)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory / "model")
    model, names = str(directory / "model"), list(DISTILLATION_CASES)
    run_checked("_grpo_parity.py", "trl", model, str(directory / "trl.pt"), *names)
    run_checked("_grpo_parity.py", "odc", model, str(directory / "odc.pt"), *names, processes=2)
    return torch.load(directory / "trl.pt"), torch.load(directory / "odc.pt")


@pytest.mark.parametrize("case", list(DISTILLATION_CASES))
def test_odc_distillation_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert len(reference["logs"]) == DISTILLATION_CASES[case].get("max_steps", 1)
    accumulating = DISTILLATION_CASES[case].get("gradient_accumulation_steps", 1) > 1
    assert_same_training(reference, ours, skip=TIMINGS + (PER_SLICE if accumulating else ()))


def test_the_teacher_runs_packed_attention(runs):
    assert all(runs[0][case]["ref_attention"] == "sdpa" for case in DISTILLATION_CASES)
    assert all(runs[1][case]["ref_attention"] == PACKED_ATTENTION for case in DISTILLATION_CASES)


def test_some_step_gave_the_ranks_different_microbatch_counts(runs):
    entries = [entry for result in runs[1].values() for entry in result["logs"]]
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in entries)


def test_the_default_example_generates_and_trains_on_two_processes(tmp_path):
    """``examples/distill.py`` with no argument but the output and fewer steps: the student decodes on each rank with
    transformers, the teacher (sharded) scores the packed rows, ODC updates the student."""
    run("distill.py", "--max_steps", "2", "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2)
    logs = logged_steps(tmp_path)
    assert sorted(logs) == [1, 2]
    assert all(entry["completions/mean_length"] > 0 and entry["scoring_s"] > 0 for entry in logs.values())
    assert (tmp_path / "model.safetensors").is_file()
