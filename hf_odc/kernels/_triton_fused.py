"""Triton kernels behind :mod:`hf_odc.kernels.fused`: RMSNorm and SiLU-times-up, forward and backward.

Each kernel reads its inputs once and writes its outputs once, with fp32 arithmetic inside, and rounds where the
PyTorch formula it replaces rounds (to the input dtype after normalising, and after the SiLU), so that a bf16 model
gives the values of the unfused one. Imported only when a kernel runs: a CPU install needs no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ELEMENTWISE_BLOCK = 1024


def _row_warps(block: int) -> int:
    """Warps for a program that holds one row of ``block`` columns."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
):
    # Program p takes the rows from p * rows_per_program on and leaves its partial weight gradient (fp32) in row p of
    # ``dw_ptr``.
    first = tl.program_id(0).to(tl.int64) * rows_per_program
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row = first
    last = tl.minimum(first + rows_per_program, n_rows)
    # A while loop, not a range: Triton's interpreter (the CPU tests) cannot take a range over a runtime bound.
    while row < last:
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        if WEIGHT_GRAD:
            dw += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        # The gradient reaches the normalised value in the input dtype (the formula casts it there).
        dn = (dy * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        dx = rstd * (dn - x_hat * (tl.sum(dn * x_hat, axis=0) / n_cols))
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        row += 1
    if WEIGHT_GRAD:
        tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols, dw, mask=mask)


@triton.jit
def _silu_mul_forward_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = (gate * sigmoid).to(dup_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dup_ptr + offsets, (dout * silu).to(dup_ptr.dtype.element_ty), mask=mask)
    dsilu = (dout * up).to(dgate_ptr.dtype.element_ty).to(tl.float32)
    dgate = dsilu * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(dgate_ptr + offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` for the rows of the contiguous 2-D ``x``: ``y`` in the promoted dtype of ``x`` and ``weight``,
    ``rstd`` (fp32, one per row) for the backward."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_forward_kernel[(n_rows,)](x, weight, y, rstd, n_cols, eps, BLOCK=block, num_warps=_row_warps(block))
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dw)`` of :func:`rms_norm_forward` for the upstream gradient ``dy`` (contiguous, ``x``'s shape); ``dw``
    (``None`` without ``weight_grad``) is summed in fp32 over a fixed split of the rows, the same on every call."""
    n_rows, n_cols = x.shape
    target = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    rows_per_program = triton.cdiv(n_rows, target)
    programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(x)
    partial = torch.empty((programs, n_cols) if weight_grad else (1,), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_backward_kernel[(programs,)](
        dy,
        x,
        weight,
        rstd,
        dx,
        partial,
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK=block,
        WEIGHT_GRAD=weight_grad,
        num_warps=_row_warps(block),
    )
    return dx, partial.sum(0).to(weight.dtype) if weight_grad else None


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two contiguous tensors of one shape and dtype, in that dtype."""
    out = torch.empty_like(gate)
    numel = gate.numel()
    _silu_mul_forward_kernel[(triton.cdiv(numel, _ELEMENTWISE_BLOCK),)](gate, up, out, numel, BLOCK=_ELEMENTWISE_BLOCK)
    return out


def silu_mul_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` of :func:`silu_mul_forward` for the upstream gradient ``dout`` (contiguous)."""
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    numel = gate.numel()
    _silu_mul_backward_kernel[(triton.cdiv(numel, _ELEMENTWISE_BLOCK),)](
        dout, gate, up, dgate, dup, numel, BLOCK=_ELEMENTWISE_BLOCK
    )
    return dgate, dup
