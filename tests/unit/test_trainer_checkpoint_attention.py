"""Activation checkpointing that keeps the attention (``checkpoint_attention="save"``): the same gradients as
recomputing it and as no checkpointing, the attention forward run once per layer instead of twice, applied by the
trainers, and what it refuses. Checkpointing only a share of the layers (``checkpoint_layer_share``): the same
gradients, only those layers recomputed, in the trainers too. Across ranks: tests/distributed/test_engine.py."""

from __future__ import annotations

import pytest
import torch
from _models import VOCAB, tiny_model
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import hf_odc.kernels.attention as kernels
from hf_odc import _compat
from hf_odc.demo import build_tokenizer, chat_dataset
from hf_odc.demo.models import MODEL_CONFIGS
from hf_odc.trainer import (
    PACKED_ATTENTION,
    ODCSFTConfig,
    ODCSFTTrainer,
    attention_saving_context_fn,
    checkpoint_layer_share,
    save_attention_checkpoint_kwargs,
)

LENGTHS = (7, 1, 12, 3)
"""One packed row of 4 documents: ``odc_packed`` runs SDPA once per document and layer on CPU."""
CUDA_LENGTHS = (40, 3, 5, 20, 1, 7, 30, 2)
"""On a GPU, with ``auto``'s threshold at 16 tokens: SDPA for 40, 20, 30 and the lone 2, one ``varlen_attn`` launch
for each of (3, 5) and (1, 7), so 6 attention operators per layer, of both kinds."""


class AttentionCount(TorchDispatchMode):
    """Counts the attention operators run under it; one that checkpointing saved is replayed, not run, in the
    backward's recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = set(_compat.attention_operators())
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.operators
        return func(*args, **(kwargs or {}))


def _packed_row(lengths: tuple[int, ...], device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    row = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(samples)
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in row.items()}


def _forward_backward(
    checkpointing: str | None, lengths: tuple[int, ...] = LENGTHS, device: str = "cpu", dtype=torch.float32
) -> tuple[dict[str, torch.Tensor], int]:
    """The 2-layer model's gradients on one packed row, and how many attention operators ran in its forward and
    backward, with ``checkpointing`` ``"save"``, ``"recompute"`` or ``None`` (off)."""
    model = tiny_model().to(device, dtype)
    model.set_attn_implementation(PACKED_ATTENTION)
    if checkpointing is not None:
        kwargs = save_attention_checkpoint_kwargs() if checkpointing == "save" else {"use_reentrant": False}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    with AttentionCount() as counted:
        model(**_packed_row(lengths, device), use_cache=False).loss.backward()
    return {name: p.grad.float() for name, p in model.named_parameters()}, counted.count


def _mlp_runs(model) -> list[int]:
    """Counts, per decoder layer of ``model`` (from now on), its MLP's forwards as they start: a checkpointed layer's
    runs again in the backward (up to the last tensor it saves, so its end is not a place to count)."""
    runs = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: runs.__setitem__(index, runs[index] + 1))
    return runs


def _with_share(share: float | None) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The 2-layer model's gradients on one packed row with ``share`` of its layers checkpointed (``None``: no
    checkpointing), enabled, disabled and enabled again (as TRL does around generation), and its MLPs' forwards."""
    model = tiny_model(checkpointing=share or False)
    model.set_attn_implementation(PACKED_ATTENTION)
    if share is not None:
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runs = _mlp_runs(model)
    model.train()
    model(**_packed_row(LENGTHS, "cpu"), use_cache=False).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, runs


def test_checkpointing_a_share_of_the_layers_recomputes_only_those_with_the_same_gradients():
    """``checkpoint_layer_share=0.5`` on the 2-layer model: the first layer runs its MLP twice (again in the
    backward), the second once, after enabling again too; the gradients are every layer checkpointed's and none's."""
    half, half_runs = _with_share(0.5)
    every, every_runs = _with_share(1.0)
    plain, plain_runs = _with_share(None)
    assert (half_runs, every_runs, plain_runs) == ([2, 1], [2, 2], [1, 1])
    for name, grad in half.items():
        torch.testing.assert_close(grad, every[name], rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(grad, plain[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_layer_share_is_refused_where_it_cannot_apply():
    """A share outside (0, 1], or one below 1 for a model without transformers' checkpointing layers."""
    with pytest.raises(ValueError, match=r"must be in \(0, 1\].*gradient_checkpointing=False\), got 0"):
        checkpoint_layer_share(tiny_model(), 0)
    with pytest.raises(ValueError, match=r"needs decoder layers that transformers checkpoints one by one.*Linear"):
        checkpoint_layer_share(torch.nn.Linear(2, 2), 0.5)
    checkpoint_layer_share(torch.nn.Linear(2, 2), 1.0)  # nothing to do


def test_saving_the_attention_keeps_the_gradients_and_runs_it_once():
    """fp32 on CPU: the gradients equal those of plain checkpointing and of none (the saved outputs are what the
    recomputation would produce), and the attention's forward runs once per document and layer, not twice."""
    once = len(LENGTHS) * 2  # documents x layers
    saved, saved_count = _forward_backward("save")
    recomputed, recomputed_count = _forward_backward("recompute")
    plain, plain_count = _forward_backward(None)
    for name, grad in saved.items():
        torch.testing.assert_close(grad, recomputed[name], rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(grad, plain[name], rtol=1e-6, atol=1e-7, msg=name)
    assert (saved_count, recomputed_count, plain_count) == (once, 2 * once, once)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_saves_both_kernels_outputs(monkeypatch):
    """bf16 on a GPU, a row that takes SDPA and ``varlen_attn``: each runs once per layer with ``"save"`` and twice
    with ``"recompute"``, and the gradients agree (within the kernels' non-deterministic backward)."""
    monkeypatch.setattr(kernels, "ALONE_FROM", 16)
    once = 6 * 2  # attention operators per layer x layers
    saved, saved_count = _forward_backward("save", CUDA_LENGTHS, "cuda", torch.bfloat16)
    recomputed, recomputed_count = _forward_backward("recompute", CUDA_LENGTHS, "cuda", torch.bfloat16)
    for name, grad in saved.items():
        error = ((grad - recomputed[name]).norm() / recomputed[name].norm()).item()
        assert error < 1e-2, (name, error)
    assert (saved_count, recomputed_count) == (once, 2 * once)


def test_the_kwargs_refuse_what_cannot_save_the_attention():
    assert save_attention_checkpoint_kwargs({"preserve_rng_state": False})["preserve_rng_state"] is False
    with pytest.raises(ValueError, match="needs non-reentrant checkpointing: unset use_reentrant"):
        save_attention_checkpoint_kwargs({"use_reentrant": True})
    with pytest.raises(ValueError, match=r"context_fn of its own.*checkpoint_attention='recompute' to keep yours"):
        save_attention_checkpoint_kwargs({"context_fn": attention_saving_context_fn()})


def _trainer_attention_count(tmp_path, checkpoint_attention: str, share: float = 1.0) -> int:
    """The attention operators run by one step of a one-process ODCSFTTrainer with activation checkpointing (on
    ``share`` of the layers)."""
    tokenizer = build_tokenizer()
    config = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id} | MODEL_CONFIGS["tiny"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    args = ODCSFTConfig(
        str(tmp_path / f"{checkpoint_attention}-{share}"), report_to="none", max_steps=1, per_device_train_batch_size=4,
        max_length=64, gradient_checkpointing=True, checkpoint_attention=checkpoint_attention, save_strategy="no",
        checkpoint_layer_share=share,
        disable_tqdm=True, cost_model="tokens", use_cpu=True,  # fp32 GQA on a GPU takes SDPA's unfused math path
    )  # fmt: skip
    dataset: Dataset = chat_dataset(4, 64, "swe-smith", seed=0)
    trainer = ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    with AttentionCount() as counted:
        trainer.train()
    trainer.end()
    return counted.count


def test_the_trainer_saves_the_attention_when_it_checkpoints(tmp_path):
    """``checkpoint_attention="save"`` (the default) reaches the checkpointing ``Trainer.train`` enables: the step runs
    half the attention forwards of ``"recompute"``."""
    saved = _trainer_attention_count(tmp_path, "save")
    assert saved > 0 and _trainer_attention_count(tmp_path, "recompute") == 2 * saved


def test_the_trainer_checkpoints_its_share_of_the_layers(tmp_path):
    """``checkpoint_layer_share=0.5`` reaches the checkpointing ``Trainer.train`` enables: with the attention
    recomputed, the step runs it once per layer plus once more for half the layers."""
    saved = _trainer_attention_count(tmp_path, "save")
    assert _trainer_attention_count(tmp_path, "recompute", share=0.5) == saved * 3 // 2


def test_the_config_refuses_what_it_cannot_honour(tmp_path):
    make = lambda **kwargs: ODCSFTConfig(str(tmp_path), report_to="none", **kwargs)  # noqa: E731
    assert make().checkpoint_attention == "save"
    with pytest.raises(ValueError, match=r"checkpoint_attention must be one of \('save', 'recompute'\), got 'keep'"):
        make(checkpoint_attention="keep")
    for share in (0, 1.5):
        with pytest.raises(ValueError, match=rf"checkpoint_layer_share must be in \(0, 1\].*got {share}"):
            make(checkpoint_layer_share=share)
    with pytest.raises(ValueError, match="needs non-reentrant checkpointing"):
        make(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="context_fn of its own"):
        make(gradient_checkpointing_kwargs={"context_fn": attention_saving_context_fn()})
    # what "save" cannot do is the user's to choose with "recompute", or without checkpointing
    make(gradient_checkpointing_kwargs={"use_reentrant": True}, checkpoint_attention="recompute")
    make(gradient_checkpointing_kwargs={"use_reentrant": True}, gradient_checkpointing=False)
