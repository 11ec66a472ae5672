"""The GPU transport: PyTorch symmetric memory (CUDA backend) within one host, Triton for the accumulate.

* ``allocate``: ``symm_mem.empty`` + ``rendezvous``; every peer's block is mapped into this process, so a peer's
  shard is an ordinary CUDA tensor here (``get_buffer``).
* ``gather``: one device-to-device copy per peer out of its mapped block. The copy engines move the bytes over
  NVLink, leaving the SMs to the layer being computed meanwhile (FSDP issues it on its all-gather stream).
* ``scatter_accumulate``: one Triton launch of relaxed atomic adds into every owner's fp32 block through the peer
  pointers (:mod:`hf_odc.kernels.transports._triton_scatter`): no staging copy, no owner involvement, no extra memory.
* ``fence``: wait for this device's work, before the ranks meet (:mod:`hf_odc.liveness`'s host barrier).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..._compat import symmetric_memory
from ..._env import env
from .transport import SymmetricTensor, Transport

DEFAULT_SCATTER_PROGRAMS = 0  # uncapped; see _triton_scatter


class CudaSymmMemTransport(Transport):
    """:class:`~hf_odc.kernels.transports.transport.Transport` over CUDA symmetric memory; collective to construct.

    Args:
        device: this rank's GPU.
        group: the process group whose ranks communicate (all on one host); ``None`` is the default group.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self._symm_mem = symm_mem = symmetric_memory()
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)
        self._group = group if group is not None else dist.group.WORLD
        if symm_mem.get_backend(self.device) is None:
            symm_mem.set_backend("CUDA")
        # At most this many programs in the accumulate kernel (0: uncapped), a tuning knob; see _triton_scatter.
        self.max_programs = int(env("SCATTER_PROGRAMS") or DEFAULT_SCATTER_PROGRAMS)
        self._handles: list = []
        self._peer_ptrs: dict[int, torch.Tensor] = {}

    def allocate(self, numel: int, dtype: torch.dtype) -> SymmetricTensor:
        numel = max(numel, 1)
        local = self._symm_mem.empty(numel, dtype=dtype, device=self.device)
        handle = self._symm_mem.rendezvous(local, self._group)
        # symm_mem.empty may carve the tensor out of a larger symmetric segment (torch's implicit memory pool), and
        # get_buffer counts from the segment's start: exchange every rank's offset instead of assuming it is 0.
        offset = (local.data_ptr() - handle.buffer_ptrs[self.rank]) // local.element_size()
        offsets: list = [None] * self.world_size
        dist.all_gather_object(offsets, offset, group=self._group)
        peers = tuple(
            local if r == self.rank else handle.get_buffer(r, (numel,), dtype, storage_offset=offsets[r])
            for r in range(self.world_size)
        )
        local.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self._group)
        buf = SymmetricTensor(self.rank, local, len(self._handles), peers=peers)
        self._handles.append(handle)
        self._peer_ptrs[buf.index] = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)
        return buf

    def scatter_accumulate(self, buf: SymmetricTensor, offset: int, numel: int, src: torch.Tensor) -> None:
        from ._triton_scatter import scatter_add

        first_owner = (self.rank + 1) % self.world_size
        scatter_add(
            src,
            self._peer_ptrs[buf.index],
            buf.dtype,
            offset,
            numel,
            first_owner,
            self.max_programs,
        )

    def fence(self) -> None:
        """Wait for this GPU's work: the accumulate kernels and copies run on its streams."""
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._peer_ptrs.clear()
        self._handles.clear()
