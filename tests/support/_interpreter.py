"""Triton kernels tested on CPU: the devices a kernel test runs on (:func:`kernel_devices`) and the pytest subprocess
that runs its ``interpreted`` cases under Triton's interpreter (:func:`run_interpreted`). The interpreter must be
switched on before Triton defines the kernels, so those cases are skipped in the suite's own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def kernel_devices(interpreting: bool) -> list:
    """Where a module's Triton kernels run, as ``device`` parameters: ``"cpu"`` (id ``interpreted``) where
    ``interpreting`` (the module read ``TRITON_INTERPRET=1`` at import), ``"cuda"`` on a GPU (marked ``gpu``)."""
    return [
        pytest.param(
            "cpu",
            id="interpreted",
            marks=pytest.mark.skipif(not interpreting, reason="runs with TRITON_INTERPRET=1, in run_interpreted"),
        ),
        pytest.param(
            "cuda",
            id="cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available() or interpreting, reason="needs a CUDA GPU"),
            ],
        ),
    ]


def run_interpreted(test_file: str, interpreting: bool) -> None:
    """Run ``test_file``'s ``interpreted`` cases in a pytest subprocess with ``TRITON_INTERPRET=1``, and check they all
    passed; skipped without Triton, or where this process interprets already."""
    pytest.importorskip("triton")
    if interpreting:
        pytest.skip("already interpreted")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "interpreted"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
