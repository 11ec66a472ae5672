"""``ODCDPOConfig`` validation and what ``ODCDPOTrainer`` refuses at construction, each with what to use instead."""

from __future__ import annotations

import pytest
from _models import tiny_qwen2_config
from peft import LoraConfig, get_peft_model
from transformers import Qwen2ForCausalLM

from hf_odc.demo import build_tokenizer, preference_dataset
from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer


def config(tmp_path, **kwargs) -> ODCDPOConfig:
    return ODCDPOConfig(str(tmp_path), report_to="none", **kwargs)


def test_a_microbatch_fits_a_pair_of_two_longest_sequences(tmp_path):
    assert config(tmp_path, max_length=100).max_tokens_for_pairs(7) == 200
    assert config(tmp_path, max_length=100, packing_ratio=1.5).max_tokens_for_pairs(7) == 300
    assert config(tmp_path, max_length=None).max_tokens_for_pairs(77) == 77  # the minibatch's longest pair
    assert config(tmp_path, max_tokens_per_microbatch=999).max_tokens_for_pairs(7) == 999


def test_short_pairs_fill_a_microbatch_to_the_floor(tmp_path):
    """``min_tokens_per_microbatch`` raises the capacity that ``max_length`` or ``packing_ratio`` gives, never lowers
    it, and yields to an explicit ``max_tokens_per_microbatch``."""
    assert config(tmp_path, max_length=100, min_tokens_per_microbatch=4096).max_tokens_for_pairs(7) == 4096
    by_ratio = config(tmp_path, max_length=100, packing_ratio=2.0, min_tokens_per_microbatch=64)
    assert by_ratio.max_tokens_for_pairs(7) == 400
    assert config(tmp_path, max_length=None, min_tokens_per_microbatch=0).max_tokens_for_pairs(77) == 77
    floored = config(tmp_path, max_tokens_per_microbatch=999, min_tokens_per_microbatch=4096)
    assert floored.max_tokens_for_pairs(7) == 999


def _tiny_model(tokenizer):
    return Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))


def test_max_tokens_below_the_longest_pair_is_refused_at_construction(tmp_path):
    """Before the reference log-probabilities are precomputed (the planner would refuse the first chunk less
    clearly) and before the first step."""
    tokenizer = build_tokenizer()
    with pytest.raises(ValueError, match=r"longest pair has \d+ tokens .* \(24 tokens\)\. Set --max_tokens_per_micro"):
        ODCDPOTrainer(
            model=_tiny_model(tokenizer),
            args=config(tmp_path, max_tokens_per_microbatch=24, precompute_ref_log_probs=True, max_length=64),
            train_dataset=preference_dataset(16, 64, "swe-smith", 0),
            processing_class=tokenizer,
        )


def test_a_peft_model_whose_adapter_trl_would_copy_is_refused(tmp_path):
    tokenizer = build_tokenizer()
    model = get_peft_model(_tiny_model(tokenizer), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(NotImplementedError, match=r"Pass the base model with peft_config .* or a ref_model"):
        ODCDPOTrainer(
            model=model, args=config(tmp_path), train_dataset=preference_dataset(4, 32, "swe-smith", 0),
            processing_class=tokenizer,
        )  # fmt: skip
