"""Transports: memory every rank can reach, one-sided gather, one-sided scatter-accumulate, a barrier that cannot hang.

:func:`make_transport` picks the implementation for a device: shared memory among the processes of one host on CPU
(:class:`CpuShmTransport`), CUDA symmetric memory with Triton kernels on NVIDIA GPUs
(:class:`~hf_odc.kernels.cuda.CudaSymmMemTransport`, imported only there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cpu import CpuShmTransport
from .transport import DEFAULT_TIMEOUT_S, PeerFailureError, SymmetricTensor, Transport

__all__ = ["DEFAULT_TIMEOUT_S", "CpuShmTransport", "PeerFailureError", "SymmetricTensor", "Transport", "make_transport"]


def make_transport(
    device: torch.device, group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT_S
) -> Transport:
    """Collective: the transport for parameters living on ``device``, over the ranks of ``group``."""
    if device.type == "cpu":
        return CpuShmTransport(group, timeout=timeout)
    if device.type == "cuda":
        from .cuda import CudaSymmMemTransport

        return CudaSymmMemTransport(device, group, timeout=timeout)
    raise NotImplementedError(f"hf_odc has no transport for {device.type!r} devices; it supports cpu and cuda.")
