"""Triton kernel: add one rank's gradient pieces into every owner's accumulator, straight over NVLink.

One launch covers every owner: program ``(i, r)`` loads block ``i`` of row ``r`` of the source (this rank's piece for
owner ``r``), upcasts it, and atomically adds it into owner ``r``'s buffer through the peer pointer that symmetric
memory mapped into this process. Relaxed atomics suffice: nothing reads the accumulators until the minibatch barrier,
which first waits for this kernel to complete.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _scatter_add_kernel(src_ptr, dst_ptrs_ptr, dst_offset, numel, DST_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    owner = tl.program_id(1)
    dst = tl.load(dst_ptrs_ptr + owner).to(tl.pointer_type(DST_DTYPE))
    idx = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    vals = tl.load(src_ptr + owner.to(tl.int64) * numel + idx, mask=mask).to(DST_DTYPE)
    tl.atomic_add(dst + dst_offset + idx, vals, mask=mask, sem="relaxed")


def scatter_add(src: torch.Tensor, dst_ptrs: torch.Tensor, dst_dtype: torch.dtype, offset: int, numel: int) -> None:
    """``owner_buffer[r][offset:offset + numel] += src.view(-1, numel)[r]`` for every ``r`` of ``dst_ptrs``."""
    if dst_dtype not in _TL_DTYPES:
        raise TypeError(f"hf_odc: GPU accumulators must be float32 or float64, not {dst_dtype}")
    if numel == 0:
        return
    block = 4096
    grid = (triton.cdiv(numel, block), dst_ptrs.numel())
    _scatter_add_kernel[grid](
        src.contiguous(), dst_ptrs, offset, numel, DST_DTYPE=_TL_DTYPES[dst_dtype], BLOCK=block, num_warps=8
    )
