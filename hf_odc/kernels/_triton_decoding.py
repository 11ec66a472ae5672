"""Triton kernels behind :mod:`hf_odc.kernels.decoding`: ``x @ weight.T + bias`` for a few rows of ``x``.

Each program owns ``BLOCK_N`` rows of the weight (output columns) and one of ``SPLIT_K`` consecutive parts of the
input dimension; it streams its weight tile once, in ``BLOCK_K`` slices, against all the rows of ``x`` (at most
``BLOCK_M``, which the tensor cores take as one tile), summing in fp32. With one part the program adds the bias and
writes the output; with several, each writes its fp32 partial sum and a second kernel adds the parts in a fixed order
(so a call gives the same values every time), adds the bias and rounds once. Imported only when a kernel runs: a CPU
install needs no Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_REDUCE_BLOCK = 1024
_SHARED_MEMORY_BUDGET = 160 * 1024
"""The shared memory the pipelined tiles may take (Hopper gives a program up to 227 KiB): deeper pipelines are cut to
fit, so that a config of the table never fails to compile for the widest ``BLOCK_M``."""


@triton.jit
def _decode_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STEPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Program (n, s) sums columns [s * k_per_split, (s + 1) * k_per_split) of its BLOCK_N weight rows, in STEPS slices
    # of BLOCK_K (STEPS * BLOCK_K == k_per_split); a constant trip count lets the loads pipeline, and lets Triton's
    # interpreter (the CPU tests) run the loop.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_start = split * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(STEPS):
        ks = k_start + step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0
        )
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 tiles as their bits: it is given them in fp32
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = row_mask[:, None] & col_mask[None, :]
    if PARTIAL:
        offsets = split.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out_ptr + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_parts_kernel(
    part_ptr, b_ptr, out_ptr, numel, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    acc = tl.load(part_ptr + offsets, mask=mask, other=0.0)
    for split in range(1, SPLIT_K):
        acc += tl.load(part_ptr + split * numel + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def decode_linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` of the contiguous 2-D ``x`` (at most 128 rows) and ``weight`` (``[N, K]``), in
    ``x``'s dtype, with the given tiling (see the module docstring). ``split_k`` is cut where the input dimension
    has fewer ``block_k`` slices."""
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    slices = triton.cdiv(k, block_k)
    split_k = max(1, min(split_k, slices))
    steps = triton.cdiv(slices, split_k)
    split_k = triton.cdiv(slices, steps)  # no part left empty
    stage_bytes = (block_m + block_n) * block_k * x.element_size()
    num_stages = max(1, min(num_stages, _SHARED_MEMORY_BUDGET // stage_bytes))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = split_k > 1
    target = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if partial else out
    has_bias = bias is not None
    _decode_linear_kernel[(triton.cdiv(n, block_n), split_k)](
        x,
        weight,
        bias if has_bias else x,
        target,
        m,
        n,
        k,
        steps * block_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STEPS=steps,
        HAS_BIAS=has_bias,
        PARTIAL=partial,
        UPCAST=_INTERPRET and x.dtype == torch.bfloat16,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if partial:
        numel = m * n
        _sum_parts_kernel[(triton.cdiv(numel, _REDUCE_BLOCK),)](
            target,
            bias if has_bias else x,
            out,
            numel,
            n,
            SPLIT_K=split_k,
            HAS_BIAS=has_bias,
            BLOCK=_REDUCE_BLOCK,
        )
    return out
