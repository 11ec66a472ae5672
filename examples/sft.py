# Copyright 2026 The hf_odc authors. Apache-2.0.
"""Supervised fine-tuning with On-Demand Communication (ODC) and LB-Mini, in TRL's script style.

With no argument it runs on CPU in well under two minutes: a tiny Llama-style model built from a config, a word-level
tokenizer with a chat template built in code, and a built-in chat dataset with long-tailed lengths (the demo's parts,
from `hf_odc.demo`). Each optimizer step takes `--global_batch_size` samples (16) whatever the number of processes, so
the runs below train on the same minibatches and match step for step (loss and gradient norm, up to floating-point
summation order).

```bash
# one process (the single-device reference)
python examples/sft.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py

# the plain-FSDP2 baseline: every rank runs the same number of microbatches
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py --odc false --balance lb-micro

# GPUs: a randomly initialised Qwen2-0.5B-shaped model on long-tailed synthetic data, bf16 (hf_odc's packed attention,
# "odc_packed", by default; --attn_implementation flash_attention_2 where flash-attn is installed)
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/sft.py \
    --model_config qwen2-0.5b --dataset synthetic-longtail --num_samples 4096 --max_length 16384 \
    --per_device_train_batch_size 16 --max_steps 20

# a real model and dataset from local disk (no Hub access needed)
accelerate launch --config_file examples/odc.yaml examples/sft.py \
    --model_name_or_path /models/Qwen2.5-0.5B-Instruct --dataset_name /data/my_chats --assistant_only_loss true
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import datasets
from datasets import Dataset, load_dataset, load_from_disk
from trl import ModelConfig, ScriptArguments, get_peft_config

from hf_odc.demo import (
    GlobalBatchParser,
    build_model,
    chat_dataset,
    fail,
    load_tokenizer,
    save_initial_model,
    synthetic_dataset,
    train_and_save,
)
from hf_odc.packing import DISTRIBUTIONS
from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer
from hf_odc.trainer.data import require_sft_columns

DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
"""What ``load_dataset`` reads a data file given as ``--dataset_name`` with, by its extension."""


@dataclass
class ODCScriptArguments(ScriptArguments):
    """TRL's script arguments, plus the built-in model and datasets of this example.

    Args:
        dataset (`str`, *optional*, defaults to `"chat-longtail"`):
            Built-in dataset used when `dataset_name` is not set: `"chat-longtail"` (conversations in `messages`
            format, long-tailed reply lengths) or `"synthetic-longtail"` (pre-tokenized random token ids, lengths from
            `length_distribution` scaled to `max_length`; fast to build at any length).
        num_samples (`int`, *optional*, defaults to `512`):
            Number of samples of the built-in dataset.
        length_distribution (`str`, *optional*, defaults to `"swe-smith"`):
            Shape of the built-in datasets' lengths: one of `hf_odc.packing.DISTRIBUTIONS`, rescaled so that its
            longest sample is `max_length` tokens.
        model_config (`str`, *optional*, defaults to `"tiny"`):
            Model built from a config, with random weights, when `model_name_or_path` is not set: `"tiny"` (Llama),
            `"tiny-moe"` (Qwen3-MoE), `"qwen2-0.5b"`, `"qwen2.5-1.5b"`, or a path to a `config.json` (a file or a
            directory holding one).
        global_batch_size (`int`, *optional*, defaults to `16`):
            Samples per optimizer step over all processes: each process gets `global_batch_size / processes`
            (`per_device_train_batch_size`), so that one process and several train on the same minibatches. Set
            this or `--per_device_train_batch_size`, not both.
    """

    dataset: str = field(
        default="chat-longtail",
        metadata={
            "help": "Built-in dataset when dataset_name is unset.",
            "choices": ["chat-longtail", "synthetic-longtail"],
        },
    )
    num_samples: int = field(default=512, metadata={"help": "Number of samples of the built-in dataset."})
    length_distribution: str = field(
        default="swe-smith",
        metadata={"help": "Length shape of the built-in datasets.", "choices": sorted(DISTRIBUTIONS)},
    )
    model_config: str = field(
        default="tiny",
        metadata={
            "help": "Model config when model_name_or_path is unset: 'tiny', 'tiny-moe', 'qwen2-0.5b', "
            "'qwen2.5-1.5b' or a path."
        },
    )
    global_batch_size: int = field(
        default=16,
        metadata={
            "help": "Samples per optimizer step over all processes (per_device_train_batch_size = this / processes). "
            "Exclusive with per_device_train_batch_size."
        },
    )


def load_train_dataset(script_args: ODCScriptArguments, training_args: ODCSFTConfig, vocab_size: int) -> Dataset:
    """``--dataset_name`` (a directory saved with ``save_to_disk``, a data file, or a dataset ``load_dataset`` finds),
    its ``--dataset_train_split``; else the built-in ``--dataset``. A dataset SFT cannot train on ends the run with one
    line naming it, the columns expected and the columns found."""
    if script_args.dataset_name:
        name = script_args.dataset_name
        if os.path.isdir(name) and any(
            os.path.exists(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")
        ):
            dataset = load_from_disk(name)
        elif os.path.isfile(name):
            builder = DATA_FILE_BUILDERS.get(os.path.splitext(name)[1].lower())
            if builder is None:
                fail(f"--dataset_name {name}: a data file must end in one of {', '.join(DATA_FILE_BUILDERS)}")
            if os.path.getsize(name) == 0:
                fail(f"--dataset_name {name}: the file is empty")
            dataset = load_dataset(builder, data_files=name, split="train")
        else:
            dataset = load_dataset(name, name=script_args.dataset_config)
        if hasattr(dataset, "keys"):
            if script_args.dataset_train_split not in dataset:
                fail(f"--dataset_name {name} has no split {script_args.dataset_train_split!r} (--dataset_train_split); "
                     f"its splits: {list(dataset)}")  # fmt: skip
            dataset = dataset[script_args.dataset_train_split]
        try:
            require_sft_columns(dataset, training_args.dataset_text_field)
        except ValueError as error:
            fail(f"--dataset_name {name}: {error}")
        return dataset
    max_length = training_args.max_length or 1024
    if script_args.dataset == "synthetic-longtail":
        return synthetic_dataset(
            script_args.num_samples, max_length, script_args.length_distribution, training_args.seed, vocab_size
        )
    return chat_dataset(script_args.num_samples, max_length, script_args.length_distribution, training_args.seed)


def main(script_args: ODCScriptArguments, training_args: ODCSFTConfig, model_args: ModelConfig) -> None:
    if training_args.process_index != 0:
        datasets.disable_progress_bars()  # every process prepares the dataset alike: the first one shows it
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)
    dataset = load_train_dataset(script_args, training_args, vocab_size=model.config.get_text_config().vocab_size)
    peft_config = get_peft_config(model_args)
    if peft_config is not None and not model_args.model_name_or_path:
        save_initial_model(model, os.path.join(training_args.output_dir, "base_model"), training_args)
    trainer = ODCSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_and_save(trainer)


def make_parser() -> GlobalBatchParser:
    parser = GlobalBatchParser((ODCScriptArguments, ODCSFTConfig, ModelConfig))
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(output_dir="odc-sft-output", max_length=256, max_steps=30, learning_rate=3e-3)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
