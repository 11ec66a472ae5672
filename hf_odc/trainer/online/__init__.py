"""The trainers that learn from their own rollouts: the rollout base, the rollout data path, the sampling correction,
and the GRPO, RLOO and distillation config/trainer pairs. It imports ``core`` and ``generation``."""

from ..core._quiet import drop_vllm_install_notes

drop_vllm_install_notes()  # before the trainers below import TRL's, which import vLLM
