"""``ODCDistillationTrainer``: TRL's (on-policy) ``DistillationTrainer`` whose student updates are packed, balanced
across ranks and free of per-microbatch collectives.

Generation and the completions' plan are GRPO's (:class:`hf_odc.trainer.online._rollout_trainer._ODCRolloutTrainer`: the
student decodes in hf_odc's generation modes, every rank gathers the step's completions once and plans them as one
ODC minibatch); what is distillation's, hook by hook:

* ``__init__``: the teacher (frozen) is sharded by hf_odc with ODC of its own, like GRPO's reference model.
* ``_after_scoring``: each microbatch's trained tokens' positions, on the host.
* ``_microbatch_context``: the teacher's forward-only ODC minibatch held open around the student's.
* ``_microbatch_loss``: the teacher's forward on the microbatch's rows (its logits at the trained tokens only, dropped
  with the microbatch), then the student's, then TRL's generalized JSD (:func:`generalized_jsd`) per trained token in
  chunks of ``divergence_chunk_size`` tokens (:func:`chunked_generalized_jsd`), summed and divided by the step's
  trained tokens; the student's entropy accumulated on the device and reduced once per step.

Memory per rank: no ``[tokens, vocab]`` tensor outlives a microbatch. In one, with ``T`` its trained tokens, ``V`` the
vocabulary and ``C`` the chunk: the student's and the teacher's logits ``[T, V]`` (the forwards' dtype), the student
logits' gradient ``[T, V]`` in the backward, and one chunk's float32 ``[C, V]`` temporaries.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from trl import DistillationTrainer

from ..core._step import StepMetrics
from ._rollout_trainer import Pass, _ODCRolloutTrainer
from .distillation_config import ODCDistillationConfig
from .rollouts import Rollouts, RolloutStep

__all__ = ["ODCDistillationTrainer", "chunked_generalized_jsd", "generalized_jsd"]


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

    def _forward_only_models(self) -> list[nn.Module]:
        """The teacher, which runs forward-only on every microbatch the student trains on."""
        return [self.teacher_model]

    def _deferred_passes(self, scored: dict[str, Any]) -> list[Pass]:
        """None: TRL's distillation scores nothing while generating (the teacher runs beside each microbatch)."""
        return []

    def _after_scoring(self, rollouts: Rollouts, planned: list[RolloutStep]) -> None:
        """Each packed microbatch's trained tokens, on the host (no device sync in the loss): ``trained_index``, their
        positions in the row (the ``(k, C)`` padded ``token_index`` where the loss mask is not zero, flattened), and
        ``trained_mask``, their loss-mask values."""
        for step in planned:
            for microbatch in step.microbatches:
                inputs = microbatch["loss"]
                trained = inputs["mask"] != 0
                inputs["trained_index"] = inputs["token_index"][trained]
                inputs["trained_mask"] = inputs["mask"][trained]

    # -- the loss -----------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _microbatch_context(self) -> Iterator[None]:
        """The teacher's forward-only ODC minibatch held around the student's, so that each microbatch runs the
        teacher on its own rows just before the student (:meth:`_microbatch_loss`): nothing of the teacher's outlives a
        microbatch, whatever the rank's number of rows. Gradients stay on inside (the teacher's minibatch turns them
        off for itself). Its forwards' device time (every second lap of its clock) is logged as ``scoring_s``."""
        runtime = self._teacher_odc
        with runtime.minibatch(backward=False), torch.enable_grad():
            yield
        self._metrics["train"]["scoring_s"].append(sum(runtime.last.microbatches[1::2]))

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: RolloutStep) -> torch.Tensor:
        """TRL's per-token divergence between the student and the teacher on one packed microbatch, summed over its
        trained tokens and divided by the step's trained tokens over every rank. Both models project only the trained
        positions through their heads (``logits_to_keep``: :meth:`_after_scoring`'s ``trained_index``), and the
        divergence runs in chunks of ``divergence_chunk_size`` tokens (:func:`chunked_generalized_jsd`)."""
        inputs, forward = microbatch["loss"], _forward_inputs(microbatch["model"])
        keep = inputs["trained_index"]
        teacher = self._teacher_odc
        teacher.lap()
        with torch.no_grad(), self.accelerator.autocast():
            teacher_logits = self.teacher_model(**forward, use_cache=False, logits_to_keep=keep).logits[0]
        teacher.lap()
        logits = model(**forward, use_cache=False, logits_to_keep=keep).logits[0]
        divergence, entropy = chunked_generalized_jsd(
            logits, teacher_logits, self.beta, self.temperature, self.args.divergence_chunk_size
        )
        mask = inputs["trained_mask"]
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


def chunked_generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`generalized_jsd` of the two models' logits (``[tokens, vocab]``, any float dtype) at ``temperature``,
    per token, with the student's entropy per token (no gradient): what ``log_softmax(logits.float() / temperature)``
    of both, then :func:`generalized_jsd`, give, computed ``chunk_size`` tokens at a time. The forward keeps no
    float32 ``[tokens, vocab]`` tensor, only the two logits it was given; the backward recomputes each chunk and
    writes its gradient into the student logits' gradient, so beside the logits and their gradient at most one
    chunk's float32 ``[chunk_size, vocab]`` temporaries are alive. The teacher gets no gradient."""
    return _ChunkedGeneralizedJSD.apply(student_logits, teacher_logits, beta, temperature, chunk_size)


class _ChunkedGeneralizedJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logits, teacher_logits, beta, temperature, chunk_size):
        tokens = student_logits.size(0)
        divergence = student_logits.new_empty(tokens, dtype=torch.float32)
        entropy = student_logits.new_empty(tokens, dtype=torch.float32)
        for rows in _chunks(tokens, chunk_size):
            student = _log_probs(student_logits[rows], temperature)
            divergence[rows] = generalized_jsd(student, _log_probs(teacher_logits[rows], temperature), beta)
            entropy[rows] = -(student.exp() * student).sum(-1)
        ctx.save_for_backward(student_logits, teacher_logits)
        ctx.settings = beta, temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, grad_divergence, grad_entropy):
        student_logits, teacher_logits = ctx.saved_tensors
        beta, temperature, chunk_size = ctx.settings
        grad = torch.empty_like(student_logits)
        for rows in _chunks(student_logits.size(0), chunk_size):
            with torch.enable_grad():
                student = student_logits[rows].detach().requires_grad_()
                teacher = _log_probs(teacher_logits[rows], temperature)
                divergence = generalized_jsd(_log_probs(student, temperature), teacher, beta)
                grad[rows] = torch.autograd.grad(divergence, student, grad_divergence[rows])[0]
        return grad, None, None, None, None


def _chunks(tokens: int, chunk_size: int) -> Iterator[slice]:
    return (slice(start, start + chunk_size) for start in range(0, tokens, chunk_size))


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _forward_inputs(model_inputs: dict[str, Any]) -> dict[str, Any]:
    """A packed row's inputs for a forward that returns logits (no labels: no loss to compute)."""
    return {name: value for name, value in model_inputs.items() if name != "labels"}
