"""Which attention implementations keep packed sequences apart.

A packed microbatch is one row: samples concatenated, ``position_ids`` restarting at 0 for each, no attention mask.
In transformers 5.x the model then builds the mask from the positions: ``masking_utils`` finds the sample boundaries
(``find_packed_sequence_indices``: a position that does not follow its predecessor by 1 starts a new sample) and the
mask function of the attention implementation turns them into a block-diagonal causal mask. That only happens when
no ``attention_mask`` and no KV cache are passed (the trainer passes neither), and only for the implementations
whose mask functions are registered in ``ALL_MASK_ATTENTION_FUNCTIONS`` and read the packed boundaries:

* ``eager`` and ``sdpa``: a materialised block-diagonal causal mask (checked in the tests: a packed row's logits equal
  the samples' own logits);
* ``flex_attention``: a block mask built from the same boundaries;
* ``flash_attention_2/3/4``: the varlen kernels, fed ``cu_seq_lens_q/k`` (which the trainer passes) or sequence
  starts derived from ``position_ids``.

Anything else (``paged|...`` implementations for generation, custom kernels registered at run time) would silently
attend across samples, so it is refused.
"""

from __future__ import annotations

from torch import nn

__all__ = ["PACKED_ATTENTION_IMPLEMENTATIONS", "check_packed_attention"]

PACKED_ATTENTION_IMPLEMENTATIONS = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)


def check_packed_attention(model: nn.Module) -> str:
    """Return the model's attention implementation; raise if it could attend across packed samples."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"The model uses attn_implementation={implementation!r}, which does not build a block-diagonal mask from "
            "position_ids, so samples packed into one microbatch would attend to each other. Use one of "
            f"{sorted(PACKED_ATTENTION_IMPLEMENTATIONS)} (e.g. attn_implementation='sdpa')."
        )
    return implementation
