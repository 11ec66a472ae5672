"""``ODCDistillationConfig``: TRL's ``DistillationConfig`` plus the ODC fields every ODC trainer shares
(:class:`_ODCConfig`) and ``odc_generation``."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DistillationConfig

from ..core._base_config import _document_odc_fields, whole_model_kwargs
from ._rollout_config import _document_generation_fields, _ODCRolloutConfig


@_document_odc_fields
@_document_generation_fields
@dataclass
class ODCDistillationConfig(_ODCRolloutConfig, DistillationConfig):
    r"""
    Configuration class for [`ODCDistillationTrainer`]: every [`~trl.DistillationConfig`] field, plus the ODC fields
    below.

    The student generates each optimizer step's completions (TRL's generation batch: `per_device_train_batch_size *
    gradient_accumulation_steps` prompts per process, one completion each) in hf_odc's generation modes, as
    [`ODCGRPOConfig`]'s policy does; every rank gathers them once and the step's completions are planned as one ODC
    minibatch, packed padding-free. The teacher (sharded by hf_odc like GRPO's reference model) scores this rank's
    packed rows in one forward-only ODC minibatch before the update. The loss is TRL's: per completion token the
    generalized Jensen-Shannon divergence between the student's and the teacher's next-token distributions at
    `temperature` (`beta=0`: forward KL(teacher || student), `beta=1`: reverse KL(student || teacher), between: the
    mixture `(1 - beta) p_student + beta p_teacher`), summed over the step's trained tokens and divided by their count
    across every rank (what every rank holds after the gather), so the update equals TRL's on one process with any
    accumulation. `entropy` is the student's mean token entropy over the step, TRL's per accumulation slice.
    TRL's `DistillationTrainer` is fully on-policy (every completion the student's own): the on-policy fraction `lmbda`
    is its experimental `GKDTrainer`'s, not covered here.

    Memory: the divergence needs both models' full-vocabulary distributions at every trained token. The teacher runs
    beside each microbatch of the student's update (its forward-only ODC minibatch held open around the student's),
    on that microbatch's rows, so nothing of it is kept between microbatches; both models project only the trained
    tokens through their heads, and the divergence is computed `divergence_chunk_size` tokens at a time, its backward
    recomputing each chunk. Per rank, with `T` a microbatch's trained tokens and `V` the vocabulary, the loss holds the
    two models' logits and, in the backward, the student logits' gradient (`3 * T * V` values in the dtype the
    forwards return), plus one chunk's float32 temporaries (a few `divergence_chunk_size * V`), whatever the number of
    rows the rank holds. TRL projects hidden states through both heads in tiles instead (no `[T, V]` logits).

    Parameters:
    {odc_parameters}

    {generation_parameters}

        > Parameters of the divergence

        divergence_chunk_size (`int`, *optional*, defaults to `512`):
            Trained tokens whose divergence is computed at once: each chunk's float32 log-probabilities and
            temporaries (a few `divergence_chunk_size * vocabulary` values) are all the loss adds to the two models'
            logits. Smaller saves memory at large vocabularies, larger launches fewer kernels; the result is the same.

    > [!NOTE]
    > Not supported, refused at construction: a trainer without a local `teacher_model` (TRL's server-side teachers
    > stay TRL's), tools, multimodal prompts, and with vLLM LoRA variants (DoRA), `lora_bias` and LoRA on other than
    > linear layers (their merge). `model_init_kwargs` and `teacher_model_init_kwargs` default `device_map` to `None`:
    > every rank loads whole models and hf_odc shards them.
    """

    divergence_chunk_size: int = field(
        default=512,
        metadata={
            "help": "Trained tokens whose divergence (float32, full vocabulary) is computed at once; the result does "
            "not depend on it."
        },
    )

    def __post_init__(self):
        if isinstance(self.divergence_chunk_size, bool) or not isinstance(self.divergence_chunk_size, int):
            raise TypeError(
                f"ODCDistillationConfig: divergence_chunk_size must be a whole number of tokens, got "
                f"{self.divergence_chunk_size!r}."
            )
        if self.divergence_chunk_size < 1:
            raise ValueError(
                f"ODCDistillationConfig: divergence_chunk_size must be at least 1 token, got "
                f"{self.divergence_chunk_size}."
            )
        super().__post_init__()
        if self.teacher_model_init_kwargs is not None:
            self.teacher_model_init_kwargs = whole_model_kwargs(self.teacher_model_init_kwargs)
