"""One decoding step's attention over a static KV cache: :func:`decode_attention`.

Why: a decoding step's query is one token per row, and the cache it attends is long and mostly the same from step to
step. SDPA given a mask reads the keys and values up to the mask's width, so a loop that keeps one CUDA graph per width
reads up to a width's rounding past what is filled, and records (and compiles for) several widths. The kernel here
(:mod:`hf_odc.kernels._triton_decode`) takes the cache's whole width and skips every block of slots the mask does not
hold before reading its keys: one shape serves every step, and each step reads what is filled. It splits each row's
cache over several programs and combines their softmaxes (flash-decoding), so that a batch of a few rows still keeps
the device's multiprocessors busy, and reads each key/value head once for the query heads that share it.

It runs on CUDA tensors (and on CPU ones under Triton's interpreter, ``TRITON_INTERPRET=1`` set before the kernels
are imported: how the tests check it without a GPU), registered as the operator ``hf_odc::decode_attention`` so that
``torch.compile`` keeps it whole inside a compiled forward and a CUDA graph records it. Elsewhere, or with
:data:`KERNEL` switched off, it is SDPA over the query heads grouped per key/value head, which gives the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton_device import runs_triton

__all__ = ["KERNEL", "decode_attention", "kernel_runs"]

KERNEL = True
"""Whether :func:`decode_attention` runs the kernel where it can (see :func:`kernel_runs`); off, it is SDPA (how the
benchmarks compare the two)."""

_MAX_HEAD_DIM = 256
"""The widest head the kernel takes (one program holds a block of keys of this width); wider ones take SDPA."""


def kernel_runs(device: torch.device, head_dim: int) -> bool:
    """Whether :func:`decode_attention` runs the kernel for heads of ``head_dim`` on ``device``: on CUDA (or anywhere
    under Triton's interpreter) with Triton installed, :data:`KERNEL` on."""
    if not KERNEL or head_dim > _MAX_HEAD_DIM or not runs_triton(device):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("hf_odc::decode_attention", mutates_args=())
def _decode_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    from . import _triton_decode

    return _triton_decode.decode_attention(query, key, value, mask, scale)


@_decode_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each row's one query token (``query`` ``[batch, heads, head_dim]``) attending the cache's ``key`` and
    ``value`` (``[batch, kv_heads, slots, head_dim]``, ``heads`` a multiple of ``kv_heads``: query head ``i`` reads
    key/value head ``i // (heads // kv_heads)``) at the slots ``mask`` (bool, ``[batch, slots]``) holds, scores scaled
    by ``scale``: ``[batch, heads, head_dim]`` in the query's dtype. A row whose mask holds no slot gives zeros from
    the kernel (SDPA's value there is not defined). Not differentiable: decoding runs without autograd."""
    batch, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    if kernel_runs(query.device, head_dim):
        return _decode_attention_op(
            query.contiguous(), _last_contiguous(key), _last_contiguous(value), mask, float(scale)
        )
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)


def _last_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where its last dimension is contiguous (a cache's slice is), else a contiguous copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
