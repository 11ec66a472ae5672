"""The checkpoint hooks of every ODC trainer (:class:`_CheckpointHooks`): sharded saves and loads in the one DCP
format of :mod:`hf_odc.trainer.core._checkpoint_format`, which resumes on any number of processes, and the completion
marker written once every rank's part is on disk.

The hooks are ``Trainer``'s own (``_save_checkpoint``, ``save_model``, ``_save_optimizer_and_scheduler``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``train`` for the choice of checkpoint), so a trainer
gets them by listing the mixin before its TRL class; they read the trainer's ``odc`` runtime (its saves are
collectives, bounded as every other) and ``_planner`` (whose calibration is saved and restored with the model).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.trainer import SCHEDULER_NAME

from ...packing import Calibration, Calibrator
from . import _checkpoint_format
from ._quiet import without_resumed_batch_size_warning

CALIBRATION_FILE = "odc_calibration.json"
"""Where the ODC trainers save the calibrated cost model, beside the model (and in every checkpoint)."""


class _CheckpointHooks:
    """DCP checkpoints and a plain ``save_pretrained`` model directory for an ODC trainer (a mixin placed before the
    TRL class)."""

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from complete checkpoints only. ``True`` takes the newest complete
        ``checkpoint-N`` of ``output_dir`` (:func:`~hf_odc.trainer.core._checkpoint_format.last_complete_checkpoint`, in
        place of transformers' ``get_last_checkpoint``, which takes the newest however incomplete); a checkpoint that is
        incomplete, or lacks the optimizer or scheduler state, is refused before anything is loaded (the string
        ``"true"`` of a command line counts as ``True`` unless such a directory exists)."""
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == "true":
            resume_from_checkpoint = True if not os.path.isdir(resume_from_checkpoint) else resume_from_checkpoint
        if resume_from_checkpoint is True:
            resume_from_checkpoint = _checkpoint_format.last_complete_checkpoint(self.args.output_dir)
        quiet = contextlib.nullcontext()
        if isinstance(resume_from_checkpoint, str | os.PathLike):
            _checkpoint_format.check_resumable(os.fspath(resume_from_checkpoint))
            if _checkpoint_format.saved_global_batch_size(os.fspath(resume_from_checkpoint)) == self._global_batch_size:
                quiet = without_resumed_batch_size_warning()  # another process count, the same minibatches
        with quiet:
            return super().train(resume_from_checkpoint, *args, **kwargs)

    @property
    def _global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        args = self.args
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer._save_checkpoint``, then, once every rank's part is on disk, the completion marker, then the
        rotation of older checkpoints (``save_total_limit``). Transformers rotates at the end of its save, which would
        be before the marker: a save killed in between could leave no complete checkpoint, so the rotation is held
        back until this one is complete."""
        with self.odc.bounded("a checkpoint save"):
            self._save_complete_checkpoint(model, trial)

    def _save_complete_checkpoint(self, model: nn.Module, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        output_dir = _checkpoint_format.checkpoint_dir_of(run_dir, self.state.global_step)
        if self.args.should_save:
            _checkpoint_format.unmark_complete(output_dir)  # before any rank overwrites an earlier save of this step
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit
        self.accelerator.wait_for_everyone()  # every rank's shards and RNG state are written
        if self.args.should_save:
            _checkpoint_format.mark_complete(output_dir, self.state.global_step, self._global_batch_size)
            _checkpoint_format.rotate(run_dir, save_total_limit, self.state.best_model_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``save_pretrained`` of the unsharded model (collective: every rank must call it), and the calibrated cost
        model beside it (:data:`CALIBRATION_FILE`)."""
        with self.odc.bounded("saving the model"):
            self._save_unsharded(output_dir, _internal_call)

    def _save_unsharded(self, output_dir: str | None, _internal_call: bool) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        calibration = self._planner.calibration
        if calibration is not None and self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            calibration.save(os.path.join(output_dir, CALIBRATION_FILE))
        if not isinstance(self.model, FSDPModule):
            return super().save_model(output_dir, _internal_call)
        state_dict = _checkpoint_format.full_model_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The model and optimizer state through DCP (each rank's shards, or one process's whole state) and the LR
        scheduler's (one process): the same format whatever the process count, so that a checkpoint resumes on any
        other. The Trainer's one-process ``optimizer.pt`` is not written."""
        _checkpoint_format.save_state(self.model, _torch_optimizer(self.optimizer), _state_dir(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The model's weights from the DCP state, resharded to this run's processes (``model``: the Trainer's wrapper
        of ``self.model``, when it passes one), and the checkpoint's calibration (newer than ``calibration_file``)
        unless frozen."""
        saved = os.path.join(resume_from_checkpoint, CALIBRATION_FILE)
        calibrator = self._planner.calibrator
        if calibrator is not None and not calibrator.frozen and os.path.isfile(saved):
            self._planner.calibrator = Calibrator(
                calibrator.world_size, initial=Calibration.load(saved), expert_slots=calibrator.expert_slots
            )
        _checkpoint_format.load_model_state(
            model if model is not None else self.model, _state_dir(resume_from_checkpoint)
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer state from DCP, resharded, and the LR scheduler's. The Trainer subclass's part runs first, for
        the state a TRL trainer keeps there (GRPO's entropy controller); its stock branch looks for ``optimizer.pt``,
        which this format does not have, and loads nothing."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        _checkpoint_format.load_optimizer_state(self.model, _torch_optimizer(self.optimizer), _state_dir(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer inside Accelerate's wrapper (DCP steps it once to initialise empty state)."""
    return getattr(optimizer, "optimizer", optimizer)


def _state_dir(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, _checkpoint_format.STATE_DIR)
