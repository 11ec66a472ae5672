"""The transport interface ODC is written against.

ODC needs four things from the machine, and nothing else:

* memory that every rank of the group can reach (``allocate``): each rank owns one block of the same size;
* a one-sided read of every peer's slice of that memory (``gather``), which the owner takes no part in;
* a one-sided, concurrency-safe accumulate into every peer's slice (``scatter_accumulate``): several ranks may push
  into one owner at the same moment, and no update may be lost;
* a barrier (``barrier``) that ends with an error naming the culprit when a peer dies or stalls, instead of hanging.

The CPU transport (:mod:`hf_odc.kernels.cpu`) implements it with shared memory between the processes of one host;
the GPU transport implements it with PyTorch symmetric memory. The FSDP wiring (:mod:`hf_odc.engine`) only ever
talks to this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a barrier waits for a live peer unless told otherwise (``HF_ODC_TIMEOUT``)."""


class PeerFailureError(RuntimeError):
    """A peer died, raised an error, or did not reach the minibatch barrier in time."""


@dataclass(frozen=True)
class SymmetricTensor:
    """One flat block per rank, all of the same numel and dtype, each reachable from every rank.

    ``peers[r]`` is a tensor over rank ``r``'s block (``peers[rank]`` is this rank's own, also ``local``);
    ``index`` numbers the buffers of one transport in allocation order.
    """

    rank: int
    peers: tuple[torch.Tensor, ...]
    index: int = 0

    @property
    def local(self) -> torch.Tensor:
        return self.peers[self.rank]

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
        is left as it is (FSDP already copied the local shard there). Both transports map every peer's block into
        this process, so a plain copy per peer is the read (on a GPU, a copy-engine transfer over NVLink).
        """
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
    def barrier(self) -> None:
        """Wait until every rank has arrived, and make every write issued before it visible to all ranks.

        Raises :class:`PeerFailureError` naming the rank if a peer died, aborted, or did not arrive within the
        transport's timeout.
        """

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Tell the peers that this rank gives up, so their next barrier fails at once instead of timing out."""

    @abstractmethod
    def close(self) -> None:
        """Release every buffer; safe to call twice. Leaves nothing behind (files, segments, processes)."""
