"""``ODCKTOConfig``: TRL's ``KTOConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import KTOConfig

from ..core._base_config import _document_odc_fields, _ODCConfig

KTO_LOSSES = ("kto", "apo_zero_unpaired")
"""TRL's KTO loss types, both supported."""


@_document_odc_fields
@dataclass
class ODCKTOConfig(_ODCConfig, KTOConfig):
    r"""
    Configuration class for [`ODCKTOTrainer`]: every [`~trl.KTOConfig`] field, plus the ODC fields below.

    Each optimizer step takes `per_device_train_batch_size * gradient_accumulation_steps * world_size` unpaired
    examples (the *global minibatch*, the same on every rank: TRL's batch size), each a prompt, a completion and its
    desirable/undesirable `label`, and plans it with `hf_odc.packing`. With `loss_type="kto"` an example is one item
    with its *mismatched* sequence, the prompt followed by another example's completion (TRL's `KL_completion_ids`:
    within each accumulation call's `per_device_train_batch_size * world_size` examples, the previous example's
    completion, the first taking the last's, as TRL pairs them on one process holding that batch, so one process and
    several train alike), the item weighing both sequences' summed length. Sequences are truncated to `max_length`
    keeping their start, as TRL truncates them. A microbatch holds `max_tokens_per_microbatch` tokens, or
    `packing_ratio` times `2 * max_length` (the minibatch's longest item when `max_length` is `None`).

    Each step runs, on this rank's items, packed: the reference's forward-only minibatch over both sequences (unless
    `precompute_ref_log_probs` computed them once before training, planned and packed the same way), then, for
    `loss_type="kto"`, the policy's forward-only minibatch over the mismatched sequences, then the training minibatch
    over the examples' own sequences. The KL estimate is TRL's: for each accumulation call's examples, the mean over
    them of the policy's minus the reference's summed log-probabilities of their mismatched completions, clamped at 0,
    detached. Its sums are a batch-level statistic: every rank adds up its own items' per accumulation call, and the
    step gathers them once from every rank (one gather, bounded like the step's other collectives), so that every rank
    holds each call's estimate before its first training microbatch. Every loss normaliser is global: the weighted
    per-example losses (`desirable_weight`, `undesirable_weight`) are summed and divided by the minibatch's examples,
    so that the update equals TRL's on one process holding the whole minibatch, with any accumulation. The logged
    `kl` is the mean over the accumulation calls' estimates, as TRL logs it. The example and token means (`rewards/*`,
    `logps/*`, `logits/*`, `entropy`) are over the whole minibatch, as TRL's with `gradient_accumulation_steps=1`
    (TRL averages them per accumulation call, then over the calls); `rewards/margins` is their difference.

    Parameters:
    {odc_parameters}

    > [!NOTE]
    > Not supported, refused at construction: `sync_ref_model` (the reference's shards are read one-sidedly by ODC and
    > must not change), vision datasets, prompt-learning PEFT, a PEFT model whose existing adapter TRL would copy as the
    > reference (pass the base model with `peft_config`, or a `ref_model`), a custom `data_collator`, an
    > `IterableDataset`, and Mixture-of-Experts auxiliary losses.
    """

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type not in KTO_LOSSES:
            raise ValueError(f"Unknown KTO loss_type {self.loss_type!r}; ODCKTOTrainer supports {KTO_LOSSES}.")
        if self.sync_ref_model:
            raise ValueError(
                "ODCKTOTrainer does not support sync_ref_model (TR-DPO): the reference model's shards are read "
                "one-sidedly by ODC and must not change during training. Set sync_ref_model=False, or use "
                "trl.KTOTrainer."
            )

    @property
    def calculate_kl(self) -> bool:
        """Whether the loss needs TRL's KL estimate (every loss type but `apo_zero_unpaired`)."""
        return self.loss_type != "apo_zero_unpaired"
