"""DPO's vision data path: preference pairs with images, processed as TRL's ``DataCollatorForVisionPreference``
processes them, planned whole and packed with their images (:mod:`hf_odc.trainer.core.vision` for SFT's samples).

TRL processes a vision pair on the fly: the prompt with its images once per sequence (the chosen and the rejected
sequence each carry the images), the replies appended, the pair truncated to ``max_length``. Every rank processes
every pair of the step's global minibatch, one pair per call (TRL's tokens, completion masks and pixels without the
padding), so a pair's two documents each keep their images' pixel values, their image grids and their own 3-D rope
positions (the model's ``get_rope_index``); the planner weighs a pair by its two sequences' tokens plus their
patches through the vision tower, and a microbatch without an image carries no pixels (a rank without one runs no
vision tower).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.vision import ImageInputs, with_images
from .pairs import PairPacker, pack_pairs

__all__ = ["VisionDocument", "VisionPairPacker"]


class VisionDocument(tuple):
    """One sequence of a vision pair: ``(ids, completion_mask)`` as :func:`~hf_odc.trainer.preference.pairs.
    pair_documents` gives a text one, carrying its :class:`~hf_odc.trainer.core.vision.ImageInputs` as ``images``."""

    images: ImageInputs

    def __new__(cls, ids: list[int], mask: list[int], images: ImageInputs) -> VisionDocument:
        document = super().__new__(cls, (ids, mask))
        document.images = images
        return document


@dataclass
class VisionPairPacker(PairPacker):
    """:class:`~hf_odc.trainer.preference.pairs.PairPacker` for vision pairs: ``process`` is TRL's vision preference
    collator (``DPOTrainer``'s ``data_collator``), called on one pair at a time; ``rope_index`` the model's
    ``get_rope_index``."""

    process: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None
    rope_index: Callable[..., Any] | None = None

    def documents(self, example: dict[str, Any]) -> tuple[VisionDocument, VisionDocument]:
        out = self.process([dict(example)])
        grid, pixels, kept = out.get("image_grid_thw"), out.get("pixel_values"), out["attention_mask"].bool()
        if grid is not None:  # TRL truncates after placing the images: a cut one leaves fewer tokens than patches
            merged = self.process.processor.image_processor.merge_size**2
            image_tokens = (out["input_ids"] == self.process.processor.image_token_id).sum()
            if int(image_tokens) != int(grid.prod(-1).sum()) // merged:
                raise ValueError(
                    f"max_length={self.max_length} cuts a preference pair inside an image's tokens (TRL fails on it "
                    "too); raise --max_length or set it to None."
                )
        positions, _ = self.rope_index(
            out["input_ids"], out["mm_token_type_ids"], image_grid_thw=grid, attention_mask=out["attention_mask"]
        )
        per_side = 0 if grid is None else grid.shape[0] // 2  # the sequences' images: the pair's, each
        bounds = [0] if grid is None else [0, *torch.cumsum(grid.prod(-1), 0).tolist()]
        documents = []
        for side in (0, 1):
            images = ImageInputs(positions[:, side, kept[side]], None, None, 0)
            if grid is not None:
                images.image_grid_thw = grid[side * per_side : (side + 1) * per_side]
                images.pixel_values = pixels[bounds[side * per_side] : bounds[(side + 1) * per_side]]
            ids, mask = out["input_ids"][side][kept[side]], out["completion_mask"][side][kept[side]]
            documents.append(VisionDocument(ids.tolist(), mask.tolist(), images))
        return documents[0], documents[1]

    def weight(self, pair: Sequence[VisionDocument]) -> int:
        """A pair's two sequences' tokens plus their patches through the vision tower."""
        return super().weight(pair) + sum(document.images.patches for document in pair)

    def metrics(self, pairs: Sequence[Sequence[VisionDocument]]) -> dict[str, float]:
        """``image_patches``: the step's patches through the vision tower (each pair's images count twice: both of its
        sequences carry them)."""
        return {"image_patches": float(sum(document.images.patches for pair in pairs for document in pair))}

    def pack(self, pairs: Sequence[Sequence[VisionDocument]], references: Sequence[Sequence[float]] | None) -> dict:
        """:func:`~hf_odc.trainer.preference.pairs.pack_pairs`'s row, :func:`~hf_odc.trainer.core.vision.with_images`
        (chosen then rejected, pair by pair, as the row holds them)."""
        packed = pack_pairs(pairs, references, self.ld_alpha)
        packed["model"] = with_images(packed["model"], [document.images for pair in pairs for document in pair])
        return packed
