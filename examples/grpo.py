# Copyright 2026 The hf_odc authors. Apache-2.0.
"""GRPO with On-Demand Communication (ODC): policy updates packed and balanced across ranks (LB-Mini), in TRL's
script style.

With no argument it runs on CPU in a couple of minutes: a tiny Llama-style model built from a config, the word-level
tokenizer of `examples/sft.py`, a built-in prompt set whose prompts ask for long-tailed reply lengths, and two
rule-based rewards written below (reply length close to the asked length; reply words taken from the prompt).

```bash
# one process
python examples/grpo.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/grpo.py

# the plain-FSDP2 baseline (every rank trains on the same number of microbatches)
accelerate launch --config_file examples/odc_cpu.yaml examples/grpo.py --odc false --balance lb-micro

# GPUs: a random Qwen2.5-1.5B-shaped policy; rollouts injected with long-tailed completions up to 16K tokens (no
# generation time: it measures the policy updates), 8 generations per prompt
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/grpo.py \
    --model_config qwen2.5-1.5b --rollouts synthetic --max_completion_length 16384 --num_generations 8 \
    --per_device_train_batch_size 16 --gradient_checkpointing true --max_steps 10

# a real model from local disk, generating with transformers
accelerate launch --config_file examples/odc.yaml examples/grpo.py --model_name_or_path /models/Qwen2.5-1.5B-Instruct
```

`--rollouts synthetic` replaces generation with TRL's `rollout_func` hook: each completion's tokens and length are
drawn from a generator seeded by its prompt and its index in the prompt's group, so they do not depend on how many
ranks run or which rank draws the prompt (the tests compare runs of different sizes with it). `--rollouts skewed`
gives every completion drawn on rank 0 a long length and every other rank's a short one: the worst case for TRL's
equal split.
"""

from __future__ import annotations

import argparse
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from datasets import Dataset
from sft import (
    NUM_WORDS,
    SPECIAL_TOKENS,
    ExampleParser,
    build_model,
    load_tokenizer,
    longtail_lengths,
    save_initial_model,
    train_and_save,
)
from trl import ModelConfig, ScriptArguments, get_peft_config

from hf_odc.packing import DISTRIBUTIONS
from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """TRL's script arguments, plus the built-in model, prompts and rollouts of this example.

    Args:
        num_prompts (`int`, *optional*, defaults to `256`):
            Number of prompts of the built-in prompt set.
        model_config (`str`, *optional*, defaults to `"tiny"`):
            Model built from a config, with random weights, when `model_name_or_path` is not set: `"tiny"`,
            `"qwen2-0.5b"`, `"qwen2.5-1.5b"`, or a path to a `config.json`.
        rollouts (`str`, *optional*, defaults to `"generate"`):
            `"generate"` (transformers `generate`), `"synthetic"` (completions injected through `rollout_func`,
            lengths from `length_distribution` scaled to `max_completion_length`) or `"skewed"` (injected: long on
            rank 0, short elsewhere).
        length_distribution (`str`, *optional*, defaults to `"swe-smith"`):
            Shape of the asked reply lengths and of synthetic completion lengths: one of
            `hf_odc.packing.DISTRIBUTIONS`, rescaled so that its longest is `max_completion_length`.
    """

    num_prompts: int = field(default=256, metadata={"help": "Number of prompts of the built-in prompt set."})
    model_config: str = field(
        default="tiny",
        metadata={
            "help": "Model config when model_name_or_path is unset: 'tiny', 'qwen2-0.5b', 'qwen2.5-1.5b' or a path."
        },
    )
    rollouts: str = field(
        default="generate",
        metadata={"help": "Where completions come from.", "choices": ["generate", "synthetic", "skewed"]},
    )
    length_distribution: str = field(
        default="swe-smith",
        metadata={"help": "Length shape of asked and synthetic completions.", "choices": sorted(DISTRIBUTIONS)},
    )


def prompt_dataset(num_prompts: int, max_completion_length: int, distribution: str, seed: int) -> Dataset:
    """Prompts "reply with N words from: w.. w.." (conversational), with the asked length N long-tailed."""
    rng = np.random.default_rng(seed)
    rows = []
    for target in longtail_lengths(num_prompts, max_completion_length, distribution, seed):
        words = [f"w{i}" for i in rng.integers(0, NUM_WORDS, size=int(rng.integers(4, 12)))]
        content = " ".join(words)
        rows.append({"prompt": [{"role": "user", "content": content}], "target_length": target})
    return Dataset.from_list(rows)


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def length_reward(completions: list, target_length: list[int], **kwargs: Any) -> list[float]:
    """1 when the reply has the asked number of words, falling linearly to 0 at twice or zero that length."""
    return [
        max(0.0, 1.0 - abs(len(_text(c).split()) - target) / target)
        for c, target in zip(completions, target_length, strict=True)
    ]


def echo_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """The fraction of the reply's words that appear in the prompt."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        allowed, words = set(_text(prompt).split()), _text(completion).split()
        rewards.append(sum(word in allowed for word in words) / len(words) if words else 0.0)
    return rewards


class SyntheticRollouts:
    """TRL's ``rollout_func``: completions drawn, not generated, reproducibly wherever they are drawn.

    A completion's length and tokens come from a generator seeded by ``seed``, its prompt's text and its index in
    the prompt's group of ``num_generations`` (from its global position, ``rank * len(prompts) + i``, the layout of
    TRL's ``RepeatSampler``). It ends with the end-of-sequence token unless it reaches ``max_completion_length``.
    """

    def __init__(self, mode: str, distribution: str, seed: int):
        self.mode, self.distribution, self.seed = mode, distribution, seed

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        tokenizer, args = trainer.processing_class, trainer.args
        rank = trainer.accelerator.process_index
        num_generations = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        low = len(SPECIAL_TOKENS) + 3  # after the special tokens and role names
        vocab = len(tokenizer)
        prompt_ids, completion_ids = [], []
        for i, prompt in enumerate(prompts):
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            index = (rank * len(prompts) + i) % num_generations
            seed = zlib.crc32(f"{self.seed}|{text}|{index}".encode())
            rng = np.random.default_rng(seed)
            limit = args.max_completion_length
            if self.mode == "skewed":
                length = (
                    int(limit * rng.uniform(0.8, 1.0)) if rank == 0 else max(2, int(limit * rng.uniform(0.02, 0.1)))
                )
            else:
                length = longtail_lengths(1, limit, self.distribution, seed % 2**31)[0]
            tokens = rng.integers(low, vocab, size=length).tolist()
            if length < limit:
                tokens[-1] = tokenizer.eos_token_id
            completion_ids.append(tokens)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def build_trainer(
    script_args: GRPOScriptArguments, training_args: ODCGRPOConfig, model_args: ModelConfig
) -> ODCGRPOTrainer:
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args, model_args, tokenizer, seed=training_args.seed)
    peft_config = get_peft_config(model_args)
    if (training_args.beta != 0.0 or peft_config is not None) and not model_args.model_name_or_path:
        # TRL loads the reference model from the policy's name; a LoRA adapter records its base model's name.
        save_initial_model(model, os.path.join(training_args.output_dir, "initial-policy"), training_args)
    dataset = prompt_dataset(
        script_args.num_prompts,
        training_args.max_completion_length,
        script_args.length_distribution,
        training_args.seed,
    )
    rollout_func = None
    if script_args.rollouts != "generate":
        rollout_func = SyntheticRollouts(script_args.rollouts, script_args.length_distribution, training_args.seed)
    return ODCGRPOTrainer(
        model=model,
        reward_funcs=[length_reward, echo_reward],
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
        peft_config=peft_config,
    )


def main(script_args: GRPOScriptArguments, training_args: ODCGRPOConfig, model_args: ModelConfig) -> None:
    train_and_save(build_trainer(script_args, training_args, model_args))


class GRPOParser(ExampleParser):
    """:class:`ExampleParser` for this script: PEFT trains with ``--beta 0`` only (ODCGRPOTrainer has no reference
    model for an adapter yet), refused here in one line rather than by the trainer on every process."""

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        super().complete(namespace, given)
        if namespace.use_peft and namespace.beta != 0.0:
            self.error(
                f"--use_peft trains with --beta 0 only (got --beta {namespace.beta:g}): ODCGRPOTrainer has no KL "
                "reference for a LoRA adapter yet. Drop --beta, or train the full model without --use_peft"
            )


def make_parser() -> ExampleParser:
    parser = GRPOParser((GRPOScriptArguments, ODCGRPOConfig, ModelConfig))
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(
        output_dir="odc-grpo-output",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=48,
        max_steps=10,
        learning_rate=1e-3,
    )
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
