"""The CPU transport: shared memory among the processes of one host.

It makes ODC testable anywhere, without a GPU. Every symmetric tensor is one ``/dev/shm`` segment per rank, mapped by
every rank (see :mod:`hf_odc.kernels.transports._dev_shm`), so a read of a peer's shard is a plain copy from its
mapping. Concurrent ``add_`` from several processes into one owner would lose updates, so an accumulate holds a POSIX
byte-range lock on exactly the range it adds to: ranks pushing into different owners or layers never wait for each
other, and a lock held by a process that dies is released by the kernel, so a crash cannot wedge the survivors.
"""

from __future__ import annotations

import fcntl
import os

import torch
import torch.distributed as dist

from ._dev_shm import ShmJob
from .transport import SymmetricTensor, Transport

# Lock ranges are keyed by (buffer, owner) blocks of this many elements; buffers are far smaller than 2**40 elements.
_LOCK_BLOCK = 1 << 40


class CpuShmTransport(Transport):
    """:class:`~hf_odc.kernels.transports.transport.Transport` over ``/dev/shm``; collective to construct.

    Args:
        group: the process group whose ranks communicate (all on one host: it refuses one that spans hosts); ``None``
            is the default group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self._job = ShmJob(group)
        self.rank, self.world_size = self._job.rank, self._job.world_size
        self._lock_fd = self._job.open_shared_file()
        self._num_buffers = 0

    @property
    def segment_prefix(self) -> str:
        """The prefix of every shared-memory name this transport creates (to check that none is left behind)."""
        return self._job.prefix

    def allocate(self, numel: int, dtype: torch.dtype) -> SymmetricTensor:
        peers = self._job.map_tensors(numel, dtype)
        buf = SymmetricTensor(self.rank, peers[self.rank], self._num_buffers, peers=peers)
        self._num_buffers += 1
        return buf

    def scatter_accumulate(self, buf: SymmetricTensor, offset: int, numel: int, src: torch.Tensor) -> None:
        rows = src.view(self.world_size, numel)
        base = buf.index * self.world_size
        # Start with the next rank so that ranks pushing at the same moment visit owners in different orders.
        for i in range(1, self.world_size + 1):
            r = (self.rank + i) % self.world_size
            start = (base + r) * _LOCK_BLOCK + offset
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX, numel, start, os.SEEK_SET)
            try:
                buf.peers[r][offset : offset + numel].add_(rows[r])
            finally:
                fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, numel, start, os.SEEK_SET)

    def fence(self) -> None:
        """Nothing to wait for: a CPU write into shared memory is done when issued."""

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        # Unmapping is left to the garbage collector: tensors that users still hold (a ``.grad`` that views an
        # accumulation buffer) keep their mapping alive. The names were unlinked at setup, so nothing is left behind.
