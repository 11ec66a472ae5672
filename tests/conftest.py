"""Hooks for the whole suite: the ``slow`` marker's rule (:mod:`_slow`)."""

from __future__ import annotations

import os

import pytest
from _slow import MARKED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures (a module-scoped one that launches processes is set up by its first test): tell the
    launch helpers whether the test may start processes."""
    os.environ[MARKED] = "1" if item.get_closest_marker("slow") else "0"
