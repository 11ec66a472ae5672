"""How busy this machine is, so that the suite's timeouts scale with it: a timeout guards against a hang, and a run
that shares two cores with other jobs, or starts more processes than there are cores, is slow without hanging. And how
long the running test has left before pytest's own timeout, so that a launch helper ends its processes and fails with
their output first (pytest's timeout, firing in the middle of a wait, would leave them running)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

DEADLINE = "HF_ODC_TEST_DEADLINE"
"""Set by ``tests/conftest.py`` before each test's fixtures: when (``time.time()``) pytest's timeout ends the test."""
_MARGIN_S = 15.0  # for ending the processes and reporting before pytest's timeout fires


def scaled(seconds: float, processes: int = 1) -> float:
    """``seconds`` stretched by the processes per core beyond one and by the load average per core, as measured now
    (an idle machine with enough cores leaves it as it is)."""
    cores = os.cpu_count() or 1
    return seconds * max(1.0, processes / cores) * (1.0 + os.getloadavg()[0] / cores)


def within_test(seconds: float) -> float:
    """``seconds``, cut to what the running test has left before pytest's timeout (less a margin to end processes
    and report); unchanged outside pytest or when the test has no timeout."""
    deadline = float(os.environ.get(DEADLINE) or "inf")
    return max(1.0, min(seconds, deadline - _MARGIN_S - time.time()))


def run_process(command: list[str], timeout: float, **popen) -> tuple[int, str, str]:
    """Run ``command`` in a session of its own for at most ``timeout`` seconds (:func:`within_test` of it); return
    the exit status, stdout and stderr. On a timeout, or anything else that ends the wait (pytest's own timeout, an
    interrupt), the whole session is killed (the launcher and every rank it started) before this returns or raises.
    """
    timeout = within_test(timeout)
    process = subprocess.Popen(command, text=True, start_new_session=True, **popen)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(process)
        out, err = process.communicate()
        output = (out or "")[-8000:] + (err or "")[-8000:]
        raise AssertionError(f"{' '.join(command)} ran past {timeout:g} s:\n{output}") from None
    finally:
        _kill(process)
    return process.returncode, out or "", err or ""


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if process.poll() is None:
        process.wait()
