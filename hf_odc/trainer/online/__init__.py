"""The trainers that learn from their own rollouts: the rollout base, the rollout data path, the sampling correction,
and the GRPO, RLOO and distillation config/trainer pairs. It imports ``core`` and ``generation``."""
