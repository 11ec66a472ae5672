"""The tiny model shape the tests build from a config: no download, a forward pass in milliseconds on CPU."""

from __future__ import annotations

VOCAB = 128


def tiny_qwen2_config(**overrides):
    """A Qwen2 config with 2 layers, hidden 64, 4 heads (2 KV), vocabulary ``VOCAB``, eager attention."""
    from transformers import Qwen2Config

    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_implementation": "eager",
    }
    return Qwen2Config(**{**shape, **overrides})
