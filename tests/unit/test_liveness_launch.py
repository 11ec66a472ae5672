"""What hf_odc does for a process from its import on (:mod:`hf_odc.liveness.launch`): at exit it lets gloo's worker
threads finish before Python finalizes (a worker that still needs the GIL then would end the process with SIGABRT).

The race itself needs a worker descheduled between completing its last collective and releasing it; this test stands
in for that worker with a thread named as gloo names its workers, busy at exit, then waiting for work as gloo's do.
(``benchmarks/fault_trials.py exits`` runs the examples many times over for the real thing.)"""

from __future__ import annotations

import subprocess
import sys

from _machine import scaled

WORKER_AT_EXIT = """
import ctypes, sys, threading, time
import torch.distributed  # a process that uses torch.distributed (gloo's threads live there)
import hf_odc

def worker():
    ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME: what gloo calls its worker threads
    time.sleep(1.0)  # still releasing its last collective when the main thread is done
    with open(sys.argv[1], "w") as f:
        f.write("released")
    threading.Event().wait()  # idle again: waiting for work, with no timeout

threading.Thread(target=worker, daemon=True).start()
time.sleep(0.1)
"""


def test_exit_waits_for_gloo_workers_to_finish_their_last_collective(tmp_path):
    """The main thread ends while a gloo worker is busy: the process exits only once the worker is idle again (it
    wrote its file), not during the worker's work."""
    released = tmp_path / "released"
    done = subprocess.run(
        [sys.executable, "-c", WORKER_AT_EXIT, str(released)], capture_output=True, text=True, timeout=scaled(120)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert released.read_text() == "released"
