"""The Triton kernels' ``interpreted`` test cases, run in one pytest subprocess with ``TRITON_INTERPRET=1``: the
interpreter must be switched on before Triton defines a kernel, so those cases cannot run in the suite's own process
(they skip there, and their ``cuda`` twins run the compiled kernels on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_odc.kernels._triton_device import INTERPRETING

ROOT = Path(__file__).resolve().parents[2]

KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        id="interpreted",
        marks=pytest.mark.skipif(not INTERPRETING, reason="runs with TRITON_INTERPRET=1, in a subprocess of its own"),
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETING, reason="needs a CUDA GPU"),
        ],
    ),
]
"""Where the Triton kernels run: CPU tensors under the interpreter, CUDA ones on a GPU."""


def assert_interpreted_cases_pass(*files: str) -> None:
    """Run the ``interpreted`` cases of ``files`` under the interpreter; every one must pass, none skip."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("already interpreted")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", "interpreted"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
