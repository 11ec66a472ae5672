"""``--trainer-data``: the SFT harness (``benchmarks/_common.minibatches``) trains, step by step, the documents
``benchmarks/vs_trl.py``'s SFT rows train (samples read in order), so that the harness's and the trainer's tokens/s
compare the same minibatches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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
