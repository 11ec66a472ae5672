"""A linear layer for the few rows of a decoding step: :func:`decode_linear`, :func:`install_decode_linear`.

A decoding step multiplies each weight by one token per sequence, a few dozen rows, so it is bound by reading the
weights, not by arithmetic; cuBLAS runs such skinny products well under the device's memory bandwidth. Here one
Triton kernel (:mod:`hf_odc.kernels._triton_decoding`) streams each weight tile once against all the rows, which
it keeps on chip, summing in fp32; where the output is too narrow to give every streaming multiprocessor a tile, the
input dimension is split too and the parts summed in a fixed order. Its tiling comes from :data:`DECODE_LINEAR_CONFIGS`
by the weight's shape.

The kernel runs for CUDA tensors (or CPU ones under Triton's interpreter, ``TRITON_INTERPRET=1`` set before this
module is imported) in bf16 or fp16, of at most :data:`MAX_DECODE_ROWS` rows, without gradients; anything else
(CPU, fp32, a prompt's prefill, training) is ``torch.nn.functional.linear``. It is the custom operator
``hf_odc::decode_linear`` with a fake implementation, so ``torch.compile`` traces it as one call and CUDA graphs record
it. It has no backward: it is for a decoding copy's forward (``odc_decode_linear``), never for training.
"""

from __future__ import annotations

import importlib.util
import os
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DECODE_LINEAR_CONFIGS",
    "MAX_DECODE_ROWS",
    "DecodeLinearConfig",
    "decode_linear",
    "decode_linear_config",
    "install_decode_linear",
]

MAX_DECODE_ROWS = 128
"""The most rows (tokens, all leading dimensions together) the kernel takes; more are a GEMM cuBLAS runs well."""

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecodeLinearConfig:
    """How the kernel tiles one weight: ``block_n`` weight rows and ``block_k`` input columns a tile, the input
    dimension split in ``split_k`` parts (one program each per ``block_n`` rows), ``num_warps`` and ``num_stages``
    (the loads in flight; cut where the tiles of the widest row block would not fit in shared memory)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


DECODE_LINEAR_CONFIGS: tuple[tuple[int, int, DecodeLinearConfig], ...] = (
    (4096, 4096, DecodeLinearConfig(block_n=32, block_k=128, split_k=4)),
    (4096, 1 << 31, DecodeLinearConfig(block_n=32, block_k=128, split_k=8)),
    (32768, 1 << 31, DecodeLinearConfig(block_n=64, block_k=128, split_k=1)),
    (1 << 31, 1 << 31, DecodeLinearConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3)),
)
"""The tiling by weight shape: ``(most output features, most input features, config)``, the first row that holds the
weight's ``[N, K]`` taken. Narrow outputs (a 1.5B model's fused q/k/v and ``o_proj``, ``down_proj`` with its long
input) split the input dimension so that there are enough programs to keep the memory busy; wide ones (the fused
gate/up, the LM head) have enough tiles without. ``benchmarks/decode_linear.py --sweep`` measures the alternatives."""


def decode_linear_config(out_features: int, in_features: int) -> DecodeLinearConfig:
    """The :data:`DECODE_LINEAR_CONFIGS` row for a weight of ``[out_features, in_features]``."""
    return next(c for n, k, c in DECODE_LINEAR_CONFIGS if out_features <= n and in_features <= k)


def _runs_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`decode_linear` runs the kernel for these arguments (see the module docstring)."""
    if not (x.is_cuda and _HAS_TRITON) and not _INTERPRET:
        return False
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.dim() != 2 or weight.device != x.device:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1):
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < rows <= MAX_DECODE_ROWS


@torch.library.custom_op("hf_odc::decode_linear", mutates_args=())
def _decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from . import _triton_decoding

    config = decode_linear_config(*weight.shape)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _triton_decoding.decode_linear_forward(
        rows,
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        config.block_n,
        config.block_k,
        config.split_k,
        config.num_warps,
        config.num_stages,
    )
    return out.view(*x.shape[:-1], weight.shape[0])


@_decode_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``, by the kernel where it runs (at most :data:`MAX_DECODE_ROWS`
    rows, bf16/fp16, no gradient; see the module docstring): fp32 sums, rounded once, so it differs from cuBLAS only
    by the order of the sums."""
    if _runs_kernel(x, weight, bias):
        return _decode_linear_op(x, weight, bias)
    return F.linear(x, weight, bias)


def _decode_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return decode_linear(x, self.weight, self.bias)


def install_decode_linear(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` (the class itself, not subclasses) not patched already the forward
    :func:`decode_linear`, on the instance; it reads the module's weight and bias when called, so weights written in
    place later are used. Returns how many modules it patched. For a model that only decodes: the kernel has no
    backward (it steps aside wherever a gradient is wanted)."""
    patched = 0
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in vars(module):
            module.forward = types.MethodType(_decode_linear_forward, module)
            patched += 1
    return patched
