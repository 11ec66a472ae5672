"""What one optimizer step of any ODC trainer is made of: the :class:`PlannedStep` a trainer's plan hook returns, and
the :class:`StepMetrics` its loss hook accumulates into.

Both exist once, for every trainer, so that the shared loop (:meth:`hf_odc.trainer.core._base_trainer._ODCTrainer.
training_step`) can run, time, gather and log any trainer's step without knowing what its samples are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...packing import GroupPlan, shard_sizes

__all__ = ["PlannedStep", "StepMetrics", "group_plan_fields", "packed_row"]


@dataclass
class PlannedStep:
    """One optimizer step's global minibatch, as this rank sees it.

    Every rank computes the same plan, so every field but ``microbatches`` is the same on every rank.

    Attributes:
        microbatches: this rank's packed microbatches (possibly none), each what the trainer's
            ``_microbatch_loss`` takes.
        microbatch_lengths: every rank's microbatches as lists of sample lengths (what the measured microbatch times
            calibrate the cost model against, and what the per-rank metrics count).
        num_samples: samples (SFT examples, GRPO rollouts, preference pairs...) in the whole minibatch.
        num_tokens: tokens of the whole minibatch.
        num_loss_tokens: tokens that carry a loss in the whole minibatch (the mean token loss's normaliser).
        predicted_bubble_rate: the plan's predicted idle fraction, under the run's synchronisation.
        metrics: values the plan itself logs this step, by name (e.g. GRPO's bubble under TRL's split).
        shared_lengths: with sequence parallelism, every rank's group microbatches (a document split over its group
            of ``sp_size`` ranks, which run it together: :mod:`hf_odc.packing.sequence_parallel`) as the lengths of
            those whole documents; they are the first of a rank's ``microbatches``, and ``microbatch_lengths`` holds
            its own ones only. Empty lists (or none at all) without.
        sp_size: the ranks per sequence-parallel group (1: none).
        attended: the lengths of the sequences the minibatch's forwards attend, where they are not its documents
            (a preference pair is planned as one item but attended as its two sequences); ``None``: its documents.
    """

    microbatches: list[Any]
    microbatch_lengths: list[list[list[int]]]
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    predicted_bubble_rate: float
    metrics: dict[str, float] = field(default_factory=dict)
    shared_lengths: list[list[int]] = field(default_factory=list)
    sp_size: int = 1
    attended: list[int] | None = None

    def _shared(self, rank: int) -> list[int]:
        return self.shared_lengths[rank] if self.shared_lengths else []

    def rank_tokens(self, rank: int) -> int:
        """Tokens of ``rank``'s share: its own microbatches' and its shards of its group microbatches'."""
        shards = sum(shard_sizes(length, self.sp_size)[rank % self.sp_size] for length in self._shared(rank))
        return sum(map(sum, self.microbatch_lengths[rank])) + shards

    def rank_documents(self, rank: int) -> int:
        """Documents (planned items) in ``rank``'s share, those of its group microbatches included: a host's work per
        step grows with them (an attention call or more each), not only with the tokens."""
        return sum(map(len, self.microbatch_lengths[rank])) + len(self._shared(rank))

    def microbatch_counts(self) -> list[int]:
        """The microbatches each rank runs, its group microbatches included."""
        return [len(self._shared(rank)) + len(own) for rank, own in enumerate(self.microbatch_lengths)]

    def own_times(self, rank: int, times: Sequence[float]) -> list[float]:
        """Of ``rank``'s measured microbatch ``times`` (in the order it ran them), those of its own microbatches
        (``microbatch_lengths[rank]``'s), without its group microbatches'."""
        first = len(self._shared(rank))
        return list(times[first : first + len(self.microbatch_lengths[rank])])

    def documents(self) -> list[int]:
        """The lengths of every document of the minibatch, once each (a group's split documents once)."""
        own = [length for rank in self.microbatch_lengths for microbatch in rank for length in microbatch]
        shared = [length for rank in range(0, len(self.shared_lengths), self.sp_size) for length in self._shared(rank)]
        return own + shared

    def attended_lengths(self) -> list[int]:
        """The lengths of every sequence the minibatch attends (:attr:`attended`, else :meth:`documents`)."""
        return self.documents() if self.attended is None else self.attended


def group_plan_fields(plan: GroupPlan, lengths: Sequence[int]) -> dict[str, Any]:
    """The :class:`PlannedStep` fields that ``plan`` (items of ``lengths``, whatever a trainer plans: samples, pairs)
    sets: every rank's own microbatches as lengths, its group microbatches' (``shared_lengths``), ``sp_size`` and,
    with sequence parallelism, the ``group_microbatches`` metric (the step's items split over a group)."""
    size = plan.group_size
    return {
        "microbatch_lengths": [[[lengths[i] for i in microbatch] for microbatch in rank] for rank in plan.plan],
        "shared_lengths": [[lengths[i] for i in plan.shared(rank)] for rank in range(len(plan.plan))],
        "sp_size": size,
        "metrics": {"group_microbatches": float(sum(map(len, plan.groups)))} if size > 1 else {},
    }


class StepMetrics:
    """Per-rank values one step accumulates on the device, reduced over the ranks once, after the minibatch.

    Every rank declares the same names in the same order (a rank may run no microbatch, and its zeros still take
    their places in the one gather). Four kinds, each reduced over ranks as its name says:

    * ``sums``: added (e.g. GRPO's ``policy_loss``);
    * ``means``: a total and a count each (:meth:`add_mean`), logged as the sum of totals over the sum of counts, so
      a mean over every token of the minibatch whatever its split (0 where nothing was counted);
    * ``minima`` / ``maxima``: running extremes, NaN skipped; logged NaN when no rank saw a finite value.

    Nothing is copied to the host before the step's gather, so no microbatch waits for the device.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        sums: Sequence[str] = (),
        means: Sequence[str] = (),
        minima: Sequence[str] = (),
        maxima: Sequence[str] = (),
    ):
        names = [*sums, *means, *minima, *maxima]
        if len(set(names)) != len(names):
            raise ValueError(f"StepMetrics names must be unique, got {names}.")
        self.sums, self.means, self.minima, self.maxima = tuple(sums), tuple(means), tuple(minima), tuple(maxima)
        self._slots: dict[str, int] = {}
        initial: list[float] = []
        for name in self.sums:
            self._slots[name] = len(initial)
            initial.append(0.0)
        for name in self.means:
            self._slots[name] = len(initial)
            initial += [0.0, 0.0]
        for name in self.minima:
            self._slots[name] = len(initial)
            initial.append(math.inf)
        for name in self.maxima:
            self._slots[name] = len(initial)
            initial.append(-math.inf)
        self._initial = torch.tensor(initial, dtype=torch.float64)
        self._values = self._initial.to(device, copy=True)  # a copy also on the CPU: reset() restores from it

    def __len__(self) -> int:
        """How many float64 values a rank contributes to the gather."""
        return len(self._initial)

    def reset(self) -> None:
        """Back to the empty step (before each minibatch)."""
        self._values.copy_(self._initial)

    def _slot(self, name: str, kind: Sequence[str]) -> int:
        if name not in kind:
            raise KeyError(f"{name!r} is not a declared metric of this kind (declared: {list(kind)}).")
        return self._slots[name]

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` to the sum ``name``."""
        self._values[self._slot(name, self.sums)] += _as_double(value)

    def add_mean(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Add ``total`` over ``count`` items to the mean ``name``."""
        slot = self._slot(name, self.means)
        self._values[slot] += _as_double(total)
        self._values[slot + 1] += _as_double(count)

    def add_extreme(self, name: str, values: torch.Tensor) -> None:
        """Fold ``values`` (any shape; NaN skipped) into the running minimum or maximum ``name``."""
        is_min = name in self.minima
        slot = self._slot(name, self.minima if is_min else self.maxima)
        fill = math.inf if is_min else -math.inf
        values = torch.where(torch.isnan(values), fill, values.detach()).double()
        if values.numel() == 0:
            return
        pick = torch.minimum if is_min else torch.maximum
        self._values[slot] = pick(self._values[slot], values.min() if is_min else values.max())

    def local(self) -> torch.Tensor:
        """This rank's values, in the declared layout (what the step's gather sends)."""
        return self._values

    def reduce(self, per_rank: Sequence[Sequence[float]]) -> dict[str, float]:
        """Every declared metric over the ranks, from each rank's :meth:`local` values (gathered, in rank order)."""
        out: dict[str, float] = {}
        for name in self.sums:
            out[name] = sum(row[self._slots[name]] for row in per_rank)
        for name in self.means:
            slot = self._slots[name]
            total, count = sum(row[slot] for row in per_rank), sum(row[slot + 1] for row in per_rank)
            out[name] = total / count if count else 0.0
        for names, pick in ((self.minima, min), (self.maxima, max)):
            for name in names:
                finite = [row[self._slots[name]] for row in per_rank if math.isfinite(row[self._slots[name]])]
                out[name] = pick(finite) if finite else math.nan
        return out


def _as_double(value: torch.Tensor | float) -> torch.Tensor | float:
    return value.detach().double() if isinstance(value, torch.Tensor) else float(value)


def packed_row(input_ids: torch.Tensor, labels: torch.Tensor, lengths: Sequence[int]) -> dict[str, torch.Tensor | int]:
    """A packed microbatch's model inputs: one row of documents of ``lengths`` tokens (``input_ids`` and ``labels``
    1-D, concatenated), ``position_ids`` restarting at 0 for each document, and ``cu_seq_lens_q/k`` /
    ``max_length_q/k`` for varlen kernels (``odc_packed`` attention reads the documents' bounds from them)."""
    cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    max_length = max(lengths)
    return {
        "input_ids": input_ids[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "labels": labels[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
