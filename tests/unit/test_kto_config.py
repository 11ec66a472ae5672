"""``ODCKTOConfig`` validation, what ``ODCKTOTrainer`` refuses at construction, and how it chooses each example's
mismatched completion for TRL's KL estimate."""

from __future__ import annotations

from datasets import Dataset

from hf_odc.trainer import ODCKTOConfig
from hf_odc.trainer.preference.kto_trainer import _with_mismatched_completions


def config(tmp_path, **kwargs) -> ODCKTOConfig:
    return ODCKTOConfig(str(tmp_path), report_to="none", **kwargs)


def test_only_the_kto_loss_estimates_the_kl(tmp_path):
    assert config(tmp_path).calculate_kl
    assert not config(tmp_path, loss_type="apo_zero_unpaired").calculate_kl


def test_the_mismatched_completion_is_the_previous_one_of_the_global_batch():
    """As TRL on one process holding each accumulation call's batch: within each run of ``batch`` examples, the
    previous example's completion, the first taking the run's last (a short last run its own last)."""
    dataset = Dataset.from_dict({"completion_ids": [[i] for i in range(7)], "KL_completion_ids": [[9]] * 7})
    mismatched = _with_mismatched_completions(dataset, 3)["KL_completion_ids"]
    assert mismatched == [[2], [0], [1], [5], [3], [4], [6]]
