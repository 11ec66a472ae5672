"""``ODCDPOTrainer``: TRL's ``DPOTrainer`` with preference pairs balanced across ranks and packed, on ODC.

What is DPO-specific, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints
are every ODC trainer's: :class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``__init__``: TRL's (tokenization, the reference model); then the reference model (frozen) is sharded with ODC of
  its own, and with ``precompute_ref_log_probs`` the reference log-probabilities are computed here, on the sharded
  models (TRL's own pass is skipped: ``_precompute_ref_logps``).
* ``get_train_dataloader``: one item per accumulation call, ``per_device_train_batch_size x world_size`` pairs, the
  same on every rank (:func:`hf_odc.trainer.core.data.minibatch_loader`).
* ``_plan_step``: the step's pairs planned whole and packed (:class:`~hf_odc.trainer.preference.pairs.PairPacker`);
  unless precomputed, the reference model's log-probabilities of this rank's pairs, in one forward-only ODC minibatch on
  the same packed rows (the reference model, or the policy with its adapter disabled under PEFT).
* ``_microbatch_loss``: each pair's completion log-probabilities summed per document, TRL's per-pair losses
  (:mod:`hf_odc.trainer.preference.dpo_losses`) summed and divided by the minibatch's pairs (``sft``: by its chosen
  tokens); TRL's metrics accumulated as :class:`~hf_odc.trainer.StepMetrics` means.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import datasets
import torch
from torch import nn
from trl import DPOTrainer

from ..core._base_config import whole_model_kwargs
from ..core._dataset_trainer import _ODCDatasetTrainer
from ..core._reference import check_peft_reference, reference_of, shard_reference
from ..core._step import StepMetrics
from ..core.data import MinibatchDataLoader, check_truncation, minibatch_loader
from ..core.vision import check_vision_model, is_vision_dataset
from .dpo_config import ODCDPOConfig
from .dpo_losses import TOKEN_LOSSES, PairLogps, pair_losses
from .pairs import (
    PAIR_COLUMNS,
    REFERENCE_COLUMNS,
    PairPacker,
    PairStep,
    check_pair_capacity,
    indistinct_pairs,
    item_sums,
)
from .reference import _ReferencePasses, trl_loads_a_model
from .vision_pairs import VisionPairPacker

__all__ = ["ODCDPOTrainer"]

_PAIR_MEANS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip
_TOKEN_MEANS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")


class ODCDPOTrainer(_ODCDatasetTrainer, _ReferencePasses, DPOTrainer):
    """
    Trainer for Direct Preference Optimization with On-Demand Communication (ODC) and minibatch-level load
    balancing of preference pairs.

    Same arguments as [`~trl.DPOTrainer`], with `args` an [`ODCDPOConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding. The reference is `ref_model`, else (PEFT) the policy with its adapter disabled, else TRL's copy of the
    policy loaded from its name, or, with `precompute_ref_log_probs`, the policy itself before training.

    Vision-language models (Qwen2.5-VL) train on TRL's image preference pairs with their processor: each pair processed
    as TRL processes it, its two sequences packed with the pair's images and their own 3-D rope positions
    (`hf_odc.trainer.preference.vision_pairs`).

    Example:

    ```python
    >>> from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer

    >>> trainer = ODCDPOTrainer(
    ...     model=model, ref_model=ref_model, args=ODCDPOConfig("out"), train_dataset=pairs, processing_class=tok
    ... )
    >>> trainer.train()
    ```
    """

    _tag_names: ClassVar[list[str]] = ["trl", "dpo", "hf-odc"]
    _name = "ODC DPO"
    _config_class = ODCDPOConfig

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: ODCDPOConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        self._check_train_data(kwargs, packs="pairs", text=None)
        train_dataset = kwargs.get("train_dataset")
        if trl_loads_a_model(model, ref_model, kwargs.get("peft_config"), args):
            args.model_init_kwargs = whole_model_kwargs(args.model_init_kwargs)
        self._reference_ready = False  # TRL's __init__ asks for precomputed log-probabilities before sharding
        super().__init__(model=model, ref_model=ref_model, args=args, **kwargs)
        check_peft_reference(self.accelerator.unwrap_model(self.model), "ODCDPOTrainer")
        self._vision = None  # a vision dataset's: the model's get_rope_index
        if train_dataset is not None and is_vision_dataset(train_dataset):
            self._vision = check_vision_model(self.model, type(self).__name__, args.sp_size)
        step_metrics = StepMetrics(args.device, means=_PAIR_MEANS + _TOKEN_MEANS)
        self._setup_odc(step_metrics)
        self._ref_odc = shard_reference(self)
        packer = dict(
            rank=self.accelerator.process_index,
            planner=self._planner,
            max_tokens_for=args.max_tokens_for_pairs,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            ld_alpha=args.ld_alpha,
            sequence_group=self.odc.sequence_group,
        )
        if self._vision:  # TRL processes the pairs on the fly: each step's, one by one
            self._packer = VisionPairPacker(**packer, process=self.data_collator, rope_index=self._vision)
        else:
            self._packer = PairPacker(**packer)
        self._reference_ready = True
        if self.train_dataset is not None and not self._vision:
            self._check_prepared_data(train_dataset, warn=self.accelerator.is_main_process)
        if args.precompute_ref_log_probs:
            self._precompute_datasets()

    # -- the reference ------------------------------------------------------------------------------------------------

    def _reference_columns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return PAIR_COLUMNS, REFERENCE_COLUMNS

    def _reference_microbatches(self, examples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        step = self._packer(examples)
        return step.microbatches, step.pair_indices

    # -- data -------------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> MinibatchDataLoader:
        """One item per accumulation call: ``per_device_train_batch_size x world_size`` pairs of the global minibatch,
        the same on every rank (not sharded by Accelerate: every rank plans the whole minibatch)."""
        if self.train_dataset is None:
            raise ValueError("ODCDPOTrainer needs a train_dataset.")
        if self._vision:
            return minibatch_loader(self.train_dataset, self.args, self.accelerator.num_processes)
        columns = self.train_dataset.column_names
        dataset = self.train_dataset.select_columns([c for c in PAIR_COLUMNS + REFERENCE_COLUMNS if c in columns])
        return minibatch_loader(dataset, self.args, self.accelerator.num_processes)

    def _check_prepared_data(self, given: datasets.Dataset, warn: bool) -> None:
        """TRL tokenized ``given`` and dropped the pairs whose prompt fills ``max_length``: refuse a microbatch the
        longest pair does not fit, then the truncation (:meth:`_check_truncation`, warning when ``warn``)."""
        self._check_max_tokens()
        self._check_truncation(self.train_dataset, len(given), warn)

    def _check_truncation(self, dataset: datasets.Dataset, given: int, warn: bool) -> None:
        """Refuse pairs that truncation to ``max_length`` left with nothing to prefer, all of them, or most of them
        unless ``allow_truncated_data`` (then warn, when ``warn``): of the ``given`` pairs, TRL drops those that lost
        a whole reply, and a kept one may keep the same tokens in both sequences
        (:func:`~hf_odc.trainer.preference.pairs.indistinct_pairs`)."""
        args = self.args
        dropped, same = given - len(dataset), indistinct_pairs(dataset, args.max_length, args.truncation_mode)
        check_truncation(
            dropped + same,
            given,
            f"max_length={args.max_length} leaves {dropped + same} of the {given} preference pairs with nothing to "
            f"prefer: {dropped} lost a whole reply (TRL drops them) and {same} keep the same tokens in their chosen "
            "and rejected sequences (their loss is log 2 whatever the policy). Raise --max_length to keep each pair's "
            "prompt and replies up to where they differ.",
            warn,
            nothing_left=dropped + same == given,
            allowed=args.allow_truncated_data,
        )

    @functools.cached_property
    def _sequence_lengths(self) -> list[int]:
        """Each pair's chosen and rejected sequences' tokens, in turn, as :func:`~hf_odc.trainer.preference.pairs.
        pair_documents` truncates them, read once: the capacity check and the attention plans' warm-up both need
        them."""
        limit = self.args.max_length or float("inf")
        columns = zip(*(self.train_dataset[c] for c in PAIR_COLUMNS), strict=True)
        return [min(len(prompt) + len(reply), limit) for prompt, *replies in columns for reply in replies]

    def _check_max_tokens(self) -> None:
        """Refuse, at construction, a microbatch size (``max_tokens_for_pairs``) that the dataset's longest pair does
        not fit, in ``sp_size`` microbatches (the planner would only find out at the minibatch that draws it)."""
        sequences = self._sequence_lengths
        pairs = [chosen + rejected for chosen, rejected in zip(sequences[::2], sequences[1::2], strict=True)]
        check_pair_capacity(pairs, self.args.max_tokens_for_pairs, self.args.sp_size)

    def _training_documents(self) -> list[int] | None:
        """Each pair's two sequences (a vision pair's are known only once its step processes it)."""
        return self._sequence_lengths if self.train_dataset is not None and not self._vision else None

    def _forward_only_models(self) -> list[nn.Module]:
        """The reference, unless its log-probabilities were precomputed."""
        return [] if self.args.precompute_ref_log_probs else [reference_of(self)[0]]

    # -- the two hooks of the step loop ---------------------------------------------------------------------------

    def _plan_step(self, window: list[dict[str, Any]]) -> PairStep:
        """The step's global minibatch (every accumulation call's pairs, the same on every rank), planned and packed:
        this rank's microbatches, with the reference's log-probabilities of their pairs unless precomputed."""
        step = self._packer([example for item in window for example in item["examples"]])
        if not self.args.precompute_ref_log_probs:
            self._warm_attention(step.attended_lengths())  # before the reference meets a new length in its pass
            self._metrics["train"]["reference_s"].append(self._score_reference(step.microbatches))
        return step

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: PairStep) -> torch.Tensor:
        """TRL's DPO loss of the microbatch's pairs, normalised for the whole minibatch; TRL's
        metrics accumulated (pair means, and token means over the scored completion tokens).

        A group microbatch (a pair split over a group of ``N`` ranks) holds this rank's tokens of the pair: the pair's
        sums are the group's (:func:`~hf_odc.trainer.preference.pairs.item_sums`), every rank of the group takes
        ``1 / N`` of the pair's loss, and the group's first rank alone counts the pair means; the token terms are this
        rank's tokens'."""
        args, pairs = self.args, microbatch["pairs"]
        shard = microbatch["model"].get("sequence_shard")
        outputs = model(**microbatch["model"], use_cache=False, fused_lm_head=True)
        log_probs = outputs.log_probs[0].float()
        logps, ref_logps, lengths = item_sums(log_probs, pairs, shard), pairs["ref_logps"], pairs["completion_tokens"]
        scored = PairLogps(*logps.unbind(1), *ref_logps.unbind(1), *lengths.unbind(1))
        ranks = 1 if shard is None else len(shard.sizes)
        loss = pair_losses(scored, args).sum() / (step.num_samples * ranks)
        scored_mask = outputs.label_mask[0]
        chosen_mask = scored_mask & (pairs["document"] % 2 == 0)
        rejected_mask = scored_mask & ~chosen_mask
        weights = args.loss_weights or [1.0] * len(args.loss_type)
        sft_weight = sum(w for t, w in zip(args.loss_type, weights, strict=True) if t in TOKEN_LOSSES)
        if sft_weight:
            loss = loss - sft_weight * (log_probs * chosen_mask).sum() / max(step.num_chosen_tokens, 1)

        with torch.no_grad():
            metrics, count = self._step_metrics, logps.shape[0]
            if shard is None or shard.index == 0:
                chosen_rewards, rejected_rewards = (args.beta * (logps - ref_logps)).unbind(1)
                metrics.add_mean("rewards/chosen", chosen_rewards.sum(), count)
                metrics.add_mean("rewards/rejected", rejected_rewards.sum(), count)
                metrics.add_mean("rewards/accuracies", (chosen_rewards > rejected_rewards).sum(), count)
                metrics.add_mean("rewards/margins", (chosen_rewards - rejected_rewards).sum(), count)
                metrics.add_mean("logps/chosen", logps[:, 0].sum(), count)
                metrics.add_mean("logps/rejected", logps[:, 1].sum(), count)
            metrics.add_mean("entropy", (outputs.entropy[0] * scored_mask).sum(), scored_mask.sum())
            metrics.add_mean("logits/chosen", (outputs.mean_logits[0] * chosen_mask).sum(), chosen_mask.sum())
            metrics.add_mean("logits/rejected", (outputs.mean_logits[0] * rejected_mask).sum(), rejected_mask.sum())
            metrics.add_mean("mean_token_accuracy", (outputs.is_top1[0] & chosen_mask).sum(), chosen_mask.sum())
        return loss
