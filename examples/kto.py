# Copyright 2026 The hf_odc authors. Apache-2.0.
"""Kahneman-Tversky Optimization (KTO) with On-Demand Communication (ODC): unpaired desirable and undesirable examples
balanced across ranks (LB-Mini, an example kept with its mismatched completion for TRL's KL estimate) and packed
padding-free, in TRL's script style.

With no argument it runs on CPU in about a minute: a tiny Llama-style model built from a config, the demos' word-level
tokenizer, and built-in unpaired examples with long-tailed lengths, each a prompt with a desirable reply (the prompt's
words in reverse) or an undesirable one (random words) (the demo's parts, from `hf_odc.demo`). The reference model is
the initial policy, built again from the same seed (`--precompute_ref_log_probs true` computes its log-probabilities
once, before training, and keeps no copy; `--use_peft` uses the policy with its adapter disabled). Each optimizer step
takes `--global_batch_size` examples (16) whatever the number of processes, so one process and several train alike.

```bash
# one process (the single-device reference)
python examples/kto.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/kto.py
hf-odc kto  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the plain-FSDP2 baseline: every rank runs the same number of microbatches
accelerate launch --config_file examples/odc_cpu.yaml examples/kto.py --odc false --balance lb-micro

# GPUs: a random Qwen2.5-1.5B-shaped policy, sequences up to 8K tokens, bf16
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/kto.py \
    --model_config qwen2.5-1.5b --max_length 8192 --num_examples 2048 --per_device_train_batch_size 16 \
    --gradient_checkpointing true --max_steps 20

# a real model and dataset from local disk (prompt / completion / label, or prompt / chosen / rejected columns)
accelerate launch --config_file examples/odc.yaml examples/kto.py \
    --model_name_or_path /models/Qwen2.5-0.5B-Instruct --dataset_name /data/my_feedback
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
    quiet_datasets_on_other_ranks,
    require_columns,
    train_and_save,
    unpaired_dataset,
)
from hf_odc.trainer import ODCKTOConfig, ODCKTOTrainer


@dataclass
class KTOScriptArguments(GlobalBatchScriptArguments):
    """The examples' script arguments (`hf_odc.demo.GlobalBatchScriptArguments`: TRL's, plus `model_config`,
    `length_distribution` and `global_batch_size`, here in examples), plus the built-in unpaired examples of this
    example.

    Args:
        num_examples (`int`, *optional*, defaults to `512`):
            Number of examples of the built-in dataset (used when `dataset_name` is not set).
    """

    num_examples: int = field(default=512, metadata={"help": "Number of examples of the built-in dataset."})


def load_examples(script_args: KTOScriptArguments, training_args: ODCKTOConfig) -> Dataset:
    """``--dataset_name``'s ``--dataset_train_split`` (checked as the command line was parsed), else the built-in
    examples."""
    if script_args.dataset_name:
        return load_script_dataset(script_args)
    max_length = training_args.max_length or 1024
    return unpaired_dataset(script_args.num_examples, max_length, script_args.length_distribution, training_args.seed)


def check_examples(dataset: Dataset, namespace: argparse.Namespace) -> None:
    """A ``--dataset_name`` dataset without KTO's examples ends the run with one line naming the columns."""
    require_columns(
        dataset,
        ("completion", "label"),
        ("chosen", "rejected"),
        needs="KTO needs unpaired examples ('prompt', 'completion' and a boolean 'label' columns) or preference pairs "
        "('prompt', 'chosen' and 'rejected')",
    )


def check_training_data(
    script_args: KTOScriptArguments, training_args: ODCKTOConfig, model_args: ModelConfig, num_processes: int = 1
) -> None:
    """What the trainer refuses of the examples once TRL has tokenized them (an example longer than a microbatch,
    with its mismatched completion: chosen within each global batch, of ``num_processes`` processes' examples),
    checked without a model: ``hf-odc kto`` runs it before any process starts."""
    examples, tokenizer = load_examples(script_args, training_args), load_tokenizer(model_args)
    ODCKTOTrainer.check_train_dataset(examples, tokenizer, training_args, num_processes)


def main(script_args: KTOScriptArguments, training_args: ODCKTOConfig, model_args: ModelConfig) -> None:
    quiet_datasets_on_other_ranks()
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)
    peft_config = get_peft_config(model_args)
    trainer = make_trainer(
        ODCKTOTrainer,
        model=model,
        ref_model=initial_reference(model, script_args, training_args, model_args, tokenizer, peft_config),
        args=training_args,
        train_dataset=load_examples(script_args, training_args),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_and_save(trainer)


def make_parser() -> GlobalBatchParser:
    parser = GlobalBatchParser((KTOScriptArguments, ODCKTOConfig, ModelConfig), check_dataset=check_examples)
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(output_dir="odc-kto-output", max_length=128, max_steps=20, learning_rate=2e-3)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
