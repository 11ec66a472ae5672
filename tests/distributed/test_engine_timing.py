"""Device-timed minibatch metrics mean the same with ODC and with plain FSDP2: a rank that sleeps is busy, its peer
waits, both see the same step, and the measured bubble is ``idle_fraction(busy, step)``."""

from __future__ import annotations

import time

import pytest
import torch
from _dist import launch
from _timing_workers import SLEEP_S, sleeping_rank

from hf_odc.engine import CollectiveMinibatch
from hf_odc.packing import idle_fraction


@pytest.mark.slow
@pytest.mark.parametrize("odc", [True, False], ids=["odc", "fsdp2"])
def test_a_sleeping_rank_is_busy_and_its_peer_waits(odc):
    per_rank = launch(sleeping_rank, 2, odc)
    for (busy0, wait0), (busy1, wait1) in zip(*per_rank, strict=True):
        assert busy1 >= SLEEP_S  # rank 1 slept inside its minibatch: that is its work
        assert busy1 > busy0 + SLEEP_S / 2  # the same microbatch and a sleep: rank 1 worked longer
        assert wait1 < 0.1  # and nobody kept it waiting
        assert wait0 == pytest.approx(busy1 - busy0, abs=0.05)  # rank 0 waited at the exit for rank 1's extra work
        assert busy0 + wait0 == pytest.approx(busy1 + wait1, abs=0.05)  # one step, the same span on every rank
        step = max(busy0 + wait0, busy1 + wait1)
        assert idle_fraction([busy0, busy1], step) == pytest.approx(wait0 / (2 * step), abs=0.05)


def test_idle_fraction_edge_cases():
    assert idle_fraction([], 1.0) == 0.0 and idle_fraction([0.5, 0.5], 0.0) == 0.0
    assert idle_fraction([1.0, 1.0], 1.0) == 0.0
    assert idle_fraction([1.0, 0.0], 1.0) == pytest.approx(0.5)


def test_laps_time_each_microbatch():
    """``lap()`` after each microbatch gives each one's time (what the calibration learns from); busy covers them."""
    runner = CollectiveMinibatch(torch.device("cpu"))
    with runner.minibatch():
        for seconds in (0.02, 0.06, 0.04):
            time.sleep(seconds)
            runner.lap()
    laps = runner.last.microbatches
    assert laps == pytest.approx([0.02, 0.06, 0.04], abs=0.015)
    assert sum(laps) == pytest.approx(runner.last.busy, abs=0.005)
    with runner.minibatch():
        pass
    assert runner.last.microbatches == [], "no lap, no microbatch time"
