"""TRL trainers on ODC: :class:`ODCSFTTrainer` and its :class:`ODCSFTConfig`.

The data path (global minibatch, plan, padding-free packing) is in :mod:`hf_odc.trainer.data`; hf_odc's packed
attention (``attn_implementation="odc_packed"``, registered with transformers on import) and the other
implementations that keep packed samples apart are in :mod:`hf_odc.trainer.attention`.
"""

from .attention import (
    PACKED_ATTENTION,
    PACKED_ATTENTION_IMPLEMENTATIONS,
    check_packed_attention,
    packed_attention_forward,
    register_packed_attention,
    use_packed_attention,
)
from .config import ODCSFTConfig
from .data import GlobalMinibatchSampler, MinibatchDataLoader, PlannedMinibatchCollator, count_target_tokens
from .sft_trainer import ODCSFTTrainer

__all__ = [
    "PACKED_ATTENTION",
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "GlobalMinibatchSampler",
    "MinibatchDataLoader",
    "ODCSFTConfig",
    "ODCSFTTrainer",
    "PlannedMinibatchCollator",
    "check_packed_attention",
    "count_target_tokens",
    "packed_attention_forward",
    "register_packed_attention",
    "use_packed_attention",
]
