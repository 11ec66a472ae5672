"""Triton kernel: add one rank's gradient pieces into every owner's accumulator, straight over NVLink.

One launch covers every owner. Task ``t`` adds block ``t // W`` of the source row for owner ``(t + first_owner) % W``
(this rank's piece for that owner, upcast) into the owner's buffer, through the peer pointer that symmetric memory
mapped into this process. Owners alternate between neighbouring tasks, so a rank pushes into its own memory and over
NVLink at once, and two ranks never start on the same owner (each starts with its next rank): both NVLink directions
stay busy (pushing into every rank's owner 0 first, as a plain 2-D grid would, serialises them on one link).

Programs loop over the tasks, so the launch can be capped at ``max_programs`` programs to leave SMs to the backward
pass that runs meanwhile; uncapped is the default (the measurements behind both choices, and behind the scalar
atomics, are in benchmarks/RESULTS.md). Atomics are relaxed (nothing reads an accumulator before the minibatch
barrier, which first waits for this kernel) at system scope (ranks on other GPUs add into the same words).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}
_BLOCK = 4096


@triton.jit
def _scatter_add_kernel(
    src_ptr,
    dst_ptrs_ptr,
    dst_offset,
    numel,
    first_owner,
    n_tasks,
    WS: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        owner = (task % WS + first_owner) % WS
        idx = (task // WS).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < numel
        dst = tl.load(dst_ptrs_ptr + owner).to(tl.pointer_type(DST_DTYPE)) + dst_offset + idx
        vals = tl.load(src_ptr + owner.to(tl.int64) * numel + idx, mask=mask).to(DST_DTYPE)
        tl.atomic_add(dst, vals, mask=mask, sem="relaxed", scope="sys")


def scatter_add(
    src: torch.Tensor,
    dst_ptrs: torch.Tensor,
    dst_dtype: torch.dtype,
    offset: int,
    numel: int,
    first_owner: int,
    max_programs: int = 0,
) -> None:
    """``owner_buffer[r][offset:offset + numel] += src.view(-1, numel)[r]`` for every owner ``r`` of ``dst_ptrs``.

    ``dst_ptrs`` holds each owner's buffer address (int64, on the device); ``first_owner`` is the owner this rank's
    first task pushes into (its next rank); ``max_programs`` caps the programs (0: one per task).
    """
    if dst_dtype not in _TL_DTYPES:
        raise TypeError(f"hf_odc: GPU accumulators must be float32 or float64, not {dst_dtype}")
    if numel == 0:
        return
    n_tasks = triton.cdiv(numel, _BLOCK) * dst_ptrs.numel()
    grid = (min(n_tasks, max_programs) if max_programs > 0 else n_tasks,)
    _scatter_add_kernel[grid](
        src.contiguous(),
        dst_ptrs,
        offset,
        numel,
        first_owner,
        n_tasks,
        WS=dst_ptrs.numel(),
        DST_DTYPE=_TL_DTYPES[dst_dtype],
        BLOCK=_BLOCK,
        num_warps=8,
    )
