"""Worker functions for the CPU transport tests."""

from __future__ import annotations

import os

import torch

from hf_odc.kernels import CpuShmTransport
from hf_odc.liveness.host_barrier import HostBarrier


def hammer(rank: int, world_size: int, numel: int, rounds: int) -> dict:
    """Every rank pushes into every owner ``rounds`` times at once; returns what each owner ends up holding."""
    t = CpuShmTransport()
    host = HostBarrier.create(None, timeout=30)
    acc = t.allocate(numel, torch.float32)
    params = t.allocate(numel, torch.bfloat16)
    params.local.copy_(torch.arange(numel) + 1000 * rank)
    t.fence()
    host.meet()
    gathered = torch.empty(world_size * numel, dtype=torch.bfloat16)
    t.gather(params, 0, numel, gathered)
    # Small integers in fp32 add exactly in any order, so a lost update shows as a wrong sum.
    src = torch.stack([torch.full((numel,), float(rank + 1 + owner)) for owner in range(world_size)])
    for _ in range(rounds):
        t.scatter_accumulate(acc, 0, numel, src.to(torch.bfloat16))
    t.fence()
    host.meet()
    out = {"acc": acc.local.clone(), "gathered": gathered.float(), "prefix": t.segment_prefix}
    t.close()
    return out


def two_hosts(rank: int, world_size: int) -> str:
    """Rank 1 presents itself as another host (``HF_ODC_HOST_ID``); building a transport must refuse, on every rank."""
    os.environ["HF_ODC_HOST_ID"] = str(rank)
    try:
        CpuShmTransport()
    except RuntimeError as e:
        return str(e)
    return ""
