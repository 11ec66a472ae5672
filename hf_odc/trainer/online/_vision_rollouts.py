"""A vision-language policy's rollouts: each rollout's images and 3-D rope positions, cut from TRL's scored batch, so
that a packed microbatch carries them with its text (:func:`hf_odc.trainer.core.vision.with_images`).

TRL's ``GRPOTrainer`` (``RLOOTrainer`` alike) scores a generation batch in one padded forward: the processor's pixel
values of every image of the batch concatenated, their ``image_grid_thw``, each rollout's image count
(``num_images``) and ``mm_token_type_ids`` over the prompt and completion; the model computes the 3-D positions of
each padded row from them. A rank whose prompts have no image scores with none of these. Here each rollout gets its
own :class:`~hf_odc.trainer.core.vision.ImageInputs`: its pixel rows and grids, and its positions computed by the
model's ``get_rope_index`` on the rollout alone (the prompt's and completion's tokens, no padding): what the padded
row's tokens see, as the positions ignore the padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.vision import ImageInputs

__all__ = ["rollout_images"]


def rollout_images(
    scored: dict[str, Any],
    prompt_ids: Sequence[torch.Tensor],
    completion_ids: Sequence[torch.Tensor],
    rope_index: Callable[..., Any],
) -> list[ImageInputs]:
    """Each rollout's :class:`~hf_odc.trainer.core.vision.ImageInputs` (CPU) from TRL's padded ``scored`` output and
    the rollouts' unpadded ``prompt_ids`` and ``completion_ids``; a rollout without an image has no pixel values."""
    grid, pixels, counts = scored.get("image_grid_thw"), scored.get("pixel_values"), scored.get("num_images")
    if grid is None or counts is None:
        grid, pixels, counts = None, None, [0] * len(prompt_ids)
    else:
        grid, pixels = grid.cpu(), pixels.cpu()
    types = scored.get("mm_token_type_ids")
    prompt_width = scored["prompt_ids"].shape[1]
    images: list[ImageInputs] = []
    first_image = first_row = 0
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids = torch.cat([prompt, completion])[None]
        if types is None:
            token_types = torch.zeros_like(ids)
        else:  # the padded row's prompt ends at prompt_width (left padding), its completion starts there
            row = types[i].cpu()
            prompt_types = row[prompt_width - len(prompt) : prompt_width]
            token_types = torch.cat([prompt_types, row[prompt_width:][: len(completion)]])[None]
        count = counts[i]
        own_grid = grid[first_image : first_image + count] if count else None
        positions, _ = rope_index(ids, token_types, image_grid_thw=own_grid, attention_mask=torch.ones_like(ids))
        own_pixels = None
        if count:
            rows = int(own_grid.prod(dim=-1).sum())
            own_pixels = pixels[first_row : first_row + rows]
            first_image, first_row = first_image + count, first_row + rows
        images.append(ImageInputs(positions[:, 0], own_pixels, own_grid, 0))
    return images
