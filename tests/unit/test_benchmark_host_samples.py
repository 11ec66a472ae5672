"""``benchmarks/host_samples.py``: py-spy's raw stacks summarised under an anchor frame, per process."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from host_samples import summarise

WORKER = 'process 1:"python driver";process 7:"python -u worker --worker reward";main (w.py:1)'
OTHER = 'process 1:"python driver";process 8:"python -u worker --worker kto";main (w.py:1)'
LOOP = "_ODCTrainer._run_minibatch (/x/hf_odc/trainer/core/_base_trainer.py:330)"
PAD = "pad (/v/site-packages/torch/nn/functional.py:5430)"
OP = "OpOverload.__call__ (/v/site-packages/torch/_ops.py:865)"
RAW = "".join(
    f"{stack} {count}\n"
    for stack, count in (
        (f"{WORKER};{LOOP};{PAD}", 3),
        (f"{WORKER};{LOOP};{PAD};{OP}", 1),
        (f"{OTHER};{LOOP}", 5),
        (f"{WORKER};load (w.py:9)", 11),
    )
)


def test_only_the_anchors_stacks_count_with_their_innermost_and_every_frame(tmp_path):
    path = tmp_path / "run.raw.gz"
    with gzip.open(path, "wt") as out:
        out.write(RAW)
    summary = summarise(path, "_run_minibatch", process="--worker reward")
    assert summary["samples"] == 4 and summary["processes"] == {"process 7": 4}
    assert summary["self"] == {"pad (torch/nn/functional.py:5430)": 3, "OpOverload.__call__ (torch/_ops.py:865)": 1}
    assert summary["total"]["pad (torch/nn/functional.py:5430)"] == 4
    assert summary["total"]["_ODCTrainer._run_minibatch (hf_odc/trainer/core/_base_trainer.py:330)"] == 4
    everyone = summarise(path, "_run_minibatch", process=None)
    assert everyone["samples"] == 9 and everyone["processes"] == {"process 7": 4, "process 8": 5}
    assert summarise(path, "recompute_fn", process=None)["samples"] == 0
