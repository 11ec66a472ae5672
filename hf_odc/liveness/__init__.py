"""Liveness: how a rank learns that a peer died, gave up or went silent, and names it within the ODC timeout instead
of hanging.

A collective cannot name a peer that never arrives, so hf_odc watches its peers in these ways, each owned here:

* :mod:`~hf_odc.liveness.host_barrier`: the meetings among the processes of one host, in shared memory; they name a
  peer that died, aborted, stalled or arrived at another meeting.
* :mod:`~hf_odc.liveness.store_meeting`: the meetings of ranks on different hosts (hybrid ODC's replicas), in the job's
  store, with the job-wide abort key.
* :mod:`~hf_odc.liveness.heartbeat`: every rank's beat in the job's store; it names a rank that went silent (stopped,
  frozen) where no meeting waits: inside a collective, during startup.
* :mod:`~hf_odc.liveness.bounded`: every process group given the ODC timeout, and a collective that failed re-raised as
  :class:`PeerFailureError` naming the rank the watches know.
* :mod:`~hf_odc.liveness.launch`: what a process gets from hf_odc's first import: under a launcher, the parent-death
  signal and heartbeats from the start.

:mod:`~hf_odc.liveness.procfs` is the one reader of ``/proc`` (process and thread states, parents, environments).

Whatever meets a group of peers speaks one protocol, :class:`PeerWatch`: the host barrier, the store meeting (and
:class:`hf_odc.engine.hybrid.ReplicaGroup`, which meets through it) and the engine's :class:`hf_odc.ODC`, which
combines both; the runtime's bounded collectives (:meth:`hf_odc.accelerate_plugin.ODCRuntime.bounded`) name a failed
collective's culprit through it. The device kernels (:mod:`hf_odc.kernels`) sit below this package and never import
it: a transport is memory only.

Importing this package imports no torch: :mod:`~hf_odc.liveness.launch` runs at hf_odc's first import, where ``hf-odc
plan`` must start fast.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["DEFAULT_TIMEOUT_S", "PeerFailureError", "PeerWatch"]

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a rank waits for a live peer unless told otherwise (``HF_ODC_TIMEOUT``)."""


class PeerFailureError(RuntimeError):
    """A peer died, raised an error, or did not reach a meeting in time."""


class PeerWatch(Protocol):
    """A rank's view of a group of peers that meet at the same points in the same order."""

    def meet(self, what: str) -> None:
        """Wait until every peer arrives at ``what``, or raise :class:`PeerFailureError` naming the peer that died,
        gave up, did not arrive within the ODC timeout, or arrived at another meeting."""

    def check(self) -> None:
        """Raise :class:`PeerFailureError` naming a peer known to have died or given up; return at once otherwise."""

    def abort(self, reason: str) -> None:
        """Tell the peers that this rank gives up, so that their next meeting fails at once, naming it."""
