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
hf-odc sft  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the plain-FSDP2 baseline: every rank runs the same number of microbatches
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py --odc false --balance lb-micro

# a tiny Mixture-of-Experts model (Qwen3-MoE: 4 experts, top-2), trained with its router's load-balancing loss, as TRL
# does (logged as aux_loss: hf_odc takes it over each global minibatch)
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py --model_config tiny-moe

# GPUs: a randomly initialised Qwen2-0.5B-shaped model on long-tailed synthetic data, bf16 (hf_odc's packed attention,
# "odc_packed", by default; --attn_implementation flash_attention_2 where flash-attn is installed)
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/sft.py \
    --model_config qwen2-0.5b --dataset synthetic-longtail --num_samples 4096 --max_length 16384 \
    --per_device_train_batch_size 16 --max_steps 20

# documents longer than a microbatch (up to 256 tokens on microbatches of 128) split over both ranks: Accelerate's
# sequence parallelism (`parallelism_config_sp_size: 2` in the yaml does the same), run by hf_odc inside ODC
accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py --max_tokens_per_microbatch 128 \
    --parallelism_config '{"sp_size": 2}'

# a real model and dataset from local disk (no Hub access needed)
accelerate launch --config_file examples/odc.yaml examples/sft.py \
    --model_name_or_path /models/Qwen2.5-0.5B-Instruct --dataset_name /data/my_chats --assistant_only_loss true
```
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from datasets import Dataset
from trl import ModelConfig, get_peft_config

from hf_odc.demo import (
    GlobalBatchParser,
    GlobalBatchScriptArguments,
    build_model,
    chat_dataset,
    load_script_dataset,
    load_tokenizer,
    make_trainer,
    quiet_datasets_on_other_ranks,
    save_initial_model,
    synthetic_dataset,
    train_and_save,
)
from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer
from hf_odc.trainer.core.data import require_sft_columns


@dataclass
class ODCScriptArguments(GlobalBatchScriptArguments):
    """The examples' script arguments (`hf_odc.demo.GlobalBatchScriptArguments`: TRL's, plus `model_config`,
    `length_distribution` and `global_batch_size`), plus the built-in datasets of this example.

    Args:
        dataset (`str`, *optional*, defaults to `"chat-longtail"`):
            Built-in dataset used when `dataset_name` is not set: `"chat-longtail"` (conversations in `messages`
            format, long-tailed reply lengths) or `"synthetic-longtail"` (pre-tokenized random token ids, lengths from
            `length_distribution` scaled to `max_length`; fast to build at any length).
        num_samples (`int`, *optional*, defaults to `512`):
            Number of samples of the built-in dataset.
    """

    dataset: str = field(
        default="chat-longtail",
        metadata={
            "help": "Built-in dataset when dataset_name is unset.",
            "choices": ["chat-longtail", "synthetic-longtail"],
        },
    )
    num_samples: int = field(default=512, metadata={"help": "Number of samples of the built-in dataset."})


def load_train_dataset(script_args: ODCScriptArguments, training_args: ODCSFTConfig, vocab_size: int) -> Dataset:
    """``--dataset_name``'s ``--dataset_train_split`` (checked as the command line was parsed), else the built-in
    ``--dataset``."""
    if script_args.dataset_name:
        return load_script_dataset(script_args)
    max_length = training_args.max_length or 1024
    if script_args.dataset == "synthetic-longtail":
        return synthetic_dataset(
            script_args.num_samples, max_length, script_args.length_distribution, training_args.seed, vocab_size
        )
    return chat_dataset(script_args.num_samples, max_length, script_args.length_distribution, training_args.seed)


def check_dataset(dataset: Dataset, namespace: argparse.Namespace) -> None:
    """A ``--dataset_name`` dataset SFT cannot train on ends the run with one line naming it, the columns expected and
    the columns found."""
    require_sft_columns(dataset, namespace.dataset_text_field)


def check_training_data(
    script_args: ODCScriptArguments, training_args: ODCSFTConfig, model_args: ModelConfig, num_processes: int = 1
) -> None:
    """What the trainer refuses of the training data once TRL has tokenized it (a sample longer than a microbatch,
    truncation that leaves most samples nothing to learn), checked without a model: ``hf-odc sft`` runs it before
    any of its ``num_processes`` processes starts. The built-in token ids are drawn below the tokenizer's size here:
    only their lengths count."""
    tokenizer = load_tokenizer(model_args)
    dataset = load_train_dataset(script_args, training_args, vocab_size=len(tokenizer))
    ODCSFTTrainer.check_train_dataset(dataset, tokenizer, training_args, num_processes)


def main(script_args: ODCScriptArguments, training_args: ODCSFTConfig, model_args: ModelConfig) -> None:
    quiet_datasets_on_other_ranks()
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)
    dataset = load_train_dataset(script_args, training_args, vocab_size=model.config.get_text_config().vocab_size)
    peft_config = get_peft_config(model_args)
    if peft_config is not None and not model_args.model_name_or_path:
        save_initial_model(model, os.path.join(training_args.output_dir, "base_model"), training_args)
    trainer = make_trainer(
        ODCSFTTrainer,
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_and_save(trainer)


def make_parser() -> GlobalBatchParser:
    parser = GlobalBatchParser((ODCScriptArguments, ODCSFTConfig, ModelConfig), check_dataset=check_dataset)
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(output_dir="odc-sft-output", max_length=256, max_steps=30, learning_rate=3e-3)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
