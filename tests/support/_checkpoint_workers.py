"""``examples/sft.py`` for the checkpoint tests, launched like the example (``accelerate launch ...
tests/support/_checkpoint_workers.py <sft.py arguments>``), with one difference: with
``HF_ODC_TEST_KILL_BEFORE_MARKING=N``, the process that would mark the checkpoint of step ``N`` complete is SIGKILLed
instead: the save is cut off after everything else of it is on disk, the latest point a kill can strike.
(``--resume_from_checkpoint True`` reaches the trainer as the string ``"True"``, which it takes for ``True``.)"""

from __future__ import annotations

import os
import runpy
import signal
from pathlib import Path

from hf_odc.trainer.core import _checkpoint_format

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft.py"


def _killed_when_marking(step: int):
    mark_complete = _checkpoint_format.mark_complete

    def mark_or_die(checkpoint_dir: str, global_step: int, *args) -> None:
        if global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        mark_complete(checkpoint_dir, global_step, *args)

    return mark_or_die


if __name__ == "__main__":
    if "HF_ODC_TEST_KILL_BEFORE_MARKING" in os.environ:
        _checkpoint_format.mark_complete = _killed_when_marking(int(os.environ["HF_ODC_TEST_KILL_BEFORE_MARKING"]))
    runpy.run_path(str(EXAMPLE), run_name="__main__")
