"""Packed microbatches must not attend across samples: check it numerically for the implementations we allow."""

from __future__ import annotations

import pytest
import torch
from _engine_workers import VOCAB, tiny_model
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import add_fused_lm_head

from hf_odc.trainer import PACKED_ATTENTION_IMPLEMENTATIONS, check_packed_attention


def _model(attn: str):
    model = tiny_model()  # the engine tests' 2-layer Qwen2 (tied embeddings), seeded
    model.set_attn_implementation(attn)
    return model.eval()


def _samples() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 1, 12, 3)]


def _pack(samples: list[list[int]]) -> dict:
    """Padding-free packing as the trainer does it (TRL's collator): one row, position_ids restarting per sample."""
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": s} for s in samples])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_logits_equal_each_samples_own_logits(attn):
    model, samples = _model(attn), _samples()
    packed = _pack(samples)
    packed.pop("labels")
    with torch.no_grad():
        together = model(**packed, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
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


def test_implementations_without_packed_masks_are_refused():
    model = _model("sdpa")
    assert check_packed_attention(model) == "sdpa"
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="attend to each other"):
        check_packed_attention(model)
    assert "paged|sdpa" not in PACKED_ATTENTION_IMPLEMENTATIONS
