"""Where hf_odc's Triton kernels run: on CUDA tensors, and on CPU ones under Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton defines a kernel: how the tests run them without a GPU)."""

from __future__ import annotations

import os

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether this process runs Triton's interpreter (read once, at import, as Triton reads it when it defines a
kernel)."""


def runs_triton(device: torch.device) -> bool:
    """Whether a Triton kernel runs on tensors of ``device``: CUDA ones, or any under the interpreter."""
    return device.type == "cuda" or INTERPRETING
