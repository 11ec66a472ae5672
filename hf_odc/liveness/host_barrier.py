"""A barrier among the processes of one host that cannot hang: it names the peer that died, aborted or stalled.

ODC meets its peers only twice per minibatch, so a barrier is cheap in count but must be robust: a peer killed in the
middle of a minibatch must end the others with a clear error in bounded time, not leave them waiting forever as a
collective would. Each rank owns a small control block in shared memory (its arrival count and the name of the meeting
it arrived at, its pid, an abort flag and reason); waiting ranks poll their peers' blocks and check that the peers'
processes are still alive. A peer that arrived at another meeting of the same number is named at once: the ranks took
different paths through the step, and waiting would only end in the timeout.

It is the host's :class:`~hf_odc.liveness.PeerWatch`. It meets; it does not wait for any device: a transport's writes
issued before a meeting are visible to every peer after it once each rank has fenced its device first
(:meth:`hf_odc.kernels.Transport.fence`, as :class:`hf_odc.ODC` does).
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.transports import ShmJob
from . import PeerFailureError, heartbeat, procfs

_ARRIVALS, _PID, _ABORTED = 0, 1, 2  # _ARRIVALS: the count << 32 | the meeting name's CRC-32, one aligned 64-bit write
_NAME_OFFSET, _REASON_OFFSET = 8, 24  # int64 slots; the meeting's name, then the abort reason, stored as bytes
_BLOCK_SLOTS = 64


class HostBarrier:
    """Barrier over control blocks ``blocks[r]`` (int64, one per rank, in memory every rank maps).

    Args:
        blocks: every rank's control block, indexed by rank (``blocks[rank]`` is this rank's).
        rank: this rank.
        pids: every rank's process id, to detect a dead peer; liveness is only checked when every pid is visible
            from this process (one pid namespace), otherwise the timeout alone bounds the wait.
        timeout: seconds a barrier waits for a live peer before it raises :class:`PeerFailureError`.
        names: what errors call each rank (its rank in the job, when the barrier's group is a subgroup); default
            the indices.
    """

    def __init__(
        self,
        blocks: tuple[torch.Tensor, ...],
        rank: int,
        pids: tuple[int, ...],
        timeout: float,
        names: tuple[int, ...] | None = None,
    ):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self._blocks = blocks
        self._rank = rank
        self._pids = pids
        self._check_pids = all(procfs.visible(p) for p in pids)
        self.timeout = timeout
        self._names = names if names is not None else tuple(range(len(blocks)))
        self._watchers: list[Callable[[], None]] = []
        self.segment_prefix: str | None = None
        """The prefix of the shared-memory names holding the blocks, when :meth:`create` made them (to check that
        none is left behind)."""
        self._arrivals = 0
        own = blocks[rank]
        own.zero_()
        own[_PID] = os.getpid()

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, timeout: float) -> HostBarrier:
        """Collective over ``group`` (``None``: the default group), whose ranks must share one host: a barrier among
        them, its control blocks in shared memory of its own. It refuses a group that spans hosts."""
        job = ShmJob(group)
        barrier = cls(job.map_tensors(_BLOCK_SLOTS, torch.int64), job.rank, job.pids, timeout, job.global_ranks)
        barrier.segment_prefix = job.prefix
        return barrier

    def _text(self, r: int, start: int, end: int) -> str:
        raw = self._blocks[r][start:end].numpy().tobytes()
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def _write_text(self, start: int, end: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[: (end - start) * 8 - 1]
        area = self._blocks[self._rank][start:end].numpy().view(np.uint8)
        area[:] = 0
        area[: len(data)] = np.frombuffer(data, dtype=np.uint8)

    def abort(self, reason: str) -> None:
        self._write_text(_REASON_OFFSET, _BLOCK_SLOTS, reason)
        self._blocks[self._rank][_ABORTED] = 1

    def watch(self, check: Callable[[], None]) -> None:
        """Also call ``check()`` at every liveness check while waiting (it raises :class:`PeerFailureError`)."""
        self._watchers.append(check)

    def _check_aborts(self) -> None:
        for r, block in enumerate(self._blocks):
            if r != self._rank and int(block[_ABORTED]):
                reason = self._text(r, _REASON_OFFSET, _BLOCK_SLOTS)
                raise PeerFailureError(f"hf_odc: rank {self._names[r]} aborted: {reason}")

    def _check_alive(self, waiting_for: list[int], what: str | None) -> None:
        if not self._check_pids:
            return
        for r in waiting_for:
            if not procfs.gone(procfs.process_state(self._pids[r])):
                continue
            if what and int(self._blocks[r][_ARRIVALS]) >> 32 >= self._arrivals:
                continue  # it arrived after ``waiting_for`` was read, passed and ended: not missing here
            if what:
                raise PeerFailureError(
                    f"hf_odc: rank {self._names[r]} (pid {self._pids[r]}) died before reaching {what}; its error, if "
                    "any, is in its own log."
                )
            raise PeerFailureError(
                f"hf_odc: rank {self._names[r]} (pid {self._pids[r]}) died; its error, if any, is in its own log."
            )

    def check(self) -> None:
        """Raise :class:`PeerFailureError` if a peer aborted or died; no waiting."""
        self._check_aborts()
        self._check_alive([r for r in range(len(self._blocks)) if r != self._rank], None)

    def meet(self, what: str = "the minibatch barrier") -> None:
        """Arrive, then return once every rank has arrived at least as many times as this one (``what``: the meeting
        point, as errors name it).

        A rank that gives up (a dead, aborted or late peer) marks itself aborted, so that peers arriving later fail
        too instead of going on with a minibatch that did not complete everywhere.
        """
        heartbeat.note(what)
        try:
            self._wait(what)
        except PeerFailureError as e:
            self.abort(f"gave up at the barrier: {e}")
            raise

    def _wait(self, what: str) -> None:
        self._arrivals += 1
        target = self._arrivals
        meeting = zlib.crc32(what.encode())
        # Count and name's CRC in one slot, so that a peer never reads the count of one meeting with the name of
        # another; the name itself only for the error (a peer at another meeting of this number stays there).
        self._write_text(_NAME_OFFSET, _REASON_OFFSET, what)
        self._blocks[self._rank][_ARRIVALS] = target << 32 | meeting
        start = time.monotonic()
        next_liveness_check = start
        delay = 0.0
        while True:
            self._check_aborts()
            arrivals = [int(b[_ARRIVALS]) for b in self._blocks]
            waiting_for = [r for r, a in enumerate(arrivals) if a >> 32 < target]
            for r, a in enumerate(arrivals):
                if a >> 32 == target and a & 0xFFFFFFFF != meeting:
                    raise PeerFailureError(
                        f"hf_odc: meeting {target} of the host differs between ranks: rank {self._names[r]} arrived at "
                        f"{self._text(r, _NAME_OFFSET, _REASON_OFFSET)!r} where rank {self._names[self._rank]} arrived "
                        f"at {what!r}; every rank must meet at the same points in the same order (a decision taken "
                        "per rank where it must be taken for the whole job)."
                    )
            if not waiting_for:
                return
            now = time.monotonic()
            if now >= next_liveness_check:
                self._check_alive(waiting_for, what)
                for check in self._watchers:
                    check()
                next_liveness_check = now + 0.05
            if now - start > self.timeout:
                raise PeerFailureError(
                    f"hf_odc: ranks {[self._names[r] for r in waiting_for]} did not reach {what} within "
                    f"{self.timeout:g} s "
                    "(if they are that slow by design, raise the timeout: --odc_timeout / `odc_timeout` with the "
                    "ODC trainers, `timeout` in hf_odc.enable(...), or the HF_ODC_TIMEOUT environment variable)."
                )
            time.sleep(delay)
            delay = min(1e-3, delay * 2 + 2e-5)
