"""Hooks for the whole suite: the ``slow`` marker's rule (:mod:`_slow`), and each test's deadline for the launch helpers
(:func:`_machine.within_test`)."""

from __future__ import annotations

import os
import time

import pytest
from _machine import DEADLINE
from _slow import MARKED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures (a module-scoped one that launches processes is set up by its first test): tell the
    launch helpers whether the test may start processes."""
    os.environ[MARKED] = "1" if item.get_closest_marker("slow") else "0"
    timeout = _pytest_timeout(item)
    os.environ[DEADLINE] = str(time.time() + timeout) if timeout > 0 else ""


def _pytest_timeout(item: pytest.Item) -> float:
    """The seconds pytest-timeout gives ``item`` (its marker, else ``--timeout``, else the ini value; 0: none, or
    without pytest-timeout, as on the GPU image)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    option = item.config.getoption("timeout", None)
    if option is not None:
        return float(option)
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # no plugin registered the value
        return 0.0
