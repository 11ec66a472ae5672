"""``benchmarks/sft_throughput.py --longest-document``'s search stops at the first step that runs out of memory: the
probes before it are the result, the error names the length that failed, no longer one is tried. On GPUs a step runs
out of memory; here a stand-in step does, at a chosen length, on one gloo process (the 2-process run of the search
itself: tests/distributed/test_benchmark_sequence_parallel.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sft_throughput
from _models import tiny_qwen2_config


def test_the_search_stops_at_the_first_step_out_of_memory(tmp_path, monkeypatch):
    tried = []

    def step(model, optimizer, runner, batch, world_size, odc, device):
        tokens = sum(row["input_ids"].numel() for row in batch.microbatches)
        tried.append(tokens)
        if tokens >= 200:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return {"busy": 1.0, "wait": 0.5, "peak_gib": tokens / 100}

    monkeypatch.setattr(sft_throughput, "run_step", step)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        args = SimpleNamespace(sp_size=1, start_length=50, growth=2.0, max_length=10_000)
        model = SimpleNamespace(config=tiny_qwen2_config())
        found = sft_throughput.longest_document(args, model, None, None, torch.device("cpu"), None)
    finally:
        dist.destroy_process_group()
    assert tried == [50, 100, 200]
    assert found["longest"] == 100 and found["sp_size"] == 1
    assert found["error"] == "OutOfMemoryError at 200 tokens: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert found["probes"] == [
        {"length": 50, "step_s": 1.5, "peak_gib_per_rank": [0.5]},
        {"length": 100, "step_s": 1.5, "peak_gib_per_rank": [1.0]},
    ]
