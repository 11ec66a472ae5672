"""Every collective around ODC's minibatches ends within the ODC timeout, with an error that names the culprit.

A collective cannot tell who is missing: gloo waits for its process group's timeout (30 minutes by default, and
transformers does not pass ``ddp_timeout`` to a CPU group) and then names nobody; a peer that died mid-collective
surfaces as "Connection reset by peer". So :class:`~hf_odc.accelerate_plugin.ODCRuntime`, for the trainers and
plain scripts alike (:meth:`~hf_odc.accelerate_plugin.ODCRuntime.bounded`),

* meets before each collective of a step (:meth:`hf_odc.ODC.meet`: ODC's host barrier, and across hosts the replicas'
  meeting), which names a rank that died, gave up or stalled since the last meeting, within the ODC timeout;
* gives every process group the ODC timeout (:func:`bound_process_groups`), so that a rank stalling *inside* a
  collective, after the meeting, is bounded too;
* turns a backend's failure into :class:`~hf_odc.PeerFailureError` naming the rank its
  :class:`~hf_odc.liveness.PeerWatch` (the engine's :class:`~hf_odc.ODC`) knows dead or aborted, or whose heartbeat
  stopped (:func:`named_failure`);
* names the dead rank when the launcher ends a survivor. torchrun sends the survivors SIGTERM a tenth of a second
  after a worker dies, before a loaded survivor has learned of the death, and the user would read only the launcher's
  report. So inside :func:`failing_together` and :func:`bounded` a SIGTERM prints the
  :class:`~hf_odc.PeerFailureError` naming the peer the watch knows dead or aborted (with the bounded block's name),
  then ends the rank as SIGTERM ends it, at once (:func:`_sigterm_names_the_dead`): no cleanup of a run whose peer is
  gone is waited for, as a collective or a meeting with the dead would block until the launcher's SIGKILL. Without a
  known failure the signal reaches the handler that was in place.

Its cost is a few meetings per optimizer step, each a host barrier in shared memory (measured in
``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._compat import process_groups, set_group_timeout
from . import PeerFailureError, PeerWatch, heartbeat

__all__ = ["bound_process_groups", "bounded", "failing_together", "is_backend_failure", "named_failure"]

_GRACE_S = 5.0  # how long a failed collective waits for the host to learn which peer died


def bound_process_groups(timeout: float) -> None:
    """Give every process group of the job (the default one, FSDP's mesh groups) ``timeout`` seconds per collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in process_groups():
        set_group_timeout(group, timedelta(seconds=timeout))


def is_backend_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because a peer went away or stalled (gloo, NCCL, the store)."""
    if isinstance(error, PeerFailureError):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "NCCL")
    )


def named_failure(watch: PeerWatch, what: str, error: BaseException, grace: float = _GRACE_S) -> PeerFailureError:
    """The :class:`PeerFailureError` for a collective of ``what`` that failed with ``error``: naming the rank ``watch``
    (the host, or, across hosts, the job's store) knows dead or aborted, else the ranks that went silent (their
    heartbeats, :mod:`hf_odc.liveness.heartbeat`), else saying where every rank is.

    A peer whose connection just closed has usually just died, but the host knows it dead only once its process is
    reaped (a killed process stays a zombie until its launcher waits for it, later on a loaded machine): so the host
    and the heartbeats are asked again for up to ``grace`` seconds before the error names nobody."""
    deadline = time.monotonic() + grace
    while True:
        try:
            watch.check()
        except PeerFailureError as known:
            return PeerFailureError(f"{known} ({what} failed: {error})")
        silent = heartbeat.describe_silent()
        if silent is not None:
            return PeerFailureError(f"{silent} ({what} failed: {error})")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    peers = heartbeat.describe_peers()
    return PeerFailureError(
        f"hf_odc: a collective of {what} failed and no rank is known to have died, given up or gone silent (a rank "
        f"was slower than the ODC timeout, or another host went away){f'; {peers}' if peers else ''}: {error}"
    )


@contextlib.contextmanager
def bounded(watch: PeerWatch | None, what: str) -> Iterator[None]:
    """Run the collectives of ``what`` once ``watch``'s ranks have met (a rank that died or stalled is named within
    the ODC timeout, where the collective would block); a collective that fails inside is re-raised as
    :class:`PeerFailureError` naming the rank if ``watch`` or the heartbeats know it. Every rank enters the same blocks
    in the same order. Without a watch (``None``: no ODC) the process groups' timeout alone bounds them."""
    if watch is None:
        yield
        return
    with _sigterm_names_the_dead(watch, what):
        watch.meet(f"{what} (hf_odc's meeting before its collectives)")
        try:
            yield
        except RuntimeError as error:
            if not is_backend_failure(error):
                raise
            raise named_failure(watch, what, error) from error


@contextlib.contextmanager
def _sigterm_names_the_dead(watch: PeerWatch, what: str | None = None) -> Iterator[None]:
    """Inside the block, a SIGTERM prints the :class:`PeerFailureError` naming the peer ``watch`` knows dead or
    aborted (the launcher ending a survivor; ``what``: the bounded block's name) and ends the process as SIGTERM ends
    it; without one, the handler that was in place gets it (by default the same end, silent). Only the main thread
    can handle signals: elsewhere the block runs as it is."""

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: installed by C code, not Python

    def handle(signum: int, frame: Any) -> None:
        try:
            watch.check()
        except PeerFailureError as known:
            why = "its launcher then ended this rank"
            _end_on_sigterm(f"PeerFailureError: {known} ({why if what is None else f'{what} failed: {why}'})")
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end_on_sigterm(line: str) -> None:
    """Print ``line`` (what ended the run) on stderr, then end the process as SIGTERM ends it."""
    print(line, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def failing_together(watch: PeerWatch | None, what: str = "training") -> Iterator[None]:
    """Around a whole run: if it fails on this rank, ``watch``'s peers are told at once (``abort``: their next meeting
    fails naming this rank), and a collective that failed because a peer went away is re-raised as
    :class:`PeerFailureError` naming it; the launcher's SIGTERM prints one naming the peer whose death made it end
    this rank (:func:`_sigterm_names_the_dead`)."""
    if watch is None:
        yield
        return
    try:
        with _sigterm_names_the_dead(watch):
            yield
    except BaseException as error:
        if isinstance(error, PeerFailureError):
            raise
        watch.abort(f"{type(error).__name__}: {error}")
        if is_backend_failure(error):
            raise named_failure(watch, what, error) from error
        raise
