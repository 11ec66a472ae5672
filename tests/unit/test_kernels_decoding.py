"""The decoding linear layer (``hf_odc.kernels.decoding``): its Triton kernel, run by Triton's interpreter on CPU
tensors, gives ``F.linear``'s values for row counts up to 128 and weight shapes that are no multiple of its tiles, with
and without a bias, with the input dimension split or not; ``torch.compile`` traces the custom operator as one call;
what the kernel does not take goes to ``F.linear``; every config of the table compiles for Hopper (sm_90) with its
loads pipelined, on a machine without a GPU.

The interpreter must be switched on before Triton defines the kernels, so the ``interpreted`` cases run in one pytest
subprocess with ``TRITON_INTERPRET=1`` (:func:`test_kernels_under_the_triton_interpreter`) and are skipped in this
process; their ``cuda`` cases run the compiled kernel on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _interpreter import kernel_devices, run_interpreted

from hf_odc.kernels import decoding as module
from hf_odc.kernels.decoding import DECODE_LINEAR_CONFIGS, MAX_DECODE_ROWS, decode_linear, decode_linear_config

KERNEL_DEVICES = kernel_devices(module._INTERPRET)
"""Where the Triton kernels run: CPU tensors under the interpreter, CUDA ones on a GPU."""


def test_kernels_under_the_triton_interpreter():
    run_interpreted(__file__, module._INTERPRET)


def _operands(rows: int, out_features: int, in_features: int, bias: bool, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    b = torch.randn(out_features, generator=g) if bias else None
    return [None if t is None else t.to(device, dtype) for t in (x, weight, b)]


def _close(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``actual`` is ``F.linear`` of the operands, summed in fp32 and rounded once to their dtype: within two units
    of the last place of the largest value (Triton's interpreter truncates to bf16 where the GPU rounds to nearest)."""
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert actual.dtype == x.dtype and actual.shape == expected.shape
    unit = torch.finfo(x.dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(actual.float(), expected, rtol=0, atol=2 * unit)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "bias"),
    [(1, 40, 72, True), (7, 200, 136, False), (64, 130, 1000, True), (128, 72, 300, False), (33, 4100, 24, True)],
)
def test_the_kernel_computes_f_linear(device, dtype, rows, out_features, in_features, bias):
    """Through :func:`decode_linear`, with the table's tiling (the input dimension split in 4 up to 4096 outputs, not
    split beyond), for shapes that are no multiple of the tiles; leading dimensions kept."""
    x, weight, b = _operands(rows, out_features, in_features, bias, dtype, device)
    out = decode_linear(x.view(1, rows, in_features), weight, b)
    assert out.shape == (1, rows, out_features)
    _close(out.view(rows, out_features), x, weight, b)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("split_k", [1, 3, 16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_every_split_of_the_input_dimension_sums_to_f_linear(device, split_k, bias):
    """The kernel itself, the input dimension in 1, 3 or (cut to its 6 slices) 16 parts, the last part short."""
    from hf_odc.kernels import _triton_decoding

    x, weight, b = _operands(20, 96, 6 * 32 - 5, bias, torch.bfloat16, device)
    out = _triton_decoding.decode_linear_forward(x, weight, b, 32, 32, split_k, 4, 3)
    _close(out, x, weight, b)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compile_traces_the_operator_as_one_call(device):
    """``torch.compile`` (``fullgraph``) traces :func:`decode_linear` into one call of ``hf_odc::decode_linear``, its
    output's shape from the fake implementation, and the compiled function gives the kernel's values; so does
    inductor's (as the decoding loop compiles its forward), with and without a bias."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    x, weight, b = _operands(16, 48, 80, True, torch.bfloat16, device)
    compiled = torch.compile(lambda x: decode_linear(x, weight, b) * 2, backend=backend, fullgraph=True)
    out = compiled(x.view(2, 8, 80))
    (graph,) = graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.hf_odc.decode_linear.default) == 1 and F.linear not in targets
    assert torch.equal(out, decode_linear(x.view(2, 8, 80), weight, b) * 2)
    for bias in (b, None):
        inductor = torch.compile(lambda x, bias=bias: decode_linear(x, weight, bias).float().relu(), fullgraph=True)
        assert torch.equal(inductor(x), decode_linear(x, weight, bias).float().relu())


def _spy(monkeypatch) -> list[str]:
    """Which path each call of :func:`decode_linear` takes: ``"kernel"`` or ``"linear"``."""
    from hf_odc.kernels import _triton_decoding

    taken = []
    forward, linear = _triton_decoding.decode_linear_forward, F.linear
    monkeypatch.setattr(_triton_decoding, "decode_linear_forward", lambda *a: taken.append("kernel") or forward(*a))
    monkeypatch.setattr(F, "linear", lambda *a: taken.append("linear") or linear(*a))
    return taken


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_what_the_kernel_does_not_take_goes_to_f_linear(monkeypatch, device):
    """More than :data:`MAX_DECODE_ROWS` rows, fp32, or a gradient wanted: ``F.linear``, with its
    values."""
    taken = _spy(monkeypatch)
    x, weight, b = _operands(MAX_DECODE_ROWS + 1, 24, 40, True, torch.bfloat16, device)
    cases = {
        "rows": (x, weight, b),
        "fp32": (x[:4].float(), weight.float(), b.float()),
        "gradient": (x[:4], weight.clone().requires_grad_(), b),
    }
    for name, args in cases.items():
        taken.clear()
        assert torch.equal(decode_linear(*args), F.linear(*args)), name
        assert taken == ["linear", "linear"], name
    taken.clear()
    with torch.no_grad():  # the same weight without a gradient wanted: the kernel
        decode_linear(x[:4], weight.clone().requires_grad_(), b)
    assert taken == ["kernel"]


def test_without_a_gpu_or_the_interpreter_every_call_is_f_linear(monkeypatch):
    monkeypatch.setattr(module, "_INTERPRET", False)
    taken = _spy(monkeypatch)
    x, weight, b = _operands(4, 24, 40, True, torch.bfloat16, "cpu")
    assert torch.equal(decode_linear(x, weight, b), F.linear(x, weight, b))
    assert taken == ["linear", "linear"]


def test_the_table_gives_every_shape_a_config_the_narrow_ones_split():
    shapes = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
    configs = {name: decode_linear_config(*shape) for name, shape in shapes.items()}
    assert configs["qkv"].split_k > 1 and configs["down"].split_k > 1 and configs["gate_up"].split_k == 1
    assert decode_linear_config(151936, 1536).split_k == 1 and decode_linear_config(2**31, 2**31)


@pytest.mark.parametrize("rows", [16, 64, 128])
def test_every_config_compiles_for_hopper_with_its_loads_pipelined(rows):
    """Each row of :data:`DECODE_LINEAR_CONFIGS`, as the launcher cuts its stages, compiled for sm_90 (the weight's
    row length a multiple of 16, as Triton specialises it at launch): tensor-core products (wgmma from 64 rows on, mma
    below), asynchronous
    copies in flight (the pipelined loads), and shared memory within Hopper's 227 KiB; the kernel summing the parts
    compiles too."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_odc.kernels._triton_decoding import _SHARED_MEMORY_BUDGET, _decode_linear_kernel, _sum_parts_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32"}
    signature = {**pointers, "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32"}
    constants = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STEPS", "HAS_BIAS", "PARTIAL", "UPCAST")
    signature |= dict.fromkeys(constants, "constexpr")
    aligned = {(index,): [["tt.divisibility", 16]] for index in range(8)}
    for _, _, config in DECODE_LINEAR_CONFIGS:
        stages = min(config.num_stages, _SHARED_MEMORY_BUDGET // ((rows + config.block_n) * config.block_k * 2))
        values = (rows, config.block_n, config.block_k, 6, True, config.split_k > 1, False)
        source = ASTSource(
            _decode_linear_kernel, signature, constexprs=dict(zip(constants, values, strict=True)), attrs=aligned
        )
        options = {"num_warps": config.num_warps, "num_stages": stages}
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = kernel.asm["ptx"]
        tensor_cores, pipelined = "wgmma" in ptx or "mma.sync" in ptx, "cp.async" in ptx
        assert tensor_cores and pipelined, f"{config} at {rows} rows: {tensor_cores=}, {pipelined=}"
        assert kernel.metadata.shared <= 227 * 1024, config
    summing = ASTSource(
        _sum_parts_kernel,
        {"part_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "numel": "i32", "N": "i32"}
        | dict.fromkeys(("SPLIT_K", "HAS_BIAS", "BLOCK"), "constexpr"),
        constexprs={"SPLIT_K": 4, "HAS_BIAS": True, "BLOCK": 1024},
    )
    assert "cubin" in triton.compile(summing, target=GPUTarget("cuda", 90, 32)).asm
