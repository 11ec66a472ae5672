"""``ODCSFTTrainer``: TRL's ``SFTTrainer`` with On-Demand Communication and minibatch-level load balancing.

What changes with respect to ``SFTTrainer``, hook by hook:

* ``__init__``: with several processes the model is sharded by hf_odc (one FSDP2 group per decoder layer, then the
  root; see :mod:`hf_odc.accelerate_plugin.sharding`) before the optimizer exists, and ODC is installed on it. When
  Accelerate has no FSDP2 config (CPU, or a plain multi-GPU config) the Trainer is told the model manages its own
  placement and gradient reduction (``is_distributed_loading_by_transformers``), so Accelerate only adds autocast
  instead of wrapping DTensor shards in DDP.
* ``get_train_dataloader``: one item per optimizer step; every rank draws the same global minibatch and keeps its
  packed microbatches from the plan (:mod:`hf_odc.trainer.data`).
* ``training_step``: runs the rank's microbatches inside ``odc.minibatch()`` (no collective inside), or, without
  ODC, with FSDP2's gradient reduction deferred to the last microbatch, between the same two meeting points
  (:class:`~hf_odc.engine.CollectiveMinibatch`), so that both modes' device-timed metrics cover the same span.
  Metrics are gathered once, afterwards.
* ``compute_loss``: the *sum* of the microbatch's token losses times ``world_size / N``, with ``N`` the target tokens
  of the whole global minibatch, counted locally by every rank (every rank holds every sample's labels), so no
  collective is needed and the update equals single-device training on the minibatch's mean token loss.
* ``save_model`` / ``_save_optimizer_and_scheduler`` / ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``:
  sharded checkpoints through ``torch.distributed.checkpoint`` (:mod:`hf_odc.trainer._checkpoint`), and a plain
  ``save_pretrained`` directory for the model.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import datasets
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.trainer import SCHEDULER_NAME
from trl import SFTTrainer

from ..accelerate_plugin import ODCPlugin
from ..engine import measured_bubble
from ..packing import AttentionCost
from . import _checkpoint
from .attention import use_packed_attention
from .config import ODCSFTConfig
from .data import GlobalMinibatchSampler, MinibatchDataLoader, PlannedMinibatchCollator

__all__ = ["ODCSFTTrainer"]


class ODCSFTTrainer(SFTTrainer):
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
        super().__init__(model=model, args=args, **kwargs)
        if self.label_smoother is not None:
            raise ValueError("ODCSFTTrainer does not support label_smoothing_factor (it needs full logits).")
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "ODCSFTTrainer does not weight MoE auxiliary losses yet; set router_aux_loss_coef=0."
            )
        use_packed_attention(self.model, args.packed_attention, args.device)

        self.odc_plugin = ODCPlugin(enabled=args.odc, timeout=args.odc_timeout)
        if self.accelerator.num_processes > 1:
            fsdp_plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            if fsdp_plugin is not None and fsdp_plugin.fsdp_version != 2:
                raise ValueError("ODCSFTTrainer shards with FSDP2; set `fsdp_version: 2` in the Accelerate config.")
            self.model = self.model_wrapped = self.odc_plugin.shard(self.model, self.accelerator)
            if not self.is_fsdp_enabled:
                self.is_distributed_loading_by_transformers = True
        self.odc_plugin.enable(self.model)
        text_config = self.model.config.get_text_config()
        self._cost = AttentionCost.from_config(text_config) if args.cost_model == "attention" else "tokens"
        # Entropy, correct top-1 predictions and target tokens of this rank's microbatches, kept on the device so that
        # no microbatch waits for a device-to-host copy.
        self._minibatch_sums = torch.zeros(3, dtype=torch.float64, device=args.device)

    @property
    def _is_sharded(self) -> bool:
        return isinstance(self.model, FSDPModule)

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
        world_size = self.accelerator.num_processes
        sampler = GlobalMinibatchSampler(
            len(dataset),
            args.per_device_train_batch_size * world_size,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=strategy == "random",
        )
        collator = PlannedMinibatchCollator(
            rank=self.accelerator.process_index,
            world_size=world_size,
            balance=args.balance,
            max_tokens=args.microbatch_token_cap,
            cost=self._cost,
            sync="minibatch" if self.odc_plugin.odc is not None else "layer",
            pad_token_id=self._tokenizer.pad_token_id,
        )
        workers = args.dataloader_num_workers
        return MinibatchDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )

    # -- one optimizer step -------------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward and backward of this rank's microbatches; returns their summed (already normalised) loss."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        microbatches = inputs["microbatches"]
        num_target_tokens = max(int(inputs["num_target_tokens"]), 1)
        defer_reduction = self.odc_plugin.odc is None and isinstance(model, FSDPModule)
        loss = torch.zeros((), device=self.args.device)
        with self.maybe_activation_offload_context, self.odc_plugin.minibatch():
            for index, microbatch in enumerate(microbatches):
                if defer_reduction:  # plain FSDP2: reduce-scatter once, in the last microbatch's backward
                    model.set_requires_gradient_sync(index == len(microbatches) - 1)
                microbatch = self._prepare_inputs(microbatch)
                with self.compute_loss_context_manager():
                    microbatch_loss = self.compute_loss(model, microbatch, num_items_in_batch=num_target_tokens)
                self.accelerator.backward(microbatch_loss)
                loss += microbatch_loss.detach()
        self._log_minibatch(inputs)
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

    def _log_minibatch(self, inputs: dict[str, Any]) -> None:
        """Gather this minibatch's metrics from every rank (one collective, after the minibatch) into ``_metrics``.

        Timings are device-timed and mean the same with and without ODC (:mod:`hf_odc.engine.timing`): the step runs
        from the minibatch's entry to its exit meeting point, ``busy`` until the rank's last microbatch finished on
        its device, ``wait`` the rest."""
        stats = self.odc_plugin.last
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        own = torch.tensor([stats.busy, stats.wait, len(inputs["microbatches"]), peak_gib], dtype=torch.float64)
        local = torch.cat([self._minibatch_sums, own.to(self._minibatch_sums.device)])
        self._minibatch_sums.zero_()
        per_rank = self.accelerator.gather(local[None]).cpu()
        entropy, correct, targets = per_rank[:, :3].sum(0).tolist()
        busy, wait, microbatches = (per_rank[:, column].tolist() for column in (3, 4, 5))
        step = max(b + w for b, w in zip(busy, wait, strict=True))
        metrics = self._metrics["train"]
        metrics["entropy"].append(entropy / targets if targets else 0.0)
        metrics["mean_token_accuracy"].append(correct / targets if targets else 0.0)
        self._total_train_tokens += int(inputs["num_tokens"])
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["step_s"].append(step)
        metrics["tokens_per_second"].append(inputs["num_tokens"] / max(step, 1e-9))
        metrics["bubble_rate"].append(measured_bubble(busy, step))
        metrics["predicted_bubble_rate"].append(inputs["predicted_bubble_rate"])
        if torch.cuda.is_available():
            metrics["peak_memory_gib"].append(per_rank[:, 6].max().item())  # the largest rank's, since the start
        for rank in range(len(busy)):
            metrics[f"busy_s/rank_{rank}"].append(busy[rank])
            metrics[f"wait_s/rank_{rank}"].append(wait[rank])
            metrics[f"microbatches/rank_{rank}"].append(microbatches[rank])

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's estimate, summed over this rank's microbatches."""
        total = 0
        for microbatch in inputs["microbatches"]:
            total += super().floating_point_ops(microbatch)
        return total

    def end(self) -> None:
        """Release ODC, then finish the trackers and destroy the process group (``Trainer.end``). Collective: call it
        once, on every rank, at the very end of the script."""
        self.odc_plugin.close()
        self.accelerator.end_training()

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``save_pretrained`` of the unsharded model (collective: every rank must call it)."""
        if not self._is_sharded:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = _checkpoint.full_model_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._is_sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        _checkpoint.save_sharded(self.model, _torch_optimizer(self.optimizer), _state_dir(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not self._is_sharded:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        _checkpoint.load_sharded_model(model if model is not None else self.model, _state_dir(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._is_sharded:
            return super()._load_optimizer_and_scheduler(checkpoint)
        _checkpoint.load_sharded_optimizer(self.model, _torch_optimizer(self.optimizer), _state_dir(checkpoint))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer inside Accelerate's wrapper (DCP steps it once to initialise empty state)."""
    return getattr(optimizer, "optimizer", optimizer)


def _state_dir(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, _checkpoint.STATE_DIR)
