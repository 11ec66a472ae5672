"""The ODC trainer's data path: the same global minibatch on every rank, planned and packed locally.

No rank ever needs another rank's data or a collective to build its share: every rank draws the same global minibatch
(a permutation seeded by the seed and the epoch), runs the same deterministic planner on the same lengths, and keeps
its own row of the plan. The same holds for the loss normaliser: every rank sees every sample's labels, so it counts
the minibatch's target tokens itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..._compat import padding_free_collator
from ...kernels import SequenceShard
from ...packing import MinibatchPlanner, Plan, shard_sizes
from ._step import PlannedStep, group_plan_fields

__all__ = [
    "GlobalMinibatchSampler",
    "MinibatchDataLoader",
    "PlannedMinibatchCollator",
    "check_sft_truncation",
    "check_truncation",
    "count_target_tokens",
    "global_minibatch",
    "minibatch_loader",
    "require_sft_columns",
    "shard_row",
    "shard_window",
]


def require_sft_columns(dataset: Any, text_field: str = "text") -> None:
    """Raise ``ValueError`` unless ``dataset`` has rows in a format SFT trains on: a ``messages`` column
    (conversations), a ``text_field`` column, ``prompt`` and ``completion``, or ``input_ids`` (tokenized). Said before
    anything reads a row: TRL would fail on the first one it reads (a ``KeyError``, an ``IndexError`` on an empty
    dataset), on one rank while the others wait in a collective."""
    formats = (("messages",), (text_field,), ("prompt", "completion"), ("input_ids",))
    expected = " or ".join(" and ".join(repr(c) for c in columns) for columns in formats)
    if len(dataset) == 0:
        raise ValueError(f"The training dataset is empty (its columns: {dataset.column_names}).")
    if not any(all(c in dataset.column_names for c in columns) for columns in formats):
        raise ValueError(
            f"The training dataset has no column SFT trains on: it needs {expected}; its columns are "
            f"{dataset.column_names}. Rename the one that holds your data (dataset.rename_column(old, new); a list of "
            "role/content messages goes in 'messages')."
        )


def check_truncation(damaged: int, total: int, message: str, warn: bool, nothing_left: bool, allowed: bool) -> None:
    """Refuse (``ValueError``) a training dataset that truncation left with ``nothing_left`` to learn from, or that it
    damaged most of (``damaged`` of its ``total`` samples) unless ``allowed`` (``allow_truncated_data``), which warns
    instead (when ``warn``: on one process); ``message`` says what happened to those samples and what to change. A run
    on such data would train on nothing, or on fragments, and still exit 0."""
    if nothing_left:
        raise ValueError(f"{message} Nothing is left to train on, so the run is refused.")
    if damaged <= total / 2:
        return
    if not allowed:
        raise ValueError(f"{message} Or pass --allow_truncated_data true to train on what is left anyway.")
    if warn:
        warnings.warn(message, stacklevel=3)


def check_sft_truncation(given: Any, prepared: Any, max_length: int | None, warn: bool, allowed: bool) -> None:
    """:func:`check_truncation` for SFT: TRL truncates the ``given`` dataset to ``max_length`` tokens and keeps, as
    ``prepared``, the samples left with a token that carries a loss. Refused when none is left, or when most were cut
    (a pre-tokenized sample longer than ``max_length``; one TRL tokenized, when it now has ``max_length`` tokens) or
    dropped, unless ``allowed``."""
    if max_length is None:
        return
    dropped = len(given) - len(prepared)
    if "input_ids" in given.column_names:  # the lengths before truncation are known: every dropped one was cut
        damaged = sum(1 for ids in given["input_ids"] if len(ids) > max_length)
    else:
        damaged = dropped + sum(1 for ids in prepared["input_ids"] if len(ids) >= max_length)
    what = []
    if dropped:
        what.append(f"{dropped} lose every token carrying a loss (their completion) and TRL drops them")
    if damaged > dropped:
        what.append(f"{damaged - dropped} train on their first {max_length} tokens only")
    check_truncation(
        damaged,
        len(given),
        f"max_length={max_length} cuts {damaged} of the {len(given)} training samples: {'; '.join(what)}. Raise "
        "--max_length to fit most samples whole.",
        warn,
        nothing_left=len(prepared) == 0,
        allowed=allowed,
    )


class GlobalMinibatchSampler(Sampler[list[int]]):
    """Yields global minibatches of dataset indices, identical on every rank.

    Each epoch is a permutation of ``range(num_samples)`` seeded by ``(seed, epoch)`` (or the identity without
    shuffling), cut into minibatches of ``minibatch_size``; an incomplete last minibatch is dropped, so every optimizer
    step sees exactly ``minibatch_size`` samples.
    """

    def __init__(self, num_samples: int, minibatch_size: int, seed: int, shuffle: bool = True):
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}.")
        if num_samples < minibatch_size:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global minibatch ({minibatch_size} = "
                "per_device_train_batch_size x the number of processes): lower --per_device_train_batch_size, run "
                "fewer processes, or add samples."
            )
        self.num_samples, self.minibatch_size, self.seed, self.shuffle = num_samples, minibatch_size, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.minibatch_size

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.num_samples)
        for start in range(0, len(self) * self.minibatch_size, self.minibatch_size):
            yield order[start : start + self.minibatch_size].tolist()


class MinibatchDataLoader(DataLoader):
    """A ``DataLoader`` over :class:`GlobalMinibatchSampler` that forwards ``set_epoch`` (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def minibatch_loader(dataset: Dataset, args: Any, world_size: int) -> MinibatchDataLoader:
    """An ODC trainer's training loader: one item per accumulation call of ``training_step``, the
    ``per_device_train_batch_size x world_size`` samples of :class:`GlobalMinibatchSampler` (the same on every rank,
    not sharded by Accelerate: every rank plans the whole minibatch), as :func:`global_minibatch` gives them; ``args``
    the trainer's config (its sampling strategy, seed and loader settings).

    ``dataloader_pin_memory`` is not applied: an item holds the samples' token lists (or arrays), not tensors, and
    pinning walks every element of every list (about a second per 500K tokens, on the training process's critical
    path) to pin nothing.
    The collators build each microbatch's tensors later, and the trainer copies them without waiting
    (:meth:`~hf_odc.trainer.core._base_trainer._ODCTrainer._to_device`)."""
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        raise ValueError(f"hf_odc's trainers sample 'random' or 'sequential' minibatches, not {strategy!r}.")
    sampler = GlobalMinibatchSampler(
        len(dataset),
        args.per_device_train_batch_size * world_size,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        shuffle=strategy == "random",
    )
    workers = args.dataloader_num_workers
    return MinibatchDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=global_minibatch,
        num_workers=workers,
        persistent_workers=args.dataloader_persistent_workers and workers > 0,
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
    )


def count_target_tokens(example: dict[str, Any]) -> int:
    """Tokens of one sample that carry a loss: next-token labels other than -100 (the first label is never one).
    Labels may be a list, an array or a tensor."""
    labels = example.get("labels", example["input_ids"])
    return int(np.count_nonzero(np.asarray(labels[1:]) != -100))


def global_minibatch(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """The data loader's ``collate_fn``: the global minibatch's examples as they are, under ``"examples"``. Planning
    happens in the training process (:class:`PlannedMinibatchCollator`), with the cost model of that step: a
    calibrated model changes between steps, and loader workers would hold stale copies of it."""
    return {"examples": examples}


@dataclass
class PlannedMinibatchCollator:
    """Turns one global minibatch (a list of tokenized samples) into this rank's :class:`~hf_odc.trainer.PlannedStep`.

    Its ``microbatches`` (a list, possibly empty) are padding-free batches from TRL's
    ``DataCollatorForLanguageModeling``: one row, ``position_ids`` restarting at 0 for each sample, the label at each
    sample's first token set to -100, and ``cu_seq_lens_*`` for varlen kernels. ``num_loss_tokens`` counts the whole
    minibatch's target tokens (:func:`count_target_tokens`). With sequence parallelism (the planner's ``group_size``
    above 1, ``sequence_group`` this rank's group) a sample longer than ``max_tokens`` is a group microbatch, first:
    this rank's shard of it (:func:`shard_row`), and the step logs ``group_microbatches``, their number.
    """

    rank: int
    planner: MinibatchPlanner
    max_tokens: int
    pad_token_id: int
    sequence_group: Any = None

    def __post_init__(self) -> None:
        self._pack = padding_free_collator(self.pad_token_id)

    def plan(self, lengths: Sequence[int]) -> Plan:
        return self.planner.plan(lengths, self.max_tokens)

    def __call__(self, examples: list[dict[str, Any]]) -> PlannedStep:
        lengths = [len(example["input_ids"]) for example in examples]
        plan = self.planner.plan_groups(lengths, self.max_tokens)
        size, shared = plan.group_size, plan.shared(self.rank)
        shards = [shard_row(self._pack([examples[i]]), self.sequence_group, self.rank % size, size) for i in shared]
        return PlannedStep(
            microbatches=shards
            + [self._pack([examples[i] for i in microbatch]) for microbatch in plan.plan[self.rank]],
            num_samples=len(examples),
            num_tokens=sum(lengths),
            num_loss_tokens=sum(count_target_tokens(example) for example in examples),
            predicted_bubble_rate=self.planner.predicted_bubble(plan, lengths, self.max_tokens),
            **group_plan_fields(plan, lengths),
        )


def shard_row(row: dict[str, Any], group: Any, index: int, size: int) -> dict[str, Any]:
    """Group rank ``index``'s shard of a packed ``row`` (:func:`padding_free_collator`'s or
    :func:`~hf_odc.trainer.core._step.packed_row`'s: its documents' bounds in ``cu_seq_lens_q``, else one document)
    split over a group of ``size`` ranks (``group``, its process group): its contiguous tokens
    (:func:`~hf_odc.packing.shard_sizes`, :func:`shard_window`) with their positions in their documents, their
    next-token labels as ``shift_labels`` (the next token may be on the next rank, so the labels are shifted before
    the row is cut), and the :class:`~hf_odc.kernels.SequenceShard` the attention reads (as a forward keyword)."""
    labels = row["labels"][0]
    length = labels.shape[0]
    bounds = row.get("cu_seq_lens_q")
    documents = tuple(bounds.diff().tolist()) if bounds is not None else (length,)
    sizes, window = shard_window(length, index, size)
    shifted = torch.cat([labels[1:], labels.new_full((1,), -100)])
    return {
        "input_ids": row["input_ids"][:, window],
        "position_ids": row["position_ids"][:, window],
        "shift_labels": shifted[None, window],
        "sequence_shard": SequenceShard(group, sizes, documents),
    }


def shard_window(length: int, index: int, size: int) -> tuple[tuple[int, ...], slice]:
    """The shards of a row of ``length`` tokens split over a group of ``size`` ranks
    (:func:`~hf_odc.packing.shard_sizes`) and group rank ``index``'s tokens of it."""
    sizes = shard_sizes(length, size)
    start = sum(sizes[:index])
    return sizes, slice(start, start + sizes[index])
