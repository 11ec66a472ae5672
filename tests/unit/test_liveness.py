"""hf_odc.liveness without processes of its own: the kernels below it import nothing of it, and its one reader of
``/proc`` tells a running, a stopped and a gone process apart."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hf_odc._compat import UnsupportedLibraryError
from hf_odc.liveness import PeerFailureError, heartbeat, procfs
from hf_odc.liveness import bounded as liveness_bounded
from hf_odc.liveness.bounded import bounded, failing_together

PACKAGE = Path(__file__).resolve().parents[1] / "hf_odc"


def _imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_the_kernels_import_nothing_of_liveness():
    """The rule that keeps the arrows one way (docs/architecture.md): a transport is memory only, and meeting the
    peers is liveness's, above it."""
    for path in sorted((PACKAGE / "kernels").rglob("*.py")):
        upward = sorted(m for m in _imported_modules(path) if m.startswith("hf_odc.liveness"))
        assert not upward, f"{path.relative_to(PACKAGE.parent)} imports {upward}"


def _soon(condition) -> bool:
    """Whether ``condition()`` holds within 10 s (a busy machine schedules a signalled child late)."""
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_procfs_tells_running_stopped_and_gone_processes_apart():
    assert procfs.process_state(os.getpid()) == "R"
    assert procfs.parent(os.getpid()) == os.getppid()
    assert threading.get_native_id() in {int(tid) for tid in procfs.thread_ids()}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert procfs.visible(child.pid) and child.pid in procfs.pids()
        assert _soon(lambda: b"time.sleep(60)" in (procfs.command_line(child.pid) or b""))  # once it ran exec
        assert procfs.environment(child.pid).get(b"PATH") == os.environ["PATH"].encode()
        os.kill(child.pid, signal.SIGSTOP)
        assert _soon(lambda: procfs.stopped(procfs.process_state(child.pid)))
        assert not procfs.gone(procfs.process_state(child.pid))
        child.kill()
        assert _soon(lambda: procfs.gone(procfs.process_state(child.pid)))  # a zombie until reaped: gone all the same
    finally:
        child.kill()
        child.wait()
    assert procfs.process_state(child.pid) is None and procfs.parent(child.pid) is None


def test_importing_liveness_imports_no_torch():
    """It runs at hf_odc's first import, where ``hf-odc plan`` must start fast."""
    code = "import sys, hf_odc.liveness.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_torch_without_the_default_store_is_named_not_left_without_heartbeats(monkeypatch):
    """torch's private ``_get_default_store`` is checked where the heartbeat reads it: a torch that renamed it fails
    naming it, instead of running on silently without heartbeats."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
        with pytest.raises(UnsupportedLibraryError, match="_get_default_store"):
            heartbeat.start_in_default_group()
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


class _DeadPeer:
    """A :class:`~hf_odc.liveness.PeerWatch` whose rank 1 has died since the meeting."""

    def meet(self, what: str) -> None:
        pass

    def check(self) -> None:
        raise PeerFailureError("hf_odc: rank 1 (pid 4242) died")

    def abort(self, reason: str) -> None:
        pass


class _Terminated(Exception):
    """What the test's SIGTERM handler raises in place of ending pytest's process."""


def _terminate(signum, frame):
    raise _Terminated


class _Ended(Exception):
    """:func:`hf_odc.liveness.bounded._end_on_sigterm`, in place of ending pytest's process: the line it prints."""


@pytest.fixture
def sigterm(monkeypatch):
    """SIGTERM raises :class:`_Terminated` (the handler in place before hf_odc's), and hf_odc's end on it raises
    :class:`_Ended`, for the length of the test."""

    def end(line: str) -> None:
        raise _Ended(line)

    monkeypatch.setattr(liveness_bounded, "_end_on_sigterm", end)
    previous = signal.signal(signal.SIGTERM, _terminate)
    yield
    assert signal.getsignal(signal.SIGTERM) is _terminate  # hf_odc's handlers are gone with their blocks
    signal.signal(signal.SIGTERM, previous)


def test_a_launchers_sigterm_inside_a_collective_names_the_dead_peer_and_the_collective(sigterm):
    """torchrun sends the survivors SIGTERM as soon as a worker dies; inside a bounded collective the survivor says
    which rank died and in which collective, then ends on the signal without waiting for the collective."""
    line = (
        "PeerFailureError: hf_odc: rank 1 (pid 4242) died (the step's metrics gather failed: its launcher then ended "
        "this rank)"
    )
    reached = []
    with pytest.raises(_Ended, match=f"^{re.escape(line)}$"), bounded(_DeadPeer(), "the step's metrics gather"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # where the signal's handler runs
        reached.append("the collective's end")
    assert reached == []


class _Healthy(_DeadPeer):
    def check(self) -> None:
        pass


def test_a_launchers_sigterm_anywhere_in_a_run_names_the_peer_that_died(sigterm):
    """Outside the bounded collectives (a microbatch, the optimizer), the launcher's SIGTERM prints the
    PeerFailureError naming the dead peer and ends the rank, waiting for no cleanup."""
    line = "PeerFailureError: hf_odc: rank 1 (pid 4242) died (its launcher then ended this rank)"
    with pytest.raises(_Ended, match=f"^{re.escape(line)}$"), failing_together(_DeadPeer()):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)


def test_a_launchers_sigterm_with_every_peer_alive_reaches_the_handler_in_place(sigterm):
    with pytest.raises(_Terminated), failing_together(_Healthy()):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
