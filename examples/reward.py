# Copyright 2026 The hf_odc authors. Apache-2.0.
"""Reward modelling with On-Demand Communication (ODC): preference pairs balanced across ranks (LB-Mini, a pair never
split) and packed padding-free, each scored by a sequence-classification head, in TRL's script style.

With no argument it runs on CPU in about a minute: a tiny Llama-style reward model (one output) built from a config,
the demos' word-level tokenizer, and built-in preference pairs with long-tailed lengths whose chosen reply echoes the
prompt's words in reverse and whose rejected reply is random words (the demo's parts, from `hf_odc.demo`). Each
optimizer step takes `--global_batch_size` pairs (16) whatever the number of processes, so one process and several
train alike.

```bash
# one process (the single-device reference)
python examples/reward.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/reward.py
hf-odc reward  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the plain-FSDP2 baseline: every rank runs the same number of microbatches
accelerate launch --config_file examples/odc_cpu.yaml examples/reward.py --odc false --balance lb-micro

# GPUs: a random Qwen2.5-1.5B-shaped reward model, pairs up to 2 x 8K tokens, bf16
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/reward.py \
    --model_config qwen2.5-1.5b --max_length 8192 --num_pairs 2048 --per_device_train_batch_size 16 \
    --gradient_checkpointing true --max_steps 20

# a real model and preference dataset from local disk (chosen / rejected, optionally prompt and margin, columns)
accelerate launch --config_file examples/odc.yaml examples/reward.py \
    --model_name_or_path /models/Qwen2.5-0.5B-Instruct --dataset_name /data/my_preferences
```
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from datasets import Dataset
from trl import ModelConfig, get_peft_config

from hf_odc.demo import (
    GlobalBatchParser,
    GlobalBatchScriptArguments,
    build_model,
    load_script_dataset,
    load_tokenizer,
    make_trainer,
    preference_dataset,
    quiet_datasets_on_other_ranks,
    require_columns,
    train_and_save,
)
from hf_odc.trainer import ODCRewardConfig, ODCRewardTrainer


@dataclass
class RewardScriptArguments(GlobalBatchScriptArguments):
    """The examples' script arguments (`hf_odc.demo.GlobalBatchScriptArguments`: TRL's, plus `model_config` (here
    with a one-output score head), `length_distribution` and `global_batch_size`, here in pairs), plus the built-in
    preference pairs of this example.

    Args:
        num_pairs (`int`, *optional*, defaults to `512`):
            Number of preference pairs of the built-in dataset (used when `dataset_name` is not set); a pair's chosen
            and rejected lengths are drawn independently.
    """

    num_pairs: int = field(default=512, metadata={"help": "Number of pairs of the built-in dataset."})


def load_pairs(script_args: RewardScriptArguments, training_args: ODCRewardConfig) -> Dataset:
    """``--dataset_name``'s ``--dataset_train_split`` (checked as the command line was parsed), else the built-in
    pairs."""
    if script_args.dataset_name:
        return load_script_dataset(script_args)
    max_length = training_args.max_length or 1024
    return preference_dataset(script_args.num_pairs, max_length, script_args.length_distribution, training_args.seed)


def check_pairs(dataset: Dataset, namespace: argparse.Namespace) -> None:
    """A ``--dataset_name`` dataset without preference pairs ends the run with one line naming the columns."""
    require_columns(
        dataset,
        ("chosen", "rejected"),
        needs="a reward model trains on preference pairs: 'chosen' and 'rejected' columns (optionally 'prompt' and "
        "'margin')",
    )


def check_training_data(
    script_args: RewardScriptArguments, training_args: ODCRewardConfig, model_args: ModelConfig, num_processes: int = 1
) -> None:
    """What the trainer refuses of the pairs once TRL has tokenized them (a pair longer than a microbatch, a
    ``max_length`` that drops most pairs), checked without a model: ``hf-odc reward`` runs it before any of its
    ``num_processes`` processes starts."""
    pairs, tokenizer = load_pairs(script_args, training_args), load_tokenizer(model_args)
    ODCRewardTrainer.check_train_dataset(pairs, tokenizer, training_args, num_processes)


def main(script_args: RewardScriptArguments, training_args: ODCRewardConfig, model_args: ModelConfig) -> None:
    quiet_datasets_on_other_ranks()
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed, num_labels=1)
    trainer = make_trainer(
        ODCRewardTrainer,
        model=model,
        args=training_args,
        train_dataset=load_pairs(script_args, training_args),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer)


def make_parser() -> GlobalBatchParser:
    parser = GlobalBatchParser((RewardScriptArguments, ODCRewardConfig, ModelConfig), check_dataset=check_pairs)
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line. With
    # --use_peft, PEFT trains a copy of the score head beside the adapter (task type SEQ_CLS).
    parser.set_defaults(
        output_dir="odc-reward-output", max_length=128, max_steps=20, learning_rate=2e-3, lora_task_type="SEQ_CLS"
    )
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
