"""``examples/grpo.py`` with ``max_rollout_staleness=1`` (its arguments as given), rank 1's background thread stalled
for good once it has decoded the second generation batch (a hung decode, as its peers see it: rank 1 itself stays
alive, its main thread waiting for the thread), while the other rank trains on the first batch and decodes its own
second: the other rank must name rank 1 and exit within the ODC timeout. Launched like the example:
``accelerate launch ... tests/support/_overlap_peer.py <grpo.py arguments>``."""

from __future__ import annotations

import os
import runpy
import time
from pathlib import Path

from hf_odc.trainer.online import _rollout_trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def _stalled(*args, **kwargs):
    time.sleep(3600)


if __name__ == "__main__":
    if int(os.environ["RANK"]) == 1:
        _rollout_trainer.behaviour_log_probs = _stalled  # scored in the thread right after its decoding
    runpy.run_path(str(EXAMPLE), run_name="__main__")
