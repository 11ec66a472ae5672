"""The fused RMSNorm and SiLU-times-up (``hf_odc.kernels.fused``): the Triton kernels, run by Triton's interpreter on
CPU tensors, give the PyTorch formula's values and gradients; a patched tiny Qwen2 and Llama give the stock model's
loss and gradients, through the kernels and through the CPU fallback; other norms and activations are left alone.

The interpreter must be switched on before Triton defines the kernels, so the kernel tests' ``interpreted`` cases run
in one pytest subprocess with ``TRITON_INTERPRET=1`` (:func:`test_kernels_under_the_triton_interpreter`) and are
skipped in this process; their ``cuda`` cases run the compiled kernels on a GPU.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from _interpreted import INTERPRETING, KERNEL_DEVICES, assert_interpreted_cases_pass
from _models import VOCAB, tiny_moe_config, tiny_qwen2_config
from torch import nn

from hf_odc.kernels import fused, install_fused_kernels, rms_norm, silu_mul
from hf_odc.trainer.core.attention import save_attention_checkpoint_kwargs


def test_kernels_under_the_triton_interpreter():
    assert_interpreted_cases_pass(__file__)


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' Qwen2RMSNorm.forward, written out
    upcast = x.to(torch.float32)
    return weight * (upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """``actual`` is ``expected`` of a computation on ``dtype`` inputs."""
    assert actual.dtype == expected.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        # A few bf16 units apart, relative to the largest value (sums over rows cancel): Triton's interpreter truncates
        # to bf16 where PyTorch and the GPU round to nearest. fp32 checks the arithmetic closely.
        torch.testing.assert_close(actual, expected, rtol=2**-5, atol=2**-6 * expected.abs().max().item())


def _same_values_and_grads(out, expected, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    _close(out, expected, dtype)
    upstream = torch.randn_like(expected)
    grads, wanted = torch.autograd.grad(out, inputs, upstream), torch.autograd.grad(expected, inputs, upstream)
    for grad, expected_grad in zip(grads, wanted, strict=True):
        _close(grad, expected_grad, dtype)


SHAPES = [(5, 96), (2, 3, 200), (3, 1536)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, None)],
)
def test_rms_norm_equals_the_formula(device, shape, dtype, weight_dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    # weight_dtype None: an fp32 weight on bf16 activations (the output is fp32, as the formula's)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(weight_dtype or torch.float32).requires_grad_()
    _same_values_and_grads(rms_norm(x, weight, 1e-6), _reference_rms_norm(x, weight, 1e-6), (x, weight), dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rms_norm_of_a_frozen_weight(device):
    x = torch.randn(4, 40, device=device, requires_grad=True)
    weight = torch.rand(40, device=device) + 0.5
    _same_values_and_grads(rms_norm(x, weight, 1e-5), _reference_rms_norm(x, weight, 1e-5), (x,), torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_equals_the_formula(device, shape, dtype):
    torch.manual_seed(0)
    gate = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    up = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    _same_values_and_grads(silu_mul(gate, up), F.silu(gate) * up, (gate, up), dtype)


def _tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = tiny_qwen2_config().to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return LlamaForCausalLM(LlamaConfig(**{key: shape[key] for key in keys}, num_key_value_heads=2))


def _tiny_qwen2(seed: int = 0, **overrides) -> nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen2_config(**overrides))


def _loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 24)).to(model.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _check_patched_model_equals_stock(build, checkpointing: bool, device: str = "cpu") -> None:
    stock = build().to(device).train()
    patched = copy.deepcopy(stock)
    # 2 layers: input and post-attention norms, an MLP each; the final norm
    assert install_fused_kernels(patched) == 7
    if checkpointing:
        for model in (stock, patched):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=save_attention_checkpoint_kwargs())
    loss, grads = _loss_and_grads(patched)
    stock_loss, stock_grads = _loss_and_grads(stock)
    _close(loss, stock_loss)
    for name, grad in stock_grads.items():
        _close(grads[name], grad)


MODELS = {"qwen2": lambda: _tiny_qwen2(attn_implementation="sdpa"), "llama": _tiny_llama}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("family", "checkpointing"), [("qwen2", True), ("llama", False)])
def test_patched_model_equals_stock(device, family, checkpointing):
    _check_patched_model_equals_stock(MODELS[family], checkpointing, device)


@pytest.mark.parametrize(("family", "checkpointing"), [("qwen2", True), ("llama", False)])
def test_patched_model_equals_stock_on_cpu(family, checkpointing):
    _check_patched_model_equals_stock(MODELS[family], checkpointing)


def test_install_patches_the_instances_once():
    model = _tiny_qwen2()
    other = _tiny_qwen2()
    assert install_fused_kernels(model) == 7
    assert install_fused_kernels(model) == 0  # already patched
    norm = model.model.norm
    assert norm.forward.__func__ is fused._fused_rms_norm_forward
    assert "forward" not in vars(other.model.norm)  # the class is untouched


@pytest.mark.parametrize(("family", "norms"), [("qwen3_moe", 9), ("mixtral", 5)])
def test_moe_models_get_their_norms_fused(family, norms):
    """Qwen3-MoE: each layer's two norms, its query and key norms, the final norm; Mixtral: the layers' and the final
    norms. Their experts are not MLP modules and keep their activation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_moe_config(family))
    assert install_fused_kernels(model) == norms == _patched_count(model)


class Qwen2RMSNorm(nn.Module):
    """A norm of the same name outside transformers: its forward is not known to be the formula."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.variance_epsilon = 1e-6


def test_other_norms_and_activations_are_left_alone():
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(
        GemmaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )
    assert install_fused_kernels(gemma) == 0  # (1 + weight) norm, GELU MLP
    gelu = _tiny_qwen2(hidden_act="gelu")
    assert install_fused_kernels(gelu) == 5  # the norms only
    assert all("forward" not in vars(layer.mlp) for layer in gelu.model.layers)
    assert install_fused_kernels(nn.Sequential(Qwen2RMSNorm())) == 0


def _patched_count(model: nn.Module) -> int:
    fused_forwards = (fused._fused_rms_norm_forward, fused._fused_mlp_forward)
    return sum(getattr(vars(module).get("forward"), "__func__", None) in fused_forwards for module in model.modules())


def test_the_trainers_patch_cuda_runs_only(tmp_path, monkeypatch):
    """``fused_kernels`` (default true) patches the model on a GPU only: a CPU trainer keeps the stock forwards."""
    from transformers import HfArgumentParser

    from hf_odc.demo import build_tokenizer, chat_dataset
    from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer
    from hf_odc.trainer.core._base_trainer import _ODCTrainer

    (parsed,) = HfArgumentParser(ODCSFTConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--fused_kernels", "false"]
    )
    assert parsed.fused_kernels is False
    args = ODCSFTConfig(str(tmp_path), report_to="none", max_length=64, use_cpu=True)
    assert args.fused_kernels is True
    tokenizer = build_tokenizer()
    model = _tiny_qwen2(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    asked = []
    install = _ODCTrainer._install_fused_kernels
    monkeypatch.setattr(_ODCTrainer, "_install_fused_kernels", lambda self, m: asked.append(m) or install(self, m))
    trainer = ODCSFTTrainer(model=model, args=args, train_dataset=chat_dataset(4, 64, "swe-smith", seed=0),
                            processing_class=tokenizer)  # fmt: skip
    trainer.end()
    assert asked == [model] and _patched_count(trainer.model) == 0  # asked, before sharding; nothing done on CPU
    # the trainers' rule, on a model of its own for each case
    for fused_kernels, device, patched in [(True, "cuda", 7), (False, "cuda", 0), (True, "cpu", 0)]:
        model = _tiny_qwen2()
        run = types.SimpleNamespace(
            args=types.SimpleNamespace(fused_kernels=fused_kernels, device=torch.device(device))
        )
        _ODCTrainer._install_fused_kernels(run, model)
        assert _patched_count(model) == patched, (fused_kernels, device)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_kernels_compile_for_hopper(dtype):
    """Without a GPU: the four kernels compile for sm_90, the norms at the widest row they take."""
    triton = pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("the interpreter compiles nothing")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_odc.kernels import _triton_fused as kernels

    t, f32, i32 = f"*{dtype}", "*fp32", "i32"
    norm_block = {"BLOCK": triton.next_power_of_2(fused.MAX_NORM_COLUMNS)}
    cases = [
        (kernels._rms_norm_forward_kernel, [t, t, t, f32, i32, "fp32"], norm_block),
        (kernels._rms_norm_backward_kernel, [t, t, t, f32, t, f32, i32, i32, i32], {**norm_block, "WEIGHT_GRAD": True}),
        (kernels._silu_mul_forward_kernel, [t, t, t, "i64"], {"BLOCK": 1024}),
        (kernels._silu_mul_backward_kernel, [t, t, t, t, t, "i64"], {"BLOCK": 1024}),
    ]
    for kernel, types_, constexprs in cases:
        signature = dict(zip(kernel.arg_names, types_ + ["constexpr"] * len(constexprs), strict=True))
        source = ASTSource(kernel, signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
        assert "cubin" in compiled.asm, kernel.fn.__name__
