"""Shared-memory segments among the processes of one host, named under ``/dev/shm`` only while they are being set up.

Each segment is a file in ``/dev/shm`` that every rank maps. As soon as every rank has mapped it, its creator unlinks
the name: the memory lives on while any process maps it and is returned to the system when the last one exits or is
killed. So a finished, crashed or SIGKILLed job leaves no ``hf_odc_*`` entry behind; only a kill inside the few
milliseconds between create and unlink can, and an ``atexit`` hook covers every exit that runs Python.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import mmap
import os
import uuid

import torch
import torch.distributed as dist

from .hosts import host_id

SHM_DIR = "/dev/shm"
SHM_PREFIX = "hf_odc_"

_pending_unlink: set[str] = set()


def unlink_pending() -> None:
    """Remove the names of segments still being set up (at exit, or before a process ends itself)."""
    for path in list(_pending_unlink):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _pending_unlink.discard(path)


atexit.register(unlink_pending)


class ShmJob:
    """The shared-memory namespace of one ODC instance: a unique prefix agreed on by every rank of ``group``.

    Construction is collective (it runs two object collectives on ``group``); so is every ``map_*`` call.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"hf_odc's host transport needs {SHM_DIR} (a tmpfs); it does not exist on this system.")
        me = (host_id(), os.getpid(), uuid.uuid4().hex)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, me, group=group)
        hosts = {h for h, _, _ in everyone}
        if len(hosts) > 1:
            by_host = {h: [r for r, e in enumerate(everyone) if e[0] == h] for h in sorted(hosts)}
            raise RuntimeError(
                "hf_odc's transports (CPU shared memory, CUDA symmetric memory) reach peers within one host, but "
                f"the ranks span {len(hosts)} hosts ({by_host}). Shard within each host and replicate across hosts "
                "(hybrid ODC: hf_odc.accelerate_plugin.shard_model does it when the job spans hosts); "
                "docs/multi_host.md has the design of a cross-host transport."
            )
        self.pids: tuple[int, ...] = tuple(e[1] for e in everyone)
        self.global_ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.prefix = f"{SHM_PREFIX}{everyone[0][2][:16]}"
        self._count = 0

    def _path(self, tag: str, rank: int) -> str:
        return os.path.join(SHM_DIR, f"{self.prefix}_{tag}_{rank}")

    def _create(self, path: str, nbytes: int) -> int:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _pending_unlink.add(path)
        try:
            # Reserve the pages now: tmpfs would otherwise accept the size and SIGBUS on the first touch past its limit.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            if e.errno == errno.ENOSPC:
                raise RuntimeError(
                    f"{SHM_DIR} has no room for {nbytes / 2**20:.1f} MiB of hf_odc buffers. Enlarge it (for a "
                    "container: `--shm-size`), or run fewer ranks per host."
                ) from e
            raise
        return fd

    def map_symmetric(self, nbytes: int) -> tuple[mmap.mmap, ...]:
        """Collective: one ``nbytes`` segment per rank, zero-filled; returns every rank's mapping, indexed by rank."""
        tag = f"s{self._count}"
        self._count += 1
        nbytes = max(nbytes, 1)
        own = self._path(tag, self.rank)
        fd = self._create(own, nbytes)
        try:
            dist.barrier(group=self.group)
            maps = []
            for r in range(self.world_size):
                if r == self.rank:
                    maps.append(mmap.mmap(fd, nbytes))
                    continue
                peer_fd = os.open(self._path(tag, r), os.O_RDWR)
                try:
                    maps.append(mmap.mmap(peer_fd, nbytes))
                finally:
                    os.close(peer_fd)
            dist.barrier(group=self.group)
        finally:
            os.close(fd)
            os.unlink(own)
            _pending_unlink.discard(own)
        return tuple(maps)

    def map_tensors(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Collective: :meth:`map_symmetric` viewed as one flat ``dtype`` tensor per rank (each keeps its mapping)."""
        nbytes = numel * dtype.itemsize
        return tuple(torch.frombuffer(m, dtype=torch.uint8)[:nbytes].view(dtype) for m in self.map_symmetric(nbytes))

    def open_shared_file(self) -> int:
        """Collective: a file descriptor, on every rank, of one file shared by the group (rank 0's), already unlinked.

        Used for POSIX byte-range locks, which the kernel releases by itself when a holder dies.
        """
        tag = f"f{self._count}"
        self._count += 1
        path = self._path(tag, 0)
        fd = self._create(path, 1) if self.rank == 0 else -1
        try:
            dist.barrier(group=self.group)
            if self.rank != 0:
                fd = os.open(path, os.O_RDWR)
            dist.barrier(group=self.group)
        finally:
            if self.rank == 0:
                os.unlink(path)
                _pending_unlink.discard(path)
        return fd
