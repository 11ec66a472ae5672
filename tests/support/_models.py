"""The tests' one tiny-model factory, built from a config: no download, a forward pass in milliseconds on CPU."""

from __future__ import annotations

VOCAB = 128


def tiny_qwen2_config(**overrides):
    """A Qwen2 config with 2 layers, hidden 64, 4 heads (2 KV), vocabulary ``VOCAB``, eager attention (not saved with
    the config); ``overrides`` set any field."""
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


def tiny_model(seed: int = 0, lora: bool = False, checkpointing: bool | float = False, device: str = "cpu"):
    """A Qwen2 of :func:`tiny_qwen2_config` with tied embeddings and 256 positions, identical on every rank for one
    seed; with ``checkpointing``, activation checkpointing (a float: on that share of the layers,
    ``checkpoint_layer_share``); with ``lora``, a LoRA adapter on q and v."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(max_position_embeddings=256, tie_word_embeddings=True))
    if isinstance(checkpointing, float):
        from hf_odc.trainer.core.activation_checkpointing import checkpoint_layer_share

        checkpoint_layer_share(model, checkpointing)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    return model.to(device)


def tiny_moe_config(family: str = "qwen3_moe", **overrides):
    """A Mixture-of-Experts config of the same tiny shape: ``"qwen3_moe"`` (Qwen3-MoE: 4 experts of width 32, top-2,
    every layer sparse) or ``"mixtral"`` (Mixtral: 4 experts of width 64, top-2), both with the router's
    load-balancing loss on (``output_router_logits``) and the model's ``router_aux_loss_coef``; eager attention.
    ``overrides`` set any field."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "attn_implementation": "eager",
    }
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{**shape, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16, **overrides})
    if family == "mixtral":
        return MixtralConfig(**{**shape, "num_local_experts": 4, "intermediate_size": 64, **overrides})
    raise ValueError(f"family must be 'qwen3_moe' or 'mixtral', got {family!r}.")
