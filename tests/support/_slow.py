"""The ``slow`` marker's rule, shared by ``tests/conftest.py`` and the launch helpers: a test that starts a process
group, an example or test script, a benchmark or a notebook kernel (seconds to minutes each) is marked
``@pytest.mark.slow``, so that ``python -m pytest -q -m "not slow"`` runs the others in well under two minutes (a
planning subprocess of a second, as in ``test_cli.py``, is not slow). The launch helpers (``_dist.launch``,
``_trainer_launch.launch`` and ``run``, ``_parity.run_checked``) refuse to start processes for an unmarked test, so
that the fast subset stays fast as tests are added."""

from __future__ import annotations

import os

MARKED = "HF_ODC_TEST_MARKED_SLOW"
"""Set by ``tests/conftest.py`` before each test's fixtures: ``"1"`` when the test is marked slow, else ``"0"``."""


def require_slow(what: str) -> None:
    """Refuse to start ``what`` for a test that is not marked slow (anything outside pytest may)."""
    if os.environ.get(MARKED) == "0":
        raise RuntimeError(f"This test starts {what}: mark it @pytest.mark.slow (tests/support/_slow.py says why).")
