"""The one reader of Linux's ``/proc``: process and thread states, parents, environments and command lines.

Every reader answers ``None`` where the entry is gone (the process or thread ended) or cannot be parsed, so that a
caller decides once what a missing answer means for it. A state letter is ``R``, ``S``, ``D``, ``T`` (stopped),
``t`` (traced), ``Z`` (zombie), ...; ``"?"`` when the process exists but its state cannot be read.
"""

from __future__ import annotations

import os

__all__ = [
    "command_line",
    "environment",
    "gone",
    "parent",
    "pids",
    "process_state",
    "stopped",
    "thread_ids",
    "thread_name",
    "thread_state",
    "thread_syscall",
    "visible",
]


def _stat(path: str) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (state, ppid, ...); ``None`` when it is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _state(path: str) -> str | None:
    try:
        fields = _stat(path)
    except OSError:
        return "?"
    return fields[0] if fields else None


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` on this host, or ``None`` when there is no such process."""
    return _state(f"/proc/{pid}/stat")


def gone(state: str | None) -> bool:
    """Whether a process in ``state`` has ended: no such process, or a zombie that its parent has not reaped yet."""
    return state is None or state in ("Z", "X", "x")


def stopped(state: str | None) -> bool:
    """Whether a process in ``state`` is stopped: SIGSTOP, or a debugger."""
    return state in ("T", "t")


def visible(pid: int) -> bool:
    """Whether process ``pid`` is visible from this process (the same pid namespace)."""
    return os.path.exists(f"/proc/{pid}")


def pids() -> list[int]:
    """Every process this process can see."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def parent(pid: int) -> int | None:
    """The parent's pid of process ``pid``."""
    try:
        fields = _stat(f"/proc/{pid}/stat")
        return int(fields[1]) if fields else None
    except (OSError, ValueError, IndexError):
        return None


def environment(pid: int) -> dict[bytes, bytes] | None:
    """The environment process ``pid`` started with (``None`` when it is not this user's to read)."""
    raw = _read(f"/proc/{pid}/environ")
    if raw is None:
        return None
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def command_line(pid: int) -> bytes | None:
    """Process ``pid``'s command line, its arguments separated by NUL bytes."""
    return _read(f"/proc/{pid}/cmdline")


def thread_ids() -> list[str]:
    """The ids of this process's threads."""
    try:
        return os.listdir("/proc/self/task")
    except OSError:
        return []


def thread_name(tid: str) -> str | None:
    """The name of this process's thread ``tid`` (what ``pthread_setname_np`` set)."""
    raw = _read(f"/proc/self/task/{tid}/comm")
    return raw.decode(errors="replace").strip() if raw is not None else None


def thread_state(tid: str) -> str | None:
    """The state letter of this process's thread ``tid``, ``None`` once it ended."""
    return _state(f"/proc/self/task/{tid}/stat")


def thread_syscall(tid: str) -> list[str] | None:
    """The system call this process's thread ``tid`` is blocked in: its number, then its arguments in hex."""
    raw = _read(f"/proc/self/task/{tid}/syscall")
    return raw.decode(errors="replace").split() if raw is not None else None
