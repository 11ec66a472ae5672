"""``max_rollout_staleness=1`` on 2 CPU processes when a peer dies while it decodes ahead (the failure of a rank's
own background thread, and what the mode computes: tests/unit/test_rollout_staleness.py)."""

from __future__ import annotations

import glob
import re

import pytest
from _trainer_launch import SUPPORT, launch


@pytest.mark.slow  # starts 2 processes
def test_a_peer_dying_while_it_decodes_ahead_is_named_and_the_run_ends(tmp_path):
    """Rank 1 is killed in its background thread; rank 0, training and decoding ahead itself, names it at its next
    meeting and exits within the ODC timeout (the launch's own timeout fails the test on a hang), leaving no shared
    memory behind."""
    before = set(glob.glob("/dev/shm/hf_odc_*"))
    code, output = launch(
        str(SUPPORT / "_overlap_peer.py"), "--odc_generation", "static", "--max_rollout_staleness", "1",
        "--max_steps", "3", "--odc_timeout", "10", "--save_strategy", "no", "--disable_tqdm", "true",
        "--output_dir", str(tmp_path), processes=2, timeout=240,
    )  # fmt: skip
    assert code != 0, output[-3000:]
    assert re.search(r"PeerFailureError: .*rank 1", output), output[-3000:]
    assert "RolloutPrefetchError" not in output  # rank 0's own thread was not what failed
    assert not set(glob.glob("/dev/shm/hf_odc_*")) - before
