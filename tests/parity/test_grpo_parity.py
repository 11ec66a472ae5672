"""ODCGRPOTrainer on 2 CPU processes against stock TRL GRPOTrainer on one process holding the whole minibatch, on
fixed rollouts (``examples/grpo.py``'s synthetic ones), for every loss type TRL 1.16 offers, the KL term (a LoRA
policy's too: its reference is the same model with the adapter disabled), the entropy bonus (static and adaptive),
``top_entropy_quantile``'s high-entropy token mask, a second iteration on old log-probabilities and the off-policy
mask: the loss, the gradient norm, TRL's metrics and the parameters after each step must agree (fp32). The re-planned
minibatch gives the two ranks different numbers of microbatches in some of these steps, which the test requires."""

from __future__ import annotations

from pathlib import Path

import pytest
from _grpo_parity import CASES, PER_SLICE, QUIET, TIMINGS
from _machine import Concurrently
from _parity import assert_same_case, assert_unequal_microbatches, parity_fixture
from _trainer_launch import logged_steps, run

from hf_odc.trainer import PACKED_ATTENTION

pytestmark = pytest.mark.slow  # every test starts processes


def _skewed(background: Concurrently, directory: Path) -> tuple[str, Path]:
    output = run("grpo.py", "--rollouts", "skewed", "--max_steps", "3", "--max_completion_length", "96",
                 "--max_tokens_per_microbatch", "192", "--cost_model", "tokens", "--beta", "0.05",
                 "--steps_per_generation", "2", "--disable_tqdm", "true", "--output_dir", str(directory), processes=2,
                 env=QUIET, background=background, timeout=360)  # fmt: skip
    return output, directory


LAUNCHES = {"test_skewed_rollouts_are_rebalanced_without_a_hang": _skewed}
"""The other test's launch, queued with the parity launches (the example's default runs: ``hf-odc grpo``'s test,
tests/unit/test_cli_train.py)."""
runs = parity_fixture("_grpo_parity.py", CASES, examples=LAUNCHES, env=QUIET)


@pytest.mark.parametrize("case", list(CASES))
def test_odc_grpo_matches_stock_trl_on_one_process(runs, case):
    # With accumulation TRL averages per-slice token means; ODC's mean is over the whole minibatch (ODCGRPOConfig).
    reference, _ = assert_same_case(runs, CASES, case, skip=TIMINGS, per_slice=PER_SLICE)
    assert len(reference["logs"]) == CASES[case].get("max_steps", 1)


def test_the_reference_model_runs_packed_attention(runs):
    """With beta > 0 TRL builds the reference model with the policy's attention before ODC switches the policy; ODC
    switches the reference too, so its passes over packed rows build no dense T x T mask (the "kl" case's parity
    above holds with it)."""
    assert runs[0]["kl"]["ref_attention"] == "sdpa"
    assert runs[1]["kl"]["ref_attention"] == PACKED_ATTENTION
    assert all(runs[1][case]["ref_attention"] is None for case in CASES if "beta" not in CASES[case])


def test_some_step_gave_the_ranks_different_microbatch_counts(runs):
    assert_unequal_microbatches(runs[1].values())


def test_skewed_rollouts_are_rebalanced_without_a_hang(runs, request):
    """Every completion drawn on rank 0 is long, rank 1's short: TRL's split would leave rank 1 idle most of the
    step; the plan evens the ranks' tokens out (its predicted bubble before and after is printed)."""
    output, tmp_path = runs.example(request)
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
