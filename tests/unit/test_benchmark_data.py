"""``--trainer-data``: the SFT harness (``benchmarks/_common.minibatches``) trains, step by step, the documents
``benchmarks/vs_trl.py``'s SFT rows train (samples read in order), so that the harness's and the trainer's tokens/s
compare the same minibatches. And which of ``vs_trl.py``'s GRPO rows run where."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pytest
import vs_trl
from _common import minibatches


def test_the_harness_trains_the_trainers_minibatches_in_order():
    args = argparse.Namespace(distribution="longalign", length_scale=0.01, seed=3, max_length=None, trainer_data=True)
    global_batch, steps = 6, 4
    samples = vs_trl.build_dataset(args, global_batch * steps, vocab_size=64)["input_ids"]
    trainer_steps = [[len(s) for s in samples[i * global_batch : (i + 1) * global_batch]] for i in range(steps)]
    harness_steps = [lengths for lengths, _ in minibatches(args, 64, global_batch, steps)]
    assert harness_steps == trainer_steps
    assert len({tuple(step) for step in trainer_steps}) == steps  # the steps differ: the order is checked


def test_vs_trl_leaves_out_the_vllm_rows_where_they_cannot_run_and_refuses_them(monkeypatch, capsys):
    """GRPO's vLLM rows: in the default rows where vLLM is installed and the completions are free; else left out with
    a line that says why, and refused (exit 2, the same reason) when ``--rows`` asks for one."""
    find_spec = importlib.util.find_spec
    free = ["--trainer", "grpo", "--completions", "free"]
    for installed in (True, False):
        spec = lambda name, *a, found=installed: (found or None) if name == "vllm" else find_spec(name, *a)  # noqa: E731
        monkeypatch.setattr(importlib.util, "find_spec", spec)
        for argv, reason in [(free, "vLLM is not installed"), (["--trainer", "grpo"], "need --completions free")]:
            runs = installed and argv is free
            expected = ["trl-default", "odc", "trl-vllm", "odc-vllm"] if runs else ["trl-default", "odc"]
            assert vs_trl.parse_args(argv).rows == expected
            assert (reason in capsys.readouterr().out) is not runs
            if not runs:
                with pytest.raises(SystemExit) as refused:
                    vs_trl.parse_args([*argv, "--rows", "odc,odc-vllm"])
                assert refused.value.code == 2 and reason in capsys.readouterr().err
