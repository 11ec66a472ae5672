"""Vision-language samples on the ODC data path: each sample processed alone, weighed with its vision work, planned
and packed with its images.

TRL processes a vision dataset on the fly (its ``DataCollatorForVisionLanguageModeling``: the processor renders the
messages, expands each image placeholder into one token per merged patch, truncates to ``max_length`` and makes the
pixel values), so the lengths are not known before a step. Every rank processes every sample of the step's global
minibatch, one sample per processor call (the same tokens, labels and pixels as TRL's padded batch, without the
padding), plans the minibatch on the samples' weights and packs its own share:

* a sample's **weight**, what the planner balances and caps at ``max_tokens`` per microbatch, is its tokens plus its
  patches through the vision tower (``pixel_values`` rows: every patch runs every vision block before the merger
  folds them into tokens), so a rank given many images gets fewer tokens. It is a count, not a cost: the configured
  cost model prices it as tokens (the attention cost's quadratic term per sample included);
* a packed row keeps each sample's pixel values and image grids with its text, in the row's order (the model fills
  the image tokens in order); for Qwen2.5-VL its ``position_ids`` are ``(4, 1, T)``: the text positions restarting at
  0 for each sample (which keep the samples apart in the attention), then the model's 3-D rope positions
  (``get_rope_index``) computed for each sample alone and concatenated, so every sample sees the positions it has
  unpacked; a LLaVA-style model (whole images through its vision tower, the processor's image tokens one per patch,
  1-D positions) keeps the text positions;
* a microbatch with no image has no ``pixel_values``: the vision tower does not run on that rank (no dummy batch).
  ODC has no per-layer collective, so a rank that leaves the vision blocks untouched waits for nobody; their owners'
  accumulators hold the other ranks' pushes only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...packing import MinibatchPlanner
from ._step import PlannedStep, packed_row

__all__ = [
    "ROPE_VISION_MODEL_TYPES",
    "VISION_MODEL_TYPES",
    "ImageInputs",
    "VisionMinibatchCollator",
    "VisionSample",
    "check_vision_model",
    "is_vision_dataset",
    "pack_vision",
    "with_images",
]

ROPE_VISION_MODEL_TYPES = frozenset({"qwen2_5_vl"})
"""The vision-language models whose 3-D rope positions ODC computes per sample with the model's own
``get_rope_index`` (``config.model_type``): SFT, DPO, GRPO and RLOO train them, checked against stock TRL."""

VISION_MODEL_TYPES = ROPE_VISION_MODEL_TYPES | {"llava"}
"""Every vision-language model SFT trains: those of :data:`ROPE_VISION_MODEL_TYPES`, and LLaVA-style models (1-D
positions, the processor's image tokens one per patch), checked against stock TRL."""


def is_vision_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a vision dataset as TRL tells one (an ``image`` or ``images`` column): TRL processes its
    samples on the fly, so their lengths are known only once a step processes them."""
    return bool({"image", "images"} & set(dataset.column_names))


def check_vision_model(
    model: nn.Module, trainer: str, sp_size: int, model_types: frozenset[str] = ROPE_VISION_MODEL_TYPES
) -> Callable[..., Any] | None:
    """The model's ``get_rope_index`` (it reads only the config, so it stays valid once the model is sharded), or
    ``None`` for a model with 1-D positions, after refusing (``ValueError``) what the trainer's vision data path does
    not train: another model type than ``model_types``, and sequence parallelism."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in model_types:
        raise ValueError(
            f"{trainer} trains vision datasets with {sorted(model_types)} models, not {model_type!r}; train "
            "this model with stock TRL, or drop the image columns."
        )
    if sp_size > 1:
        raise ValueError(f"{trainer} does not split vision samples over ranks; set sp_size to 1 for a vision dataset.")
    if model_type not in ROPE_VISION_MODEL_TYPES:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's
    return base.model.get_rope_index


@dataclass
class ImageInputs:
    """A document's vision inputs: its 3-D rope ``positions`` ``(3, L)`` (``None`` for a model with 1-D positions),
    its ``pixel_values`` (Qwen's ``(patches, D)``, LLaVA's whole images ``(images, C, H, W)``) and ``image_grid_thw``
    ``(images, 3)`` (``None`` without an image, or for whole images), and ``image_tokens``, its image tokens (one per
    patch of a whole image)."""

    positions: torch.Tensor | None
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    image_tokens: int

    @property
    def patches(self) -> int:
        """Patches through the vision tower: Qwen's ``pixel_values`` rows, or a whole image's tokens."""
        if self.pixel_values is None:
            return 0
        return int(self.pixel_values.shape[0]) if self.pixel_values.dim() == 2 else self.image_tokens


@dataclass
class VisionSample(ImageInputs):
    """One processed SFT sample: its :class:`ImageInputs`, ``input_ids`` and ``labels`` (1-D)."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def weight(self) -> int:
        """What the planner balances: tokens plus patches."""
        return int(self.input_ids.numel()) + self.patches


def with_images(row: dict[str, Any], documents: Sequence[ImageInputs]) -> dict[str, Any]:
    """A packed ``row`` (:func:`~hf_odc.trainer.core._step.packed_row`'s, of ``documents`` in order) given their vision
    inputs: with 3-D rope positions, ``position_ids`` ``(4, 1, T)`` (the row's text positions, then the documents'
    3-D rope positions); the documents' pixel values and image grids concatenated in row order, where any document
    has an image."""
    if documents[0].positions is not None:
        rope = torch.cat([document.positions for document in documents], dim=1)[:, None]
        row["position_ids"] = torch.cat([row["position_ids"][None], rope])
    imaged = [document for document in documents if document.pixel_values is not None]
    if imaged:
        row["pixel_values"] = torch.cat([document.pixel_values for document in imaged])
        if imaged[0].image_grid_thw is not None:
            row["image_grid_thw"] = torch.cat([document.image_grid_thw for document in imaged])
    return row


def pack_vision(samples: Sequence[VisionSample]) -> dict[str, Any]:
    """One packed row of ``samples``: :func:`~hf_odc.trainer.core._step.packed_row`'s inputs (each sample's first
    label -100: nothing predicts it across the boundary) :func:`with_images`."""
    labels = [sample.labels.clone() for sample in samples]
    for label in labels:
        label[0] = -100
    row = packed_row(
        torch.cat([sample.input_ids for sample in samples]),
        torch.cat(labels),
        [sample.input_ids.numel() for sample in samples],
    )
    return with_images(row, samples)


@dataclass
class VisionMinibatchCollator:
    """Turns one global minibatch of vision samples (a dataset's rows) into this rank's
    :class:`~hf_odc.trainer.PlannedStep` (see the module docstring).

    ``process`` is TRL's vision collator (``SFTTrainer``'s ``data_collator``), called on one sample at a time;
    ``rope_index`` the model's ``get_rope_index`` (``None``: 1-D positions); ``max_length`` TRL's, named in the
    refusal of a truncation inside an image's tokens; ``image_token_id`` the model's image token (a whole image's
    patches are its tokens)."""

    rank: int
    planner: MinibatchPlanner
    max_tokens: int
    process: Callable[[list[dict[str, Any]]], dict[str, Any]]
    rope_index: Callable[..., Any] | None
    max_length: int | None
    image_token_id: int | None = None

    def sample(self, example: dict[str, Any]) -> VisionSample:
        """``example`` processed alone, as TRL's collator processes it in a batch."""
        try:
            out = self.process([dict(example)])
        except ValueError as e:
            if "token count" in str(e) and self.max_length is not None:
                raise ValueError(
                    f"max_length={self.max_length} cuts a sample inside an image's tokens (TRL refuses it too); raise "
                    "--max_length or set it to None."
                ) from e
            raise
        grid, ids = out.get("image_grid_thw"), out["input_ids"]
        positions = None
        if self.rope_index is not None:
            positions, _ = self.rope_index(
                ids, out["mm_token_type_ids"], image_grid_thw=grid, attention_mask=out["attention_mask"]
            )
            positions = positions[:, 0]
        image_tokens = 0 if self.image_token_id is None else int((ids == self.image_token_id).sum())
        return VisionSample(positions, out.get("pixel_values"), grid, image_tokens, ids[0], out["labels"][0])

    def __call__(self, examples: list[dict[str, Any]]) -> PlannedStep:
        samples = [self.sample(example) for example in examples]
        weights = [sample.weight for sample in samples]
        heaviest = max(range(len(weights)), key=weights.__getitem__)
        if weights[heaviest] > self.max_tokens:
            raise ValueError(
                f"A vision sample weighs {weights[heaviest]} (its {samples[heaviest].input_ids.numel()} tokens plus "
                f"{samples[heaviest].patches} image patches), more than one microbatch holds ({self.max_tokens}). "
                f"Set --max_tokens_per_microbatch to at least {weights[heaviest]}, or shrink its images."
            )
        plan = self.planner.plan(weights, self.max_tokens)
        lengths = [sample.input_ids.numel() for sample in samples]
        return PlannedStep(
            microbatches=[pack_vision([samples[i] for i in microbatch]) for microbatch in plan[self.rank]],
            microbatch_lengths=[[[weights[i] for i in microbatch] for microbatch in rank] for rank in plan],
            num_samples=len(samples),
            num_tokens=sum(lengths),
            attended=lengths,
            num_loss_tokens=sum(int((sample.labels[1:] != -100).sum()) for sample in samples),
            predicted_bubble_rate=self.planner.predicted_bubble(plan, weights, self.max_tokens),
            metrics={"image_patches": float(sum(sample.patches for sample in samples))},
        )
