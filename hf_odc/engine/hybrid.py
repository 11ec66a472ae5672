"""Hybrid ODC's one cross-host step: all-reduce each gradient shard with its replicas once per minibatch, bounded.

Across hosts the parameters are replicated (FSDP2's HSDP layout): rank ``r`` of every host owns the same shard. Inside a
minibatch each host runs ODC on its own; at the exit, after the host barrier, the owners of one shard on every host
sum their accumulators. That is one collective per dtype per minibatch, where HSDP runs one all-reduce per layer and
microbatch, and hosts may run different numbers of microbatches.

Nothing here may hang. The replicas first meet in the job's store (:class:`hf_odc.liveness.store_meeting.StoreMeeting`:
a missing or aborted replica is named instead of blocking the collective). The all-reduce itself runs on a process
group of its own whose timeout is the ODC timeout, so a replica that dies *during* it ends the others within the same
bound.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import default_store
from ..liveness import PeerFailureError
from ..liveness.store_meeting import StoreMeeting

__all__ = ["ReplicaGroup"]


class ReplicaGroup:
    """This rank and its replicas on the other hosts; :meth:`all_reduce` sums tensors across them, bounded in time.
    It meets, checks and aborts (:class:`~hf_odc.liveness.PeerWatch`) through its :class:`StoreMeeting`.

    Build it with :meth:`create` (collective over every rank of the job).
    """

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], store: dist.Store, timeout: float):
        self.group = group
        self.ranks = ranks  # global ranks, this one included
        self.rank = dist.get_rank()
        self.timeout = timeout
        self._meeting = StoreMeeting(store, self.rank, ranks, timeout)

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
        """Tell every rank of the job, on any host, that this rank gives up."""
        self._meeting.abort(reason)

    def check(self) -> None:
        """Raise :class:`PeerFailureError` if any rank of the job gave up."""
        self._meeting.check()

    def meet(self, what: str = "the minibatch's cross-host all-reduce") -> None:
        """Wait for every replica at ``what`` in the job's store (:meth:`StoreMeeting.meet`)."""
        self._meeting.meet(what)

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

    def _explain_collective_failure(self, error: RuntimeError) -> str:
        """Name who failed: a dying replica's host peers write the abort key within milliseconds."""
        try:
            self._meeting.await_report()
        except PeerFailureError as e:
            return f"{e} (the cross-host all-reduce with ranks {self.ranks} failed: {error})"
        return (
            f"hf_odc: the cross-host all-reduce with ranks {self.ranks} failed and no rank reported why (a replica "
            f"or its host went away): {error}"
        )

    def close(self) -> None:
        """Release the process group (local: no collective)."""
        dist.destroy_process_group(self.group)
