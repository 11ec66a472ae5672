"""The reference of the preference trainers (``ODCDPOTrainer``, ``ODCKTOTrainer``): how it runs
(:class:`_ReferencePasses`, the family's base), and whether TRL loads a copy of the policy for it
(:func:`trl_loads_a_model`). Which model it is, and the PEFT setups refused, are every trainer's:
:mod:`hf_odc.trainer.core._reference`.
"""

from __future__ import annotations

from typing import Any

import datasets
from accelerate.utils import DistributedType, gather_object, is_peft_model

from ..core._reference import reference_of
from .pairs import item_sums_into

__all__ = ["trl_loads_a_model"]


def trl_loads_a_model(model: Any, ref_model: Any, peft_config: Any, args: Any) -> bool:
    """Whether TRL's ``__init__`` will load a model by name: the policy given as a name, or a reference copy of it
    (no ``ref_model``, no PEFT, and the log-probabilities not precomputed, or precomputed under an FSDP config)."""
    if isinstance(model, str):
        return True
    if ref_model is not None or peft_config is not None or is_peft_model(model):
        return False
    return not args.precompute_ref_log_probs or args.distributed_state.distributed_type == DistributedType.FSDP


class _ReferencePasses:
    """The reference's forward-only passes of a preference trainer (a mixin placed before the TRL class): on this
    rank's packed microbatches each step, or once, over a whole dataset, before training (``precompute_ref_log_probs``:
    TRL's own pass, which runs in its ``__init__`` before hf_odc has sharded anything, is skipped until
    ``_reference_ready``).

    A trainer supplies :meth:`_reference_columns` and :meth:`_reference_microbatches`, sets ``_reference_ready`` once
    its models are sharded, and calls :meth:`_precompute_datasets` then.
    """

    _reference_ready = False

    def _reference_columns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The dataset columns an item is packed from, and the reference columns written, one per document."""
        raise NotImplementedError

    def _reference_microbatches(self, examples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """``examples`` planned and packed for the reference (:func:`~hf_odc.trainer.preference.pairs.pack_pairs` rows):
        this rank's microbatches and, for each, its items' indices in ``examples``."""
        raise NotImplementedError

    def _score_reference(self, microbatches: list[dict[str, Any]]) -> float:
        """The reference's summed completion log-probabilities of each item of this rank's packed ``microbatches``,
        stored as their ``ref_logps``, in one forward-only minibatch; returns its device-timed span (seconds)."""
        model, runtime, context = reference_of(self)
        return self._forward_only(model, runtime, microbatches, item_sums_into("ref_logps"), (context,))

    def _precompute_ref_logps(self, dataset: datasets.Dataset, name: str, batch_size: int) -> datasets.Dataset:
        """``dataset`` with the reference's log-probabilities of each item (the second of
        :meth:`_reference_columns`), computed in planned, packed forward-only minibatches of ``batch_size x
        world_size`` items on the sharded reference, then gathered once."""
        if not self._reference_ready:
            return dataset
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError("precompute_ref_log_probs needs a map-style `datasets.Dataset`.")
        inputs, outputs = self._reference_columns()
        dataset = dataset.remove_columns([c for c in outputs if c in dataset.column_names])
        items, size = dataset.select_columns(list(inputs)), batch_size * self.accelerator.num_processes
        self._warm_attention(self._training_documents() or (), forward_only=[reference_of(self)[0]])
        computed: dict[int, list[float]] = {}
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            examples = [dict(zip(chunk, values, strict=True)) for values in zip(*chunk.values(), strict=True)]
            microbatches, indices = self._reference_microbatches(examples)
            self._score_reference(microbatches)
            for own, microbatch in zip(indices, microbatches, strict=True):
                logps = microbatch["pairs"]["ref_logps"].cpu().tolist()
                computed.update({start + i: values for i, values in zip(own, logps, strict=True)})
        with self.odc.bounded(f"gathering the reference log-probabilities of the {name} dataset"):
            for part in gather_object([computed]):
                computed.update(part)
        for side, column in enumerate(outputs):
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
