"""Packed microbatches must not attend across samples (checked numerically for the implementations we allow), and
hf_odc's own ``odc_packed`` must do it at the cost of the samples: no T x T tensor, exact gradients, sdpa elsewhere."""

from __future__ import annotations

import warnings

import pytest
import torch
from _models import VOCAB, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import add_fused_lm_head

import hf_odc.kernels.attention as kernels
from hf_odc.trainer import (
    PACKED_ATTENTION,
    use_packed_attention,
)


def _model(attn: str, **kwargs):
    model = tiny_model(**kwargs)  # the engine tests' 2-layer Qwen2 (tied embeddings), seeded
    model.set_attn_implementation(attn)
    return model.eval()


def _samples(lengths=(7, 1, 12, 3)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _pack(samples: list[list[int]]) -> dict:
    """Padding-free packing as the trainer does it (TRL's collator): one row, position_ids restarting per sample."""
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": s} for s in samples])


@pytest.mark.parametrize("attn", ["eager", "sdpa", PACKED_ATTENTION])
def test_packed_logits_equal_each_samples_own_logits(attn):
    model, samples = _model(attn), _samples()
    packed = _pack(samples)
    packed.pop("labels")
    with torch.no_grad():
        together = model(**packed, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa", PACKED_ATTENTION])
def test_fused_lm_head_log_probs_of_a_packed_row_equal_each_samples(attn):
    """The exact path the trainer takes: TRL's fused head, labels masked at every sample's first token."""
    model, samples = _model(attn), _samples()
    add_fused_lm_head(model, outputs=("log_probs",))
    packed = _pack(samples)
    with torch.no_grad():
        together = model(**packed, use_cache=False, fused_lm_head=True).log_probs[0]
        alone = [
            model(input_ids=torch.tensor([s]), labels=torch.tensor([s]), use_cache=False, fused_lm_head=True)
            for s in samples
        ]
    # In the packed row, position i predicts token i+1; a sample's first token is never a target.
    expected = torch.cat([torch.cat([torch.zeros(1), out.log_probs[0]]) for out in alone])[1:]
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)


def test_cross_sample_attention_would_be_detected():
    """Sanity check of the test itself: without position_ids the samples attend to each other."""
    model, samples = _model("sdpa"), _samples()
    with torch.no_grad():
        together = model(input_ids=torch.tensor([[t for s in samples for t in s]]), use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples])
    assert not torch.allclose(together, alone, atol=1e-3)


@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
def test_packed_row_trains_like_each_sample_alone(boundaries):
    """Loss and every gradient of a packed row equal the samples' own, summed; with activation checkpointing, so
    that the recomputed forward takes the same boundaries."""
    samples = _samples()
    packed = _pack(samples)
    if boundaries == "position_ids":
        packed = {k: packed[k] for k in ("input_ids", "labels", "position_ids")}
    model = _model(PACKED_ATTENTION, checkpointing=True).train()
    logits = model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False).logits[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], packed["labels"][0, 1:], ignore_index=-100, reduction="sum")
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = _model("sdpa", checkpointing=True).train()
    total = 0.0
    for s in samples:
        if len(s) > 1:
            out = reference(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            one = torch.nn.functional.cross_entropy(out[:-1], torch.tensor(s[1:]), reduction="sum")
            one.backward()
            total += one.item()
    assert loss.item() == pytest.approx(total, rel=1e-5)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_generation_and_padded_batches_are_sdpas():
    """With a KV cache or a padding mask the implementation is sdpa with its mask: same tokens, same logits."""
    ours, theirs = _model(PACKED_ATTENTION).eval(), _model("sdpa").eval()
    prompt = torch.tensor([_samples()[0]])
    generate = {"max_new_tokens": 6, "do_sample": False}
    assert torch.equal(ours.generate(prompt, **generate), theirs.generate(prompt, **generate))
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids, attention_mask=mask).logits, theirs(input_ids=ids, attention_mask=mask).logits
        )
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)  # unpadded batch


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize(("attn", "dense"), [(PACKED_ATTENTION, False), ("sdpa", True)])
def test_a_long_packed_row_never_makes_a_t_by_t_tensor(attn, dense):
    """Forward and backward of a 3072-token row of 24 samples: no tensor reaches T*T elements (the largest
    legitimate one, the logits, is T x 128); sdpa, with its block-diagonal mask, does, which shows the probe works."""
    samples = _samples([128] * 24)
    tokens = sum(map(len, samples))
    packed = _pack(samples)
    model = _model(attn).train()
    with _LargestTensor() as probe:
        logits = model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
    assert (probe.numel >= tokens * tokens) == dense, probe.numel


def test_trainers_switch_dense_mask_attention_and_warn_when_told_not_to():
    model = _model("sdpa")
    assert use_packed_attention(model, True, torch.device("cpu")) == PACKED_ATTENTION
    kept = _model("eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on CPU
        assert use_packed_attention(kept, False, torch.device("cpu")) == "eager"
    with pytest.warns(UserWarning, match="dense T x T mask"):
        assert use_packed_attention(kept, False, torch.device("cuda")) == "eager"
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="attend to each other"):
        use_packed_attention(model, True, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_packed_row_takes_both_kernels_and_trains_like_each_sample_alone(monkeypatch):
    """bf16 on a GPU, with ``auto``'s threshold lowered to 16 tokens so that this row of long and short samples
    takes both kernels (SDPA alone for the long ones, one varlen launch per run of short ones): logits and gradients
    equal the samples' own, run alone through sdpa, within bf16 rounding."""
    monkeypatch.setattr(kernels, "ALONE_FROM", 16)
    launches = []
    real = kernels._varlen_attn
    monkeypatch.setattr(kernels, "_varlen_attn", lambda *args, **kw: launches.append(1) or real(*args, **kw))
    samples = _samples((40, 3, 5, 20, 1, 7, 30, 2))
    packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _pack(samples).items() if k != "labels"}
    model = _model(PACKED_ATTENTION).to("cuda", torch.bfloat16).train()
    logits = model(**packed, use_cache=False).logits[0]
    logits.float().logsumexp(-1).sum().backward()
    assert launches == [1, 1] * 2  # two runs of short samples, each layer
    packed_grads = {n: p.grad.float() for n, p in model.named_parameters()}

    reference = _model("sdpa").to("cuda", torch.bfloat16).train()
    alone = [reference(input_ids=torch.tensor([s], device="cuda"), use_cache=False).logits[0] for s in samples]
    torch.cat(alone).float().logsumexp(-1).sum().backward()
    torch.testing.assert_close(logits, torch.cat(alone), rtol=2e-2, atol=2e-2)
    for name, param in reference.named_parameters():
        error = ((packed_grads[name] - param.grad.float()).norm() / param.grad.float().norm()).item()
        assert error < 2e-2, (name, error)
