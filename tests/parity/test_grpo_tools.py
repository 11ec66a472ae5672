"""ODCGRPOTrainer with TRL's tool calling and environments, on 2 CPU processes, against stock TRL GRPOTrainer on one
process (``tests/support/_grpo_tools.py``: scripted multi-turn rollouts, the same on both sides): generating with the
``"gathered"``, ``"sharded"`` and ``"static"`` modes keeps TRL's tool loop (its calls, ``max_tool_calling_iterations``,
tool results appended to the completion; the ranks decode different numbers of turns), the multi-turn completions are
packed and balanced whole, tool results included, the ranks running different numbers of microbatches, and the update
equals TRL's (loss, gradient norm, TRL's metrics and parameters); tool-result tokens get no gradient. The same checks
run with a colocated vLLM engine in tests/distributed/test_vllm.py."""

from __future__ import annotations

import pytest
from _grpo_tools import CASES, build_tool_tokenizer, check_probes, check_tool_training
from _parity import parity_runs

pytestmark = pytest.mark.slow  # every test starts processes
QUIET = {"TRL_EXPERIMENTAL_SILENCE": "1"}  # rollout_func and environment_factory are "experimental" in TRL 1.16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tokenizer = build_tool_tokenizer()
    return parity_runs(tmp_path_factory.mktemp("grpo_tools"), "_grpo_tools.py", CASES, env=QUIET,
                       vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_odc_grpo_with_tools_matches_stock_trl_on_one_process(runs, case):
    check_tool_training(runs[0][case], runs[1][case])


@pytest.mark.parametrize("case", list(CASES))
def test_tool_result_tokens_get_no_gradient(runs, case):
    check_probes(runs[1][case]["probes"])
