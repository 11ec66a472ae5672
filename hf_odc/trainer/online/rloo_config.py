"""``ODCRLOOConfig``: TRL's ``RLOOConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`) and
``odc_generation``."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig

from ..core._base_config import _document_odc_fields
from ._rollout_config import _document_generation_fields, _ODCRolloutConfig


@_document_odc_fields
@_document_generation_fields
@dataclass
class ODCRLOOConfig(_ODCRolloutConfig, RLOOConfig):
    r"""
    Configuration class for [`ODCRLOOTrainer`]: every [`~trl.RLOOConfig`] field, plus the ODC fields below.

    Generation, rewards and the rollouts' plan are those of [`ODCGRPOConfig`]: TRL generates and scores each
    generation batch, every rank gathers its rollouts once, cuts it into `steps_per_generation /
    gradient_accumulation_steps` minibatches of `per_device_train_batch_size * gradient_accumulation_steps * world_size`
    rollouts (a seeded permutation, the same on every rank) and plans each as one ODC minibatch, packed padding-free.

    The loss is TRL's: each rollout's clipped ratio of sequence probabilities (summed log-probabilities over its trained
    completion tokens) times its leave-one-out advantage, averaged over the minibatch's rollouts (a global count every
    rank holds), so the update equals TRL's on one process holding the whole minibatch, with any accumulation. The
    old policy's log-probabilities are a packed forward-only pass after generation, run when the update can differ
    from the policy that generated (`steps_per_generation > gradient_accumulation_steps` or `num_iterations > 1`) or
    when `beta > 0`. With `beta > 0` the reference's log-probabilities (a PEFT policy's reference: the same sharded
    model with its adapter disabled) are a second such pass, and the KL penalty enters the rewards as TRL's does (each
    rollout's summed `log pi_old - log pi_ref`, times `beta`): every rank sums it over its packed rollouts, the
    per-rollout sums are reduced over the ranks once per generation batch (one all-reduce of one value per rollout),
    and the leave-one-out advantages are recomputed from TRL's rewards with it.
    TRL's `entropy` is the mean over the minibatch's trained tokens; with `gradient_accumulation_steps > 1` TRL takes
    it, and the clip ratios' extremes, per accumulation slice and averages the slices, while hf_odc takes them over
    the whole minibatch.

    Parameters:
    {odc_parameters}

    {generation_parameters}

    > [!NOTE]
    > Not supported, refused at construction: `use_transformers_continuous_batching`, a PEFT model whose adapter TRL
    > would copy as the reference (pass the base model with `peft_config`) and prompt-learning PEFT,
    > Mixture-of-Experts auxiliary losses, and with vLLM LoRA variants (DoRA), `lora_bias` and LoRA on other
    > than linear layers (their merge). `model_init_kwargs` defaults `device_map` to `None`: every rank loads whole
    > models and hf_odc shards them.
    """
