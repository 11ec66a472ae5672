"""``ODCRewardTrainer``: TRL's ``RewardTrainer`` with preference pairs balanced across ranks and packed, on ODC.

What is specific to reward modelling, hook by hook (the step loop, sharding, ODC, the timings, bounded collectives and
checkpoints are every ODC trainer's: :class:`hf_odc.trainer.core._base_trainer._ODCTrainer`):

* ``get_train_dataloader``: one item per accumulation call, ``per_device_train_batch_size x world_size`` pairs, the
  same on every rank (:func:`hf_odc.trainer.core.data.minibatch_loader`).
* ``_plan_step``: the step's pairs planned whole and packed as DPO's are
  (:class:`~hf_odc.trainer.preference.pairs.PairPacker`, the whole sequences as completions of an empty prompt), with
  each document's scored position: its last token that is not the padding token, the position the model's own pooling
  reads in TRL's right-padded batch.
* ``_microbatch_loss``: the score head's output at every position of the packed row (the model's output while it runs:
  its own pooling keeps one position per row), each document's at its scored position; TRL's pairwise loss (with
  ``margin`` and ``center_rewards_coefficient``) summed over the pairs and divided by the minibatch's pairs; TRL's
  metrics accumulated as :class:`~hf_odc.trainer.StepMetrics` means and extremes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from accelerate.utils import is_peft_model
from torch import nn
from trl import RewardTrainer

from ..core._base_config import whole_model_kwargs
from ..core._dataset_trainer import _ODCDatasetTrainer
from ..core._reference import refuse_prompt_learning
from ..core._step import StepMetrics
from ..core.data import MinibatchDataLoader, check_truncation, minibatch_loader
from .pairs import PairPacker, PairStep, check_pair_capacity
from .reward_config import ODCRewardConfig

__all__ = ["ODCRewardTrainer"]

_SEQUENCE_COLUMNS = ("chosen_ids", "rejected_ids")


class ODCRewardTrainer(_ODCDatasetTrainer, RewardTrainer):
    """
    Trainer for (pairwise) reward modelling with On-Demand Communication (ODC) and minibatch-level load balancing of
    preference pairs.

    Same arguments as [`~trl.RewardTrainer`], with `args` an [`ODCRewardConfig`] and `model` a sequence-classification
    model with one label (or its name). Launch it with `accelerate launch` (see `examples/odc.yaml` and
    `examples/odc_cpu.yaml`); with a single process it trains on the same plan without sharding.

    Example:

    ```python
    >>> from hf_odc.trainer import ODCRewardConfig, ODCRewardTrainer

    >>> trainer = ODCRewardTrainer(model=model, args=ODCRewardConfig("out"), train_dataset=pairs, processing_class=tok)
    >>> trainer.train()
    ```
    """

    _tag_names: ClassVar[list[str]] = ["trl", "reward-trainer", "hf-odc"]
    _name = "ODC Reward"
    _config_class = ODCRewardConfig

    def __init__(self, model: Any, args: ODCRewardConfig | None = None, **kwargs: Any):
        args = self._odc_args(args)
        self._check_train_data(kwargs, packs="pairs", text=None)
        if isinstance(model, str):
            args.model_init_kwargs = whole_model_kwargs(args.model_init_kwargs)
        super().__init__(model=model, args=args, **kwargs)
        policy = self.accelerator.unwrap_model(self.model)
        if is_peft_model(policy):
            refuse_prompt_learning(policy, "ODCRewardTrainer")
        base = policy.get_base_model() if is_peft_model(policy) else policy
        self._score_head = getattr(base, "score", None)
        if not isinstance(self._score_head, nn.Module):
            raise TypeError(
                f"ODCRewardTrainer reads the reward from a sequence-classification model's `score` head, which "
                f"{type(base).__name__} does not have. Use an AutoModelForSequenceClassification decoder model (with "
                "num_labels=1), or trl.RewardTrainer."
            )
        self._pad_token_id = base.config.get_text_config().pad_token_id
        self._setup_odc(
            StepMetrics(
                args.device, means=("accuracy", "margin", "mean_reward"), minima=("min_reward",), maxima=("max_reward",)
            )
        )
        self._packer = PairPacker(
            rank=self.accelerator.process_index,
            planner=self._planner,
            max_tokens_for=args.max_tokens_for_pairs,
            max_length=None,  # TRL filters out the pairs longer than max_length: nothing is truncated
        )
        self._check_prepared_data(kwargs.get("train_dataset"), warn=self.accelerator.is_main_process)

    # -- data -------------------------------------------------------------------------------------------------------

    def _check_prepared_data(self, given: Any, warn: bool) -> None:
        """TRL tokenized the ``given`` pairs and dropped those with a sequence longer than ``max_length`` (nothing is
        truncated): refuse a run left with no pair, or with fewer than half of them unless ``allow_truncated_data``
        (then warn, when ``warn``), then a microbatch the longest pair that is left does not fit."""
        args, kept = self.args, len(self.train_dataset)
        dropped = len(given) - kept
        check_truncation(
            dropped,
            len(given),
            f"max_length={args.max_length} drops {dropped} of the {len(given)} preference pairs: TRL's reward trainer "
            "drops a pair whose chosen or rejected sequence is longer. Raise --max_length to keep most pairs.",
            warn,
            nothing_left=kept == 0,
            allowed=args.allow_truncated_data,
        )
        check_pair_capacity([sum(pair) for pair in self._sequence_lengths], args.max_tokens_for_pairs)

    @functools.cached_property
    def _sequence_lengths(self) -> list[tuple[int, int]]:
        """Each pair's chosen and rejected sequences' tokens (whole: TRL dropped the longer pairs), read once: the
        capacity check and the attention plans' warm-up both need them."""
        columns = (self.train_dataset[c] for c in _SEQUENCE_COLUMNS)
        return [(len(chosen), len(rejected)) for chosen, rejected in zip(*columns, strict=True)]

    def _training_documents(self) -> list[int]:
        """Each pair's chosen and rejected sequences."""
        return [length for pair in self._sequence_lengths for length in pair]

    def get_train_dataloader(self) -> MinibatchDataLoader:
        """One item per accumulation call: ``per_device_train_batch_size x world_size`` pairs of the global minibatch,
        the same on every rank (not sharded by Accelerate: every rank plans the whole minibatch)."""
        columns = [c for c in (*_SEQUENCE_COLUMNS, "margin") if c in self.train_dataset.column_names]
        return minibatch_loader(self.train_dataset.select_columns(columns), self.args, self.accelerator.num_processes)

    # -- the two hooks of the step loop ---------------------------------------------------------------------------

    def _plan_step(self, window: list[dict[str, Any]]) -> PairStep:
        """The step's global minibatch (every accumulation call's pairs, the same on every rank), planned and packed
        as DPO's pairs: this rank's microbatches, each with its documents' scored positions and its pairs' margins."""
        examples = [{"prompt_ids": (), **example} for item in window for example in item["examples"]]
        step = self._packer(examples)
        for index, (microbatch, pairs) in enumerate(zip(step.microbatches, step.pair_indices, strict=True)):
            inputs = {key: value for key, value in microbatch["model"].items() if key != "labels"}
            packed = {"model": inputs, "last": _last_positions(inputs, self._pad_token_id)}
            if "margin" in examples[0]:
                packed["margin"] = torch.tensor([float(examples[i]["margin"]) for i in pairs])
            step.microbatches[index] = packed
        return step

    def _microbatch_loss(self, model: nn.Module, microbatch: dict[str, Any], step: PairStep) -> torch.Tensor:
        """TRL's pairwise loss of the microbatch's pairs, normalised for the whole minibatch; TRL's
        metrics accumulated."""
        with _scoring_every_position(model, self._score_head):
            scores = model(**microbatch["model"], use_cache=False).logits
        rewards = scores[0, microbatch["last"], 0].float().view(-1, 2)
        chosen, rejected = rewards.unbind(1)
        difference = chosen - rejected
        loss = -nn.functional.logsigmoid(difference - microbatch.get("margin", 0.0)).sum()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * ((chosen + rejected) ** 2).sum()

        with torch.no_grad():
            metrics, count = self._step_metrics, rewards.shape[0]
            metrics.add_mean("accuracy", (difference > 0).sum(), count)
            metrics.add_mean("margin", difference.sum(), count)
            metrics.add_mean("mean_reward", rewards.sum(), rewards.numel())
            metrics.add_extreme("min_reward", rewards)
            metrics.add_extreme("max_reward", rewards)
        return loss / step.num_samples


def _last_positions(inputs: dict[str, Any], pad_token_id: int | None) -> torch.Tensor:
    """Each document's scored position in a packed row: its last token that is not ``pad_token_id`` (its first
    token if it has none; its last without a padding token), as the model's pooling picks it in a padded row."""
    ids, bounds = inputs["input_ids"][0], inputs["cu_seq_lens_q"].tolist()
    positions = []
    for start, end in itertools.pairwise(bounds):
        kept = (ids[start:end] != pad_token_id).nonzero() if pad_token_id is not None else None
        positions.append(end - 1 if kept is None else start + (int(kept[-1]) if len(kept) else 0))
    return torch.tensor(positions)


@contextlib.contextmanager
def _scoring_every_position(model: nn.Module, head: nn.Module) -> Iterator[None]:
    """While open, ``model``'s output ``logits`` are ``head``'s output at every position of the row, ``(1, T, 1)``,
    instead of the one position the model pools. The model's output carries them (FSDP2 and ODC run the root's
    backward from its outputs), so they are set before any other hook of the model reads its output."""
    scores: list[torch.Tensor] = []

    def keep(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        scores.append(output)

    def replace(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        output.logits = scores.pop()
        return output

    handles = [head.register_forward_hook(keep), model.register_forward_hook(replace, prepend=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
