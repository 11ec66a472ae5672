"""``ODCDPOTrainer``: TRL's ``DPOTrainer`` with preference pairs balanced across ranks and packed, on ODC.

What is DPO-specific, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints
are every ODC trainer's: :class:`hf_odc.trainer._base_trainer._ODCTrainer`):

* ``__init__``: TRL's (tokenization, the reference model); then the reference model (frozen) is sharded with ODC of
  its own, and with ``precompute_ref_log_probs`` the reference log-probabilities are computed here, on the sharded
  models (TRL's own pass is skipped: ``_precompute_ref_logps``).
* ``get_train_dataloader``: one item per accumulation call, ``per_device_train_batch_size x world_size`` pairs, the
  same on every rank (:func:`hf_odc.trainer.data.minibatch_loader`).
* ``_plan_step``: the step's pairs planned whole and packed (:class:`~hf_odc.trainer.pairs.PairPacker`); unless
  precomputed, the reference model's log-probabilities of this rank's pairs, in one forward-only ODC minibatch on
  the same packed rows (the reference model, or the policy with its adapter disabled under PEFT).
* ``_microbatch_loss``: each pair's completion log-probabilities summed per document, TRL's per-pair losses
  (:mod:`hf_odc.trainer.dpo_losses`) summed and divided by the minibatch's pairs (``sft``: by its chosen tokens),
  times the world size; TRL's metrics accumulated as :class:`~hf_odc.trainer.StepMetrics` means.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import datasets
import torch
from accelerate.utils import DistributedType, gather_object, is_peft_model
from torch import nn
from trl import DPOTrainer

from ..accelerate_plugin import ODCRuntime
from ._base_trainer import _ODCTrainer
from ._step import StepMetrics
from .data import MinibatchDataLoader, check_truncation, minibatch_loader
from .dpo_config import ODCDPOConfig
from .dpo_losses import TOKEN_LOSSES, PairLogps, pair_losses
from .pairs import PAIR_COLUMNS, REFERENCE_COLUMNS, PairPacker, PairStep, document_sums, indistinct_pairs

__all__ = ["ODCDPOTrainer"]

_PAIR_MEANS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip
_TOKEN_MEANS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")


class ODCDPOTrainer(_ODCTrainer, DPOTrainer):
    """
    Trainer for Direct Preference Optimization with On-Demand Communication (ODC) and minibatch-level load
    balancing of preference pairs.

    Same arguments as [`~trl.DPOTrainer`], with `args` an [`ODCDPOConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding. The reference is `ref_model`, else (PEFT) the policy with its adapter disabled, else TRL's copy of the
    policy loaded from its name, or, with `precompute_ref_log_probs`, the policy itself before training.

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

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: ODCDPOConfig | None = None, **kwargs: Any):
        if args is None:
            args = ODCDPOConfig("odc-dpo")
        elif not isinstance(args, ODCDPOConfig):
            raise TypeError(f"ODCDPOTrainer needs an ODCDPOConfig, got {type(args).__name__}.")
        if kwargs.get("data_collator") is not None:
            raise ValueError("ODCDPOTrainer does not accept `data_collator`: the planner packs the pairs.")
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is not None and not isinstance(train_dataset, datasets.Dataset):
            raise TypeError("ODCDPOTrainer needs a map-style `datasets.Dataset`: it samples global minibatches.")
        if train_dataset is not None and {"image", "images"} & set(train_dataset.column_names):
            raise NotImplementedError("ODCDPOTrainer trains on text pairs; vision datasets are not supported.")
        if _trl_loads_a_model(model, ref_model, kwargs.get("peft_config"), args):
            # Every rank loads the whole model and hf_odc shards it: TRL's default device_map="auto" would spread it
            # over all of this host's GPUs instead.
            args.model_init_kwargs = {"device_map": None, **(args.model_init_kwargs or {})}
        self._reference_ready = False  # TRL's __init__ asks for precomputed log-probabilities before sharding
        super().__init__(model=model, ref_model=ref_model, args=args, **kwargs)
        _check_peft(self.accelerator.unwrap_model(self.model))
        step_metrics = StepMetrics(args.device, means=_PAIR_MEANS + _TOKEN_MEANS)
        self._setup_odc(step_metrics)
        self._ref_odc: ODCRuntime | None = None
        if self.ref_model is not None:
            self.ref_model, self._ref_odc = self._shard_frozen(self.ref_model)
        self._packer = PairPacker(
            rank=self.accelerator.process_index,
            planner=self._planner,
            max_tokens_for=args.max_tokens_for_pairs,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            ld_alpha=args.ld_alpha,
        )
        self._reference_ready = True
        if self.train_dataset is not None:
            self._check_max_tokens(self.train_dataset)
            self._check_truncation(self.train_dataset, len(train_dataset))
        if args.precompute_ref_log_probs:
            self._precompute_datasets()

    # -- the reference ------------------------------------------------------------------------------------------------

    def _reference(self) -> tuple[nn.Module, ODCRuntime, contextlib.AbstractContextManager]:
        """The reference model, its runtime, and the context to run it in: ``ref_model``; else the policy with its
        PEFT adapter disabled; else (``precompute_ref_log_probs``, before training) the policy itself."""
        if self.ref_model is not None:
            return self.ref_model, self._ref_odc, contextlib.nullcontext()
        policy = self.accelerator.unwrap_model(self.model)
        return self.model, self.odc, policy.disable_adapter() if is_peft_model(policy) else contextlib.nullcontext()

    def _score_reference(self, microbatches: list[dict[str, Any]]) -> float:
        """The reference's summed completion log-probabilities of each pair of this rank's packed ``microbatches``,
        stored as their ``ref_logps``, in one forward-only minibatch; returns its device-timed span (seconds)."""
        model, runtime, context = self._reference()
        with runtime.minibatch(backward=False), context, self.accelerator.autocast():
            for microbatch in microbatches:
                inputs = self._to_device(microbatch)
                outputs = model(**inputs["model"], use_cache=False, fused_lm_head=True)
                microbatch["pairs"]["ref_logps"] = _pair_sums(outputs.log_probs[0].float(), inputs["pairs"])
        return runtime.last.step

    def _precompute_ref_logps(self, dataset: datasets.Dataset, name: str, batch_size: int) -> datasets.Dataset:
        """``dataset`` with the reference's log-probabilities of each pair (:data:`REFERENCE_COLUMNS`), computed in
        planned, packed forward-only minibatches of ``batch_size x world_size`` pairs on the sharded reference, then
        gathered once. (TRL's own pass, which runs in its ``__init__`` before hf_odc has sharded anything, is
        skipped: this one runs at the end of :meth:`__init__`.)"""
        if not self._reference_ready:
            return dataset
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError("precompute_ref_log_probs needs a map-style `datasets.Dataset`.")
        dataset = dataset.remove_columns([c for c in REFERENCE_COLUMNS if c in dataset.column_names])
        pairs, size = dataset.select_columns(PAIR_COLUMNS), batch_size * self.accelerator.num_processes
        computed: dict[int, list[float]] = {}
        for start in range(0, len(pairs), size):
            chunk = pairs[start : start + size]
            step = self._packer([dict(zip(chunk, values, strict=True)) for values in zip(*chunk.values(), strict=True)])
            self._score_reference(step.microbatches)
            for indices, microbatch in zip(step.pair_indices, step.microbatches, strict=True):
                logps = microbatch["pairs"]["ref_logps"].cpu().tolist()
                computed.update({start + i: values for i, values in zip(indices, logps, strict=True)})
        with self.odc.bounded(f"gathering the reference log-probabilities of the {name} dataset"):
            for part in gather_object([computed]):
                computed.update(part)
        for column, side in zip(REFERENCE_COLUMNS, (0, 1), strict=True):
            dataset = dataset.add_column(column, [computed[i][side] for i in range(len(dataset))])
        return dataset

    def _precompute_datasets(self) -> None:
        """The reference's log-probabilities of the training and evaluation datasets (what TRL's ``__init__`` does
        with ``precompute_ref_log_probs``), now that the models are sharded."""
        args = self.args
        self.train_dataset = self._precompute_ref_logps(
            self.train_dataset, "train", args.precompute_ref_batch_size or args.per_device_train_batch_size
        )
        if self.eval_dataset is None:
            return
        batch_size = args.precompute_ref_batch_size or args.per_device_eval_batch_size
        if isinstance(self.eval_dataset, dict):
            datasets_by_name = self.eval_dataset.items()
            self.eval_dataset = {name: self._precompute_ref_logps(d, name, batch_size) for name, d in datasets_by_name}
        else:
            self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, "eval", batch_size)

    # -- data -------------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> MinibatchDataLoader:
        """One item per accumulation call: ``per_device_train_batch_size x world_size`` pairs of the global minibatch,
        the same on every rank (not sharded by Accelerate: every rank plans the whole minibatch)."""
        if self.train_dataset is None:
            raise ValueError("ODCDPOTrainer needs a train_dataset.")
        columns = self.train_dataset.column_names
        dataset = self.train_dataset.select_columns([c for c in PAIR_COLUMNS + REFERENCE_COLUMNS if c in columns])
        return minibatch_loader(dataset, self.args, self.accelerator.num_processes)

    def _check_truncation(self, dataset: datasets.Dataset, given: int) -> None:
        """Refuse pairs that truncation to ``max_length`` left with nothing to prefer, all of them; warn once where it
        left most so: of the ``given`` pairs, TRL drops those that lost a whole reply, and a kept one may keep the
        same tokens in both sequences (:func:`~hf_odc.trainer.pairs.indistinct_pairs`)."""
        args = self.args
        dropped, same = given - len(dataset), indistinct_pairs(dataset, args.max_length, args.truncation_mode)
        check_truncation(
            dropped + same,
            given,
            f"max_length={args.max_length} leaves {dropped + same} of the {given} preference pairs with nothing to "
            f"prefer: {dropped} lost a whole reply (TRL drops them) and {same} keep the same tokens in their chosen "
            "and rejected sequences (their loss is log 2 whatever the policy). Raise --max_length to keep each pair's "
            "prompt and replies up to where they differ.",
            self.accelerator.is_main_process,
            nothing_left=dropped + same == given,
        )

    def _check_max_tokens(self, dataset: datasets.Dataset) -> None:
        """Refuse, at construction, a microbatch size (``max_tokens_for_pairs``) that the dataset's longest pair does
        not fit (the planner would only find out at the minibatch that draws it)."""
        args, limit = self.args, self.args.max_length or float("inf")
        lengths = [
            min(len(prompt) + len(chosen), limit) + min(len(prompt) + len(rejected), limit)
            for prompt, chosen, rejected in zip(*(dataset[c] for c in PAIR_COLUMNS), strict=True)
        ]
        longest = max(lengths, default=0)
        max_tokens = args.max_tokens_for_pairs(longest)
        if longest > max_tokens:
            raise ValueError(
                f"The training dataset's longest pair has {longest} tokens (its chosen and rejected sequences "
                f"together stay in one microbatch), more than one microbatch holds ({max_tokens} tokens). Set "
                f"--max_tokens_per_microbatch to at least {longest}, or --packing_ratio to at least 1, or drop or "
                "truncate (--max_length) the longest pairs."
            )

    # -- the two hooks of the step loop ---------------------------------------------------------------------------

    def _plan_step(self, window: list[dict[str, Any]]) -> PairStep:
        """The step's global minibatch (every accumulation call's pairs, the same on every rank), planned and packed:
        this rank's microbatches, with the reference's log-probabilities of their pairs unless precomputed."""
        step = self._packer([example for item in window for example in item["examples"]])
        if not self.args.precompute_ref_log_probs:
            self._metrics["train"]["reference_s"].append(self._score_reference(step.microbatches))
        return step

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: PairStep) -> torch.Tensor:
        """TRL's DPO loss of the microbatch's pairs, normalised for the whole minibatch and times the world size;
        TRL's metrics accumulated (pair means, and token means over the scored completion tokens)."""
        args, pairs = self.args, microbatch["pairs"]
        outputs = model(**microbatch["model"], use_cache=False, fused_lm_head=True)
        log_probs = outputs.log_probs[0].float()
        logps, ref_logps, lengths = _pair_sums(log_probs, pairs), pairs["ref_logps"], pairs["completion_tokens"]
        scored = PairLogps(*logps.unbind(1), *ref_logps.unbind(1), *lengths.unbind(1))
        loss = pair_losses(scored, args).sum() / step.num_samples
        scored_mask = outputs.label_mask[0]
        chosen_mask = scored_mask & (pairs["document"] % 2 == 0)
        rejected_mask = scored_mask & ~chosen_mask
        weights = args.loss_weights or [1.0] * len(args.loss_type)
        sft_weight = sum(w for t, w in zip(args.loss_type, weights, strict=True) if t in TOKEN_LOSSES)
        if sft_weight:
            loss = loss - sft_weight * (log_probs * chosen_mask).sum() / max(step.num_chosen_tokens, 1)

        with torch.no_grad():
            metrics, count = self._step_metrics, logps.shape[0]
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
        return loss * self.accelerator.num_processes

    def _microbatch_context(self) -> contextlib.AbstractContextManager:
        """DPOTrainer's activation offloading (``activation_offloading``), around the whole minibatch."""
        return self.maybe_activation_offload_context

    def _end_step(self, step: PairStep, metrics: dict[str, float]) -> None:
        """DPOTrainer's ``num_tokens``: the tokens (both sequences of every pair) trained on so far."""
        self._total_train_tokens += step.num_tokens
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]


def _pair_sums(log_probs: torch.Tensor, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each pair's summed (LD-DPO-weighted) completion log-probabilities from a packed row's per-position
    ``log_probs``: ``(k, 2)``, chosen then rejected."""
    count = pairs["completion_tokens"].shape[0]
    return document_sums(log_probs * pairs["weight"], pairs["document"], 2 * count).view(count, 2)


def _trl_loads_a_model(model: Any, ref_model: Any, peft_config: Any, args: ODCDPOConfig) -> bool:
    """Whether TRL's ``__init__`` will load a model by name: the policy given as a name, or a reference copy of it
    (no ``ref_model``, no PEFT, and the log-probabilities not precomputed, or precomputed under an FSDP config)."""
    if isinstance(model, str):
        return True
    if ref_model is not None or peft_config is not None or is_peft_model(model):
        return False
    return not args.precompute_ref_log_probs or args.distributed_state.distributed_type == DistributedType.FSDP


def _check_peft(policy: nn.Module) -> None:
    """Refuse the PEFT setups whose reference the packed path cannot reproduce."""
    if not is_peft_model(policy):
        return
    if "ref" in policy.peft_config:
        raise NotImplementedError(
            "ODCDPOTrainer got a PEFT model with an adapter and no ref_model: TRL would keep a copy of the adapter as "
            "the reference and switch adapters between passes, which changes the trainable parameters ODC laid out. "
            "Pass the base model with peft_config (the reference is then the base model, adapter disabled), or a "
            "ref_model."
        )
    if policy.active_peft_config.is_prompt_learning:
        raise NotImplementedError(
            "ODCDPOTrainer does not support prompt-learning PEFT (prefix, prompt or P-tuning): its virtual tokens "
            "belong to a row, and a packed row holds several pairs. Use LoRA (or another adapter method)."
        )
