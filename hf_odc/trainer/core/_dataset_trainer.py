"""What the trainers over a dataset's examples share (SFT, DPO, KTO, reward modelling): :class:`_ODCDatasetTrainer`,
the family base beside :class:`~hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer`."""

from __future__ import annotations

import contextlib
from typing import Any

from ..._compat import trl_prepared_dataset
from ._base_trainer import _ODCTrainer
from ._step import PlannedStep
from .vision import is_vision_dataset


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

    @classmethod
    def check_train_dataset(cls, train_dataset: Any, processing_class: Any, args: Any, num_processes: int = 1) -> None:
        """Raise ``ValueError``, as this trainer built with ``train_dataset``, ``processing_class`` and ``args`` on
        ``num_processes`` processes would, for training data it refuses once TRL has prepared it (samples longer than
        a microbatch, truncation that leaves most of them nothing to learn), without a model, a process group or a
        device: ``hf-odc`` runs it in the launching process, before any worker starts. The data is prepared here as
        TRL's ``__init__`` prepares it (:func:`hf_odc._compat.trl_prepared_dataset`: tokenized once more), then as
        the trainer's own ``__init__`` does (:meth:`_with_run_columns`), then checked by the trainer's own
        ``_check_prepared_data``. A vision dataset's samples are processed, and checked, by the step that draws
        them."""
        args = cls._odc_args(args)
        cls._check_train_data({"train_dataset": train_dataset}, packs=None, text=None)
        if is_vision_dataset(train_dataset):
            return
        unbuilt = cls.__new__(cls)  # the trainer's checks read only its args and its prepared data
        unbuilt.args = args
        prepared = trl_prepared_dataset(unbuilt, train_dataset, processing_class, args)
        if prepared is not None:
            unbuilt.train_dataset = unbuilt._with_run_columns(prepared, num_processes)
            unbuilt._check_prepared_data(train_dataset, warn=False)

    def _with_run_columns(self, dataset: Any, num_processes: int) -> Any:
        """``dataset`` as TRL prepared it, with the columns that the trainer adds for a run on ``num_processes``
        processes (KTO's mismatched completions, chosen within each global batch); here none."""
        return dataset
