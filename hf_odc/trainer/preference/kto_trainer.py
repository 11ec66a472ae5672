"""``ODCKTOTrainer``: TRL's ``KTOTrainer`` with unpaired preference examples balanced across ranks and packed, on ODC.

What is KTO-specific, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints
are every ODC trainer's: :class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``__init__``: TRL's (tokenization, the reference model); then the reference model (frozen) is sharded with ODC of
  its own, each example's mismatched completion is chosen within its accumulation call's global batch (as TRL chooses
  it on one process holding that batch), and with ``precompute_ref_log_probs`` the reference log-probabilities are
  computed here, on the sharded models (:class:`~hf_odc.trainer.preference.reference._ReferencePasses`).
* ``get_train_dataloader``: one item per accumulation call, ``per_device_train_batch_size x world_size`` examples,
  the same on every rank (:func:`hf_odc.trainer.core.data.minibatch_loader`).
* ``_plan_step``: the step's examples planned whole, each with its mismatched sequence (one item of their summed
  length); unless precomputed, the reference's log-probabilities of both sequences in one forward-only ODC minibatch;
  with the KL estimate, the policy's of the mismatched sequences in another, whose sums per accumulation call are
  gathered once from every rank (the step's one gather of its own); then the training rows: the examples' own
  sequences, packed (:func:`~hf_odc.trainer.preference.pairs.pack_pairs`, one document per example).
* ``_microbatch_loss``: each example's completion log-probabilities summed, TRL's per-example loss against the
  reference's and its call's KL estimate, weighted, summed and divided by the minibatch's examples; TRL's metrics
  accumulated as :class:`~hf_odc.trainer.StepMetrics` means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import datasets
import torch
from torch import nn
from trl import KTOTrainer

from ...packing import Plan
from ..core._base_config import whole_model_kwargs
from ..core._dataset_trainer import _ODCDatasetTrainer
from ..core._reference import check_peft_reference, shard_reference
from ..core._step import PlannedStep, StepMetrics
from ..core.data import MinibatchDataLoader, minibatch_loader
from .kto_config import ODCKTOConfig
from .pairs import check_pair_capacity, item_sums, item_sums_into, pack_pairs, pair_documents
from .reference import _ReferencePasses, trl_loads_a_model

__all__ = ["ODCKTOTrainer"]

_MEANS = (
    "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "entropy", "logits/chosen",
    "logits/rejected",
)  # fmt: skip

Document = tuple[list[int], list[int]]


@dataclass
class KTOStep(PlannedStep):
    """One optimizer step's minibatch of unpaired examples, as this rank sees it: a
    :class:`~hf_odc.trainer.PlannedStep` whose samples are examples and whose lengths are their own sequences'
    (the tokens the training minibatch runs).

    Attributes:
        labels_seen: whether the minibatch holds desirable and undesirable examples (``(desirable, undesirable)``).
    """

    labels_seen: tuple[bool, bool] = (False, False)


class ODCKTOTrainer(_ODCDatasetTrainer, _ReferencePasses, KTOTrainer):
    """
    Trainer for Kahneman-Tversky Optimization (KTO) with On-Demand Communication (ODC) and minibatch-level load
    balancing of unpaired preference examples.

    Same arguments as [`~trl.KTOTrainer`], with `args` an [`ODCKTOConfig`]. Launch it with `accelerate launch` (see
    `examples/odc.yaml` and `examples/odc_cpu.yaml`); with a single process it trains on the same plan without
    sharding. The reference is `ref_model`, else (PEFT) the policy with its adapter disabled, else TRL's copy of the
    policy loaded from its name, or, with `precompute_ref_log_probs`, the policy itself before training.

    Example:

    ```python
    >>> from hf_odc.trainer import ODCKTOConfig, ODCKTOTrainer

    >>> trainer = ODCKTOTrainer(
    ...     model=model, ref_model=ref_model, args=ODCKTOConfig("out"), train_dataset=examples, processing_class=tok
    ... )
    >>> trainer.train()
    ```
    """

    _weighs_moe_aux_loss = False  # the router's loss not yet checked against TRL's here

    _tag_names: ClassVar[list[str]] = ["trl", "kto", "hf-odc"]
    _name = "ODC KTO"
    _config_class = ODCKTOConfig

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: ODCKTOConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        self._check_train_data(kwargs, packs="examples", text="examples")
        if trl_loads_a_model(model, ref_model, kwargs.get("peft_config"), args):
            args.model_init_kwargs = whole_model_kwargs(args.model_init_kwargs)
        self._reference_ready = False  # TRL's __init__ asks for precomputed log-probabilities before sharding
        super().__init__(model=model, ref_model=ref_model, args=args, **kwargs)
        check_peft_reference(self.accelerator.unwrap_model(self.model), "ODCKTOTrainer")
        self._setup_odc(StepMetrics(args.device, means=_MEANS))
        self._ref_odc = shard_reference(self)
        self.train_dataset = self._with_run_columns(self.train_dataset, self.accelerator.num_processes)
        self._reference_ready = True
        self._check_prepared_data(kwargs.get("train_dataset"), warn=self.accelerator.is_main_process)
        if args.precompute_ref_log_probs:
            self._precompute_datasets()

    # -- data -------------------------------------------------------------------------------------------------------

    def _with_run_columns(self, dataset: datasets.Dataset, num_processes: int) -> datasets.Dataset:
        """With the KL estimate, each example's mismatched completion (``KL_completion_ids``), chosen within its
        accumulation call's global batch (``per_device_train_batch_size x num_processes`` examples), as TRL chooses
        it on one process holding that batch (:func:`_with_mismatched_completions`)."""
        if not self.args.calculate_kl:
            return dataset
        return _with_mismatched_completions(dataset, self.args.per_device_train_batch_size * num_processes)

    def _check_prepared_data(self, given: Any, warn: bool) -> None:
        """Refuse a microbatch that the longest example, with its mismatched completion (planned together), does not
        fit; nothing is truncated beyond TRL's dropping of the examples whose prompt fills ``max_length``, so nothing
        to warn of."""
        lengths = [sum(len(ids) for ids, _ in self._documents(example)) for example in self.train_dataset]
        together = "it and its mismatched KL completion stay in one microbatch" if self.args.calculate_kl else None
        check_pair_capacity(lengths, self.args.max_tokens_for_pairs, item="example", together=together)

    def get_train_dataloader(self) -> MinibatchDataLoader:
        """One item per accumulation call: ``per_device_train_batch_size x world_size`` examples of the global
        minibatch, the same on every rank (not sharded by Accelerate: every rank plans the whole minibatch)."""
        inputs, references = self._reference_columns()
        wanted = (*inputs, "label", *references)
        columns = [c for c in wanted if c in self.train_dataset.column_names]
        return minibatch_loader(self.train_dataset.select_columns(columns), self.args, self.accelerator.num_processes)

    def _documents(self, example: dict[str, Any]) -> tuple[Document, ...]:
        """The example's sequence and, with the KL estimate, its mismatched one, each ``(ids, completion_mask)``,
        truncated to ``max_length`` keeping the start, as TRL's collator truncates them."""
        sequences = {"prompt_ids": example["prompt_ids"], "chosen_ids": example["completion_ids"]}
        sequences["rejected_ids"] = example.get("KL_completion_ids") or ()
        own, mismatched = pair_documents(sequences, self.args.max_length, "keep_start")
        return (own, mismatched) if self.args.calculate_kl else (own,)

    def _plan(self, examples: list[dict[str, Any]]) -> tuple[list[tuple[Document, ...]], list[int], Plan, int]:
        """Every rank's plan of ``examples``, each one item with its mismatched sequence: their documents, the
        items' lengths, the plan and its microbatch capacity."""
        documents = [self._documents(example) for example in examples]
        lengths = [sum(len(ids) for ids, _ in item) for item in documents]
        max_tokens = self.args.max_tokens_for_pairs(max(lengths))
        return documents, lengths, self._planner.plan(lengths, max_tokens), max_tokens

    # -- the reference (hf_odc.trainer.preference.reference._ReferencePasses) ---------------------------------------

    def _reference_columns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.args.calculate_kl:
            return ("prompt_ids", "completion_ids", "KL_completion_ids"), ("ref_logps", "ref_KL_logps")
        return ("prompt_ids", "completion_ids"), ("ref_logps",)

    def _reference_microbatches(self, examples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        documents, _, plan, _ = self._plan(examples)
        own = [list(microbatch) for microbatch in plan[self.accelerator.process_index]]
        return [pack_pairs([documents[i] for i in microbatch]) for microbatch in own], own

    # -- the two hooks of the step loop ---------------------------------------------------------------------------

    def _plan_step(self, window: list[dict[str, Any]]) -> KTOStep:
        """The step's global minibatch (every accumulation call's examples, the same on every rank), planned: this
        rank's training microbatches, each example with its reference log-probability and its call's KL estimate."""
        args, rank, metrics = self.args, self.accelerator.process_index, self._metrics["train"]
        examples = [example for item in window for example in item["examples"]]
        calls = torch.tensor([call for call, item in enumerate(window) for _ in item["examples"]])
        documents, lengths, plan, max_tokens = self._plan(examples)
        own = [list(microbatch) for microbatch in plan[rank]]
        _, reference_columns = self._reference_columns()
        references = None
        if args.precompute_ref_log_probs:
            references = [[float(examples[i][c]) for c in reference_columns] for i in range(len(examples))]
        scored = [
            pack_pairs([documents[i] for i in mb], None if references is None else [references[i] for i in mb])
            for mb in own
        ]
        if not args.precompute_ref_log_probs:
            metrics["reference_s"].append(self._score_reference(scored))
        estimates = torch.zeros(len(window))
        if args.calculate_kl:
            estimates = self._kl_estimates(documents, own, scored, calls, [len(item["examples"]) for item in window])
        metrics["kl"].append(estimates.mean().item())
        microbatches = []
        for microbatch, scores in zip(own, scored, strict=True):
            packed = pack_pairs([documents[i][:1] for i in microbatch])
            packed["pairs"]["ref_logps"] = scores["pairs"]["ref_logps"][:, 0]
            packed["pairs"]["label"] = torch.tensor([bool(examples[i]["label"]) for i in microbatch])
            packed["pairs"]["kl"] = estimates[calls[microbatch]]
            microbatches.append(packed)
        own_lengths = [len(item[0][0]) for item in documents]
        labels = {bool(example["label"]) for example in examples}
        return KTOStep(
            microbatches=microbatches,
            microbatch_lengths=[[[own_lengths[i] for i in mb] for mb in rank_plan] for rank_plan in plan],
            num_samples=len(examples),
            num_tokens=sum(own_lengths),
            num_loss_tokens=sum(sum(item[0][1][1:]) for item in documents),
            predicted_bubble_rate=self._planner.predicted_bubble(plan, lengths, max_tokens),
            attended=[len(ids) for item in documents for ids, _ in item],
            labels_seen=(True in labels, False in labels),
        )

    def _kl_estimates(
        self,
        documents: list[tuple[Document, ...]],
        own: list[list[int]],
        scored: list[dict[str, Any]],
        calls: torch.Tensor,
        counts: list[int],
    ) -> torch.Tensor:
        """TRL's KL estimate of each accumulation call: the mean over its examples of the policy's minus the
        reference's summed log-probabilities of their mismatched sequences, clamped at 0. The policy's come from one
        forward-only minibatch on this rank's mismatched sequences; the per-call sums are gathered once."""
        rows = [pack_pairs([documents[i][1:] for i in microbatch]) for microbatch in own]
        self._metrics["train"]["kl_s"].append(
            self._forward_only(self.model, self.odc, rows, item_sums_into("policy_logps"))
        )
        sums = torch.zeros(len(counts), dtype=torch.float64, device=self.args.device)
        for microbatch, row, scores in zip(own, rows, scored, strict=True):
            difference = row["pairs"]["policy_logps"][:, 0] - scores["pairs"]["ref_logps"][:, 1].to(sums.device)
            sums.index_add_(0, calls[microbatch].to(sums.device), difference.double())
        with self.odc.bounded("the KL estimate's gather"):
            sums = self.accelerator.gather(sums[None]).sum(0).cpu()
        return (sums / torch.tensor(counts, dtype=torch.float64)).clamp(min=0).float()

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: KTOStep) -> torch.Tensor:
        """TRL's KTO loss of the microbatch's examples, normalised for the whole minibatch; TRL's
        metrics accumulated (example means, and token means over the scored completion tokens)."""
        args, items = self.args, microbatch["pairs"]
        outputs = model(**microbatch["model"], use_cache=False, fused_lm_head=True)
        logps = item_sums(outputs.log_probs[0].float(), items)[:, 0]
        logratios, desirable, kl = logps - items["ref_logps"], items["label"], items["kl"]
        if args.loss_type == "kto":
            losses = torch.where(
                desirable,
                args.desirable_weight * (1 - torch.sigmoid(args.beta * (logratios - kl))),
                args.undesirable_weight * (1 - torch.sigmoid(args.beta * (kl - logratios))),
            )
        else:  # apo_zero_unpaired
            losses = torch.where(
                desirable,
                args.desirable_weight * (1 - torch.sigmoid(args.beta * logratios)),
                args.undesirable_weight * torch.sigmoid(args.beta * logratios),
            )
        loss = losses.sum() / step.num_samples

        with torch.no_grad():
            metrics, rewards, undesirable = self._step_metrics, args.beta * logratios, ~desirable
            metrics.add_mean("rewards/chosen", rewards[desirable].sum(), desirable.sum())
            metrics.add_mean("rewards/rejected", rewards[undesirable].sum(), undesirable.sum())
            metrics.add_mean("logps/chosen", logps[desirable].sum(), desirable.sum())
            metrics.add_mean("logps/rejected", logps[undesirable].sum(), undesirable.sum())
            scored = outputs.label_mask[0]
            chosen = scored & desirable[items["document"]]
            rejected = scored & ~chosen
            metrics.add_mean("entropy", (outputs.entropy[0] * scored).sum(), scored.sum())
            metrics.add_mean("logits/chosen", (outputs.mean_logits[0] * chosen).sum(), chosen.sum())
            metrics.add_mean("logits/rejected", (outputs.mean_logits[0] * rejected).sum(), rejected.sum())
        return loss

    def _end_step(self, step: KTOStep, metrics: dict[str, float]) -> None:
        """KTOTrainer's ``num_tokens`` (:class:`_ODCDatasetTrainer`'s) and ``rewards/margins`` (when the minibatch holds
        both labels)."""
        super()._end_step(step, metrics)
        if all(step.labels_seen):
            self._metrics["train"]["rewards/margins"].append(metrics["rewards/chosen"] - metrics["rewards/rejected"])


def _with_mismatched_completions(dataset: datasets.Dataset, batch: int) -> datasets.Dataset:
    """``dataset`` with TRL's ``KL_completion_ids`` chosen within each run of ``batch`` consecutive examples (a global
    batch of one accumulation call under sequential sampling): the previous example's completion, the first example
    taking the run's last one's."""
    completions = dataset["completion_ids"]
    count = len(completions)
    mismatched = [completions[i - 1] if i % batch else completions[min(i + batch, count) - 1] for i in range(count)]
    if "KL_completion_ids" in dataset.column_names:
        dataset = dataset.remove_columns("KL_completion_ids")
    return dataset.add_column("KL_completion_ids", mismatched)
