"""Worker of tests/distributed/test_engine_timing.py (importable by the spawned processes)."""

from __future__ import annotations

import time

import torch
from _models import VOCAB, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hf_odc

SLEEP_S = 0.4


def sleeping_rank(rank: int, world_size: int, odc: bool) -> list[tuple[float, float]]:
    """Three minibatches of one microbatch each, rank 1 sleeping ``SLEEP_S`` in each; returns (busy, wait) of the
    last two (the first one warms up)."""
    model = tiny_model()
    mesh = init_device_mesh("cpu", (world_size,))  # a CPU test on any machine: FSDP2 would pick a GPU where one exists
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    runner = hf_odc.enable(model) if odc else hf_odc.CollectiveMinibatch(torch.device("cpu"))
    stats = []
    for step in range(3):
        with runner.minibatch():
            ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()  # collective in the FSDP2 case: equal counts
            if rank == 1:
                time.sleep(SLEEP_S)
        stats.append((runner.last.busy, runner.last.wait))
    if odc:
        runner.close()
    return stats[1:]
