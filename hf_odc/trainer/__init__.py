"""TRL trainers on ODC: :class:`ODCSFTTrainer` / :class:`ODCSFTConfig`, :class:`ODCGRPOTrainer` /
:class:`ODCGRPOConfig`, :class:`ODCRLOOTrainer` / :class:`ODCRLOOConfig`, :class:`ODCDistillationTrainer` /
:class:`ODCDistillationConfig`, :class:`ODCDPOTrainer` / :class:`ODCDPOConfig`, :class:`ODCRewardTrainer` /
:class:`ODCRewardConfig` and :class:`ODCKTOTrainer` / :class:`ODCKTOConfig`.

The data paths (global minibatch, plan, padding-free packing) are in :mod:`hf_odc.trainer.core.data` (SFT),
:mod:`hf_odc.trainer.online.rollouts` (GRPO, RLOO, distillation) and :mod:`hf_odc.trainer.preference.pairs` (DPO, reward
modelling, KTO); hf_odc's packed attention (``attn_implementation="odc_packed"``, registered with transformers on
import) and the other implementations that keep packed samples apart are in :mod:`hf_odc.trainer.core.attention`, with
what activation checkpointing keeps of the attention (``save_attention_checkpoint_kwargs``); which layers it
checkpoints and whether it keeps the attention, once enabled, in :mod:`hf_odc.trainer.core.activation_checkpointing`.
"""

from .._compat import check_classes
from .core._step import PlannedStep, StepMetrics
from .core.activation_checkpointing import checkpoint_layer_share, save_attention_in_checkpoints
from .core.attention import (
    CHECKPOINT_ATTENTION,
    PACKED_ATTENTION,
    PACKED_ATTENTION_IMPLEMENTATIONS,
    attention_saving_context_fn,
    check_packed_attention,
    packed_attention_forward,
    register_packed_attention,
    save_attention_checkpoint_kwargs,
    use_packed_attention,
)
from .core.data import (
    GlobalMinibatchSampler,
    MinibatchDataLoader,
    PlannedMinibatchCollator,
    count_target_tokens,
    global_minibatch,
    minibatch_loader,
)
from .online.distillation_config import ODCDistillationConfig
from .online.distillation_trainer import ODCDistillationTrainer
from .online.grpo_config import ODCGRPOConfig
from .online.grpo_trainer import ODCGRPOTrainer
from .online.rloo_config import ODCRLOOConfig
from .online.rloo_trainer import ODCRLOOTrainer
from .preference.dpo_config import ODCDPOConfig
from .preference.dpo_trainer import ODCDPOTrainer
from .preference.kto_config import ODCKTOConfig
from .preference.kto_trainer import ODCKTOTrainer
from .preference.reward_config import ODCRewardConfig
from .preference.reward_trainer import ODCRewardTrainer
from .sft_config import ODCSFTConfig
from .sft_trainer import ODCSFTTrainer

check_classes()  # the private TRL / transformers names the trainers rely on (hf_odc._compat)

__all__ = [
    "CHECKPOINT_ATTENTION",
    "PACKED_ATTENTION",
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "GlobalMinibatchSampler",
    "MinibatchDataLoader",
    "ODCDPOConfig",
    "ODCDPOTrainer",
    "ODCDistillationConfig",
    "ODCDistillationTrainer",
    "ODCGRPOConfig",
    "ODCGRPOTrainer",
    "ODCKTOConfig",
    "ODCKTOTrainer",
    "ODCRLOOConfig",
    "ODCRLOOTrainer",
    "ODCRewardConfig",
    "ODCRewardTrainer",
    "ODCSFTConfig",
    "ODCSFTTrainer",
    "PlannedMinibatchCollator",
    "PlannedStep",
    "StepMetrics",
    "attention_saving_context_fn",
    "check_packed_attention",
    "checkpoint_layer_share",
    "count_target_tokens",
    "global_minibatch",
    "minibatch_loader",
    "packed_attention_forward",
    "register_packed_attention",
    "save_attention_checkpoint_kwargs",
    "save_attention_in_checkpoints",
    "use_packed_attention",
]
