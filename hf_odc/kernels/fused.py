"""Fused RMSNorm and SiLU-gated MLP activation for transformers' decoders: :func:`rms_norm`, :func:`silu_mul` and
:func:`install_fused_kernels`.

transformers' Llama-family RMSNorm runs as seven elementwise kernels (upcast, square, mean, rsqrt, scale, downcast,
times the weight) and the gated MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` as two, each reading and writing the whole
activation; on long packed rows, where the matrix products are few and large, those passes take a large share of the
step. Here each is one Triton kernel forward and one backward (:mod:`hf_odc.kernels._triton_fused`), with fp32
arithmetic inside and the formula's roundings kept (the normalised value is cast to the input dtype before the weight
multiplies it; the SiLU is rounded before the product), so a patched model computes what the stock one does, up to
the order of fp32 sums. RMSNorm saves only its input and one fp32 scale per row for the backward; its weight gradient
is summed in fp32 over a fixed split of the rows, so the same inputs give the same gradient on every call (activation
checkpointing reruns the forward and must get the same values).

The kernels run on CUDA tensors. Elsewhere both functions compute the PyTorch formula itself, so a CPU run of a
patched model is the stock computation; with ``TRITON_INTERPRET=1`` set before this module is imported, Triton's
interpreter runs the kernels on CPU tensors too (how the tests check them without a GPU). Rows wider than
:data:`MAX_NORM_COLUMNS` keep the formula.

:func:`install_fused_kernels` patches a model's modules one by one (the instances' ``forward``, never the class), only
those whose forward is known to be the formula above: the classes of :data:`RMS_NORM_CLASSES` and
:data:`SILU_MLP_CLASSES` from transformers. Other norms (Gemma's ``1 + weight``...) and activations are left alone.
The patched forwards read the module's parameters when called, so FSDP2 sharding afterwards works as before (its
forward hooks unshard them first).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ._triton_device import runs_triton

__all__ = ["MAX_NORM_COLUMNS", "RMS_NORM_CLASSES", "SILU_MLP_CLASSES", "install_fused_kernels", "rms_norm", "silu_mul"]

RMS_NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen2RMSNorm",
        "Qwen3MoeRMSNorm",
        "Qwen3RMSNorm",
    }
)
"""transformers' RMSNorm classes whose forward is ``weight * normalise(x.float()).to(x.dtype)`` with ``weight`` and
``variance_epsilon``: the ones :func:`install_fused_kernels` patches."""

SILU_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP"})
"""transformers' gated MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: the ones
:func:`install_fused_kernels` patches when their ``act_fn`` is a SiLU."""

MAX_NORM_COLUMNS = 16384
"""The widest row the RMSNorm kernel takes (one program holds a row); wider rows keep the PyTorch formula."""


def _use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``x``: on CUDA, or anywhere under Triton's interpreter."""
    return runs_triton(x.device)


def _kernels():
    from . import _triton_fused

    return _triton_fused


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = _kernels().rms_norm_forward(rows, weight.contiguous(), eps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        rows, weight, rstd = ctx.saved_tensors
        dy = dy.reshape(rows.shape).contiguous()
        dx, dw = _kernels().rms_norm_backward(dy, rows, weight.contiguous(), rstd, ctx.needs_input_grad[1])
        return dx.view(ctx.shape), dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _kernels().silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _kernels().silu_mul_backward(dout.contiguous(), gate, up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)`` over the last dimension of ``x``
    (transformers' Llama-family RMSNorm), in the dtype ``weight * x`` would have; differentiable in ``x`` and
    ``weight``. One Triton kernel each way where :func:`_use_triton` (rows up to :data:`MAX_NORM_COLUMNS` wide)."""
    if _use_triton(x) and x.numel() > 0 and x.shape[-1] <= MAX_NORM_COLUMNS:
        return _RMSNorm.apply(x, weight, eps)
    upcast = x.float()
    return weight * (upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (the gated MLP's activation), differentiable in both. One Triton kernel each way where
    :func:`_use_triton`, for two tensors of one shape and dtype."""
    if _use_triton(gate) and gate.shape == up.shape and gate.dtype == up.dtype and gate.numel() > 0:
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


def _fused_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _patchable(module: nn.Module, classes: frozenset[str]) -> bool:
    """Whether ``module`` is an unpatched instance of one of transformers' ``classes``."""
    cls = type(module)
    return cls.__name__ in classes and cls.__module__.startswith("transformers.") and "forward" not in vars(module)


def install_fused_kernels(model: nn.Module) -> int:
    """Give every RMSNorm of :data:`RMS_NORM_CLASSES` and every SiLU MLP of :data:`SILU_MLP_CLASSES` in ``model`` the
    fused forward (:func:`rms_norm`, :func:`silu_mul`), on the instances. Call it before sharding. Returns how many
    modules it patched (0 for a model with none, or already patched)."""
    from transformers.activations import ACT2FN

    silu_types = (nn.SiLU, type(ACT2FN["silu"]))
    patched = 0
    for module in model.modules():
        if _patchable(module, RMS_NORM_CLASSES):
            module.forward = types.MethodType(_fused_rms_norm_forward, module)
        elif _patchable(module, SILU_MLP_CLASSES) and type(module.act_fn) in silu_types:
            module.forward = types.MethodType(_fused_mlp_forward, module)
        else:
            continue
        patched += 1
    return patched
