"""``ODCDistillationTrainer``: TRL's (on-policy) ``DistillationTrainer`` whose student updates are packed, balanced
across ranks and free of per-microbatch collectives.

Generation and the completions' plan are GRPO's (:class:`hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer`: the
student decodes in hf_odc's generation modes, every rank gathers the step's completions once and plans them as one
ODC minibatch); what is distillation's, hook by hook:

* ``__init__``: the teacher (frozen) is sharded by hf_odc with ODC of its own, like GRPO's reference model.
* ``_after_scoring``: the teacher's next-token log-probabilities (full vocabulary, at ``temperature``) on this rank's
  packed rows, in one forward-only ODC minibatch.
* ``_microbatch_loss``: TRL's generalized JSD (:func:`generalized_jsd`) per trained token, summed and divided by the
  step's trained tokens; the student's entropy accumulated on the device and reduced once per step.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn
from trl import DistillationTrainer

from ..core._step import StepMetrics
from ._rollout_trainer import Pass, _ODCRolloutTrainer
from .distillation_config import ODCDistillationConfig
from .rollouts import Rollouts, RolloutStep

__all__ = ["ODCDistillationTrainer", "generalized_jsd"]


class ODCDistillationTrainer(_ODCRolloutTrainer, DistillationTrainer):
    """
    Trainer for on-policy knowledge distillation with On-Demand Communication (ODC) and minibatch-level load
    balancing of the student's updates.

    Same arguments as [`~trl.DistillationTrainer`], with `args` an [`ODCDistillationConfig`] and a local
    `teacher_model` (a model or its name). Launch it with `accelerate launch` (see `examples/odc.yaml` and
    `examples/odc_cpu.yaml`); with a single process it trains on the same plan without sharding.

    Example:

    ```python
    >>> from hf_odc.trainer import ODCDistillationConfig, ODCDistillationTrainer

    >>> trainer = ODCDistillationTrainer(
    ...     model=student, teacher_model=teacher, args=ODCDistillationConfig("out"), train_dataset=prompts,
    ...     processing_class=tok,
    ... )
    >>> trainer.train()
    ```
    """

    _weighs_moe_aux_loss = False  # the router's loss not yet checked against TRL's here

    _tag_names: ClassVar[list[str]] = ["trl", "distillation", "hf-odc"]
    _name = "ODC Distillation"
    _config_class = ODCDistillationConfig
    _trains_vision = False  # its teacher's pass is text-only

    def __init__(self, model: Any, teacher_model: Any = None, args: ODCDistillationConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        if teacher_model is None:
            raise ValueError(
                "ODCDistillationTrainer shards and runs a local teacher: pass teacher_model (a model or its name); a "
                "teacher served elsewhere stays TRL's (use TRL's trainer for it)."
            )
        if kwargs.get("tools"):
            raise NotImplementedError("ODCDistillationTrainer does not run tools yet; drop tools or use TRL's trainer.")
        super().__init__(model=model, teacher_model=teacher_model, args=args, **kwargs)
        self._setup_odc(StepMetrics(args.device, means=["entropy"]))
        self._setup_generation()
        self.teacher_model, self._teacher_odc = self._shard_frozen(self.teacher_model)

    def _loads_a_model(self, model: Any, args: Any, kwargs: dict[str, Any]) -> bool:
        """The student by name (the teacher loads with ``teacher_model_init_kwargs``)."""
        return isinstance(model, str)

    # -- the completions ----------------------------------------------------------------------------------------------

    def _steps_per_generation(self) -> int:
        """TRL generates once per optimizer step."""
        return self.args.gradient_accumulation_steps

    def _iterations_per_generation(self) -> int:
        return 1

    def _deferred_passes(self, scored: dict[str, Any]) -> list[Pass]:
        """None: TRL's distillation scores nothing while generating (the teacher runs in :meth:`_after_scoring`)."""
        return []

    def _after_scoring(self, rollouts: Rollouts, planned: list[RolloutStep]) -> None:
        """The teacher's next-token log-probabilities at every completion token of this rank's packed rows (full
        vocabulary, at ``temperature``), stored as ``teacher_logps`` in each microbatch's loss inputs, in one
        forward-only minibatch of the teacher's ODC; its device-timed span is logged as ``scoring_s``."""
        runtime = self._teacher_odc
        with runtime.minibatch(backward=False), self.accelerator.autocast(), torch.no_grad():
            for step in planned:
                for microbatch in step.microbatches:
                    inputs = self._to_device(microbatch)
                    logits = self.teacher_model(**_forward_inputs(inputs["model"]), use_cache=False).logits[0]
                    logits = logits[inputs["loss"]["token_index"]].float() / self.temperature
                    microbatch["loss"]["teacher_logps"] = torch.log_softmax(logits, dim=-1)
        self._metrics["train"]["scoring_s"].append(runtime.last.step)

    # -- the loss -----------------------------------------------------------------------------------------------------

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: RolloutStep) -> torch.Tensor:
        """TRL's per-token divergence between the student and the teacher on one packed microbatch, summed over its
        trained tokens and divided by the step's trained tokens over every rank."""
        inputs = microbatch["loss"]
        logits = model(**_forward_inputs(microbatch["model"]), use_cache=False).logits[0]
        student_logps = torch.log_softmax(logits[inputs["token_index"]].float() / self.temperature, dim=-1)
        mask = inputs["mask"]
        divergence = generalized_jsd(student_logps, inputs["teacher_logps"], self.beta)
        with torch.no_grad():
            entropy = -(student_logps.exp() * student_logps).sum(-1)
            self._step_metrics.add_mean("entropy", (entropy * mask).sum(), mask.sum())
        return (divergence * mask).sum() / max(step.num_loss_tokens, 1)


def generalized_jsd(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's divergence per position from both models' log-probabilities over the vocabulary (last dimension):
    ``beta=0`` the forward KL(teacher || student), ``beta=1`` the reverse KL(student || teacher), between them the
    generalized JSD ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` with the mixture ``m = (1 - beta)
    student + beta teacher``. The gradient reaches the student only (the teacher's are constants)."""
    if beta == 0.0:
        return (teacher_logps.exp() * (teacher_logps - student_logps)).sum(-1)
    if beta == 1.0:
        return (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)
    mixture = torch.logaddexp(student_logps + math.log(1 - beta), teacher_logps + math.log(beta))
    teacher_part = teacher_logps.exp() * (teacher_logps - mixture)
    student_part = student_logps.exp() * (student_logps - mixture)
    return (beta * teacher_part + (1 - beta) * student_part).sum(-1)


def _forward_inputs(model_inputs: dict[str, Any]) -> dict[str, Any]:
    """A packed row's inputs for a forward that returns logits (no labels: no loss to compute)."""
    return {name: value for name, value in model_inputs.items() if name != "labels"}
