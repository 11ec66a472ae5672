"""The suite's own rule (``tests/support/_slow.py``): a test that is not marked slow cannot start processes through the
launch helpers, so that ``-m "not slow"`` stays fast as tests are added."""

from __future__ import annotations

import pytest
from _dist import launch as launch_workers
from _parity import run_checked
from _trainer_launch import launch as launch_script


def _never_run(rank: int, world_size: int) -> None:
    raise AssertionError("an unmarked test started a process group")


def test_an_unmarked_test_cannot_start_a_process_group():
    with pytest.raises(RuntimeError, match=r"starts 2 processes: mark it @pytest\.mark\.slow"):
        launch_workers(_never_run, 2)


def test_an_unmarked_test_cannot_run_a_script():
    with pytest.raises(RuntimeError, match=r"starts the script sft\.py: mark it @pytest\.mark\.slow"):
        launch_script("sft.py", "--help")


def test_an_unmarked_test_cannot_run_a_parity_script():
    with pytest.raises(RuntimeError, match=r"starts the script _sft_parity\.py: mark it @pytest\.mark\.slow"):
        run_checked("_sft_parity.py", "--help")
