"""ODCGRPOTrainer on 2 CPU processes against stock TRL GRPOTrainer on one process holding the whole minibatch, on
fixed rollouts (``examples/grpo.py``'s synthetic ones), for every loss type TRL 1.16 offers, the KL term (a LoRA
policy's too: its reference is the same model with the adapter disabled), the entropy bonus (static and adaptive),
``top_entropy_quantile``'s high-entropy token mask, a second iteration on old log-probabilities and the off-policy
mask: the loss, the gradient norm, TRL's metrics and the parameters after each step must agree (fp32). The re-planned
minibatch gives the two ranks different numbers of microbatches in some of these steps, which the test requires."""

from __future__ import annotations

import pytest
import torch
from _grpo_parity import CASES
from _models import tiny_qwen2_config
from _parity import assert_same_training, run_checked
from _trainer_launch import logged_steps, run
from transformers import Qwen2ForCausalLM

from hf_odc.trainer import PACKED_ATTENTION

pytestmark = pytest.mark.slow  # every test starts processes
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
PER_SLICE = ("entropy",)  # token means TRL logs per accumulation slice
QUIET = {"TRL_EXPERIMENTAL_SILENCE": "1"}  # rollout_func is "experimental" in TRL 1.16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo_parity")
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=507, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                               pad_token_id=0, eos_token_id=3)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory / "model")
    model, names = str(directory / "model"), list(CASES)
    run_checked("_grpo_parity.py", "trl", model, str(directory / "trl.pt"), *names, env=QUIET)
    run_checked("_grpo_parity.py", "odc", model, str(directory / "odc.pt"), *names, processes=2, env=QUIET)
    return torch.load(directory / "trl.pt"), torch.load(directory / "odc.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_odc_grpo_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert len(reference["logs"]) == CASES[case].get("max_steps", 1)
    # With accumulation TRL averages per-slice token means; ODC's mean is over the whole minibatch (ODCGRPOConfig).
    accumulating = CASES[case].get("gradient_accumulation_steps", 1) > 1
    assert_same_training(reference, ours, skip=TIMINGS + (PER_SLICE if accumulating else ()))


def test_the_reference_model_runs_packed_attention(runs):
    """With beta > 0 TRL builds the reference model with the policy's attention before ODC switches the policy; ODC
    switches the reference too, so its passes over packed rows build no dense T x T mask (the "kl" case's parity
    above holds with it)."""
    assert runs[0]["kl"]["ref_attention"] == "sdpa"
    assert runs[1]["kl"]["ref_attention"] == PACKED_ATTENTION
    assert all(runs[1][case]["ref_attention"] is None for case in CASES if "beta" not in CASES[case])


def test_some_step_gave_the_ranks_different_microbatch_counts(runs):
    entries = [entry for result in runs[1].values() for entry in result["logs"]]
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in entries)


def test_skewed_rollouts_are_rebalanced_without_a_hang(tmp_path):
    """Every completion drawn on rank 0 is long, rank 1's short: TRL's split would leave rank 1 idle most of the
    step; the plan evens the ranks' tokens out (its predicted bubble before and after is printed)."""
    output = run("grpo.py", "--rollouts", "skewed", "--max_steps", "3", "--max_completion_length", "96",
                 "--max_tokens_per_microbatch", "192", "--cost_model", "tokens", "--beta", "0.05",
                 "--steps_per_generation", "2", "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2,
                 env=QUIET)  # fmt: skip
    # the reference model (beta > 0) loads with the model_init_kwargs hf_odc sets: TRL's "ignored" would be false
    assert "model_init_kwargs" not in output, output[-3000:]
    logs = logged_steps(tmp_path)
    assert sorted(logs) == [1, 2, 3]
    for step, entry in logs.items():
        before, after = entry["predicted_bubble_rate_unbalanced"], entry["predicted_bubble_rate"]
        tokens = [entry["tokens/rank_0"], entry["tokens/rank_1"]]
        print(f"step {step}: predicted bubble {before:.1%} with TRL's split, {after:.1%} planned; tokens {tokens}")
        assert before > 0.2 and after < 0.05
        assert max(tokens) <= 1.1 * min(tokens)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_the_default_example_generates_and_trains_on_two_processes(tmp_path, peft):
    """No argument but the output (and ``--use_peft --beta 0.04``): transformers generation (each rank decoding
    alone, the default; a LoRA policy's generate enters below the FSDP root), then ODC updates (a LoRA policy's KL
    reference: the same model, adapter disabled); a LoRA run saves its adapter."""
    flags = ["--use_peft", "--beta", "0.04", "--max_steps", "1"] if peft else ["--max_steps", "2"]
    run("grpo.py", *flags, "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2,
        env=QUIET)  # fmt: skip
    logs = logged_steps(tmp_path)
    assert sorted(logs) == ([1] if peft else [1, 2])
    assert all(entry["completions/mean_length"] > 0 and entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert (tmp_path / "adapter_config.json").is_file() == peft
    assert (tmp_path / "model.safetensors").is_file() != peft
