"""ODCGRPOTrainer with TRL's tool calling and environments, on 2 CPU processes, against stock TRL GRPOTrainer on one
process (``tests/support/_grpo_tools.py``: scripted multi-turn rollouts, the same on both sides): generating with the
``"gathered"``, ``"sharded"`` and ``"static"`` modes keeps TRL's tool loop (its calls, ``max_tool_calling_iterations``,
tool results appended to the completion; the ranks decode different numbers of turns), the multi-turn completions are
packed and balanced whole, tool results included, the ranks running different numbers of microbatches, and the update
equals TRL's (loss, gradient norm, TRL's metrics and parameters); tool-result tokens get no gradient."""

from __future__ import annotations

import pytest
import torch
from _grpo_tools import CASES, GENERATIONS, MAX_ITERATIONS, build_tool_tokenizer
from _parity import assert_same_training, parity_runs

pytestmark = pytest.mark.slow  # every test starts processes
TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
QUIET = {"TRL_EXPERIMENTAL_SILENCE": "1"}  # rollout_func and environment_factory are "experimental" in TRL 1.16
# Tokens of the step's rollouts: 4 of a short prompt (8 tokens) and 4 of a long one (17); completions of 2, 18, 19 and
# 20 tokens for the short one, 2, 18, 34 and 34 for the long one (calls of 6 tokens, each but a third one followed by
# its 8-token tool result, then the answer's words and the end of turn).
ROLLOUT_TOKENS = 4 * 8 + 4 * 17 + (2 + 18 + 19 + 20) + (2 + 18 + 34 + 34)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tokenizer = build_tool_tokenizer()
    return parity_runs(tmp_path_factory.mktemp("grpo_tools"), "_grpo_tools.py", CASES, env=QUIET,
                       vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_odc_grpo_with_tools_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert_same_training(reference, ours, skip=TIMINGS)
    (entry,) = ours["logs"]
    # the g-th generation calls the tool g times (a short prompt's at most once), but TRL's loop runs at most
    # MAX_ITERATIONS rounds
    calls = sum(min(g, 1) + min(g, MAX_ITERATIONS) for g in range(GENERATIONS)) / (2 * GENERATIONS)
    assert entry["tools/call_frequency"] == reference["logs"][0]["tools/call_frequency"] == calls
    # every rollout packed whole, tool results included, and the ranks given different numbers of microbatches
    assert entry["tokens/rank_0"] + entry["tokens/rank_1"] == ROLLOUT_TOKENS
    assert entry["microbatches/rank_0"] != entry["microbatches/rank_1"]


@pytest.mark.parametrize("case", list(CASES))
def test_tool_result_tokens_get_no_gradient(runs, case):
    """The gradient of the loss with respect to each completion token's log-probability, in every microbatch rank 0
    trained: zero at the tool results' tokens (loss mask 0 inside a completion), not at the model's own."""
    probes = runs[1][case]["probes"]
    assert probes
    tool_tokens = 0
    for gradient, token_index, mask in probes:
        inside = token_index > 0  # padding points at position 0
        tool, trained = inside & (mask == 0), inside & (mask == 1)
        tool_tokens += int(tool.sum())
        assert torch.all(gradient[tool] == 0)
        assert gradient[trained].abs().sum() > 0
    assert tool_tokens > 0
