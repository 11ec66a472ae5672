# Copyright 2026 The hf_odc authors. Apache-2.0.
"""Direct Preference Optimization with On-Demand Communication (ODC): preference pairs balanced across ranks
(LB-Mini, a pair never split) and packed padding-free, in TRL's script style.

With no argument it runs on CPU in about a minute: a tiny Llama-style model built from a config, the demos' word-level
tokenizer, and built-in preference pairs with long-tailed lengths whose chosen reply echoes the prompt's words in
reverse and whose rejected reply is random words (the demo's parts, from `hf_odc.demo`). The reference model is the
initial policy, built again from the same seed (`--precompute_ref_log_probs true` computes its log-probabilities once,
before training, and keeps no copy; `--use_peft` uses the policy with its adapter disabled). Each optimizer step takes
`--global_batch_size` pairs (16) whatever the number of processes, so one process and several train alike.

```bash
# one process (the single-device reference)
python examples/dpo.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/dpo.py
hf-odc dpo  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the plain-FSDP2 baseline: every rank runs the same number of microbatches
accelerate launch --config_file examples/odc_cpu.yaml examples/dpo.py --odc false --balance lb-micro

# GPUs: a random Qwen2.5-1.5B-shaped policy, pairs up to 2 x 8K tokens, bf16
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/dpo.py \
    --model_config qwen2.5-1.5b --max_length 8192 --num_pairs 2048 --per_device_train_batch_size 16 \
    --gradient_checkpointing true --max_steps 20

# a real model and preference dataset from local disk (prompt / chosen / rejected columns)
accelerate launch --config_file examples/odc.yaml examples/dpo.py \
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
    initial_reference,
    load_script_dataset,
    load_tokenizer,
    make_trainer,
    preference_dataset,
    quiet_datasets_on_other_ranks,
    require_columns,
    train_and_save,
)
from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer


@dataclass
class DPOScriptArguments(GlobalBatchScriptArguments):
    """The examples' script arguments (`hf_odc.demo.GlobalBatchScriptArguments`: TRL's, plus `model_config`,
    `length_distribution` and `global_batch_size`, here in pairs), plus the built-in preference pairs of this example.

    Args:
        num_pairs (`int`, *optional*, defaults to `512`):
            Number of preference pairs of the built-in dataset (used when `dataset_name` is not set); a pair's chosen
            and rejected lengths are drawn independently.
    """

    num_pairs: int = field(default=512, metadata={"help": "Number of pairs of the built-in dataset."})


def load_pairs(script_args: DPOScriptArguments, training_args: ODCDPOConfig) -> Dataset:
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
        needs="DPO needs preference pairs: 'chosen' and 'rejected' columns (and 'prompt', unless the conversations "
        "hold it)",
    )


def check_training_data(
    script_args: DPOScriptArguments, training_args: ODCDPOConfig, model_args: ModelConfig, num_processes: int = 1
) -> None:
    """What the trainer refuses of the pairs once TRL has tokenized them (a pair longer than a microbatch, truncation
    that leaves most pairs nothing to prefer), checked without a model: ``hf-odc dpo`` runs it before any of its
    ``num_processes`` processes starts."""
    pairs, tokenizer = load_pairs(script_args, training_args), load_tokenizer(model_args)
    ODCDPOTrainer.check_train_dataset(pairs, tokenizer, training_args, num_processes)


def main(script_args: DPOScriptArguments, training_args: ODCDPOConfig, model_args: ModelConfig) -> None:
    quiet_datasets_on_other_ranks()
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)
    peft_config = get_peft_config(model_args)
    ref_model = initial_reference(model, script_args, training_args, model_args, tokenizer, peft_config)
    trainer = make_trainer(
        ODCDPOTrainer,
        model=model,
        ref_model=ref_model,
        args=training_args,
        train_dataset=load_pairs(script_args, training_args),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_and_save(trainer)


def make_parser() -> GlobalBatchParser:
    parser = GlobalBatchParser((DPOScriptArguments, ODCDPOConfig, ModelConfig), check_dataset=check_pairs)
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(output_dir="odc-dpo-output", max_length=128, max_steps=20, learning_rate=2e-3)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
