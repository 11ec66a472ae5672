"""Which host each rank runs on: what decides where one-sided transports reach and how a job is split into hosts.

A host is what can share memory: one hostname under one kernel boot (``/proc/sys/kernel/random/boot_id``).

``HF_ODC_HOST_ID`` overrides the identity, **for tests only**: ranks that set different values are treated as
different hosts, so that one machine can present, e.g., 4 processes as 2 hosts x 2 and exercise hybrid ODC. It never
makes ranks on different machines share memory: set it to different values, never to equal ones across machines.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from ..._env import env

__all__ = ["host_id", "host_ranks"]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """This process's host identity (``HF_ODC_HOST_ID`` when set, for tests)."""
    override = env("HOST_ID")
    if override is not None:
        return f"test-host:{override}"
    return f"{socket.gethostname()}:{_boot_id()}"


def host_ranks(group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Collective over ``group``: the group ranks of each host, hosts ordered by their lowest rank."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, host_id(), group=group)
    hosts: dict[str, list[int]] = {}
    for rank, host in enumerate(everyone):
        hosts.setdefault(host, []).append(rank)
    return list(hosts.values())
