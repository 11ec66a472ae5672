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
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert kernel_kind("_rms_norm_forward") == "elementwise"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4>") == "elementwise"
    assert kernel_kind("aten::mm") == kernel_kind("aten::addmm") == "gemm"  # a CPU's operators
    assert kernel_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kernel_kind("aten::copy_") == "copy" and kernel_kind("aten::empty") == "other"


def test_a_trace_is_read_into_kinds_busy_time_gaps_and_waits():
    work = [
        _event("kernel", "nvjet_gemm", 0, 100),
        _event("kernel", "_scatter_add_kernel", 50, 100),  # overlaps the GEMM (another stream)
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 60, 10),
        _event("kernel", "flash_fwd", 400, 50),  # after a gap of 250 us
        _event("kernel", "some_kernel", 460, 40),  # after 10 us
        _event("kernel", "_scatter_add_kernel", 600, 60),  # after 100 us
    ]
    waits = [_event("cuda_runtime", "cudaStreamSynchronize", 0, 30)]
    out = _kinds(work, waits, top=2)
    assert out["gemm"] == pytest.approx(1e-4) and out["odc push"] == pytest.approx(1.6e-4)
    assert out["attention"] == pytest.approx(5e-5) and out["other"] == pytest.approx(4e-5)
    assert out["copy"] == pytest.approx(1e-5)
    assert out["span"] == pytest.approx(6.6e-4)
    assert out["kernels busy"] == pytest.approx(3e-4)  # 0-150, 400-450, 460-500, 600-660
    assert out["kernels"] == 5
    assert out["host waits"] == pytest.approx(3e-5)
    assert out["gaps"] == [(pytest.approx(2.5e-4), "_scatter_add_kernel", "flash_fwd"),
                           (pytest.approx(1e-4), "some_kernel", "_scatter_add_kernel")]  # fmt: skip
    assert out["top kernels"] == [
        ("_scatter_add_kernel", pytest.approx(1.6e-4), 2),
        ("nvjet_gemm", pytest.approx(1e-4), 1),
    ]


def test_a_cuda_step_is_read_per_microbatch_by_launch_time():
    """``_profile.step_summary`` on a hand-made CUDA trace: each kernel belongs to the microbatch whose range was
    open when its launch (the runtime call of the same correlation id) began, wherever it ran; overlapping kernels
    share their time, so the kinds add up to the busy time; a gap names the host event the host was in; kernels
    launched outside every microbatch count for the step only."""
    from _profile import step_summary

    def kernel(name, ts, dur, correlation):
        return {**_event("kernel", name, ts, dur), "args": {"correlation": correlation}}

    def launch(ts, correlation):
        return {**_event("cuda_runtime", "cudaLaunchKernel", ts, 2), "args": {"correlation": correlation}}

    events = [
        _event("user_annotation", "microbatch 0", 0, 100),
        _event("user_annotation", "microbatch 1", 100, 100),
        launch(10, 1), kernel("nvjet_gemm", 50, 100, 1),
        launch(20, 2), kernel("_scatter_add_kernel", 100, 100, 2),  # overlaps the GEMM for 50 us
        launch(150, 3), kernel("flash_fwd", 400, 50, 3),  # microbatch 1's, after a gap of 200 us
        launch(300, 4), kernel("vectorized_elementwise_kernel", 500, 10, 4),  # the optimizer's: outside
        _event("cuda_runtime", "cudaStreamSynchronize", 190, 250),
        _event("cpu_op", "aten::_local_scalar_dense", 180, 270),
    ]  # fmt: skip
    out = step_summary(events, cuda=True)
    assert out["busy_s"] == pytest.approx(2e-4) and out["span_s"] == pytest.approx(4e-4)
    assert out["idle_s"] == pytest.approx(2e-4) and out["overlapped_s"] == pytest.approx(5e-5)
    kinds = out["kinds_s"]
    assert kinds["gemm"] == pytest.approx(7.5e-5) and kinds["odc push"] == pytest.approx(7.5e-5)
    assert kinds["attention"] == pytest.approx(5e-5) and sum(kinds.values()) == pytest.approx(out["busy_s"])
    assert [(mb["events"], mb["device_s"]) for mb in out["microbatches"]] == [(2, pytest.approx(1.5e-4)),
                                                                              (1, pytest.approx(5e-5))]  # fmt: skip
    assert out["gaps"] == [{"s": pytest.approx(2e-4), "before": "_scatter_add_kernel", "after": "flash_fwd",
                            "host": "cudaStreamSynchronize"}]  # fmt: skip
    assert out["step_device_events"] == 4 and out["step_device_busy_s"] == pytest.approx(2.1e-4)
    assert ("cudaStreamSynchronize", pytest.approx(2.5e-4), 1) in out["host_ops_step"]
    # host operators that began inside the microbatches' range only: not the optimizer's launch
    assert out["host_ops_minibatch"] == [("aten::_local_scalar_dense", pytest.approx(2.7e-4), 1),
                                         ("cudaStreamSynchronize", pytest.approx(2.5e-4), 1),
                                         ("cudaLaunchKernel", pytest.approx(6e-6), 3)]  # fmt: skip
