"""Triton kernels behind :mod:`hf_odc.kernels.decode_attention`: one query token per row attending a static KV cache,
split over the cache's slots (flash-decoding), then the splits' partial softmaxes combined.

Split ``s`` of ``n`` takes the cache's blocks ``s, s + n, s + 2n, ...``: interleaved, so that however much of the
cache is filled its blocks spread evenly over the splits. A block none of whose slots the mask holds is skipped before
its keys are read, so a pass reads the filled part of the cache, whatever width it is given. A key/value head's query
heads (grouped-query attention) are one program's rows, so each key and value is read once. Imported only when a
kernel runs: a CPU install needs no Triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_SLOTS = 128
"""Cache slots per block: the unit that is read or skipped."""

_PROGRAMS_PER_SM = 8
"""Programs per streaming multiprocessor the split aims at."""

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

_INTERPRETER_SMS = 4
"""The streaming multiprocessors counted for CPU tensors (Triton's interpreter, the tests): a few splits."""


@triton.jit
def _attend_block(
    q, k_base, v_base, mask_base, block, slots, k_slot, v_slot, mask_slot, running_max, running_sum, acc, scale_log2,
    dims, dim_ok, offsets, BLOCK: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    # One block of slots into a program's running softmax: nothing of it is read where the mask holds none of it.
    slot = block * BLOCK + offsets
    held = tl.load(mask_base + slot * mask_slot, mask=slot < slots, other=0) != 0
    if tl.max(held.to(tl.int32), axis=0) > 0:
        kv_mask = held[:, None] & dim_ok[None, :]
        k = tl.load(k_base + slot[:, None] * k_slot + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision="ieee") * scale_log2
        scores = tl.where(held[None, :], scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: the block holds a slot
        weights = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(running_max - new_max)
        v = tl.load(v_base + slot[:, None] * v_slot + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(DOT), v.to(DOT), input_precision="ieee")
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        running_max = new_max
    return running_max, running_sum, acc


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
    kv_heads, slots, splits, scale_log2,
    q_batch, q_head, k_batch, k_head, k_slot, v_batch, v_head, v_slot, mask_batch, mask_slot,
    GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    ROUNDS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    # Program (b * kv_heads + h, s): key/value head h of row b over blocks s, s + splits, ... (``ROUNDS`` of them at
    # most: a constant, since Triton's interpreter cannot loop over a runtime bound); its query heads, h * GROUP
    # onwards, are its rows. Leaves their unnormalised outputs, running maxima (log2 units) and sums.
    row_head = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    batch = row_head // kv_heads
    head = row_head % kv_heads
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK)
    dim_ok = dims < HEAD_DIM
    row_ok = rows < GROUP
    q = tl.load(
        q_ptr + batch * q_batch + (head * GROUP + rows)[:, None] * q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + batch * k_batch + head * k_head
    v_base = v_ptr + batch * v_batch + head * v_head
    mask_base = mask_ptr + batch * mask_batch
    running_max = tl.full([ROWS], -float("inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    for round in range(ROUNDS):
        running_max, running_sum, acc = _attend_block(
            q, k_base, v_base, mask_base, split + round * splits, slots, k_slot, v_slot, mask_slot, running_max,
            running_sum, acc, scale_log2, dims, dim_ok, offsets, BLOCK, DOT,
        )  # fmt: skip
    out = (row_head * splits + split) * ROWS + rows
    tl.store(acc_ptr + out[:, None] * DIM + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(max_ptr + out, running_max, mask=row_ok)
    tl.store(sum_ptr + out, running_sum, mask=row_ok)


@triton.jit
def _combine_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr, heads, kv_heads, splits, out_batch, out_head,
    GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    # Program b * heads + i: query head i of row b, its splits' partial softmaxes rescaled to their common maximum and
    # summed. Every split is loaded at once (``SPLITS``, their number rounded up to a power of two), not one after
    # another: each load waits for the memory, so a loop over the splits would wait that many times.
    program = tl.program_id(0).to(tl.int64)
    batch = program // heads
    head = program % heads
    split = tl.arange(0, SPLITS)
    dims = tl.arange(0, DIM)
    held = split < splits
    part = ((batch * kv_heads + head // GROUP) * splits + split) * ROWS + head % GROUP
    maxima = tl.load(max_ptr + part, mask=held, other=-float("inf"))
    top = tl.max(maxima, axis=0)
    weights = tl.math.exp2(maxima - tl.where(top == -float("inf"), 0.0, top))  # 0 for a split that saw no slot
    total = tl.sum(tl.load(sum_ptr + part, mask=held, other=0.0) * weights, axis=0)
    acc = tl.load(acc_ptr + part[:, None] * DIM + dims[None, :], mask=held[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # no slot held: zeros
    target = out_ptr + batch * out_batch + head * out_head + dims
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _splits(programs: int, blocks: int, device: torch.device) -> int:
    """How many splits the cache's ``blocks`` are dealt to, for ``programs`` (row, key/value head) pairs: enough that
    the device has :data:`_PROGRAMS_PER_SM` programs per multiprocessor, at most one per block."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _INTERPRETER_SMS
    return max(1, min(blocks, math.ceil(_PROGRAMS_PER_SM * sms / programs)))


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query`` ``[batch, heads, head_dim]`` (last dimension contiguous) attending ``key`` and ``value``
    ``[batch, kv_heads, slots, head_dim]`` (any strides but a contiguous last dimension) where ``mask``
    ``[batch, slots]`` (bool, any strides) holds; ``[batch, heads, head_dim]`` in the query's dtype."""
    batch, heads, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    rows, dim = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))
    programs = batch * kv_heads
    blocks = triton.cdiv(slots, BLOCK_SLOTS)
    splits = _splits(programs, blocks, query.device)
    acc = torch.empty(programs * splits * rows, dim, dtype=torch.float32, device=query.device)
    maxima = torch.empty(programs * splits * rows, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxima)
    mask = mask.view(torch.uint8)
    # The products in the cache's dtype (the weights rounded to it, as flash attention does; float32 ones in full,
    # not TF32, precision), but in float32 under Triton's interpreter, whose 16-bit products are wrong (triton 3.6).
    dot = tl.float32 if query.device.type == "cpu" else _DTYPES[query.dtype]
    _partial_kernel[(programs, splits)](
        query, key, value, mask, acc, maxima, sums,
        kv_heads, slots, splits, scale * math.log2(math.e),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(1),
        GROUP=group, ROWS=rows, DIM=dim, HEAD_DIM=head_dim, BLOCK=BLOCK_SLOTS, ROUNDS=triton.cdiv(blocks, splits),
        DOT=dot, num_warps=4,
    )  # fmt: skip
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    # One warp a program: each combines a few kilobytes behind one wait for memory, and more warps only lengthen it.
    _combine_kernel[(batch * heads,)](
        acc, maxima, sums, out, heads, kv_heads, splits, out.stride(0), out.stride(1),
        GROUP=group, ROWS=rows, DIM=dim, HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(splits), num_warps=1,
    )  # fmt: skip
    return out
