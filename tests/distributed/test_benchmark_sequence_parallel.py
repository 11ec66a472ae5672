"""The sequence-parallel benchmarks run end to end on 2 CPU processes (gloo, a tiny model), so that their GPU
commands cannot rot unnoticed: ``sft_throughput.py --sp-size 2`` (ODC+LB-Mini's group microbatches against FSDP2 +
LB-Micro with every microbatch split over a group), its ``--longest-document`` search, and ``ulysses_exchange.py``
(the all-to-all's share, fitted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _machine import scaled

pytestmark = pytest.mark.slow  # every test starts processes
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _torchrun(tmp_path: Path, script: str, *options: str) -> dict:
    """``benchmarks/<script>`` on 2 CPU processes with ``options``; its JSON."""
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(BENCHMARKS / script), *options, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "HF_ODC_PEAK_TFLOPS": "0.001"}  # a peak for the CPU, so that MFU is computed
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300, 2))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_sft_throughput_splits_long_documents_over_groups(tmp_path):
    result = _torchrun(tmp_path, "sft_throughput.py", "--model", "tiny", "--distribution", "longalign",
                       "--samples-per-device", "4", "--length-scale", "0.004", "--steps", "2", "--warmup", "1",
                       "--schemes", "Collective+LB-Micro,ODC+LB-Mini", "--predict-world-sizes", "8",
                       "--sp-size", "2")["results"][0]  # fmt: skip
    schemes, records, cap = result["summary"]["schemes"], result["records"], result["max_tokens"]
    assert list(schemes) == ["Collective+LB-Micro", "ODC+LB-Mini"]
    for row in schemes.values():
        assert row["tokens_per_second"] > 0 and row["mfu"] > 0 and len(row["peak_gib_per_rank"]) == 2
    # FSDP2 + LB-Micro: every microbatch split over the group of both ranks, so both run the same ones
    for rank in records:
        assert all(step["shared"] == len(step["microbatch_s"]) > 0 for step in rank["Collective+LB-Micro"])
    assert records[0]["Collective+LB-Micro"][0]["plan"] == records[1]["Collective+LB-Micro"][0]["plan"]
    # ODC+LB-Mini: the documents over the cap (and only those) split over the group, first, beside own microbatches
    steps = records[0]["ODC+LB-Mini"]
    assert any(step["shared"] > 0 for step in steps)
    for step, other in zip(steps, records[1]["ODC+LB-Mini"], strict=True):
        split = [i for group in step["groups"] for i in group]
        assert sorted(split) == [i for i, length in enumerate(step["lengths"]) if length > cap]
        assert step["shared"] == other["shared"] == len(split)


def test_sft_throughput_finds_the_longest_document(tmp_path):
    found = _torchrun(tmp_path, "sft_throughput.py", "--model", "tiny", "--sp-size", "2", "--longest-document",
                      "--start-length", "64", "--growth", "2", "--max-length", "128")["longest_document"]  # fmt: skip
    assert found["sp_size"] == 2 and found["longest"] == 128 and found["error"] is None
    assert [probe["length"] for probe in found["probes"]] == [64, 128]
    assert all(len(probe["peak_gib_per_rank"]) == 2 and probe["step_s"] > 0 for probe in found["probes"])


def test_ulysses_exchange_fits_the_all_to_alls_share(tmp_path):
    record = _torchrun(tmp_path, "ulysses_exchange.py", "--model", "tiny", "--lengths", "64,128", "--warmup", "1",
                       "--reps", "2")  # fmt: skip
    assert record["world_size"] == 2 and [row["length"] for row in record["rows"]] == [64, 128]
    for row in record["rows"]:
        assert all(ms > 0 for ms in row["ms"].values()) and row["sent"] == row["length"] / 4
        assert row["share"] == pytest.approx(row["model_exchange_ms"] / (row["token_ms"] * row["sent"]))
    assert math.isfinite(record["exchange"]) and record["exchange"] >= 0
