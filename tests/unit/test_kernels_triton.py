"""The GPU accumulate kernel compiles for Hopper (sm_90) on a machine without a GPU, whenever Triton is installed."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("src_dtype", ["*fp32", "*bf16"])
def test_scatter_add_kernel_compiles_to_system_scope_atomics(src_dtype):
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_odc.kernels.transports._triton_scatter import _scatter_add_kernel

    signature = {
        "src_ptr": src_dtype,
        "dst_ptrs_ptr": "*i64",
        "dst_offset": "i64",
        "numel": "i64",
        "first_owner": "i32",
        "n_tasks": "i32",
        "WS": "constexpr",
        "DST_DTYPE": "constexpr",
        "BLOCK": "constexpr",
    }
    src = ASTSource(_scatter_add_kernel, signature, constexprs={"WS": 2, "DST_DTYPE": tl.float32, "BLOCK": 4096})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert "cubin" in kernel.asm
    # Peers on other GPUs add into the same words: the adds must be system-scope atomics.
    # (triton <= 3.8 emits the returning ``atom``, triton 3.9 the non-returning ``red``: both are system-scope.)
    ptx = kernel.asm["ptx"]
    assert "atom.global.sys.relaxed.add.f32" in ptx or "red.global.sys.relaxed.add.f32" in ptx
