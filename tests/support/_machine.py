"""How busy this machine is, so that the suite's timeouts scale with it: a timeout guards against a hang, and a run
that shares two cores with other jobs, or starts more processes than there are cores, is slow without hanging. And how
long the running test has left before pytest's own timeout, so that a launch helper ends its processes and fails with
their output first (pytest's timeout, firing in the middle of a wait, would leave them running). And how to run
launches side by side where they leave the cores idle (:class:`Concurrently`)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from threading import Event, Lock

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


class Concurrently:
    """Launches that leave the cores idle much of their time (waiting for a stalled rank's timeout, a launcher's
    start-up and teardown, one rank waiting for the other) run side by side: each job, a function of this object that
    starts its processes, waits for them and returns what it saw, runs in a thread, at most ``at_once`` at a time, in
    the order given, while the tests go on; a test takes its own job's result with :meth:`result`, which raises what
    the job raised, and a job may wait for an earlier one's (begun before it: none waits for one not begun). A job
    starts its processes through :meth:`popen` or :meth:`run` (or hands them to :meth:`track`): leaving the ``with``
    block (a module fixture's teardown, after a test's timeout too) kills those still running, each with its session,
    and drops the jobs not begun. A job's timeouts are its own: :func:`within_test` would cut
    them to whichever test is running meanwhile, unless ``one_test``: every job is the running test's own, which waits
    for them all (a fixture's launches), and :meth:`run` cuts their timeouts to it."""

    def __init__(self, jobs: dict, at_once: int = 2, one_test: bool = False):
        self._lock, self._closed, self._processes, self._one_test = Lock(), False, [], one_test
        self._executor = ThreadPoolExecutor(at_once, thread_name_prefix="launch")
        self._futures, self._submitted = {}, Event()  # a job may wait for an earlier one's result while these start
        for key, job in jobs.items():
            self._futures[key] = self._executor.submit(job, self)
        self._submitted.set()

    @classmethod
    def of_tests(cls, request, directories, jobs: dict, at_once: int = 2, shared: dict | None = None) -> Concurrently:
        """For a module fixture (``request``, ``directories``: pytest's ``tmp_path_factory``): the job of each
        selected test of the module that takes the fixture, in the tests' order, ``jobs[test name](self, directory,
        **the test's parameters)`` with a directory of its own, by test id (the test's ``request.node.nodeid``).
        ``shared``: jobs that several tests read (a reference run), ``shared[key](self)``, by ``key``, started
        before the tests' (so that a test's job may wait for one with :meth:`result`)."""
        chosen = dict(shared or {})
        for item in request.session.items:
            takes = item.module is request.module and request.fixturename in item.fixturenames
            if takes and (shared is None or item.originalname in jobs):  # with shared jobs, a test may have none
                params = item.callspec.params if hasattr(item, "callspec") else {}
                directory = directories.mktemp(item.originalname[:30])
                chosen[item.nodeid] = functools.partial(jobs[item.originalname], directory=directory, **params)
        return cls(chosen, at_once)

    def result(self, key):
        """What the job ``key`` returned (waiting for it), or what it raised."""
        self._submitted.wait()
        return self._futures[key].result()

    def track(self, process: subprocess.Popen) -> subprocess.Popen:
        """Kill ``process``'s session when the block is left (``process`` started one of its own)."""
        with self._lock:
            self._processes.append(process)
            if self._closed:
                _kill(process)
        return process

    def popen(self, command: list[str], **popen) -> subprocess.Popen:
        """``subprocess.Popen(command, **popen)`` in a session of its own, tracked."""
        return self.track(subprocess.Popen(command, start_new_session=True, **popen))

    def limit(self, timeout: float) -> float:
        """A job's ``timeout``: its own, or with ``one_test`` cut to the running test's (:func:`within_test`)."""
        return within_test(timeout) if self._one_test else timeout

    def run(self, command: list[str], timeout: float, **popen) -> tuple[int, str, str]:
        """:func:`run_process` for a job: its output as text (``popen`` may send stderr to stdout), the session killed
        at the end or after ``timeout`` s (cut to the test's with ``one_test``; an AssertionError with the output)."""
        timeout = self.limit(timeout)
        process = self.popen(command, text=True, **({"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} | popen))
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

    def __enter__(self) -> Concurrently:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            for future in self._futures.values():
                future.cancel()
            for process in self._processes:
                _kill(process)
        self._executor.shutdown(wait=True)
