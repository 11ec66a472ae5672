"""What hf_odc does for a training process from the moment it is imported: it ends with its launcher, it starts beating,
and it exits with the status its script earned.

* **The launcher's death ends the workers.** torchrun (``accelerate launch``) ends its workers when one fails, but a
  launcher killed with SIGKILL ends nobody: its workers would wait in a rendezvous or train on, unsupervised. So a
  worker asks the kernel for SIGTERM on its parent's death (Linux ``PR_SET_PDEATHSIG``) as soon as hf_odc is imported,
  and ends itself if the launcher is already gone.
* **Heartbeats from the start** (:mod:`hf_odc.liveness.heartbeat`), in the launcher's store, so that a rank that stops
  during startup is named within the ODC timeout.
* **A clean exit.** gloo runs each collective on worker threads of its own, which release the collective's tensors
  after the caller has seen it complete. Releasing a tensor that Python also knew needs Python's GIL; a worker that asks
  for it once the interpreter has begun finalizing is ended by Python through a C++ frame that allows no unwinding,
  and the process dies of SIGABRT ("terminate called without an active exception") after a run that succeeded. The
  process groups of an FSDP2 model outlive ``destroy_process_group`` (DTensor specs keep their mesh), so their threads
  live until finalization. At exit, before finalization, hf_odc waits (a few milliseconds, with the GIL released) until
  every gloo worker thread is idle again.

Nothing here imports torch unless the process was started by a launcher: ``hf-odc plan`` must start fast.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import signal
import sys
import time

from . import procfs

__all__ = ["on_import"]

_GLOO_WORKER = "pt_gloo_runloop"  # the name gloo's process groups give their worker threads
_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_DRAIN_LIMIT_S = 5.0  # a worker still busy then is inside a collective that will not end: exit anyway


def on_import() -> None:
    """Run once, when hf_odc is first imported."""
    atexit.register(wait_for_gloo_workers)
    if not sys.platform.startswith("linux") or os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return  # not started by torchrun: the parent may be a shell or a notebook that outlives nothing
    _end_with_launcher()
    from . import heartbeat  # imports torch: only under a launcher

    heartbeat.start_under_launcher()


def _end_with_launcher() -> None:
    """SIGTERM on the launcher's death; at once if it is already dead."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return  # refused by the kernel: the launcher's own teardown still ends the workers
    if _orphaned():
        os.kill(os.getpid(), signal.SIGTERM)


def _orphaned() -> bool:
    """Whether this worker's launcher died before it asked for the signal: the kernel then made init (pid 1) its
    parent. In a container whose first process *is* the launcher, pid 1 is alive and names the training script or a
    launcher on its command line; init does not."""
    if os.getppid() != 1:
        return False
    command = procfs.command_line(1)
    if command is None:
        return False
    script = os.path.basename(sys.argv[0]).encode() if sys.argv and sys.argv[0] else b""
    marks = [b"torchrun", b"torch.distributed.run", b"accelerate", *([script] if len(script) > 3 else [])]
    return not any(mark in command for mark in marks)


def wait_for_gloo_workers(limit: float = _DRAIN_LIMIT_S) -> None:
    """Return once every gloo worker thread of this process is idle (waiting for work, with no timeout), seen twice in
    a row, or after ``limit`` seconds. Sleeping releases the GIL, so a worker that needs it to release its last
    collective's tensors gets it now rather than during finalization."""
    if "torch.distributed" not in sys.modules:
        return
    workers = _gloo_workers()
    end = time.monotonic() + limit
    idle_in_a_row = 0
    while workers and idle_in_a_row < 2 and time.monotonic() < end:
        idle_in_a_row = idle_in_a_row + 1 if all(_idle(tid) for tid in workers) else 0
        time.sleep(0.002)


def _gloo_workers() -> list[str]:
    return [tid for tid in procfs.thread_ids() if procfs.thread_name(tid) == _GLOO_WORKER]


def _idle(tid: str) -> bool:
    """Whether thread ``tid`` sleeps on a futex with no timeout: a worker waiting for work (a thread that wants the
    GIL waits with a timeout; one that runs, or is about to, is not asleep). A thread that ended, or whose state cannot
    be read, counts as idle."""
    state = procfs.thread_state(tid)
    if state in (None, "?"):
        return True
    if state != "S":
        return False
    if _FUTEX is None:
        return True  # an architecture whose futex number is not listed: asleep is the best sign available
    call = procfs.thread_syscall(tid)
    if call is None:
        return True
    # "<number> <uaddr> <op> <val> <timeout> ...": a futex wait (FUTEX_WAIT or FUTEX_WAIT_BITSET) with no timeout.
    return len(call) > 4 and call[0] == str(_FUTEX) and int(call[2], 16) & 0x7F in (0, 9) and int(call[4], 16) == 0
