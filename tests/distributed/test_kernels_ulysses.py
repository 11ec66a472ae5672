"""Sequence parallelism's attention (``hf_odc.kernels.ulysses``) on 2 CPU processes: a row of documents that cross the
shards' bounds, split unequally, gives each rank what the whole row gives its tokens, forward and backward, with
key/value heads split among the ranks and repeated for their query heads (the trainer's end-to-end runs are
``tests/parity/test_sft_sequence_parallel.py``)."""

from __future__ import annotations

import pytest
from _dist import launch
from _ulysses_workers import sharded_against_whole

pytestmark = pytest.mark.slow  # starts processes


def test_a_split_row_attends_as_the_whole_row():
    for rank, errors in enumerate(launch(sharded_against_whole, 2)):
        for kv_heads, (forward, backward) in errors.items():
            assert forward < 1e-5 and backward < 1e-5, (rank, kv_heads, forward, backward)
