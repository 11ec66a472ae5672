"""Rollouts longer than a microbatch, with Accelerate's sequence parallelism taken over by hf_odc: ODCGRPOTrainer's
update on 2 CPU processes launched with ``parallelism_config: {parallelism_config_sp_size: 2}`` trains rollouts of up
to twice its microbatch's tokens as group microbatches of both ranks (each rank scores the completion tokens of its
slice; a rollout's sequence-level ratio and its clip ratios' means are the group's sums), beside short rollouts on one
rank each, exactly as stock TRL ``GRPOTrainer`` does on one process, on fixed rollouts: loss, gradient norm, TRL's
metrics and the parameters, with the reference's KL, a sequence-level ratio, gradient accumulation with a second
iteration against the old policy, LoRA (its reference: the adapter disabled) and the high-entropy token mask."""

from __future__ import annotations

import pytest
from _grpo_parity import LONG_ROLLOUT_CASES, PER_SLICE, QUIET, TIMINGS
from _parity import SEQUENCE_PARALLEL, assert_same_case, parity_fixture

pytestmark = pytest.mark.slow  # every test starts processes

runs = parity_fixture("_grpo_parity.py", LONG_ROLLOUT_CASES, env=QUIET, accelerate=SEQUENCE_PARALLEL)


# With accumulation TRL logs its token means per slice (ODCGRPOConfig), the clip ratios' too (clipped on the second
# iteration)
CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.mark.parametrize("case", list(LONG_ROLLOUT_CASES))
def test_long_rollouts_train_as_on_one_process(runs, case):
    _, ours = assert_same_case(runs, LONG_ROLLOUT_CASES, case, skip=TIMINGS, per_slice=PER_SLICE + CLIP_MEANS)
    assert len(ours["logs"]) == LONG_ROLLOUT_CASES[case]["max_steps"]
    # the last step split rollouts over both ranks (up to 40-token completions after their prompts, on 32-token
    # microbatches; the first generation batch's are shorter)
    assert ours["logs"][-1]["group_microbatches"] >= 1, ours["logs"]
