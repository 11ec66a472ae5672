"""A meeting of ranks on different hosts, in the job's store, that cannot hang: hybrid ODC's replicas meet here.

A collective cannot name a peer that never arrives, so the replicas first meet in the job's store
(``arrived/<n>/<rank>`` keys holding the meeting's name, polled with the ODC timeout): a missing replica is named after
the timeout, a replica whose meeting ``n`` is another one is named at once, and a rank that gives up anywhere writes an
``abort`` key that every waiting rank, on any host, reads within milliseconds (the host barriers poll it too, through
:meth:`StoreMeeting.check`). It is the cross-host :class:`~hf_odc.liveness.PeerWatch`
(:class:`hf_odc.engine.hybrid.ReplicaGroup` meets through it before its all-reduce).
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from . import PeerFailureError

__all__ = ["StoreMeeting"]

_ABORT = "abort"


class StoreMeeting:
    """This rank (``rank``, a global rank) and ``ranks`` (every one that meets, this one included), meeting in ``store``
    (a namespace of the job's store shared by all of them); a meeting waits ``timeout`` seconds for a live peer."""

    def __init__(self, store: dist.Store, rank: int, ranks: list[int], timeout: float):
        self.rank, self.ranks, self.timeout = rank, ranks, timeout
        self._store = store
        self._meetings = 0

    def abort(self, reason: str) -> None:
        """Tell every rank of the job, on any host, that this rank gives up (the first reason written is kept)."""
        with contextlib.suppress(dist.DistError):  # the store's host is gone: the peers learn it from the store
            self._store.compare_set(_ABORT, "", f"rank {self.rank}: {reason}")

    def check(self) -> None:
        """Raise :class:`PeerFailureError` if any rank of the job gave up (cheap: one store lookup)."""
        try:
            aborted = self._store.check([_ABORT])
        except dist.DistError as e:
            raise PeerFailureError(self._store_gone(e)) from e
        if aborted:
            raise PeerFailureError(f"hf_odc: {self._store.get(_ABORT).decode(errors='replace')}")

    def meet(self, what: str) -> None:
        """Wait for every rank in the store; raises :class:`PeerFailureError` naming the rank that did not arrive at
        ``what`` within the timeout, the rank that gave up, or, at once, a rank whose meeting of the same number is
        another one (the ranks took different paths through the step: waiting would only time out)."""
        self._meetings += 1
        n = self._meetings
        try:
            self._store.set(f"arrived/{n}/{self.rank}", what)
            # Reaching meeting n means every replica arrived at n - 1, so each has finished waiting at n - 2 and no
            # longer reads that key. (Meeting n - 1's key is still read by a replica that has not yet seen it.)
            if n > 2:
                self._store.delete_key(f"arrived/{n - 2}/{self.rank}")
        except dist.DistError as e:
            raise PeerFailureError(self._store_gone(e)) from e
        self._wait_for_replicas(n, what)

    def _wait_for_replicas(self, n: int, what: str) -> None:
        start = time.monotonic()
        delay = 0.0
        waiting = [r for r in self.ranks if r != self.rank]
        while waiting:
            self.check()
            try:
                arrived = [r for r in waiting if self._store.check([f"arrived/{n}/{r}"])]
                for r in arrived:
                    self._check_same_meeting(n, r, what)
            except dist.DistError as e:
                raise PeerFailureError(self._store_gone(e)) from e
            waiting = [r for r in waiting if r not in arrived]
            if not waiting:
                return
            if time.monotonic() - start > self.timeout:
                # A replica held up by a stalled peer of its own host reports that peer at about this moment.
                self.await_report()
                raise PeerFailureError(
                    f"hf_odc: ranks {waiting} (replicas on other hosts) did not reach {what} within {self.timeout:g} s "
                    "(if they are that slow by design, raise --odc_timeout / HF_ODC_TIMEOUT)."
                )
            time.sleep(delay)
            delay = min(5e-3, delay * 2 + 5e-5)

    def _check_same_meeting(self, n: int, rank: int, what: str) -> None:
        theirs = self._store.get(f"arrived/{n}/{rank}").decode(errors="replace")
        if theirs != what:
            raise PeerFailureError(
                f"hf_odc: meeting {n} of the job differs between replicas: rank {rank} arrived at {theirs!r} where "
                f"rank {self.rank} arrived at {what!r}; every rank must meet at the same points in the same order (a "
                "decision taken per rank or per host where it must be taken for the whole job)."
            )

    def await_report(self) -> None:
        """Wait briefly (at most 5 s) for a rank to report why it gave up, and raise that report if one comes."""
        deadline = time.monotonic() + min(5.0, self.timeout)
        while time.monotonic() < deadline:
            self.check()
            time.sleep(0.05)

    @staticmethod
    def _store_gone(error: Exception) -> str:
        return (
            "hf_odc: the job's store is unreachable, so the process hosting it (rank 0, or the launcher) is gone: "
            f"{error}"
        )
