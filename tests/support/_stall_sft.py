"""``examples/sft.py`` with rank 1 (or ``HF_ODC_TEST_STALL_RANK``) stalling at a chosen point of the second optimizer
step, deterministically.

``HF_ODC_TEST_STALL`` names the point (:data:`POINTS`); when rank 1 reaches it, it writes ``"<pid> <time>"`` to
``HF_ODC_TEST_STALL_FILE`` and sleeps (a hung driver, a paused VM, a deadlocked data worker, as its peers see it). Each
point wraps the trainer's method from outside, so the stalled rank stops where that part of the step begins; one,
``killed-in-gather``, instead dies inside the metrics gather, after meeting its peers (a death the survivor sees as a
connection reset). The :data:`STOPS` freeze rank 1 with SIGSTOP (its heartbeat thread too): inside the metrics gather,
or at startup, before the process group exists.
Launched like the example: ``accelerate launch ... tests/support/_stall_sft.py <sft.py arguments>``."""

from __future__ import annotations

import os
import runpy
import signal
import time
from pathlib import Path

from accelerate import Accelerator

from hf_odc.engine.odc import ODC
from hf_odc.trainer import ODCSFTTrainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft.py"
STALLED_RANK = int(os.environ.get("HF_ODC_TEST_STALL_RANK", "1"))
STEP = 2  # the optimizer step (1-based) in which rank 1 stalls


def _stall(kill: bool = False, stop: bool = False) -> None:
    with open(os.environ["HF_ODC_TEST_STALL_FILE"], "w") as f:
        f.write(f"{os.getpid()} {time.time()}\n")
    if kill or stop:  # SIGSTOP freezes every thread, the heartbeat's too: a hung driver or a paused VM
        os.kill(os.getpid(), signal.SIGKILL if kill else signal.SIGSTOP)
    time.sleep(3600)


def _in_step(trainer: ODCSFTTrainer) -> bool:
    """Whether ``trainer`` is in optimizer step :data:`STEP` (``global_step`` counts the finished ones)."""
    return trainer.state.global_step == STEP - 1


def _stall_in_trainer(name: str) -> None:
    original = getattr(ODCSFTTrainer, name)

    def stalled(self, *args, **kwargs):
        if _in_step(self):
            _stall()
        return original(self, *args, **kwargs)

    setattr(ODCSFTTrainer, name, stalled)


def _stall_at_the_exit_barrier() -> None:
    original = ODC._barrier
    calls = []

    def stalled(self, what: str = "the minibatch barrier"):
        if what == "the minibatch barrier":
            calls.append(what)
            if len(calls) == 2 * STEP:  # each minibatch meets twice: entry, exit
                _stall()
        return original(self, what)

    ODC._barrier = stalled


def _end_inside_the_metrics_gather(kill: bool) -> None:
    original = ODCSFTTrainer._log_step
    gather = Accelerator.gather

    def dying(self, tensor):
        _stall(kill=kill, stop=not kill)

    def logged(self, *args, **kwargs):
        if _in_step(self):
            self.accelerator.gather = dying.__get__(self.accelerator)  # the trainer met its peers before gathering
        try:
            return original(self, *args, **kwargs)
        finally:
            self.accelerator.gather = gather.__get__(self.accelerator)

    ODCSFTTrainer._log_step = logged


POINTS = {
    "microbatch": lambda: _stall_in_trainer("_microbatch_loss"),
    "exit-barrier": _stall_at_the_exit_barrier,
    "metrics-gather": lambda: _stall_in_trainer("_log_step"),
    "clip-grad": lambda: _stall_in_trainer("_clip_grad_norm"),
    "logging": lambda: _stall_in_trainer("_maybe_log_save_evaluate"),
    "checkpoint-save": lambda: _stall_in_trainer("_save_checkpoint"),
    "killed-in-gather": lambda: _end_inside_the_metrics_gather(kill=True),
}
STOPS = {
    "stopped-in-gather": lambda: _end_inside_the_metrics_gather(kill=False),
    "stopped-at-startup": lambda: _stall(stop=True),  # before the process group exists
}


if __name__ == "__main__":
    if int(os.environ["RANK"]) == STALLED_RANK:
        {**POINTS, **STOPS}[os.environ["HF_ODC_TEST_STALL"]]()
    runpy.run_path(str(EXAMPLE), run_name="__main__")
