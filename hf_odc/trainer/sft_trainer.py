"""``ODCSFTTrainer``: TRL's ``SFTTrainer`` with On-Demand Communication and minibatch-level load balancing.

What changes with respect to ``SFTTrainer``, hook by hook (the hooks every ODC trainer shares are in
:class:`hf_odc.trainer._base._ODCTrainer`):

* ``__init__``: packed attention, and with several processes the model is sharded by hf_odc (one FSDP2 group per
  decoder layer, then the root; see :mod:`hf_odc.accelerate_plugin.sharding`) before the optimizer exists, and ODC
  is installed on it (``_setup_odc``).
* ``get_train_dataloader``: one item per optimizer step, the same global minibatch on every rank
  (:mod:`hf_odc.trainer.data`).
* ``training_step``: plans the minibatch (every rank the same plan, with the step's cost model) and runs the rank's
  packed microbatches inside ``odc.minibatch()`` (no collective inside), or, without
  ODC, with FSDP2's gradient reduction deferred to the last microbatch, between the same two meeting points
  (:class:`~hf_odc.engine.CollectiveMinibatch`), so that both modes' device-timed metrics cover the same span.
  Metrics are gathered once, afterwards.
* ``compute_loss``: the *sum* of the microbatch's token losses times ``world_size / N``, with ``N`` the target tokens
  of the whole global minibatch, counted locally by every rank (every rank holds every sample's labels), so no
  collective is needed and the update equals single-device training on the minibatch's mean token loss.
* ``save_model`` / ``_save_optimizer_and_scheduler`` / ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``
  (shared): sharded checkpoints through ``torch.distributed.checkpoint`` (:mod:`hf_odc.trainer._checkpoint`), and a
  plain ``save_pretrained`` directory for the model.
"""

from __future__ import annotations

from typing import Any, ClassVar

import datasets
import torch
from torch import nn
from trl import SFTTrainer

from ._base import _ODCTrainer
from .config import ODCSFTConfig
from .data import (
    GlobalMinibatchSampler,
    MinibatchDataLoader,
    PlannedMinibatchCollator,
    global_minibatch,
    require_sft_columns,
)

__all__ = ["ODCSFTTrainer"]


class ODCSFTTrainer(_ODCTrainer, SFTTrainer):
    """
    Trainer for supervised fine-tuning with On-Demand Communication (ODC) and minibatch-level load balancing.

    Same arguments as [`~trl.SFTTrainer`], with `args` an [`ODCSFTConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding, which is the reference the distributed runs must match.

    Not supported (refused at construction): a custom `data_collator` for training (the planner packs),
    `compute_loss_func`, `label_smoothing_factor`, Mixture-of-Experts auxiliary losses, `IterableDataset`s (a global
    minibatch needs random access), and attention implementations that would attend across packed samples (see
    `hf_odc.trainer.attention`).

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

    def __init__(self, model: Any, args: ODCSFTConfig | None = None, **kwargs: Any):
        if args is None:
            args = ODCSFTConfig("odc-sft")
        elif not isinstance(args, ODCSFTConfig):
            raise TypeError(f"ODCSFTTrainer needs an ODCSFTConfig, got {type(args).__name__}.")
        for unsupported in ("data_collator", "compute_loss_func"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"ODCSFTTrainer does not accept `{unsupported}`: the planner packs and scales.")
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is not None and not isinstance(train_dataset, datasets.Dataset):
            raise TypeError("ODCSFTTrainer needs a map-style `datasets.Dataset`: it samples global minibatches.")
        if train_dataset is not None:
            require_sft_columns(train_dataset, args.dataset_text_field)
        super().__init__(model=model, args=args, **kwargs)
        if self.label_smoother is not None:
            raise ValueError("ODCSFTTrainer does not support label_smoothing_factor (it needs full logits).")
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "ODCSFTTrainer does not weight MoE auxiliary losses yet; set router_aux_loss_coef=0."
            )
        self._setup_odc()
        # Entropy, correct top-1 predictions and target tokens of this rank's microbatches, kept on the device so that
        # no microbatch waits for a device-to-host copy.
        self._minibatch_sums = torch.zeros(3, dtype=torch.float64, device=args.device)

    # -- data -------------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> MinibatchDataLoader:
        """One item per optimizer step: this rank's packed microbatches of the global minibatch (not sharded by
        Accelerate: every rank needs the whole minibatch to plan it)."""
        if self.train_dataset is None:
            raise ValueError("ODCSFTTrainer needs a train_dataset.")
        args = self.args
        strategy = getattr(args, "train_sampling_strategy", "random")
        if strategy not in ("random", "sequential"):
            raise ValueError(f"ODCSFTTrainer samples 'random' or 'sequential' minibatches, not {strategy!r}.")
        dataset = self.train_dataset.select_columns(
            [c for c in ("input_ids", "labels") if c in self.train_dataset.column_names]
        )
        self._check_token_cap(dataset)
        world_size = self.accelerator.num_processes
        sampler = GlobalMinibatchSampler(
            len(dataset),
            args.per_device_train_batch_size * world_size,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=strategy == "random",
        )
        self._collator = PlannedMinibatchCollator(
            rank=self.accelerator.process_index,
            planner=self._planner,
            max_tokens=args.microbatch_token_cap,
            pad_token_id=self._tokenizer.pad_token_id,
        )
        workers = args.dataloader_num_workers
        return MinibatchDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=global_minibatch,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )

    def _check_token_cap(self, dataset: datasets.Dataset) -> None:
        """Refuse, before the first step, a token cap that the dataset's longest sample does not fit (the planner would
        only find out at the minibatch that draws it)."""
        args, cap = self.args, self.args.microbatch_token_cap
        lengths = [len(ids) for ids in dataset["input_ids"]]
        longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        if longest is None or lengths[longest] <= cap:
            return
        setting = (
            f"max_tokens_per_microbatch={args.max_tokens_per_microbatch}"
            if args.max_tokens_per_microbatch is not None
            else f"packing_ratio={args.packing_ratio or 1.0:g} x max_length={args.max_length}"
        )
        ratio = f", or --packing_ratio to at least {lengths[longest] / args.max_length:.3g}" if args.max_length else ""
        raise ValueError(
            f"Sample {longest} of the training dataset has {lengths[longest]} tokens, more than one microbatch holds "
            f"({cap} tokens, from {setting}). Set --max_tokens_per_microbatch to at least {lengths[longest]}{ratio}, "
            "or drop or truncate that sample."
        )

    # -- one optimizer step -------------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Plan the global minibatch (in place: the Trainer's later hooks see this rank's ``microbatches``), then
        forward and backward of this rank's microbatches; returns their summed (already normalised) loss."""
        inputs.update(self._collator(inputs.pop("examples")))
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        num_target_tokens = max(int(inputs["num_target_tokens"]), 1)

        def loss_of(microbatch: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager():
                return self.compute_loss(model, microbatch, num_items_in_batch=num_target_tokens)

        loss = self._run_minibatch(model, inputs["microbatches"], loss_of)
        entropy, correct, targets = self._minibatch_sums
        per_rank = self._log_minibatch(
            inputs["microbatch_lengths"],
            int(inputs["num_tokens"]),
            inputs["predicted_bubble_rate"],
            {"entropy": entropy, "correct": correct, "targets": targets},
        )
        self._minibatch_sums.zero_()
        sums = {name: sum(values) for name, values in per_rank.items()}
        self._total_train_tokens += int(inputs["num_tokens"])
        metrics, targets = self._metrics["train"], sums["targets"]
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["entropy"].append(sums["entropy"] / targets if targets else 0.0)
        metrics["mean_token_accuracy"].append(sums["correct"] / targets if targets else 0.0)
        return loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Training: ``sum of token losses * world_size / num_items_in_batch`` (the global minibatch's target
        tokens), with the metrics accumulated locally; evaluation is ``SFTTrainer``'s."""
        if not model.training or return_outputs or num_items_in_batch is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs, use_cache=False, fused_lm_head=True)
        per_token_loss = -outputs.log_probs.float()  # zero where the label is -100; summed in fp32, not bf16
        if self.args.loss_type == "dft":  # Dynamic Fine-Tuning, as in SFTTrainer
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        with torch.no_grad():
            sums = torch.stack([outputs.entropy.sum(), outputs.is_top1.sum(), outputs.label_mask.sum()])
            self._minibatch_sums += sums.double()
        return per_token_loss.sum() * (self.accelerator.num_processes / num_items_in_batch)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's estimate, summed over this rank's microbatches."""
        total = 0
        for microbatch in inputs["microbatches"]:
            total += super().floating_point_ops(microbatch)
        return total
