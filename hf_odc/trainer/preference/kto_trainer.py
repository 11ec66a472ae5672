"""``ODCKTOTrainer``: TRL's ``KTOTrainer`` with unpaired preference examples balanced across ranks and packed, on ODC.

What is KTO-specific, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and checkpoints
are every ODC trainer's: :class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``__init__``: TRL's (tokenization, the reference model); then the reference model (frozen) is sharded with ODC of
  its own, each example's mismatched completion is chosen within its accumulation call's global batch (as TRL chooses
  it on one process holding that batch), and with ``precompute_ref_log_probs`` the reference log-probabilities are
  computed here, on the sharded models (:class:`~hf_odc.trainer.preference.reference._ReferencePasses`).
* ``get_train_dataloader``: one item per accumulation call, ``per_device_train_batch_size x world_size`` examples,
  the same on every rank (:func:`hf_odc.trainer.core.data.minibatch_loader`).
* ``_plan_step``: each of the step's passes planned on the tokens it runs (:func:`_plan_passes`): unless
  precomputed, the reference's log-probabilities of each example's sequence and its mismatched one in one forward-only
  ODC minibatch; with the KL estimate, the policy's of the mismatched sequences in another, and what the ranks scored
  gathered once (the step's one gather of its own); then the training rows, balanced on the examples' own
  sequences, packed (:func:`~hf_odc.trainer.preference.pairs.pack_pairs`, one document per example).
* ``_microbatch_loss``: each example's completion log-probabilities summed, TRL's per-example loss against the
  reference's and its call's KL estimate, weighted, summed and divided by the minibatch's examples; TRL's metrics
  accumulated as :class:`~hf_odc.trainer.StepMetrics` means.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import datasets
import torch
from torch import nn
from trl import KTOTrainer

from ...packing import MinibatchPlanner, Plan
from ..core._base_config import whole_model_kwargs
from ..core._dataset_trainer import _ODCDatasetTrainer
from ..core._reference import check_peft_reference, reference_of, shard_reference
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


class _KTOPlans(NamedTuple):
    """A step's examples planned per pass (:func:`_plan_passes`).

    Attributes:
        documents: each example's documents (its own sequence and, with the KL estimate, its mismatched one).
        lengths: each example's own sequence's tokens, what its training microbatch runs.
        capacity: the microbatch capacity of every pass.
        training: the training minibatch's plan, balanced on ``lengths``.
        reference: the reference's forward-only pass's plan, balanced on each example's documents together.
        kl: the policy's forward-only pass over the mismatched sequences, balanced on theirs (``None``: no KL).
    """

    documents: list[tuple[Document, ...]]
    lengths: list[int]
    capacity: int
    training: Plan
    reference: Plan
    kl: Plan | None


def _plan_passes(planner: MinibatchPlanner, documents: list[tuple[Document, ...]], capacity: int) -> _KTOPlans:
    """Each of a KTO step's passes planned on the tokens it runs. The passes meet apart (each is an ODC minibatch,
    and the KL estimate is gathered before training), so one plan of the examples' documents together, as the
    reference pass runs them, would leave the training minibatch, which runs only the own sequences and costs the
    most, unbalanced by as much as the mismatched sequences differ."""
    lengths = [len(item[0][0]) for item in documents]
    training = planner.plan(lengths, capacity)
    if len(documents[0]) == 1:
        return _KTOPlans(documents, lengths, capacity, training, training, None)
    reference = planner.plan([sum(len(ids) for ids, _ in item) for item in documents], capacity)
    kl = planner.plan([len(item[1][0]) for item in documents], capacity)
    return _KTOPlans(documents, lengths, capacity, training, reference, kl)


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
        lengths = [sum(sequences) for sequences in self._sequence_lengths]
        together = "it and its mismatched KL completion stay in one microbatch" if self.args.calculate_kl else None
        check_pair_capacity(lengths, self.args.max_tokens_for_pairs, item="example", together=together)

    @functools.cached_property
    def _sequence_lengths(self) -> list[tuple[int, ...]]:
        """Each example's sequence and, with the KL estimate, its mismatched one (:meth:`_documents`), their tokens,
        read once: the capacity check and the attention plans' warm-up both need them."""
        return [tuple(len(ids) for ids, _ in self._documents(example)) for example in self.train_dataset]

    def _training_documents(self) -> list[int]:
        """Every example's sequences (its own and, with the KL estimate, its mismatched one)."""
        return [length for sequences in self._sequence_lengths for length in sequences]

    def _forward_only_models(self) -> list[nn.Module]:
        """The reference, unless its log-probabilities were precomputed, and with the KL estimate the policy."""
        models = [] if self.args.precompute_ref_log_probs else [reference_of(self)[0]]
        return [*models, self.model] if self.args.calculate_kl else models

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

    def _plans(self, examples: list[dict[str, Any]]) -> _KTOPlans:
        """Every rank's plans of ``examples``' passes (:func:`_plan_passes`), with the examples' documents."""
        documents = [self._documents(example) for example in examples]
        capacity = self.args.max_tokens_for_pairs(max(sum(len(ids) for ids, _ in item) for item in documents))
        return _plan_passes(self._planner, documents, capacity)

    # -- the reference (hf_odc.trainer.preference.reference._ReferencePasses) ---------------------------------------

    def _reference_columns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self.args.calculate_kl:
            return ("prompt_ids", "completion_ids", "KL_completion_ids"), ("ref_logps", "ref_KL_logps")
        return ("prompt_ids", "completion_ids"), ("ref_logps",)

    def _reference_microbatches(self, examples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        plans = self._plans(examples)
        own = [list(microbatch) for microbatch in plans.reference[self.accelerator.process_index]]
        return [pack_pairs([plans.documents[i] for i in microbatch]) for microbatch in own], own

    # -- the two hooks of the step loop ---------------------------------------------------------------------------

    def _plan_step(self, window: list[dict[str, Any]]) -> KTOStep:
        """The step's global minibatch (every accumulation call's examples, the same on every rank), planned: the
        log-probabilities its loss reads (:meth:`_scores`), then this rank's training microbatches, each example
        with its reference log-probability and its call's KL estimate."""
        args, rank = self.args, self.accelerator.process_index
        examples = [example for item in window for example in item["examples"]]
        calls = torch.tensor([call for call, item in enumerate(window) for _ in item["examples"]])
        plans = self._plans(examples)
        documents = plans.documents
        attended = [len(ids) for item in documents for ids, _ in item]
        self._warm_attention(attended)  # before the reference and KL passes meet a new length
        scores = self._scores(examples, plans)
        estimates = torch.zeros(len(window))
        if args.calculate_kl:
            # TRL's estimate of each accumulation call: the mean over its examples of the policy's minus the
            # reference's summed log-probabilities of their mismatched sequences, clamped at 0.
            differences = (scores[:, 2].float() - scores[:, 1].float()).double()
            sums = torch.zeros(len(window), dtype=torch.float64).index_add_(0, calls, differences)
            counts = torch.tensor([len(item["examples"]) for item in window], dtype=torch.float64)
            estimates = (sums / counts).clamp(min=0).float()
        self._metrics["train"]["kl"].append(estimates.mean().item())
        microbatches = []
        for microbatch in plans.training[rank]:
            packed = pack_pairs([documents[i][:1] for i in microbatch])
            packed["pairs"]["ref_logps"] = scores[list(microbatch), 0].float()
            packed["pairs"]["label"] = torch.tensor([bool(examples[i]["label"]) for i in microbatch])
            packed["pairs"]["kl"] = estimates[calls[list(microbatch)]]
            microbatches.append(packed)
        own_lengths = plans.lengths
        labels = {bool(example["label"]) for example in examples}
        return KTOStep(
            microbatches=microbatches,
            microbatch_lengths=[[[own_lengths[i] for i in mb] for mb in rank_plan] for rank_plan in plans.training],
            num_samples=len(examples),
            num_tokens=sum(own_lengths),
            num_loss_tokens=sum(sum(item[0][1][1:]) for item in documents),
            predicted_bubble_rate=self._planner.predicted_bubble(plans.training, own_lengths, plans.capacity),
            attended=attended,
            labels_seen=(True in labels, False in labels),
        )

    def _scores(self, examples: list[dict[str, Any]], plans: _KTOPlans) -> torch.Tensor:
        """Per example (rows), the summed completion log-probabilities its loss and its call's KL estimate read: the
        reference's of its own sequence and, with the KL estimate, of its mismatched one, then the policy's of the
        mismatched one. Each pass is one forward-only ODC minibatch on its own plan, so each example is scored on
        one rank, and with the KL estimate what the ranks scored is gathered once (without it the reference runs the
        training plan, and each rank reads only its own examples); precomputed reference columns are read instead."""
        args, rank, metrics = self.args, self.accelerator.process_index, self._metrics["train"]
        documents = plans.documents
        scored = torch.zeros(len(examples), 3 if args.calculate_kl else 1, dtype=torch.float64)
        if not args.precompute_ref_log_probs:
            rows = [pack_pairs([documents[i] for i in microbatch]) for microbatch in plans.reference[rank]]
            metrics["reference_s"].append(self._score_reference(rows))
            for microbatch, row in zip(plans.reference[rank], rows, strict=True):
                logps = row["pairs"]["ref_logps"]
                scored[list(microbatch), : logps.shape[1]] = logps.double().cpu()
        if args.calculate_kl:
            rows = [pack_pairs([documents[i][1:] for i in microbatch]) for microbatch in plans.kl[rank]]
            metrics["kl_s"].append(self._forward_only(self.model, self.odc, rows, item_sums_into("policy_logps")))
            for microbatch, row in zip(plans.kl[rank], rows, strict=True):
                scored[list(microbatch), 2] = row["pairs"]["policy_logps"][:, 0].double().cpu()
        if args.calculate_kl:  # without it the reference ran the training plan: each rank scored its own examples
            with self.odc.bounded("the reference's and the KL estimate's log-probabilities' gather"):
                # Exactly one rank scored each entry (zeros elsewhere), so the sum over ranks is exact.
                scored = self.accelerator.gather(scored[None].to(args.device)).sum(0).cpu()
        if args.precompute_ref_log_probs:
            _, columns = self._reference_columns()
            scored[:, : len(columns)] = torch.tensor([[float(e[c]) for c in columns] for e in examples]).double()
        return scored

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
