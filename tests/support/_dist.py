"""Run a function on N CPU processes (gloo) and collect what each returns, without ever hanging the test suite. The
processes are forked by the test zygote (:mod:`_zygote`: torch and the libraries imported once), each running this
file with its rank's pickled call, as a spawned process would run it."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _zygote
import torch
from _machine import scaled, within_test
from _slow import require_slow


def _entry(fn: Callable, rank: int, world_size: int, tmp: str, args: tuple, pg_timeout: float, cuda: bool) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"out{rank}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"err{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # No destroy_process_group: after a peer died, tearing down a communicator can block; the result is saved.
    os._exit(0)


class WorkersTimedOut(RuntimeError):
    """The workers did not finish in time; they were killed."""


def launch(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    may_fail: frozenset[int] = frozenset(),
    cuda: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return their results by rank.

    Raises :class:`WorkersTimedOut` (after killing them) if they outlive ``timeout``, or ``RuntimeError`` with the
    failing ranks' tracebacks. Ranks in ``may_fail`` may die instead: their result is ``None``. With ``cuda``, rank
    ``r`` uses GPU ``r`` and NCCL. Both timeouts are :func:`~_machine.scaled` to how busy the machine is, and
    ``timeout`` ends before pytest's (:func:`~_machine.within_test`).
    """
    timeout, pg_timeout = within_test(scaled(timeout, world_size)), scaled(pg_timeout, world_size)
    require_slow(f"{world_size} processes")
    with tempfile.TemporaryDirectory(prefix="hf_odc_test_") as tmp:
        procs = []
        try:
            for r in range(world_size):
                call = os.path.join(tmp, f"call{r}.pkl")
                with open(call, "wb") as f:  # the path first: fn's module is found on it
                    pickle.dump(sys.path, f)
                    pickle.dump((fn, r, world_size, tmp, args, pg_timeout, cuda), f)
                procs.append(_zygote.start(__file__, [call], dict(os.environ), Path(tmp) / f"output{r}.txt"))
            end = time.monotonic() + timeout
            for p in procs:
                p.wait(max(0.0, end - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
        finally:  # whatever ends the wait (pytest's own timeout too), no worker outlives it
            for p in procs:
                p.signal(signal.SIGKILL)
                p.wait()
        if alive:
            raise WorkersTimedOut(f"ranks {alive} still running after {timeout:g} s")
        errors = []
        for r, p in enumerate(procs):
            if p.returncode != 0 and r not in may_fail:
                path = os.path.join(tmp, f"err{r}.txt")
                text = f"exit code {p.returncode}, output:\n{Path(tmp, f'output{r}.txt').read_text()[-8000:]}"
                if os.path.exists(path):
                    with open(path) as f:
                        text = f.read()
                errors.append(f"--- rank {r} ---\n{text}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [
            torch.load(path, weights_only=False) if os.path.exists(path := os.path.join(tmp, f"out{r}.pt")) else None
            for r in range(world_size)
        ]


if __name__ == "__main__":  # a rank: run its pickled call (launch)
    with open(sys.argv[1], "rb") as f:
        sys.path[:] = pickle.load(f)
        call = pickle.load(f)
    _entry(*call)
