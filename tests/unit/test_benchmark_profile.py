"""``benchmarks/_common.py``'s reading of a profiler trace (what ``profile_step.py`` and ``grpo_generation.py
--profile`` report): kernels sorted by kind, the span, the time in which any kernel ran, the gaps and the host's
waits. The profiling itself needs a GPU; the reading is checked here on a hand-made trace."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _common import _kinds, kernel_kind


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}  # microseconds, as Kineto writes them


def test_kernel_kinds():
    assert kernel_kind("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT") == "gemm"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert kernel_kind("_scatter_add_kernel") == "odc push"
    assert kernel_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert kernel_kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<adam>") == "optimizer"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_a_trace_is_read_into_kinds_busy_time_gaps_and_waits():
    work = [
        _event("kernel", "nvjet_gemm", 0, 100),
        _event("kernel", "_scatter_add_kernel", 50, 100),  # overlaps the GEMM (another stream)
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 60, 10),
        _event("kernel", "flash_fwd", 400, 50),  # after a gap of 250 us
        _event("kernel", "elementwise", 460, 40),  # after 10 us
    ]
    waits = [_event("cuda_runtime", "cudaStreamSynchronize", 0, 30)]
    out = _kinds(work, waits, top=2)
    assert out["gemm"] == pytest.approx(1e-4) and out["odc push"] == pytest.approx(1e-4)
    assert out["attention"] == pytest.approx(5e-5) and out["other"] == pytest.approx(4e-5)
    assert out["copy"] == pytest.approx(1e-5)
    assert out["span"] == pytest.approx(5e-4)
    assert out["kernels busy"] == pytest.approx(2.4e-4)  # 0-150, 400-450, 460-500
    assert out["kernels"] == 4
    assert out["host waits"] == pytest.approx(3e-5)
    assert out["gaps"] == [(pytest.approx(2.5e-4), "_scatter_add_kernel", "flash_fwd"),
                           (pytest.approx(1e-5), "flash_fwd", "elementwise")]  # fmt: skip
    assert [name for name, _ in out["top kernels"]] == ["nvjet_gemm", "_scatter_add_kernel"]
