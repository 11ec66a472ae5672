"""What the trainers over a dataset's examples share (SFT, DPO, KTO, reward modelling): :class:`_ODCDatasetTrainer`,
the family base beside :class:`~hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer`."""

from __future__ import annotations

import contextlib

from ._base_trainer import _ODCTrainer
from ._step import PlannedStep


class _ODCDatasetTrainer(_ODCTrainer):
    """The step loop's optional hooks as TRL's ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer`` and ``RewardTrainer``
    all keep them: their activation offloading around the minibatch, and their ``num_tokens`` metric."""

    def _microbatch_context(self) -> contextlib.AbstractContextManager:
        """TRL's activation offloading (``activation_offloading``), around the whole minibatch."""
        return self.maybe_activation_offload_context

    def _end_step(self, step: PlannedStep, metrics: dict[str, float]) -> None:
        """TRL's ``num_tokens``: the tokens trained on so far (a step's ``num_tokens``: SFT's samples, both sequences
        of every preference pair, KTO's examples' own sequences)."""
        self._total_train_tokens += step.num_tokens
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
