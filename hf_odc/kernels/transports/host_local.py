"""What every transport among the processes of one host shares: the job's shared memory, its barrier and abort.

The peers' liveness, the barrier that names a dead or stalled peer (:mod:`hf_odc.kernels.transports.host_barrier`)
and the segment namespace (:mod:`hf_odc.kernels.transports._dev_shm`) do not depend on where the tensors live; a
subclass adds the memory and the accumulate, and says how to wait for its device before meeting
(:meth:`HostLocalTransport._drain`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from ...liveness.host_barrier import HostBarrier
from ._dev_shm import ShmJob
from .transport import DEFAULT_TIMEOUT_S, Transport

__all__ = ["HostLocalTransport"]


class HostLocalTransport(Transport):
    """Base of the host-local transports; collective to construct (it refuses a group that spans hosts).

    Args:
        group: the process group whose ranks communicate; ``None`` is the default group.
        timeout: seconds a barrier waits for a live peer before it raises.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self._job = ShmJob(group)
        self.rank, self.world_size = self._job.rank, self._job.world_size
        self._barrier = HostBarrier.create(self._job, timeout)

    @property
    def segment_prefix(self) -> str:
        """The prefix of every shared-memory name this transport creates (to check that none is left behind)."""
        return self._job.prefix

    def _drain(self) -> None:
        """Wait for this rank's device work before meeting the peers (CPU work is already done)."""

    def barrier(self, what: str = "the minibatch barrier") -> None:
        self._drain()
        self._barrier.wait(what)

    def check(self) -> None:
        self._barrier.check()

    def watch(self, check: Callable[[], None]) -> None:
        self._barrier.watch(check)

    def abort(self, reason: str) -> None:
        self._barrier.abort(reason)
