"""``examples/grpo.py`` with ``max_rollout_staleness=1`` (its arguments as given), rank 1 killed (SIGKILL) inside its
background thread while it decodes the second generation batch, as the other rank trains on the first and decodes its
own second batch: the other rank must name it and exit within the ODC timeout. Launched like the example:
``accelerate launch ... tests/support/_overlap_peer.py <grpo.py arguments>``."""

from __future__ import annotations

import os
import runpy
import signal
from pathlib import Path

from hf_odc.trainer.online import _rollout_trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def _killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if int(os.environ["RANK"]) == 1:
        _rollout_trainer.behaviour_log_probs = _killed  # scored in the thread right after its decoding
    runpy.run_path(str(EXAMPLE), run_name="__main__")
