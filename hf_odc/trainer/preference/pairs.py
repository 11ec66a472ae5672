"""The DPO trainer's data path: preference pairs planned whole and packed padding-free.

A pair's loss needs both of its sequences (prompt + chosen, prompt + rejected), so a pair is never split between
microbatches: the planner balances pairs, each one item weighing its two sequences' summed length, and a microbatch
holds whole pairs, each as two documents of one packed row (chosen then rejected, ``position_ids`` restarting at 0 for
each). As for SFT, every rank draws the same global minibatch, plans it the same way and packs its own row of the
plan, so the loss normalisers (the minibatch's pairs and chosen tokens) are counted locally, without a collective.

With sequence parallelism (the planner's ``group_size`` above 1) a pair longer than a microbatch is a group
microbatch: its row of two documents is cut over the group's ranks (:func:`shard_pairs`), each rank sums the
log-probabilities of its own tokens, and :func:`item_sums` adds the group's partial sums
(:func:`~hf_odc.kernels.group_sum`), so that every rank of the group holds the pair's whole sums.

The sequences are those of TRL's ``DataCollatorForPreference``: ``prompt_ids + chosen_ids`` and ``prompt_ids +
rejected_ids``, each truncated to ``max_length`` as ``truncation_mode`` says, the completion's tokens scored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import SequenceShard, group_sum
from ...packing import MinibatchPlanner
from ..core._step import PlannedStep, group_plan_fields, packed_row
from ..core.data import shard_row, shard_window

__all__ = [
    "PAIR_COLUMNS",
    "REFERENCE_COLUMNS",
    "PairPacker",
    "PairStep",
    "check_pair_capacity",
    "document_sums",
    "indistinct_pairs",
    "item_sums",
    "item_sums_into",
    "pack_pairs",
    "pair_documents",
    "shard_pairs",
]

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
"""The columns of a tokenized preference dataset (TRL's ``DPOTrainer`` writes them)."""

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
"""The reference model's log-probabilities of each pair's completions, when precomputed."""


def pair_documents(
    example: dict[str, Any], max_length: int | None, truncation_mode: str = "keep_start"
) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """The pair's two sequences as ``((chosen_ids, chosen_completion_mask), (rejected_ids, rejected_completion_mask))``,
    each truncated to ``max_length`` tokens, keeping the start (``"keep_start"``) or the end (``"keep_end"``), as TRL
    truncates them."""
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}.")
    prompt = list(example["prompt_ids"])
    documents = []
    for key in ("chosen_ids", "rejected_ids"):
        completion = list(example[key])
        ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        if max_length is not None and len(ids) > max_length:
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[cut], mask[cut]
        documents.append((ids, mask))
    return documents[0], documents[1]


def check_pair_capacity(
    lengths: Sequence[int],
    max_tokens_for: Callable[[int], int],
    sp_size: int = 1,
    item: str = "pair",
    together: str | None = "its chosen and rejected sequences together stay in one microbatch",
) -> None:
    """Refuse, at construction, a microbatch size that the dataset's longest pair (``lengths``: each pair's two
    sequences' summed length, as packed) does not fit: the planner would only find out at the minibatch that draws
    it. ``max_tokens_for(longest)`` is the microbatch's capacity (``max_tokens_for_pairs``); with sequence
    parallelism a pair may fill ``sp_size`` microbatches. The message names each length's ``item`` (KTO's: an
    example) and, where it is more than one sequence, what stays ``together``."""
    longest = max(lengths, default=0)
    max_tokens = max_tokens_for(longest)
    if longest <= sp_size * max_tokens:
        return
    if sp_size > 1:
        raise ValueError(
            f"The training dataset's longest {item} has {longest} tokens, more than sp_size={sp_size} ranks hold "
            f"({sp_size} x {max_tokens} tokens per microbatch). Raise sp_size or --max_tokens_per_microbatch, or drop "
            f"or shorten (--max_length) the longest {item}s."
        )
    raise ValueError(
        f"The training dataset's longest {item} has {longest} tokens{f' ({together})' if together else ''}, more "
        f"than one microbatch holds ({max_tokens} tokens). Set --max_tokens_per_microbatch to at least {longest}, or "
        f"--packing_ratio to at least 1, or drop or shorten (--max_length) the longest {item}s."
    )


def indistinct_pairs(dataset: Any, max_length: int | None, truncation_mode: str = "keep_start") -> int:
    """How many pairs of a tokenized preference dataset (:data:`PAIR_COLUMNS`) have the same tokens in their chosen and
    rejected sequences once truncated (:func:`pair_documents`): the prompt fills ``max_length``, or the two replies
    agree up to it. Such a pair's margin is 0 whatever the policy: its loss is log 2 and its gradient nothing."""
    count = 0
    for values in zip(*(dataset[column] for column in PAIR_COLUMNS), strict=True):
        example = dict(zip(PAIR_COLUMNS, values, strict=True))
        (chosen, _), (rejected, _) = pair_documents(example, max_length, truncation_mode)
        count += chosen == rejected
    return count


def document_sums(values: torch.Tensor, document: torch.Tensor, num_documents: int) -> torch.Tensor:
    """``values`` of a packed row (one per scored position) summed per document (``document`` holds each position's),
    differentiably: ``(num_documents,)``."""
    return values.new_zeros(num_documents).index_add(0, document, values)


def pack_pairs(
    documents: Sequence[Sequence[tuple[list[int], list[int]]]],
    references: Sequence[Sequence[float]] | None = None,
    ld_alpha: float | None = None,
) -> dict[str, Any]:
    """One padding-free microbatch of ``k`` items of ``w`` documents each (a pair as :func:`pair_documents` gives it,
    ``w = 2``; KTO packs single completions, ``w = 1``): document ``w * j + i`` is item ``j``'s ``i``-th sequence (a
    pair's chosen sequence, then its rejected one).

    Returns ``{"model": ..., "pairs": ...}``. ``model`` holds the forward's inputs: one row of the ``w * k`` documents,
    ``position_ids`` restarting at 0 for each, ``labels`` equal to the tokens on completions and -100 elsewhere and on
    each document's first token (which no position predicts), so a fused LM head scores exactly the completion tokens
    TRL scores; and ``cu_seq_lens_q/k`` / ``max_length_q/k`` for varlen kernels. ``pairs`` holds, per scored position
    (the row's ``log_probs`` score token ``t`` at ``t - 1``): ``document`` (its document) and ``weight`` (1, or
    ``ld_alpha`` past the item's shared completion length as TRL's LD-DPO weighs it; 0 where nothing is scored); per
    item, ``completion_tokens`` ``(k, w)`` (each completion's length, as TRL's IPO and ``sigmoid_norm`` normalise
    by it) and, if ``references`` is given, ``ref_logps`` ``(k, w)``.
    """
    width = len(documents[0]) if documents else 2
    ids, labels, owner, weights, lengths, sizes = [], [], [], [], [], []
    for item, sequences in enumerate(documents):
        shared = min(sum(mask[1:]) for _, mask in sequences)
        for side, (tokens, mask) in enumerate(sequences):
            ids += tokens
            labels += [-100] + [t if m else -100 for t, m in zip(tokens[1:], mask[1:], strict=True)]
            owner += [width * item + side] * len(tokens)
            counted = 0
            weights.append(0.0)
            for m in mask[1:]:
                counted += m
                weights.append(0.0 if not m else 1.0 if ld_alpha is None or counted <= shared else ld_alpha)
            lengths.append(sum(mask))
            sizes.append(len(tokens))
    packed = {
        "model": packed_row(torch.tensor(ids), torch.tensor(labels), sizes),
        "pairs": {
            "document": torch.tensor(owner[1:]),
            "weight": torch.tensor(weights[1:]),
            "completion_tokens": torch.tensor(lengths, dtype=torch.float32).view(-1, width),
        },
    }
    if references is not None:
        packed["pairs"]["ref_logps"] = torch.tensor(references, dtype=torch.float32).view(-1, width)
    return packed


def item_sums(
    log_probs: torch.Tensor, pairs: dict[str, torch.Tensor], shard: SequenceShard | None = None
) -> torch.Tensor:
    """Each packed item's summed (weighted) completion log-probabilities per document, from a :func:`pack_pairs` row's
    per-position ``log_probs``: ``(k, w)``. For a row split over a group (``shard``, :func:`shard_pairs`), the whole
    row's sums, on every rank of the group (collective: the group's ranks call it together)."""
    count, width = pairs["completion_tokens"].shape
    sums = document_sums(log_probs * pairs["weight"], pairs["document"], count * width).view(count, width)
    return sums if shard is None else group_sum(sums, shard)


def item_sums_into(key: str) -> Callable[[dict[str, Any], dict[str, Any], Any], None]:
    """A forward-only pass's ``store`` (``_ODCTrainer._forward_only``): each item's summed completion log-probabilities
    (:func:`item_sums`) of a :func:`pack_pairs` row, under ``microbatch["pairs"][key]``."""

    def store(microbatch: dict[str, Any], inputs: dict[str, Any], outputs: Any) -> None:
        shard = inputs["model"].get("sequence_shard")
        microbatch["pairs"][key] = item_sums(outputs.log_probs[0].float(), inputs["pairs"], shard)

    return store


def shard_pairs(packed: dict[str, Any], group: Any, index: int, size: int) -> dict[str, Any]:
    """Group rank ``index``'s shard of a :func:`pack_pairs` microbatch split over a group of ``size`` ranks (``group``,
    its process group): the row's tokens (:func:`~hf_odc.trainer.core.data.shard_row`, whose ``log_probs`` score one
    position per token, the row's last scoring nothing) and its positions' ``document`` and ``weight``; the items'
    own values (``completion_tokens``, ``ref_logps``) whole."""
    model = packed["model"]
    _, window = shard_window(model["input_ids"].shape[1], index, size)
    pairs = dict(packed["pairs"])
    document, weight = pairs["document"], pairs["weight"]
    pairs["document"] = torch.cat([document, document[-1:]])[window]
    pairs["weight"] = torch.cat([weight, weight.new_zeros(1)])[window]
    return {"model": shard_row(model, group, index, size), "pairs": pairs}


@dataclass
class PairStep(PlannedStep):
    """One optimizer step's minibatch of preference pairs, as this rank sees it: a
    :class:`~hf_odc.trainer.PlannedStep` whose ``microbatches`` are :func:`pack_pairs`'s, whose samples are pairs
    (``num_samples`` counts pairs, ``microbatch_lengths`` holds each pair's summed length) and whose
    ``num_loss_tokens`` counts both completions' scored tokens.

    Attributes:
        pair_indices: this rank's microbatches, each a list of the pairs' indices in the minibatch, in the order of
            ``microbatches``.
        num_chosen_tokens: scored chosen tokens of the whole minibatch (the normaliser of TRL's ``sft`` loss term).
    """

    pair_indices: list[list[int]] | None = None
    num_chosen_tokens: int = 0


@dataclass
class PairPacker:
    """Turns one global minibatch of tokenized pairs into this rank's :class:`PairStep`.

    ``max_tokens_for(longest)`` gives a microbatch's token capacity from the minibatch's longest pair. Examples that
    carry :data:`REFERENCE_COLUMNS` pass them on as ``ref_logps``. A pair's sequences (:meth:`documents`), its weight
    for the planner (:meth:`weight`), a microbatch's packing (:meth:`pack`) and the step's own metrics
    (:meth:`metrics`) are hooks: vision pairs override them (:mod:`hf_odc.trainer.preference.vision_pairs`). With
    sequence parallelism (the planner's ``group_size`` above 1, ``sequence_group`` this rank's group) a pair longer
    than a microbatch is a group microbatch, first: this rank's shard of it (:func:`shard_pairs`).
    """

    rank: int
    planner: MinibatchPlanner
    max_tokens_for: Callable[[int], int]
    max_length: int | None
    truncation_mode: str = "keep_start"
    ld_alpha: float | None = None
    sequence_group: Any = None

    def documents(self, example: dict[str, Any]) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        return pair_documents(example, self.max_length, self.truncation_mode)

    def weight(self, pair: Sequence[tuple[list[int], list[int]]]) -> int:
        """What the planner balances of a pair (:meth:`documents`'): its two sequences' tokens."""
        return sum(len(ids) for ids, _ in pair)

    def pack(self, pairs: Sequence[Any], references: Sequence[Sequence[float]] | None) -> dict[str, Any]:
        """One microbatch of ``pairs`` (:meth:`documents`'): :func:`pack_pairs`'s."""
        return pack_pairs(pairs, references, self.ld_alpha)

    def metrics(self, pairs: Sequence[Any]) -> dict[str, float]:
        """What the step logs of its ``pairs`` (:meth:`documents`'), by name: nothing."""
        return {}

    def __call__(self, examples: Sequence[dict[str, Any]]) -> PairStep:
        documents = [self.documents(example) for example in examples]
        lengths = [self.weight(pair) for pair in documents]
        # vision pairs: known only now; text pairs: checked before
        check_pair_capacity(lengths, self.max_tokens_for, self.planner.group_size)
        max_tokens = self.max_tokens_for(max(lengths))
        plan = self.planner.plan_groups(lengths, max_tokens)
        references = None
        if all(column in examples[0] for column in REFERENCE_COLUMNS):
            references = [tuple(float(example[column]) for column in REFERENCE_COLUMNS) for example in examples]

        def pack(indices: list[int]) -> dict[str, Any]:
            return self.pack(
                [documents[i] for i in indices], None if references is None else [references[i] for i in indices]
            )

        size, shared = plan.group_size, plan.shared(self.rank)
        fields = group_plan_fields(plan, lengths)
        metrics = {**fields.pop("metrics"), **self.metrics(documents)}
        own = [list(microbatch) for microbatch in plan.plan[self.rank]]
        scored = [[sum(mask[1:]) for _, mask in pair] for pair in documents]
        attended = [len(ids) for pair in documents for ids, _ in pair]
        return PairStep(
            microbatches=[shard_pairs(pack([i]), self.sequence_group, self.rank % size, size) for i in shared]
            + [pack(microbatch) for microbatch in own],
            num_samples=len(examples),
            num_tokens=sum(attended),
            num_loss_tokens=sum(map(sum, scored)),
            predicted_bubble_rate=self.planner.predicted_bubble(plan, lengths, max_tokens),
            **fields,
            metrics=metrics,
            attended=attended,
            pair_indices=[[i] for i in shared] + own,
            num_chosen_tokens=sum(chosen for chosen, _ in scored),
        )
