# Copyright 2026 The hf_odc authors. Apache-2.0.
"""Supervised fine-tuning of a vision-language model with On-Demand Communication (ODC) and LB-Mini, in TRL's script
style.

With no argument it runs on CPU: a tiny Qwen2.5-VL built from a config (random weights, a 2-block vision tower), its
processor built in code (the demos' word-level tokenizer with Qwen's vision tokens, Qwen2-VL's image processor with
4-pixel patches) and a built-in dataset of conversations with 0 to 2 random-pixel images each, in TRL's format
(`images` and `messages` columns), from `hf_odc.demo`. Each sample is processed as TRL's `SFTTrainer` processes it;
the planner weighs a sample by its tokens plus its image patches, and a rank whose microbatches hold no image runs no
vision tower (no dummy batch). Each optimizer step takes `--global_batch_size` samples (16) whatever the number of
processes, so the runs below train on the same minibatches and match step for step.

```bash
# one process (the single-device reference)
python examples/sft_vlm.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/sft_vlm.py

# a real Qwen2.5-VL and an image dataset from local disk (no Hub access needed)
accelerate launch --config_file examples/odc.yaml examples/sft_vlm.py \
    --model_name_or_path /models/Qwen2.5-VL-3B-Instruct --dataset_name /data/my_image_chats --max_length 4096
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import ModelConfig, get_peft_config

from hf_odc.demo import (
    VISION_SHAPES,
    GlobalBatchParser,
    GlobalBatchScriptArguments,
    build_vision_model,
    build_vision_processor,
    load_script_dataset,
    make_trainer,
    quiet_datasets_on_other_ranks,
    train_and_save,
    vision_dataset,
)
from hf_odc.trainer import PACKED_ATTENTION, ODCSFTConfig, ODCSFTTrainer


@dataclass
class VisionScriptArguments(GlobalBatchScriptArguments):
    """The examples' script arguments (`hf_odc.demo.GlobalBatchScriptArguments`), plus the built-in image dataset's.
    Without `model_name_or_path`, `model_config` names a built-in Qwen2.5-VL shape (`hf_odc.demo.VISION_SHAPES`:
    `"tiny"`, or `"qwen2.5-vl-3b"` with random weights, for GPU benchmarks).

    Args:
        num_samples (`int`, *optional*, defaults to `160`):
            Number of samples of the built-in image dataset.
        max_images (`int`, *optional*, defaults to `2`):
            Most images of a built-in sample (every third has none).
        long_tailed (`bool`, *optional*, defaults to `False`):
            Built-in samples with long-tailed reply lengths (up to a quarter of `max_length` words) and image counts
            (1 to `max_images`: a benchmark's workload, which FSDP2 runs too), images of up to the shape's largest
            side.
    """

    num_samples: int = field(default=160, metadata={"help": "Number of samples of the built-in image dataset."})
    max_images: int = field(default=2, metadata={"help": "Most images of a built-in sample."})
    long_tailed: bool = field(
        default=False, metadata={"help": "Long-tailed reply lengths and image counts in the built-in dataset."}
    )


def load_model_and_processor(model_args: ModelConfig, seed: int, shape: str = "tiny") -> tuple[torch.nn.Module, object]:
    """``--model_name_or_path`` (a directory holding a Qwen2.5-VL and its processor), else the built-in ``shape``."""
    attn = model_args.attn_implementation or PACKED_ATTENTION
    if not model_args.model_name_or_path:
        if shape not in VISION_SHAPES:
            raise ValueError(f"--model_config must be one of {sorted(VISION_SHAPES)} for the built-in model.")
        processor = build_vision_processor(shape)
        return build_vision_model(processor, seed, attn_implementation=attn, shape=shape), processor
    dtype = getattr(torch, model_args.dtype) if model_args.dtype not in (None, "auto") else torch.float32
    path = model_args.model_name_or_path
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    return model, AutoProcessor.from_pretrained(path)


def load_train_dataset(script_args: VisionScriptArguments, training_args: ODCSFTConfig) -> Dataset:
    """``--dataset_name``'s ``--dataset_train_split``, else the built-in image conversations."""
    if script_args.dataset_name:
        return load_script_dataset(script_args)
    if not script_args.long_tailed:
        return vision_dataset(script_args.num_samples, training_args.seed, script_args.max_images)
    max_side = VISION_SHAPES.get(script_args.model_config, VISION_SHAPES["tiny"])["max_side"]
    return vision_dataset(
        script_args.num_samples, training_args.seed, script_args.max_images, training_args.max_length // 4, max_side
    )


def main(script_args: VisionScriptArguments, training_args: ODCSFTConfig, model_args: ModelConfig) -> None:
    quiet_datasets_on_other_ranks()
    model, processor = load_model_and_processor(model_args, training_args.seed, script_args.model_config)
    trainer = make_trainer(
        ODCSFTTrainer,
        model=model,
        args=training_args,
        train_dataset=load_train_dataset(script_args, training_args),
        processing_class=processor,
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer)


def make_parser() -> GlobalBatchParser:
    parser = GlobalBatchParser(
        (VisionScriptArguments, ODCSFTConfig, ModelConfig), built_in_models=VISION_SHAPES, model_config_files=False
    )
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(output_dir="odc-sft-vlm-output", max_length=256, max_steps=10, learning_rate=3e-3)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
