"""``ODCRewardConfig``: TRL's ``RewardConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RewardConfig

from ..core._base_config import _document_odc_fields, _ODCConfig


@_document_odc_fields
@dataclass
class ODCRewardConfig(_ODCConfig, RewardConfig):
    r"""
    Configuration class for [`ODCRewardTrainer`]: every [`~trl.RewardConfig`] field, plus the ODC fields below.

    Each optimizer step takes `per_device_train_batch_size * gradient_accumulation_steps * world_size` preference
    pairs (the *global minibatch*, the same on every rank: TRL's batch size) and plans it with `hf_odc.packing`, a
    pair being one item that weighs its two sequences' summed length (`hf_odc.trainer.preference.pairs`, as for DPO): a
    pair's chosen and rejected sequences (TRL's `chosen_ids` and `rejected_ids`, pairs with a sequence longer than
    `max_length` filtered out as TRL filters them) stay on one rank, as two documents of one padding-free packed row. A
    microbatch holds `max_tokens_per_microbatch` tokens, or `packing_ratio` times the longest pair (`2 * max_length`;
    the minibatch's longest pair when `max_length` is `None`). A sequence's reward is the score head's output at its
    last token that is not the padding token, in its own document, the position TRL's padded batch reads.

    Every loss normaliser is global over the minibatch, counted by every rank from the pairs it holds, so that the
    update equals TRL's on one process holding the whole minibatch: the pairwise loss (less a pair's `margin` where
    the dataset has that column) and `center_rewards_coefficient` times the squared summed rewards are averaged over
    the minibatch's pairs. The logged `accuracy`, `margin` and `mean_reward` are means over the whole minibatch and
    equal TRL's with any accumulation; `min_reward` and `max_reward` are the minibatch's extremes, which equal TRL's
    with `gradient_accumulation_steps=1` (TRL averages each accumulation slice's extreme).

    Parameters:
    {odc_parameters}

    > [!NOTE]
    > Not supported, refused at construction: a custom `data_collator` (the trainer packs the pairs), an
    > `IterableDataset` (every rank samples the same global minibatches), prompt-learning PEFT (its virtual tokens
    > belong to a row, not to a packed document), and a model without a `score` head (a
    > `*ForSequenceClassification` model that pools its rightmost non-padding token).
    """
