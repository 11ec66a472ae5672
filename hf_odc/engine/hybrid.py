"""Hybrid ODC's one cross-host step: all-reduce each gradient shard with its replicas once per minibatch, bounded.

Across hosts the parameters are replicated (FSDP2's HSDP layout): rank ``r`` of every host owns the same shard. Inside a
minibatch each host runs ODC on its own; at the exit, after the host barrier, the owners of one shard on every host
sum their accumulators. That is one collective per dtype per minibatch, where HSDP runs one all-reduce per layer and
microbatch, and hosts may run different numbers of microbatches.

Nothing here may hang. A collective cannot name a peer that never arrives, so the replicas first meet in the job's
store (``arrived/<n>/<rank>`` keys holding the meeting's name, polled with the ODC timeout): a missing replica is
named after the timeout, a replica whose meeting ``n`` is another one is named at once, and a rank that gives up
anywhere writes an ``abort`` key that every waiting rank, on any host, reads within milliseconds (the host barriers
poll it too, see :meth:`ReplicaGroup.check`). The all-reduce itself runs on a process group of its own whose timeout
is the ODC timeout, so a replica that dies *during* it ends the others within the same bound.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import default_store
from ..kernels import PeerFailureError

__all__ = ["ReplicaGroup"]

_ABORT = "abort"


class ReplicaGroup:
    """This rank and its replicas on the other hosts; :meth:`all_reduce` sums tensors across them, bounded in time.

    Build it with :meth:`create` (collective over every rank of the job).
    """

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], store: dist.Store, timeout: float):
        self.group = group
        self.ranks = ranks  # global ranks, this one included
        self.rank = dist.get_rank()
        self.timeout = timeout
        self._store = store
        self._meetings = 0

    @classmethod
    def create(cls, replicate_group: dist.ProcessGroup, timeout: float) -> ReplicaGroup:
        """Collective over the whole job: a copy of every replica group (``replicate_group`` is this rank's, from the
        FSDP2 mesh) whose collectives time out after ``timeout`` seconds, and a store namespace shared by the job."""
        mine = dist.get_process_group_ranks(replicate_group)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, uuid.uuid4().hex))
        groups = sorted({tuple(ranks) for ranks, _ in every})
        group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], timeout=timedelta(seconds=timeout))
        store = dist.PrefixStore(f"hf_odc/{every[0][1][:16]}/", default_store())
        return cls(group, mine, store, timeout)

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

    def meet(self, what: str = "the minibatch's cross-host all-reduce") -> None:
        """Wait for every replica in the job's store; raises :class:`PeerFailureError` naming the replica that did not
        arrive at ``what`` within the timeout, the rank that gave up, or, at once, a replica whose meeting of the same
        number is another one (the ranks took different paths through the step: waiting would only time out)."""
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

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum each of ``tensors`` across the replicas, in place, once every replica has met (:meth:`meet`); every
        replica passes tensors of the same shapes. On a GPU the sums have completed when it returns (the minibatch's
        timing counts them)."""
        self.meet()
        try:
            for tensor in tensors:
                dist.all_reduce(tensor, group=self.group)
            if tensors and tensors[0].is_cuda:
                torch.cuda.current_stream(tensors[0].device).synchronize()
        except RuntimeError as e:
            raise PeerFailureError(self._explain_collective_failure(e)) from e

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
                self._await_report()
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

    def _await_report(self) -> None:
        """Wait briefly (at most 5 s) for a rank to report why it gave up, and raise that report if one comes."""
        deadline = time.monotonic() + min(5.0, self.timeout)
        while time.monotonic() < deadline:
            self.check()
            time.sleep(0.05)

    def _explain_collective_failure(self, error: RuntimeError) -> str:
        """Name who failed: a dying replica's host peers write the abort key within milliseconds."""
        try:
            self._await_report()
        except PeerFailureError as e:
            return f"{e} (the cross-host all-reduce with ranks {self.ranks} failed: {error})"
        return (
            f"hf_odc: the cross-host all-reduce with ranks {self.ranks} failed and no rank reported why (a replica "
            f"or its host went away): {error}"
        )

    @staticmethod
    def _store_gone(error: Exception) -> str:
        return (
            "hf_odc: the job's store is unreachable, so the process hosting it (rank 0, or the launcher) is gone: "
            f"{error}"
        )

    def close(self) -> None:
        """Release the process group (local: no collective)."""
        dist.destroy_process_group(self.group)
