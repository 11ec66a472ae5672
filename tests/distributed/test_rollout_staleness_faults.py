"""``max_rollout_staleness=1`` on 2 CPU processes when a peer's decoding ahead hangs (the failure of a rank's
own background thread, and what the mode computes: tests/unit/test_rollout_staleness.py)."""

from __future__ import annotations

import glob
import re

import pytest
from _machine import scaled
from _trainer_launch import SUPPORT, launch

TIMEOUT = max(10, round(scaled(10, 2)))
"""The ODC timeout: a healthy rank of a busy machine does not miss it."""
SAYS = r"PeerFailureError: hf_odc: ranks \[1\] did not reach the minibatch barrier within {} s"


@pytest.mark.slow  # starts 2 processes
def test_a_peer_hung_while_it_decodes_ahead_is_named_within_the_timeout(tmp_path):
    """Rank 1's background thread hangs (``tests/support/_overlap_peer.py``), so its main thread waits for it before
    the next generation batch; rank 0, which trained and decoded ahead itself, names rank 1 at that meeting within the
    ODC timeout and exits non-zero (the launch's own timeout fails the test on a hang; the launcher then ends rank 1),
    leaving no shared memory behind."""
    before = set(glob.glob("/dev/shm/hf_odc_*"))
    code, output = launch(
        str(SUPPORT / "_overlap_peer.py"), "--odc_generation", "static", "--max_rollout_staleness", "1",
        "--max_steps", "3", "--odc_timeout", str(TIMEOUT), "--save_strategy", "no", "--disable_tqdm", "true",
        "--output_dir", str(tmp_path), processes=2, timeout=240,
    )  # fmt: skip
    assert code != 0, output[-3000:]
    assert re.search(SAYS.format(TIMEOUT), output), output[-3000:]
    assert "RolloutPrefetchError" not in output  # no thread failed: rank 1's hung
    assert not set(glob.glob("/dev/shm/hf_odc_*")) - before
