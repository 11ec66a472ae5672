"""Transports: memory every rank can reach, one-sided gather, one-sided scatter-accumulate.

:func:`make_transport` picks the implementation for a device: shared memory among the processes of one host on CPU
(:class:`CpuShmTransport`, ``"cpu-shm"``), CUDA symmetric memory with Triton kernels on NVIDIA GPUs
(:class:`~hf_odc.kernels.transports.cuda.CudaSymmMemTransport`, ``"cuda-symm-mem"``, imported only there), or the one
named.

:class:`ShmJob` (a shared-memory namespace among one host's processes) and :func:`host_id` are exported for
:mod:`hf_odc.liveness`, whose host barrier meets in shared memory of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._dev_shm import ShmJob, unlink_pending
from .cpu import CpuShmTransport
from .hosts import host_id, host_ranks
from .transport import SymmetricTensor, Transport

__all__ = [
    "TRANSPORTS",
    "CpuShmTransport",
    "ShmJob",
    "SymmetricTensor",
    "Transport",
    "host_id",
    "host_ranks",
    "make_transport",
    "unlink_pending",
]


TRANSPORTS: dict[str, str] = {"cpu-shm": "cpu", "cuda-symm-mem": "cuda"}
"""The transports by name, each with the device type its buffers live on."""


def make_transport(device: torch.device, group: dist.ProcessGroup | None = None, kind: str | None = None) -> Transport:
    """Collective: the transport ``kind`` (a name of :data:`TRANSPORTS`; ``None``: the one for ``device``'s type) for
    parameters living on ``device``, over the ranks of ``group``."""
    device = torch.device(device)
    if kind is None:
        kind = next((name for name, device_type in TRANSPORTS.items() if device_type == device.type), None)
        if kind is None:
            raise NotImplementedError(
                f"hf_odc has no transport for {device.type!r} devices; it has {sorted(TRANSPORTS)}."
            )
    if kind not in TRANSPORTS:
        raise ValueError(f"Unknown transport {kind!r}: use one of {sorted(TRANSPORTS)}.")
    if TRANSPORTS[kind] != device.type:
        raise ValueError(
            f"The {kind!r} transport serves {TRANSPORTS[kind]} tensors, but the model's parameters are on "
            f"{device.type}; pick the transport for that device (or leave it unset)."
        )
    if kind == "cpu-shm":
        return CpuShmTransport(group)
    from .cuda import CudaSymmMemTransport

    return CudaSymmMemTransport(device, group)
