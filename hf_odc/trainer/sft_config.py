"""``ODCSFTConfig``: TRL's ``SFTConfig`` plus the ODC fields every ODC trainer shares (:class:`_ODCConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import SFTConfig

from .core._base_config import _document_odc_fields, _ODCConfig


@_document_odc_fields
@dataclass
class ODCSFTConfig(_ODCConfig, SFTConfig):
    r"""
    Configuration class for [`ODCSFTTrainer`]: every [`~trl.SFTConfig`] field, plus the ODC fields below.

    Each optimizer step takes `per_device_train_batch_size * gradient_accumulation_steps * world_size` samples (the
    *global minibatch*, the same on every rank: TRL's batch size), plans it with `hf_odc.packing`, and runs each rank's
    share as padding-free packed microbatches, as many as `max_tokens_per_microbatch` requires. The loss is the mean
    token loss of the whole minibatch, as `SFTTrainer`'s with accumulation. `packing` and `padding_free` stay off: the
    planner packs.

    Parameters:
    {odc_parameters}
    """

    _splits_sequences = True

    def __post_init__(self):
        if self.packing or self.padding_free:
            raise ValueError(
                "ODCSFTTrainer packs each microbatch itself (padding-free, from the plan); leave packing and "
                "padding_free off."
            )
        if self.max_tokens_per_microbatch is None and self.max_length is None:
            raise ValueError("Set max_tokens_per_microbatch when max_length is None (there is nothing to scale).")
        super().__post_init__()
