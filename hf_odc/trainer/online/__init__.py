"""The online trainers: the rollout base, the rollout data path, the sampling correction, and the GRPO, RLOO and
distillation config/trainer pairs."""
