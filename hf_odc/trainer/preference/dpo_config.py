"""``ODCDPOConfig``: TRL's ``DPOConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig

from ..core._base_config import _document_odc_fields, _ODCConfig
from .dpo_losses import PAIR_LOSSES, TOKEN_LOSSES, UNSUPPORTED_LOSSES


@_document_odc_fields
@dataclass
class ODCDPOConfig(_ODCConfig, DPOConfig):
    r"""
    Configuration class for [`ODCDPOTrainer`]: every [`~trl.DPOConfig`] field, plus the ODC fields below.

    Each optimizer step takes `per_device_train_batch_size * gradient_accumulation_steps * world_size` preference
    pairs (the *global minibatch*, the same on every rank: TRL's batch size) and plans it with `hf_odc.packing`, a
    pair being one item that weighs its two sequences' summed length: a pair's chosen and rejected sequences (each
    `prompt + completion`, truncated to `max_length` as TRL truncates them) stay on one rank, as two documents of one
    padding-free packed row. A microbatch holds `max_tokens_per_microbatch` tokens, or `packing_ratio` times the
    longest pair (`2 * max_length`; the minibatch's longest pair when `max_length` is `None`). The reference model's
    log-probabilities come from forward-only ODC minibatches on the same packed rows, or are precomputed once
    (`precompute_ref_log_probs`) the same way, planned and packed, before training.

    Every loss normaliser is global over the minibatch, counted by every rank from the pairs it holds, so that the
    update equals TRL's on one process holding the whole minibatch: the per-pair losses (`sigmoid`, `hinge`, `ipo`,
    `exo_pair`, `nca_pair`, `robust`, `bco_pair`, `sppo_hard`, `apo_zero`, `apo_down`, `discopop`, `sigmoid_norm`,
    with any `f_divergence_type`, `ld_alpha` and `loss_weights`) are averaged over the minibatch's pairs, and `sft`
    over its chosen completion tokens. With `gradient_accumulation_steps > 1` TRL averages `sft` and its logged token
    means (`entropy`, `logits/*`, `mean_token_accuracy`) per accumulation slice, then over the slices; hf_odc takes
    them over the whole minibatch, which equals TRL's when the slices hold equal numbers of tokens. The pair means
    (the loss, `rewards/*`, `logps/*`) equal TRL's with any accumulation.

    Parameters:
    {odc_parameters}

    > [!NOTE]
    > Not supported, refused at construction: the loss types `aot` and `aot_unpaired` (they sort the whole batch's
    > log-ratios), `use_weighting` (WPO), `sync_ref_model` (TR-DPO), `padding_free` (the trainer always packs; leave it
    > off), vision datasets, prompt-learning PEFT (its virtual tokens belong to a row, not to a packed document), a
    > PEFT model whose existing adapter TRL would copy as the reference (pass the base model with `peft_config`, or a
    > `ref_model`), and a custom `data_collator`.
    """

    _splits_sequences = True

    def __post_init__(self):
        if self.padding_free:
            raise ValueError(
                "ODCDPOTrainer packs each microbatch itself (padding-free, from the plan); leave padding_free off."
            )
        super().__post_init__()
        for loss_type in self.loss_type:
            if loss_type in UNSUPPORTED_LOSSES:
                raise ValueError(
                    f"ODCDPOTrainer does not support loss_type={loss_type!r}: {UNSUPPORTED_LOSSES[loss_type]}. Use "
                    f"one of {PAIR_LOSSES + TOKEN_LOSSES}, or trl.DPOTrainer."
                )
            if loss_type not in PAIR_LOSSES + TOKEN_LOSSES:
                raise ValueError(
                    f"Unknown DPO loss_type {loss_type!r}; ODCDPOTrainer supports {PAIR_LOSSES + TOKEN_LOSSES}."
                )
        if self.use_weighting:
            raise ValueError(
                "ODCDPOTrainer does not support use_weighting (WPO) yet: set use_weighting=False, or use "
                "trl.DPOTrainer."
            )
        if self.sync_ref_model:
            raise ValueError(
                "ODCDPOTrainer does not support sync_ref_model (TR-DPO): the reference model's shards are read "
                "one-sidedly by ODC and must not change during training. Set sync_ref_model=False, or use "
                "trl.DPOTrainer."
            )
