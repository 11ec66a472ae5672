"""Heartbeats: every rank says in the job's store, about once per beat, that it runs and what it is doing, so that a
rank left waiting can name the rank that went silent, and what that rank was last doing.

A collective cannot name a peer that never arrives: gloo's timeout says "Timed out" and NCCL's names a sequence
number. ODC's meetings name a late rank (:mod:`hf_odc.liveness.host_barrier`), but a rank can stop *inside* a
collective, after every meeting, or before the first one: during startup, where no hf_odc code waits at all. So each
rank runs a daemon thread that writes its beat (a counter, its pid, host and clock, and what its main thread is doing)
every tenth of the ODC timeout (at most every second), and reads its peers' beats. A stopped process (SIGSTOP, a
debugger, a paused container) or a frozen one beats no more; a slow one still beats. A peer on the same host is silent
since the time its last beat carries; a peer on another host since this rank last saw its beat change (the hosts'
clocks need not agree).

Two uses:

* :func:`describe_silent` names the silent ranks when a collective failed
  (:func:`hf_odc.liveness.bounded.named_failure`), or says that every rank still beats and where each one is.
* The watchdog: a rank silent for longer than the ODC timeout (plus a grace period, so that hf_odc's own bounded
  waits, which raise a catchable error, come first) ends this process with a message naming it. That bounds the parts
  of a run that no hf_odc wait covers, startup above all (process-group creation, dataset preparation behind
  ``main_process_first``, the first barriers), whose process groups wait 30 minutes by default. A rank that is alive
  and working (still beating) is never ended on: it is waited for as long as the process groups' timeouts allow.
  A peer that exited cleanly says so in its last beat; one whose process is gone was not silent but died, which the
  launcher reports itself.

Under a launcher with an agent-hosted store (``torchrun``, ``accelerate launch``), beats start when hf_odc is imported
(:mod:`hf_odc.liveness.launch`); otherwise when ODC is enabled, in the default process group's store.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .._compat import default_store
from .._env import timeout_seconds
from ..kernels.transports import host_id, unlink_pending
from . import DEFAULT_TIMEOUT_S, procfs
from .procfs import gone, stopped

__all__ = [
    "Heartbeat",
    "current",
    "current_timeout",
    "describe_silent",
    "note",
    "set_timeout",
    "start",
    "start_in_default_group",
]

_EXITED = "exited"
_SEPARATOR = "\t"
_WATCHED_PER_INTERVAL = 16  # peers read per beat interval: a large job reads each peer less often, not all at once
_STORE_TIMEOUT_S = 5.0

_lock = threading.Lock()
_heartbeat: Heartbeat | None = None
_timeout: float | None = None  # the process's ODC timeout, once set or first read (set_timeout)


@dataclass
class _Peer:
    """What this rank knows of a peer: its last beat and when (this rank's monotonic clock) that beat changed."""

    beat: str | None = None
    changed_at: float = 0.0
    pid: int | None = None
    host: str | None = None
    written: float = 0.0  # the beat's wall-clock time, as its writer's clock says
    read_at: float = 0.0  # when this rank last read it (monotonic), and on the wall clock
    read_wall: float = 0.0
    doing: str = "starting (it has not beaten yet)"
    exited: bool = False


@dataclass(frozen=True)
class Silence:
    """A peer that has not beaten for ``seconds``; ``state`` is its process's state when it runs on this host."""

    rank: int
    seconds: float
    pid: int | None
    host: str | None
    doing: str
    state: str | None
    same_host: bool

    @property
    def died(self) -> bool:
        """Its process is gone (only known for a peer on this host)."""
        return self.same_host and gone(self.state)

    def describe(self) -> str:
        where = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        if self.host is not None and not self.same_host:
            where += f" on {self.host.split(':')[0]}"
        if self.died:
            how = "its process is gone"
        elif stopped(self.state):
            how = "its process is stopped: SIGSTOP, a debugger or a paused container"
        elif self.same_host:
            how = "its process runs but beats no more: hung, or busy without releasing Python's GIL"
        else:
            how = "stopped, hung, or its host is unreachable"
        return (
            f"rank {self.rank} ({where}) has not been heard from for {self.seconds:.1f} s ({how}); it was last seen "
            f"{self.doing}"
        )


class Heartbeat:
    """This rank's beat in ``store`` (keys ``<rank>``) and what it knows of its peers' beats.

    Args:
        store: a store every rank of the job reaches (its own client connection: a main thread blocked in the
            store must not block the beats).
        rank, world_size: this rank and the job's rank count.

    It beats every :func:`_interval` of the current ODC timeout (:func:`set_timeout`).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self._store = store
        self.rank, self.world_size = rank, world_size
        self._pid, self._host = os.getpid(), host_id()
        self._count = 0
        self._note = ""
        self._started = time.monotonic()
        self._last_read = self._started
        self._peers = {
            r: _Peer(changed_at=self._started, read_at=self._started) for r in range(world_size) if r != rank
        }
        self._reading = threading.Lock()
        self._order = sorted(self._peers, key=lambda r: (r - rank) % world_size)
        self._next_peer = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_odc_heartbeat", daemon=True)
        self._main = threading.main_thread().ident

    # -- this rank's beat ---------------------------------------------------------------------------------------------

    def note(self, what: str) -> None:
        """Say what hf_odc is about to do (a meeting point), for peers' messages."""
        self._note = what

    def doing(self) -> str:
        """What this rank's main thread is doing: hf_odc's last note and the innermost frames of its stack."""
        frame = sys._current_frames().get(self._main)
        where = _describe_stack(frame) if frame is not None else "with no main thread"
        return f"{where} (its last hf_odc meeting point: {self._note})" if self._note else where

    def _beat(self) -> None:
        self._count += 1
        fields = (str(self._count), str(self._pid), self._host, f"{time.time():.3f}", self.doing())
        value = _SEPARATOR.join(fields)
        self._store.set(str(self.rank), value)

    # -- the peers ----------------------------------------------------------------------------------------------------

    def _read(self, ranks: list[int]) -> None:
        """Read ``ranks``' beats, noting whose changed and when."""
        with self._reading:
            present = [r for r in ranks if self._peers[r].beat is not None or self._store.check([str(r)])]
            values = self._store.multi_get([str(r) for r in present]) if present else []
            now, wall = time.monotonic(), time.time()
            for r, raw in zip(present, values, strict=True):
                beat, peer = raw.decode("utf-8", "replace"), self._peers[r]
                if beat != peer.beat:
                    peer.beat, peer.changed_at = beat, now
                    fields = beat.split(_SEPARATOR, 4)
                    peer.exited = beat == _EXITED
                    if len(fields) == 5:
                        peer.pid, peer.host, peer.written, peer.doing = (
                            int(fields[1]),
                            fields[2],
                            float(fields[3]),
                            fields[4],
                        )
            for r in ranks:
                self._peers[r].read_at, self._peers[r].read_wall = now, wall
            self._last_read = now

    def _read_next(self) -> None:
        """Read the next peers in turn: all of them in a small job, :data:`_WATCHED_PER_INTERVAL` per beat in a large
        one (each beat would otherwise read every rank's key from one store)."""
        count = min(len(self._order), _WATCHED_PER_INTERVAL)
        self._read([self._order[(self._next_peer + i) % len(self._order)] for i in range(count)])
        self._next_peer = (self._next_peer + count) % len(self._order)

    def refresh(self) -> None:
        """Read every peer's beat now (after a failure: what :meth:`silent` then says is current)."""
        self._read(self._order)

    def silent(self, after: float) -> list[Silence]:
        """The peers (not exited) whose beat had not changed for more than ``after`` seconds when last read. A peer
        that never beat counts only when its process, found on this host, is stopped: one still importing its
        libraries is not silent, only slow to start."""
        found = []
        for r, peer in sorted(self._peers.items()):
            same_host = peer.host == self._host
            # On this host the beat's own time is on this clock; across hosts, count from when this rank saw it change.
            seconds = peer.read_wall - peer.written if same_host else peer.read_at - peer.changed_at
            if peer.exited or seconds <= after:
                continue
            pid = peer.pid if peer.beat is not None else _sibling_pid(r)
            same_host = same_host or (peer.beat is None and pid is not None)
            state = procfs.process_state(pid) if same_host and pid is not None else None
            if peer.beat is None and not stopped(state):
                continue
            found.append(Silence(r, seconds, pid, peer.host, peer.doing, state, same_host))
        return found

    def store_silent_for(self) -> float:
        """Seconds since this rank last read its peers' beats (the store stopped answering when it grows)."""
        return time.monotonic() - self._last_read

    def peers_doing(self) -> list[tuple[int, str]]:
        return [(r, peer.doing) for r, peer in sorted(self._peers.items()) if not peer.exited]

    # -- the thread ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, exited: bool) -> None:
        """Stop beating; with ``exited``, say so, so that peers do not take this rank for a silent one."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _STORE_TIMEOUT_S)
        if exited:
            with contextlib.suppress(Exception):
                self._store.set(str(self.rank), _EXITED)

    def _run(self) -> None:
        while True:
            try:
                self._beat()
                if self._peers:
                    self._read_next()
            except Exception:  # the store did not answer in time: try again next beat (a gone launcher ends us)
                pass
            else:
                self._watch()
            if self._stop.wait(_interval(current_timeout())):
                return

    def _watch(self) -> None:
        timeout = current_timeout()
        grace = _grace(timeout) if self._note else 0.0  # before ODC's first meeting no hf_odc wait bounds anything
        silent = [s for s in self.silent(timeout + grace) if not s.died]
        if not silent:
            return
        lines = "\n  ".join(s.describe() for s in silent)
        bound = f"the ODC timeout ({timeout:g} s)" + (f" plus {grace:g} s" if grace else "")
        message = (
            f"hf_odc: ending rank {self.rank}: a rank went silent for longer than {bound}:\n  {lines}\n"
            f"Rank {self.rank} was {self.doing()}. (If a rank is that slow by design, raise the timeout: --odc_timeout "
            "/ `odc_timeout`, `timeout` in hf_odc.enable(...), or HF_ODC_TIMEOUT.)"
        )
        _end_process(message)


# -- the process's heartbeat ------------------------------------------------------------------------------------------


def _interval(timeout: float) -> float:
    """Seconds between beats: a tenth of the timeout, between 0.1 s and 1 s."""
    return min(1.0, max(0.1, timeout / 10))


def _grace(timeout: float) -> float:
    """What the watchdog adds to the timeout: half of it, between 2 s and 10 s."""
    return min(10.0, max(2.0, timeout / 2))


def silent_after(timeout: float) -> float:
    """How long a peer's beat may stay unchanged before :func:`describe_silent` calls it silent."""
    return max(3 * _interval(timeout), 1.5)


def current() -> Heartbeat | None:
    """This process's heartbeat, once started."""
    return _heartbeat


def set_timeout(timeout: float | str | None = None) -> float:
    """Set the process's ODC timeout, the watchdog's bound (plus a grace period) on a peer's silence and what ODC's
    meetings wait: ``timeout``, else ``HF_ODC_TIMEOUT``, else :data:`~hf_odc.liveness.DEFAULT_TIMEOUT_S`, validated
    (the one place it is resolved); returns it. An :class:`~hf_odc.accelerate_plugin.ODCPlugin` sets it when built,
    ``hf_odc.enable`` when given one."""
    global _timeout
    _timeout = timeout_seconds(timeout, DEFAULT_TIMEOUT_S)
    return _timeout


def current_timeout() -> float:
    """The process's ODC timeout: the one set last (:func:`set_timeout`), else ``HF_ODC_TIMEOUT``, else
    :data:`~hf_odc.liveness.DEFAULT_TIMEOUT_S`."""
    return _timeout if _timeout is not None else set_timeout()


def note(what: str) -> None:
    """Tell the peers what this rank is about to do (a no-op before :func:`start`)."""
    if _heartbeat is not None:
        _heartbeat.note(what)


def start(store: dist.Store, rank: int, world_size: int) -> Heartbeat | None:
    """Start this process's heartbeat in ``store`` (a client of its own), once; ``None`` with one rank."""
    global _heartbeat
    with _lock:
        if _heartbeat is None and world_size > 1:
            heartbeat = Heartbeat(store, rank, world_size)
            heartbeat.start()
            atexit.register(heartbeat.stop, exited=True)
            _heartbeat = heartbeat
    return _heartbeat


def start_under_launcher() -> Heartbeat | None:
    """Start beating into the launcher's store (``torchrun``'s agent hosts it before any worker starts), if this
    process was started by one; else leave it to :func:`start_in_default_group`."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    set_timeout()
    try:
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=_STORE_TIMEOUT_S),
            wait_for_workers=False,
        )
        prefix = f"hf_odc/heartbeat/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ['TORCHELASTIC_RESTART_COUNT']}/"
        return start(dist.PrefixStore(prefix, client), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    except (KeyError, ValueError, RuntimeError):
        return None  # an unusual launcher: beats start with ODC, in the default group's store


def start_in_default_group() -> Heartbeat | None:
    """Start beating into a client of the default process group's store (once), unless already beating."""
    if _heartbeat is not None or not (dist.is_available() and dist.is_initialized()):
        return _heartbeat
    store = default_store()  # outside the try: a torch that renamed it fails here, naming it, not without beats
    try:
        store = store.clone()
        store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
    except (RuntimeError, NotImplementedError):
        return None  # a store that cannot open a second client (a file store): no beats
    return start(dist.PrefixStore("hf_odc/heartbeat/", store), dist.get_rank(), dist.get_world_size())


def describe_silent() -> str | None:
    """The ranks that went silent, each named with its process and what it was last doing; ``None`` without a
    heartbeat, or when no peer is silent (then :func:`describe_peers` says where they are)."""
    heartbeat = _heartbeat
    if heartbeat is None:
        return None
    with contextlib.suppress(Exception):  # the store is gone: say what the last reads said
        heartbeat.refresh()
    silent = heartbeat.silent(silent_after(current_timeout()))
    stale = heartbeat.store_silent_for()
    if silent and stale > silent_after(current_timeout()):
        return f"hf_odc: the job's store has not answered rank {heartbeat.rank}'s reads for {stale:.1f} s"
    if not silent:
        return None
    return "hf_odc: " + "; ".join(s.describe() for s in silent)


def describe_peers() -> str | None:
    """Where every peer was at its last beat (all of them still beating), or ``None`` without a heartbeat."""
    heartbeat = _heartbeat
    if heartbeat is None:
        return None
    return "; ".join(f"rank {r} was {doing}" for r, doing in heartbeat.peers_doing())


# -- helpers --------------------------------------------------------------------------------------------------------


def _describe_stack(frame) -> str:
    """``in f (file:line)``, and when that frame is torch's (or the standard library's), the innermost caller that
    is neither: the library or script code that called it."""
    frames = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False, limit=200)
    if not frames:
        return "idle"
    inner = frames[0]
    text = f"in {inner.name} ({_short(inner.filename)}:{inner.lineno})"
    if _plumbing(inner.filename):
        caller = next((f for f in frames if not _plumbing(f.filename)), None)
        if caller is not None:
            text += f" called from {caller.name} ({_short(caller.filename)}:{caller.lineno})"
    return text


_STDLIB = os.path.dirname(os.__file__)


_OWN = (__file__, os.path.join(os.path.dirname(__file__), "launch.py"))  # starting to beat


def _plumbing(path: str) -> bool:
    """Whether ``path`` is torch's, the standard library's, typing_extensions' (decorators' wrappers) or what starts
    the heartbeat (at import: the caller is the script's import line)."""
    in_stdlib = path.startswith(_STDLIB) and "site-packages" not in path
    return in_stdlib or f"{os.sep}torch{os.sep}" in path or path.endswith("typing_extensions.py") or path in _OWN


def _short(path: str) -> str:
    """A path from its package on: ``torch/distributed/distributed_c10d.py``, ``hf_odc/trainer/core/_step.py``."""
    for marker in (f"site-packages{os.sep}", f"{os.sep}hf_odc{os.sep}"):
        if marker in path:
            tail = path.rsplit(marker, 1)[1]
            return tail if marker.startswith("site") else f"hf_odc{os.sep}{tail}"
    return os.path.basename(path)


def _sibling_pid(rank: int) -> int | None:
    """The pid of rank ``rank`` among this process's siblings (a launcher's workers on this host), found by their
    ``RANK``: for a peer that never beat."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    me, parent = os.getpid(), os.getppid()
    for pid in procfs.pids():
        if pid == me or procfs.parent(pid) != parent:
            continue
        environ = procfs.environment(pid) or {}
        if environ.get(b"RANK") == str(rank).encode() and environ.get(b"TORCHELASTIC_RUN_ID") == run_id.encode():
            return pid
    return None


def _end_process(message: str) -> None:
    """End this process now, from the heartbeat's thread: its main thread is blocked where no exception reaches it.
    Shared-memory names still pending are removed first; the launcher sees the failure and ends the others."""
    with contextlib.suppress(Exception):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    unlink_pending()
    os._exit(1)
