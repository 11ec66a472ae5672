"""``ODCSFTTrainer``: TRL's ``SFTTrainer`` with On-Demand Communication and minibatch-level load balancing.

What is SFT-specific, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints
are every ODC trainer's: :class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``get_train_dataloader``: one item per accumulation step, ``per_device_train_batch_size x world_size`` samples, the
  same on every rank (:mod:`hf_odc.trainer.core.data`); an optimizer step's items form its global minibatch.
* ``_plan_step``: that minibatch planned (every rank the same plan, with the step's cost model) and this rank's share
  packed padding-free (:class:`~hf_odc.trainer.core.data.PlannedMinibatchCollator`); with Accelerate's ``sp_size``,
  its shards of the documents longer than a microbatch first (group microbatches:
  :mod:`hf_odc.packing.sequence_parallel`).
* ``_microbatch_loss``: the *sum* of the microbatch's token losses divided by ``N``, with ``N`` the target
  tokens of the whole global minibatch, counted locally by every rank (every rank holds every sample's labels), so no
  collective is needed and the update equals single-device training on the minibatch's mean token loss; entropy and
  top-1 accuracy accumulated per token, as ``SFTTrainer`` logs them.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn
from trl import SFTTrainer

from .core._dataset_trainer import _ODCDatasetTrainer
from .core._step import PlannedStep, StepMetrics
from .core.data import (
    MinibatchDataLoader,
    PlannedMinibatchCollator,
    check_sft_truncation,
    minibatch_loader,
    require_sft_columns,
)
from .core.vision import VISION_MODEL_TYPES, VisionMinibatchCollator, check_vision_model, is_vision_dataset
from .sft_config import ODCSFTConfig

__all__ = ["ODCSFTTrainer"]


class ODCSFTTrainer(_ODCDatasetTrainer, SFTTrainer):
    """
    Trainer for supervised fine-tuning with On-Demand Communication (ODC) and minibatch-level load balancing.

    Same arguments as [`~trl.SFTTrainer`], with `args` an [`ODCSFTConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding, which is the reference the distributed runs must match.

    Not supported (refused at construction): a custom `data_collator` for training (the planner packs),
    `compute_loss_func`, `label_smoothing_factor`, `IterableDataset`s (a global minibatch needs random access), and
    attention implementations that would attend across packed samples (see `hf_odc.trainer.core.attention`).

    Vision-language models (Qwen2.5-VL) train on TRL's image datasets with their processor: each sample processed as
    TRL processes it, weighed by its tokens plus its image patches, packed with its pixels and its own 3-D rope
    positions; a rank with no image in its share runs no vision tower (see `hf_odc.trainer.core.vision`).

    Mixture-of-Experts models train with the router's load-balancing loss over each global minibatch (see
    `ODCSFTConfig`). Documents longer than a microbatch train split over groups of ranks with Accelerate's
    `parallelism_config` `sp_size` (see `ODCSFTConfig`).

    Example:

    ```python
    >>> from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer

    >>> trainer = ODCSFTTrainer(
    ...     model=model, args=ODCSFTConfig("out", balance="lb-mini"), train_dataset=dataset, processing_class=tok
    ... )
    >>> trainer.train()
    ```
    """

    _tag_names: ClassVar[list[str]] = ["trl", "sft", "hf-odc"]
    _name = "ODC SFT"
    _config_class = ODCSFTConfig

    def __init__(self, model: Any, args: ODCSFTConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        for unsupported in ("data_collator", "compute_loss_func"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"ODCSFTTrainer does not accept `{unsupported}`: the planner packs and scales.")
        self._check_train_data(kwargs, packs=None, text=None)
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is not None:
            require_sft_columns(train_dataset, args.dataset_text_field)
        super().__init__(model=model, args=args, **kwargs)
        self._rope_index = None
        self._vision = train_dataset is not None and is_vision_dataset(train_dataset)  # no lengths before a step
        if self._vision:
            name, sp_size = type(self).__name__, args.sp_size
            self._rope_index = check_vision_model(self.model, name, sp_size, model_types=VISION_MODEL_TYPES)
        elif train_dataset is not None:
            self._check_prepared_data(train_dataset, warn=self.accelerator.is_main_process)
        if self.label_smoother is not None:
            raise ValueError("ODCSFTTrainer does not support label_smoothing_factor (it needs full logits).")
        self._setup_odc(StepMetrics(args.device, means=("entropy", "mean_token_accuracy")))

    # -- data -------------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> MinibatchDataLoader:
        """One item per accumulation step: ``per_device_train_batch_size x world_size`` samples, the same on every rank
        (not sharded by Accelerate: every rank needs the whole minibatch to plan it), each sample's token ids and
        labels as numpy arrays: turning long samples' Arrow lists into Python lists cost every rank about a second
        per 500K tokens of each minibatch, and the collator makes tensors of them anyway."""
        if self.train_dataset is None:
            raise ValueError("ODCSFTTrainer needs a train_dataset.")
        max_tokens = self.args.max_tokens_for(self.args.max_length)
        if self._vision:  # images: each sample processed by TRL's collator when its step plans it
            self._collator = VisionMinibatchCollator(
                rank=self.accelerator.process_index,
                planner=self._planner,
                max_tokens=max_tokens,
                process=self.data_collator,
                rope_index=self._rope_index,
                max_length=self.args.max_length,
                image_token_id=self.model.config.image_token_id,
            )
            return minibatch_loader(self.train_dataset, self.args, self.accelerator.num_processes)
        dataset = self.train_dataset.select_columns(
            [c for c in ("input_ids", "labels") if c in self.train_dataset.column_names]
        ).with_format("numpy")
        self._collator = PlannedMinibatchCollator(
            rank=self.accelerator.process_index,
            planner=self._planner,
            max_tokens=max_tokens,
            pad_token_id=self._tokenizer.pad_token_id,
            sequence_group=self.odc.sequence_group,
        )
        return minibatch_loader(dataset, self.args, self.accelerator.num_processes)

    def _check_prepared_data(self, given: Any, warn: bool) -> None:
        """TRL truncated ``given`` to ``max_length`` and dropped what has nothing left to learn: refuse what is left
        (:func:`~hf_odc.trainer.core.data.check_sft_truncation`, warning when ``warn``), then a microbatch its longest
        sample does not fit."""
        args = self.args
        check_sft_truncation(given, self.train_dataset, args.max_length, warn, args.allow_truncated_data)
        self._check_max_tokens()

    @functools.cached_property
    def _sample_lengths(self) -> list[int]:
        """Each training sample's tokens (TRL truncated them already), read once: the capacity check and the attention
        plans' warm-up both need them."""
        return [len(ids) for ids in self.train_dataset["input_ids"]]

    def _check_max_tokens(self) -> None:
        """Refuse, at construction, a microbatch size (``max_tokens_for(max_length)``) that the dataset's longest
        sample does not fit (the planner would only find out at the minibatch that draws it); with sequence
        parallelism, a sample longer than ``sp_size`` microbatches."""
        args = self.args
        max_tokens = args.max_tokens_for(args.max_length)
        lengths = self._sample_lengths
        longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        if longest is None or lengths[longest] <= args.sp_size * max_tokens:
            return
        if args.sp_size > 1:
            raise ValueError(
                f"Sample {longest} of the training dataset has {lengths[longest]} tokens, more than sp_size="
                f"{args.sp_size} ranks hold ({args.sp_size} x {max_tokens} tokens per microbatch). Raise sp_size or "
                "--max_tokens_per_microbatch, or drop or truncate that sample."
            )
        setting = (
            f"max_tokens_per_microbatch={args.max_tokens_per_microbatch}"
            if args.max_tokens_per_microbatch is not None
            else f"packing_ratio={args.packing_ratio or 1.0:g} x max_length={args.max_length}"
        )
        ratio = f", or --packing_ratio to at least {lengths[longest] / args.max_length:.3g}" if args.max_length else ""
        raise ValueError(
            f"Sample {longest} of the training dataset has {lengths[longest]} tokens, more than one microbatch holds "
            f"({max_tokens} tokens, from {setting}). Set --max_tokens_per_microbatch to at least "
            f"{lengths[longest]}{ratio}, or drop or truncate that sample."
        )

    def _training_documents(self) -> list[int] | None:
        """Every sample is one document (a vision sample's length is known only once its step processes it)."""
        return self._sample_lengths if self.train_dataset is not None and not self._vision else None

    # -- the two hooks of the step loop ---------------------------------------------------------------------------

    def _plan_step(self, window: list[dict[str, Any]]) -> PlannedStep:
        """The step's global minibatch (every accumulation call's samples, the same on every rank), planned and
        packed: this rank's microbatches."""
        return self._collator([example for item in window for example in item["examples"]])

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: PlannedStep) -> torch.Tensor:
        """``sum of token losses / N``, ``N`` the target tokens of the whole global minibatch (every rank
        counts it, holding every sample's labels), with the entropy and the top-1 accuracy accumulated per token."""
        outputs = model(**microbatch, use_cache=False, fused_lm_head=True)
        per_token_loss = -outputs.log_probs.float()  # zero where the label is -100; summed in fp32, not bf16
        if self.args.loss_type == "dft":  # Dynamic Fine-Tuning, as in SFTTrainer
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        with torch.no_grad():
            targets = outputs.label_mask.sum()
            self._step_metrics.add_mean("entropy", outputs.entropy.sum(), targets)
            self._step_metrics.add_mean("mean_token_accuracy", outputs.is_top1.sum(), targets)
        return per_token_loss.sum() / max(step.num_loss_tokens, 1)

    def _model_inputs(self, microbatch: dict[str, Any]) -> dict[str, Any]:
        """A packed SFT microbatch is the model's inputs itself."""
        return microbatch
