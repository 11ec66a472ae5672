"""The vision demos' parts: a tiny Qwen2.5-VL-shaped model (random weights, from a config), its processor (the demos'
word-level tokenizer with Qwen's vision tokens, Qwen2-VL's image processor with small patches) and a synthetic image
dataset (random pixels, a mixed number of images per sample, none included). Nothing downloads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from datasets import Dataset, Features, Image, Sequence, Value
from transformers import (
    CLIPImageProcessorPil,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)

from .._compat import set_attn_implementation
from .data import longtail_lengths
from .tokenizer import build_tokenizer

if TYPE_CHECKING:  # Pillow is imported where images are made: the text demos need no imaging library
    from PIL import Image as PILImage

__all__ = [
    "LLAVA_IMAGE_TOKEN",
    "VISION_SHAPES",
    "VISION_TOKENS",
    "build_llava_model",
    "build_llava_processor",
    "build_vision_model",
    "build_vision_processor",
    "vision_dataset",
    "vision_preference_dataset",
    "vision_prompt_dataset",
]

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2.5-VL's vision tokens, added to the demos' vocabulary: an image is ``<|vision_start|>``, one
``<|image_pad|>`` per merged patch (the processor expands it), ``<|vision_end|>``."""

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 4, 2, 2
"""The tiny vision tower's patches: 4 x 4 pixels, 2 x 2 of them merged into one token, images as 2 frames."""

VISION_SHAPES = {
    "tiny": dict(
        patch_size=PATCH_SIZE, max_side=32, vocab_size=None,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mrope_section=[2, 3, 3]),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1]),
    ),
    "qwen2.5-vl-3b": dict(
        patch_size=14, max_side=448, vocab_size=151936,
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, mrope_section=[16, 24, 24]),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    fullatt_block_indexes=[7, 15, 23, 31]),
    ),
}  # fmt: skip
"""The vision demos' Qwen2.5-VL shapes (``build_vision_model``'s and ``build_vision_processor``'s ``shape``): the tiny
one, and Qwen2.5-VL-3B's (random weights; its vocabulary's size, the demos' tokens) for GPU benchmarks. Both merge
2 x 2 patches into a token and take images of up to ``max_side`` pixels a side."""

# ChatML over TRL's structured messages (`prepare_multimodal_messages`: every content a list of typed parts), an image
# part rendered as Qwen's placeholder; the assistant's reply inside {% generation %} as in the text demos' template.
_VISION_CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ render(message['content']) + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_vision_processor(shape: str = "tiny") -> Qwen2_5_VLProcessor:
    """Qwen2.5-VL's processor over the demos' word-level tokenizer (with :data:`VISION_TOKENS`) and Qwen2-VL's image
    processor (the PIL one: no torchvision needed) for :data:`VISION_SHAPES`' ``shape``: the tiny one's 4-pixel
    patches, images resized to between 8 x 8 and 32 x 32 pixels (at most 16 image tokens each); the 3B one's 14-pixel
    patches, images of up to 448 x 448 pixels (256 tokens)."""
    tokenizer = build_tokenizer(extra_tokens=VISION_TOKENS, chat_template=_VISION_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})  # split out wherever they stand
    patch, side = VISION_SHAPES[shape]["patch_size"], VISION_SHAPES[shape]["max_side"]
    factor = patch * MERGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": factor * factor, "longest_edge": side * side},
    )
    return _ImageProcessor(image_processor, tokenizer, chat_template=_VISION_CHAT_TEMPLATE)


class _ImageProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor for images only: transformers' video processor needs torchvision, which the demos do not
    (its checks would refuse the processor built without one)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


def build_vision_model(
    processor: Qwen2_5_VLProcessor, seed: int, attn_implementation: str = "sdpa", shape: str = "tiny"
) -> PreTrainedModel:
    """A Qwen2.5-VL of :data:`VISION_SHAPES`' ``shape`` (the tiny one: 2 text layers of width 64, a 2-block vision
    tower of width 32 with window and full attention, Qwen's 3-D rope) with random weights seeded by ``seed`` (the
    same on every rank), for ``processor``'s vocabulary and vision tokens."""
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS, strict=True
    )}  # fmt: skip
    sizes = VISION_SHAPES[shape]
    text = dict(sizes["text"])
    mrope_section, patch = text.pop("mrope_section"), sizes["patch_size"]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=sizes["vocab_size"] or len(tokenizer),
            **text,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(
            **sizes["vision"],
            patch_size=patch,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE,
            window_size=2 * patch * MERGE_SIZE if shape == "tiny" else 112,
            out_hidden_size=text["hidden_size"],
        ),
        tie_word_embeddings=True,
        **ids,
    )
    set_attn_implementation(config, attn_implementation)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


LLAVA_IMAGE_TOKEN = "<image>"
"""The LLaVA-style demo's image placeholder, one per image in the rendered prompt; its processor expands it into one
token per patch."""

LLAVA_IMAGE_SIZE = 16
"""The LLaVA-style demo's images: every image resized to 16 x 16 pixels, 16 patches of 4 x 4 (16 image tokens)."""

_LLAVA_CHAT_TEMPLATE = _VISION_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", LLAVA_IMAGE_TOKEN)


def build_llava_processor() -> LlavaProcessor:
    """LLaVA's processor over the demos' word-level tokenizer (with :data:`LLAVA_IMAGE_TOKEN`) and CLIP's image
    processor (the PIL one) resizing every image to :data:`LLAVA_IMAGE_SIZE` pixels a side; the processor expands each
    placeholder into one token per 4 x 4 patch."""
    tokenizer = build_tokenizer(extra_tokens=[LLAVA_IMAGE_TOKEN], chat_template=_LLAVA_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE_TOKEN]})
    size = {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
    image_processor = CLIPImageProcessorPil(size=size, crop_size=size, do_center_crop=False)
    return LlavaProcessor(
        image_processor, tokenizer, patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
        chat_template=_LLAVA_CHAT_TEMPLATE, image_token=LLAVA_IMAGE_TOKEN, num_additional_image_tokens=1,
    )  # fmt: skip


def build_llava_model(processor: LlavaProcessor, seed: int, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A tiny LLaVA-style model (a 2-block CLIP vision tower of width 32 over 4-pixel patches, its CLS feature dropped,
    a 2-layer projector, a 2-layer Qwen2 language model of width 64, plain 1-D positions) with random weights seeded by
    ``seed``, for ``processor``'s vocabulary and image token."""
    tokenizer = processor.tokenizer
    config = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, image_size=LLAVA_IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )  # fmt: skip
    set_attn_implementation(config, attn_implementation)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config)


def _random_images(
    rng: np.random.Generator, index: int, max_images: int, long_tailed: bool = False, max_side: int = 32
) -> list[PILImage.Image]:
    """Sample ``index``'s images: none for every third, else 1 to ``max_images`` RGB images of random pixels, 8 (a
    quarter of ``max_side`` when larger) to ``max_side`` pixels a side, their count uniform; or, ``long_tailed``, 1 to
    ``max_images`` for every sample, their count long-tailed (Zipf's, exponent 2: most samples one image, a few many),
    so that every microbatch runs the vision tower once (what FSDP2's per-layer collectives need to compare with)."""
    if long_tailed:
        count = min(int(rng.zipf(2.0)), max_images)
    else:
        count = 0 if index % 3 == 2 else int(rng.integers(1, max_images + 1))
    try:
        from PIL import Image as PILImage
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "The vision-language demos make their images with Pillow: pip install 'hf_odc[vision]'."
        ) from error

    sizes = rng.integers(max(8, max_side // 4), max_side + 1, size=(count, 2))
    return [PILImage.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _words(rng: np.random.Generator, low: int, high: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(0, 500, size=int(rng.integers(low, high))))


_MESSAGES = [{"role": Value("string"), "content": Value("string")}]


def vision_dataset(
    num_samples: int, seed: int, max_images: int = 2, max_reply: int | None = None, max_side: int = 32
) -> Dataset:
    """``num_samples`` one-turn conversations in TRL's vision format: ``images`` (0 to ``max_images`` random-pixel RGB
    images of 8 to ``max_side`` pixels a side) and ``messages`` (a user turn of a few words, an assistant reply of 4 to
    24 words), seeded by ``seed``. Every third sample has no image. With ``max_reply`` (a benchmark's workload), the
    replies' lengths are long-tailed up to ``max_reply`` words (``swe-smith``'s shape) and so are the image counts, at
    least one per sample (:func:`_random_images`)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"images": [], "messages": []}
    replies = longtail_lengths(num_samples, max_reply, "swe-smith", seed) if max_reply else None
    for index in range(num_samples):
        rows["images"].append(_random_images(rng, index, max_images, replies is not None, max_side))
        user = _words(rng, 2, 8)
        reply = _words(rng, 4, 25) if replies is None else _words(rng, replies[index], replies[index] + 1)
        rows["messages"].append([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
    return Dataset.from_dict(rows, features=Features({"images": Sequence(Image()), "messages": _MESSAGES}))


def vision_preference_dataset(num_pairs: int, seed: int, max_images: int = 2) -> Dataset:
    """``num_pairs`` preference pairs in TRL's vision format: ``images`` (as :func:`vision_dataset`'s), a one-turn
    ``prompt`` and two replies, ``chosen`` (the prompt's words reversed) and ``rejected`` (random words), seeded by
    ``seed``."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"images": [], "prompt": [], "chosen": [], "rejected": []}
    for index in range(num_pairs):
        rows["images"].append(_random_images(rng, index, max_images))
        prompt = _words(rng, 2, 8)
        rows["prompt"].append([{"role": "user", "content": prompt}])
        rows["chosen"].append([{"role": "assistant", "content": " ".join(prompt.split()[::-1])}])
        rows["rejected"].append([{"role": "assistant", "content": _words(rng, 2, 12)}])
    features = {"images": Sequence(Image()), "prompt": _MESSAGES, "chosen": _MESSAGES, "rejected": _MESSAGES}
    return Dataset.from_dict(rows, features=Features(features))


def vision_prompt_dataset(num_prompts: int, seed: int, max_images: int = 2, max_completion_length: int = 16) -> Dataset:
    """``num_prompts`` GRPO prompts in TRL's vision format: ``images`` (as :func:`vision_dataset`'s), a one-turn
    ``prompt`` of a few words and the reply's asked length ``target_length`` (1 to ``max_completion_length`` words,
    :func:`hf_odc.demo.length_reward`'s column), seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"images": [], "prompt": [], "target_length": []}
    for index in range(num_prompts):
        rows["images"].append(_random_images(rng, index, max_images))
        rows["prompt"].append([{"role": "user", "content": _words(rng, 2, 8)}])
        rows["target_length"].append(int(rng.integers(1, max_completion_length + 1)))
    features = {"images": Sequence(Image()), "prompt": _MESSAGES, "target_length": Value("int64")}
    return Dataset.from_dict(rows, features=Features(features))
