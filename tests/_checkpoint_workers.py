"""``examples/sft.py`` for the checkpoint tests, launched like the example (``accelerate launch ...
tests/_checkpoint_workers.py <sft.py arguments>``), with two differences:

* ``--resume_from_checkpoint True`` means ``trainer.train(resume_from_checkpoint=True)`` (the example passes the string
  on, which the Trainer would take for a directory);
* with ``HF_ODC_TEST_KILL_BEFORE_MARKING=N``, the process that would mark the checkpoint of step ``N`` complete is
  SIGKILLed instead: the save is cut off after everything else of it is on disk, the latest point a kill can strike.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import sft

from hf_odc.trainer import _checkpoint


def _killed_when_marking(step: int):
    mark_complete = _checkpoint.mark_complete

    def mark_or_die(checkpoint_dir: str, global_step: int, *args) -> None:
        if global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        mark_complete(checkpoint_dir, global_step, *args)

    return mark_or_die


if __name__ == "__main__":
    script_args, training_args, model_args = sft.make_parser().parse_args_and_config()
    if training_args.resume_from_checkpoint == "True":
        training_args.resume_from_checkpoint = True
    if "HF_ODC_TEST_KILL_BEFORE_MARKING" in os.environ:
        _checkpoint.mark_complete = _killed_when_marking(int(os.environ["HF_ODC_TEST_KILL_BEFORE_MARKING"]))
    sft.main(script_args, training_args, model_args)
