"""``ODCDistillationConfig``: TRL's ``DistillationConfig`` plus the ODC fields every ODC trainer shares
(:class:`_ODCConfig`) and ``odc_generation``."""

from __future__ import annotations

from dataclasses import dataclass

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

    Memory: the divergence needs both models' full-vocabulary distributions at every trained token. hf_odc keeps the
    teacher's log-probabilities of this rank's packed rows (trained tokens times vocabulary, float32) from its
    forward-only minibatch to the update, and the student's microbatch computes its full logits; TRL instead projects
    hidden states through both heads in chunks. Fine for small vocabularies and rows; budget `4 * tokens * vocab` bytes
    per rank for the teacher's.

    Parameters:
    {odc_parameters}

    {generation_parameters}

    > [!NOTE]
    > Not supported, refused at construction: a trainer without a local `teacher_model` (TRL's server-side teachers
    > stay TRL's), tools, multimodal prompts, and with vLLM LoRA variants (DoRA), `lora_bias` and LoRA on other than
    > linear layers (their merge). `model_init_kwargs` and `teacher_model_init_kwargs` default `device_map` to `None`:
    > every rank loads whole models and hf_odc shards them.
    """

    def __post_init__(self):
        super().__post_init__()
        if self.teacher_model_init_kwargs is not None:
            self.teacher_model_init_kwargs = whole_model_kwargs(self.teacher_model_init_kwargs)
