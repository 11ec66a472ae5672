"""The transport interface ODC is written against.

ODC needs three things from the machine's memory, and nothing else:

* memory that every rank of the group can reach (``allocate``): each rank owns one block of the same size;
* a one-sided read of every peer's slice of that memory (``gather``), which the owner takes no part in;
* a one-sided, concurrency-safe accumulate into every peer's slice (``scatter_accumulate``): several ranks may push
  into one owner at the same moment, and no update may be lost.

A transport is that memory half only. Meeting the peers, and naming one that died or stalled instead of hanging, is
:mod:`hf_odc.liveness`'s (:class:`hf_odc.liveness.host_barrier.HostBarrier`), which sits above the kernels: a writer
fences its device (``fence``), then meets; after the meeting every peer sees its writes.

The CPU transport (:mod:`hf_odc.kernels.transports.cpu`) implements it with shared memory between the processes of
one host; the GPU transport implements it with PyTorch symmetric memory. The FSDP wiring (:mod:`hf_odc.engine`) only
ever talks to this interface, and only ever touches a buffer's ``local`` block: how peers' blocks are reached is the
transport's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SymmetricTensor:
    """One flat block per rank, all of the same numel and dtype, each reachable from every rank.

    ``local`` is this rank's block. ``peers[r]`` is a tensor over rank ``r``'s block when the transport maps every
    block into this process (load/store addressable peers, as within one host), else ``None``; ``handle`` is whatever
    else the transport needs to reach them (opaque to everyone but the transport). ``index`` numbers the buffers of
    one transport in allocation order.
    """

    rank: int
    local: torch.Tensor
    index: int = 0
    peers: tuple[torch.Tensor, ...] | None = None
    handle: object = None

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


class Transport(ABC):
    """One-sided communication among the ranks of one process group (see the module docstring)."""

    rank: int
    world_size: int

    @abstractmethod
    def allocate(self, numel: int, dtype: torch.dtype) -> SymmetricTensor:
        """Collective: every rank calls it with the same arguments and gets a zero-filled symmetric tensor."""

    def gather(
        self, buf: SymmetricTensor, offset: int, numel: int, out: torch.Tensor, include_self: bool = True
    ) -> None:
        """``out.view(world_size, numel)[r] = buf.peers[r][offset:offset + numel]`` for every rank ``r``.

        ``out`` has ``buf``'s dtype; the owners are not involved. With ``include_self=False`` this rank's own row
        is left as it is (FSDP already copied the local shard there). Here, for transports that map every peer's
        block into this process (``buf.peers``), a plain copy per peer is the read (on a GPU, a copy-engine transfer
        over NVLink); a transport whose peers are not load/store addressable overrides it.
        """
        if buf.peers is None:
            raise NotImplementedError(f"{type(self).__name__} must implement gather(): its peers are not mapped.")
        rows = out.view(self.world_size, numel)
        for r, peer in enumerate(buf.peers):
            if r != self.rank or include_self:
                rows[r].copy_(peer[offset : offset + numel])

    @abstractmethod
    def scatter_accumulate(self, buf: SymmetricTensor, offset: int, numel: int, src: torch.Tensor) -> None:
        """``buf.peers[r][offset:offset + numel] += src.view(world_size, numel)[r]`` for every rank ``r``.

        Atomic with respect to every other rank's ``scatter_accumulate`` on the same range; the owners are not
        involved. ``src`` may be of a lower precision than ``buf`` (it is upcast before the add).
        """

    @abstractmethod
    def fence(self) -> None:
        """Wait until this rank's writes issued so far (its ``scatter_accumulate`` pushes, its own block) are done, so
        that the peers see them once the ranks next meet."""

    @abstractmethod
    def close(self) -> None:
        """Release every buffer; safe to call twice. Leaves nothing behind (files, segments, processes)."""
