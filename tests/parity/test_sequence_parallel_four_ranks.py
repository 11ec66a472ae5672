"""Sequence parallelism on 4 ranks: ODCSFTTrainer (groups of 2 and of 4), ODCDPOTrainer (groups of 2) and
ODCGRPOTrainer's update (one group of 4, a sequence-level ratio) on 4 CPU processes, the group size set per case
(Accelerate's ``ParallelismConfig(sp_size=N)`` given as the config's ``parallelism_config``, so that one launch runs
every case), train documents (pairs, rollouts) of up to ``sp_size`` times their microbatch's tokens as group
microbatches beside short ones on one rank each, exactly as the stock TRL trainer does on one process without a token
budget: loss, gradient norm, TRL's metrics and the parameters; SFT with LoRA and gradient accumulation together
too."""

from __future__ import annotations

import pytest
from _dpo_parity import DIFFERENCES
from _dpo_parity import PER_SLICE as DPO_PER_SLICE
from _dpo_parity import TIMINGS as DPO_TIMINGS
from _four_rank_parity import CASES, QUIET
from _grpo_parity import PER_SLICE as GRPO_PER_SLICE
from _grpo_parity import TIMINGS as GRPO_TIMINGS
from _parity import assert_same_case, parity_fixture
from _sft_parity import demo_token_fields

pytestmark = pytest.mark.slow  # every test starts processes

runs = parity_fixture(
    "_four_rank_parity.py",
    CASES,
    env=QUIET,
    processes=4,
    **demo_token_fields(),
)
SFT_CASES = [name for name in CASES if name.startswith("sft/")]
# SFT's cases are (samples, accumulation steps, microbatch tokens, settings); DPO's and GRPO's are their settings
SETTINGS = {name: {"gradient_accumulation_steps": CASES[name][1]} for name in SFT_CASES}
SETTINGS |= {name: case for name, case in CASES.items() if name not in SFT_CASES}
CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _assert_ranks_split_and_differ(logs: list[dict]) -> None:
    """Every step split documents over groups, and some rank ran a different number of microbatches than another."""
    assert all(entry["group_microbatches"] >= 1 for entry in logs), logs
    counts = [[entry[f"microbatches/rank_{rank}"] for rank in range(4)] for entry in logs]
    assert any(len(set(step)) > 1 for step in counts), counts


@pytest.mark.parametrize("case", SFT_CASES)
def test_long_documents_train_on_four_ranks_as_on_one_process(runs, case):
    _, ours = assert_same_case(runs, SETTINGS, case, per_slice=("entropy", "mean_token_accuracy"))
    _assert_ranks_split_and_differ(ours["logs"])


@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("dpo/")])
def test_long_pairs_train_on_four_ranks_as_on_one_process(runs, case):
    absolute = dict.fromkeys(DIFFERENCES, 2e-5)
    _, ours = assert_same_case(runs, SETTINGS, case, skip=DPO_TIMINGS, per_slice=DPO_PER_SLICE, absolute=absolute)
    assert all(entry["group_microbatches"] >= 1 for entry in ours["logs"]), ours["logs"]


@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("grpo/")])
def test_long_rollouts_train_on_four_ranks_as_on_one_process(runs, case):
    _, ours = assert_same_case(runs, SETTINGS, case, skip=GRPO_TIMINGS, per_slice=GRPO_PER_SLICE + CLIP_MEANS)
    assert len(ours["logs"]) == CASES[case]["max_steps"]
    assert ours["logs"][-1]["group_microbatches"] >= 1, ours["logs"]
