"""The GRPO trainer's data path: scored rollouts, gathered once per generation batch, re-planned across ranks and
packed padding-free.

TRL's ``GRPOTrainer`` trains each rank on the rollouts it generated, cut into equal slices, so a rank that drew the
long completions sets the pace of every step. Here, once a generation batch is generated and scored (its advantages
final), every rank gathers every rollout (:func:`gather_rollouts`, one gather per generation batch), cuts the batch
into ``steps_per_generation`` minibatches with the same seeded permutation, and plans each minibatch with the
trainer's planner on the rollouts' weights (their tokens, plus a vision policy's image patches;
:func:`plan_generation_batch`): every rank computes the same plan and keeps its own row, so rollouts move between
ranks without any further communication. Each microbatch is one padding-free
row (:func:`pack_rollouts`): each rollout's prompt and completion, ``position_ids`` restarting at 0. With sequence
parallelism (the planner's ``group_size`` above 1) a rollout longer than a microbatch is a group microbatch: its row
cut over the group's ranks, each scoring the completion tokens of its own slice (:func:`shard_rollouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather_object

from ...packing import CapacityError, MinibatchPlanner
from ..core._step import PlannedStep, group_plan_fields, packed_row
from ..core.data import shard_row, shard_window
from ..core.vision import ImageInputs, with_images

__all__ = ["RolloutStep", "Rollouts", "gather_rollouts", "pack_rollouts", "plan_generation_batch", "shard_rollouts"]


@dataclass
class Rollouts:
    """Scored rollouts, one entry per sample, each unpadded (CPU tensors).

    Attributes:
        prompt_ids: each rollout's prompt token ids.
        completion_ids: each rollout's completion token ids (up to and including its end-of-sequence token).
        loss_mask: per completion token, 1.0 where it is trained: the completion mask times the tool mask (0 on tool
            output), all zeros for a truncated completion with ``mask_truncated_completions``.
        advantages: one per rollout, final (normalised over its group); zeros for a trainer without them
            (distillation).
        sampling_logps: per completion token, the generator's log-probabilities when it returned them
            (a ``rollout_func``), else ``None``.
        images: a vision-language policy's rollouts' images and 3-D rope positions, one per rollout
            (:mod:`hf_odc.trainer.online._vision_rollouts`); ``None`` for a text-only policy.
    """

    prompt_ids: list[torch.Tensor]
    completion_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    advantages: torch.Tensor
    sampling_logps: list[torch.Tensor] | None = None
    images: list[ImageInputs] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each rollout (prompt + completion): what a microbatch holds and the planner balances."""
        return [len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids, strict=True)]

    @property
    def weights(self) -> list[int]:
        """What the planner balances: each rollout's tokens, plus its patches through the vision tower (as
        :class:`~hf_odc.trainer.core.vision.VisionSample` weighs an SFT sample)."""
        if self.images is None:
            return self.lengths
        return [length + image.patches for length, image in zip(self.lengths, self.images, strict=True)]

    def count_loss_tokens(self, indices: Sequence[int] | None = None) -> int:
        """Trained completion tokens of the rollouts ``indices`` (all of them by default: TRL's
        ``num_items_in_batch`` of a generation batch)."""
        masks = self.loss_mask if indices is None else [self.loss_mask[i] for i in indices]
        return int(sum(float(mask.sum()) for mask in masks))

    @classmethod
    def from_scored(cls, scored: dict[str, Any], completion_lengths: Sequence[int]) -> Rollouts:
        """This rank's rollouts from the padded output of ``GRPOTrainer._generate_and_score_completions``.

        ``completion_lengths`` are the completions' true lengths (their padded width can be larger, and a truncated
        completion's mask can be all zeros)."""
        prompt_mask = scored["prompt_mask"].bool().cpu()
        prompt_ids = [ids[mask] for ids, mask in zip(scored["prompt_ids"].cpu(), prompt_mask, strict=True)]
        mask = scored["completion_mask"]
        if scored.get("tool_mask") is not None:
            mask = mask * scored["tool_mask"]
        mask = mask.float().cpu()
        completion_ids = scored["completion_ids"].cpu()
        lengths = list(completion_lengths)
        sampling = scored.get("sampling_per_token_logps")
        return cls(
            prompt_ids=prompt_ids,
            completion_ids=[ids[:n] for ids, n in zip(completion_ids, lengths, strict=True)],
            loss_mask=[m[:n] for m, n in zip(mask, lengths, strict=True)],
            advantages=scored["advantages"].float().cpu() if "advantages" in scored else torch.zeros(len(prompt_ids)),
            sampling_logps=None
            if sampling is None
            else [s[:n] for s, n in zip(sampling.float().cpu(), lengths, strict=True)],
        )

    @classmethod
    def concat(cls, parts: Sequence[Rollouts]) -> Rollouts:
        """The rollouts of ``parts``, in order."""
        sampling, images = [p.sampling_logps for p in parts], [p.images for p in parts]
        return cls(
            prompt_ids=[x for p in parts for x in p.prompt_ids],
            completion_ids=[x for p in parts for x in p.completion_ids],
            loss_mask=[x for p in parts for x in p.loss_mask],
            advantages=torch.cat([p.advantages for p in parts]),
            sampling_logps=None if any(s is None for s in sampling) else [x for s in sampling for x in s],
            images=None if any(i is None for i in images) else [x for i in images for x in i],
        )


def gather_rollouts(local: Rollouts) -> Rollouts:
    """Every rank's rollouts, in rank order (rank 0's first: the order of TRL's global generation batch).

    One ``all_gather_object`` of CPU tensors, once per generation batch; with one process, ``local`` itself."""
    return Rollouts.concat(gather_object([local]))


@dataclass
class RolloutStep(PlannedStep):
    """One optimizer step's minibatch of rollouts, as this rank sees it: a :class:`~hf_odc.trainer.PlannedStep` whose
    ``microbatches`` are packed rollouts (:func:`pack_rollouts`) and whose ``num_samples`` counts rollouts, plus what
    GRPO's loss normalisers need.

    Attributes:
        rollout_indices: this rank's microbatches, each a list of rollout indices (into the generation batch), in the
            order of ``microbatches``.
        generation_loss_tokens: trained completion tokens of the whole generation batch.
        generation_steps: optimizer steps (minibatches) the generation batch is cut into.
    """

    rollout_indices: list[list[int]] = field(default_factory=list)
    generation_loss_tokens: int = 0
    generation_steps: int = 1


def plan_generation_batch(
    rollouts: Rollouts,
    *,
    steps: int,
    rank: int,
    seed: int,
    planner: MinibatchPlanner,
    max_tokens_for: Callable[[int], int],
    sequence_group: Any = None,
) -> list[RolloutStep]:
    """Cut the generation batch into ``steps`` minibatches, plan each one (the same on every rank) and pack this
    rank's share: with sequence parallelism (``planner.group_size`` above 1, ``sequence_group`` this rank's group),
    its shards of the rollouts longer than a microbatch first (:func:`shard_rollouts`).

    Besides the plan's bubble, each step logs (in ``metrics``) ``predicted_bubble_rate_unbalanced``, the same
    prediction if each rank kept the rollouts it generated (TRL's split), packed alike: what the rebalancing removed
    (not logged when a rollout is longer than a microbatch, which that split cannot hold); and
    ``tokens_generated/rank_R``, the tokens of the minibatch's rollouts rank R generated (what TRL's split would train
    it on), against which the logged ``tokens/rank_R`` shows what the plan gave it.

    The rollouts (in rank order, ``len(rollouts) / world_size`` generated by each rank) are permuted with a generator
    seeded by ``seed`` (TRL shuffles a generation batch before slicing it, too) and cut into ``steps`` equal
    minibatches. Each is planned by ``planner``, ``max_tokens_for(longest rollout of the minibatch)`` tokens per
    microbatch.
    """
    lengths, text_tokens, generation_loss_tokens = rollouts.weights, rollouts.lengths, rollouts.count_loss_tokens()
    total, world_size = len(lengths), planner.world_size
    if total % (steps * world_size):
        raise ValueError(f"{total} rollouts do not split into {steps} minibatches of {world_size} ranks.")
    per_rank, size = total // world_size, total // steps
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    planned = []
    for start in range(0, total, size):
        indices = order[start : start + size]
        local_lengths = [lengths[i] for i in indices]
        longest, group = max(local_lengths), planner.group_size
        max_tokens = max_tokens_for(longest)
        if longest > group * max_tokens:
            holds = f"{group} ranks' microbatches hold (sp_size x " if group > 1 else "a microbatch holds ("
            raise CapacityError(
                f"A rollout of {longest} tokens (its prompt and completion) is longer than {holds}"
                f"max_tokens_per_microbatch={max_tokens}). Set --max_tokens_per_microbatch to at least "
                f"{-(-longest // group)}, lower --max_completion_length, or unset --max_tokens_per_microbatch (a "
                "microbatch then holds per_device_train_batch_size longest rollouts)."
            )
        plan = planner.plan_groups(local_lengths, max_tokens)
        fields = group_plan_fields(plan, local_lengths)
        metrics = fields.pop("metrics")
        # TRL's split: every rank trains on the rollouts it generated, packed by the same planner.
        generated_by = [[j for j, i in enumerate(indices) if i // per_rank == r] for r in range(world_size)]
        if max(local_lengths) <= max_tokens:
            unbalanced = [
                [
                    [share[j] for j in microbatch]
                    for microbatch in planner.pack_alone([local_lengths[j] for j in share], max_tokens)
                ]
                if share
                else []
                for share in generated_by
            ]
            metrics["predicted_bubble_rate_unbalanced"] = planner.predicted_bubble(
                unbalanced, local_lengths, max_tokens
            )
        group_size, shared = plan.group_size, [indices[j] for j in plan.shared(rank)]
        microbatches = [sorted(indices[j] for j in microbatch) for microbatch in plan.plan[rank]]
        generated = [sum(local_lengths[j] for j in share) for share in generated_by]
        if rollouts.images is not None:  # as SFT logs it: the vision tower's work in the minibatch
            metrics["image_patches"] = float(sum(rollouts.images[i].patches for i in indices))
        planned.append(
            RolloutStep(
                microbatches=[
                    shard_rollouts(pack_rollouts(rollouts, [i]), sequence_group, rank % group_size, group_size)
                    for i in shared
                ]
                + [pack_rollouts(rollouts, microbatch) for microbatch in microbatches],
                num_samples=size,
                num_tokens=sum(text_tokens[i] for i in indices),
                attended=None if rollouts.images is None else [text_tokens[i] for i in indices],
                num_loss_tokens=rollouts.count_loss_tokens(indices),
                predicted_bubble_rate=planner.predicted_bubble(plan, local_lengths, max_tokens),
                metrics=metrics | {f"tokens_generated/rank_{r}": tokens for r, tokens in enumerate(generated)},
                **fields,
                rollout_indices=[[i] for i in shared] + microbatches,
                generation_loss_tokens=generation_loss_tokens,
                generation_steps=steps,
            )
        )
    return planned


def pack_rollouts(rollouts: Rollouts, indices: Sequence[int]) -> dict[str, Any]:
    """One padding-free microbatch of the rollouts ``indices``.

    Returns ``{"model": ..., "loss": ...}``. ``model`` holds the forward's inputs: one row of the rollouts' prompts
    and completions, ``position_ids`` restarting at 0 for each, ``labels`` equal to the tokens on completions and -100
    elsewhere (so a fused LM head scores only completions), and ``cu_seq_lens_q/k`` / ``max_length_q/k`` for varlen
    kernels. ``loss`` holds ``(k, C)`` tensors for the ``k`` rollouts, ``C`` the longest completion: ``token_index``
    (each completion token's position in the row's ``log_probs``, which score token ``t`` at ``t - 1``; padding
    points at position 0), ``mask`` (the loss mask, 0 on padding),
    ``sampling_logps`` (or ``None``), and ``(k,)`` ``advantages`` and ``sequence_tokens`` (each rollout's trained
    tokens, the per-rollout normaliser).
    """
    ids, labels, lengths, token_index = [], [], [], []
    for i in indices:
        prompt, completion = rollouts.prompt_ids[i], rollouts.completion_ids[i]
        first = sum(lengths) + len(prompt)
        ids.append(torch.cat([prompt, completion]))
        labels.append(torch.cat([torch.full_like(prompt, -100), completion]))
        token_index.append(torch.arange(first - 1, first - 1 + len(completion)))
        lengths.append(len(prompt) + len(completion))
    model_inputs = packed_row(torch.cat(ids), torch.cat(labels), lengths)
    if rollouts.images is not None:
        model_inputs = with_images(model_inputs, [rollouts.images[i] for i in indices])
    width = max(1, max(len(rollouts.completion_ids[i]) for i in indices))
    loss = {
        "token_index": _pad(token_index, width, 0).long(),
        "mask": _pad([rollouts.loss_mask[i] for i in indices], width, 0.0).float(),
        "advantages": rollouts.advantages[list(indices)].clone(),
        "sequence_tokens": torch.stack([rollouts.loss_mask[i].float().sum() for i in indices]),
        "sampling_logps": None
        if rollouts.sampling_logps is None
        else _pad([rollouts.sampling_logps[i] for i in indices], width, 0.0).float(),
    }
    return {"model": model_inputs, "loss": loss}


def shard_rollouts(packed: dict[str, Any], group: Any, index: int, size: int) -> dict[str, Any]:
    """Group rank ``index``'s shard of a :func:`pack_rollouts` microbatch split over a group of ``size`` ranks
    (``group``, its process group): the row's tokens (:func:`~hf_odc.trainer.core.data.shard_row`) and the loss
    inputs of the completion tokens its slice scores: ``token_index`` into its own ``log_probs``, ``mask`` zero at the
    tokens another rank of the group scores (so that each token counts once in the group's sums), the rest whole
    (``sequence_tokens`` the whole rollouts' counts: what a loss over a whole rollout divides by)."""
    model, loss = packed["model"], dict(packed["loss"])
    _, window = shard_window(model["input_ids"].shape[1], index, size)
    token_index = loss["token_index"]
    here = (token_index >= window.start) & (token_index < window.stop)
    loss["token_index"] = torch.where(here, token_index - window.start, 0)
    loss["mask"] = loss["mask"] * here
    return {"model": shard_row(model, group, index, size), "loss": loss}


def _pad(rows: list[torch.Tensor], width: int, value: float) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype if rows else torch.float32)
    for row, values in zip(out, rows, strict=True):
        row[: len(values)] = values
    return out
