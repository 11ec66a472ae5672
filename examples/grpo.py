# Copyright 2026 The hf_odc authors. Apache-2.0.
"""GRPO with On-Demand Communication (ODC): policy updates packed and balanced across ranks (LB-Mini), in TRL's
script style.

With no argument it runs on CPU in a couple of minutes: a tiny Llama-style model built from a config, the SFT
example's word-level tokenizer, a built-in prompt set whose prompts ask for long-tailed reply lengths, and two
rule-based rewards (reply length close to the asked length; reply words taken from the prompt): the demo's parts, from
`hf_odc.demo` (`hf_odc/demo/rewards.py` shows how a reward function is written).

```bash
# one process
python examples/grpo.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/grpo.py
hf-odc grpo  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the plain-FSDP2 baseline (every rank trains on the same number of microbatches)
accelerate launch --config_file examples/odc_cpu.yaml examples/grpo.py --odc false --balance lb-micro

# GPUs: a random Qwen2.5-1.5B-shaped policy; rollouts injected with long-tailed completions up to 16K tokens (no
# generation time: it measures the policy updates), 8 generations per prompt
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/grpo.py \
    --model_config qwen2.5-1.5b --rollouts synthetic --max_completion_length 16384 --num_generations 8 \
    --per_device_train_batch_size 16 --gradient_checkpointing true --max_steps 10

# generating with vLLM, an engine colocated on each CPU process (vLLM's own environment: see docs/api.md, "vLLM on
# CPU, end to end"); the built-in model is then the "tiny-vllm" shape, saved under the output directory for the engine
PYTHONPATH=$PWD VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/accelerate launch --config_file examples/odc_cpu.yaml \
    examples/grpo.py --use_vllm true --vllm_mode colocate

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

from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from hf_odc.demo import (
    ExampleParser,
    PromptScriptArguments,
    SyntheticRollouts,
    build_model,
    built_in_prompts,
    echo_reward,
    length_reward,
    load_tokenizer,
    make_trainer,
    policy_model_config,
    save_policy_for_reference,
    train_and_save,
)
from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer


@dataclass
class GRPOScriptArguments(PromptScriptArguments):
    """The generating examples' script arguments (`hf_odc.demo.PromptScriptArguments`: TRL's, plus `model_config`,
    `length_distribution` and `num_prompts`), plus where this example's completions come from.

    Args:
        rollouts (`str`, *optional*, defaults to `"generate"`):
            `"generate"` (transformers `generate`), `"synthetic"` (completions injected through `rollout_func`,
            lengths from `length_distribution` scaled to `max_completion_length`) or `"skewed"` (injected: long on
            rank 0, short elsewhere).
    """

    rollouts: str = field(
        default="generate",
        metadata={"help": "Where completions come from.", "choices": ["generate", "synthetic", "skewed"]},
    )


def build_trainer(
    script_args: GRPOScriptArguments, training_args: ODCGRPOConfig, model_args: ModelConfig
) -> ODCGRPOTrainer:
    tokenizer = load_tokenizer(model_args)
    model = build_model(policy_model_config(script_args, training_args), model_args, tokenizer, seed=training_args.seed)
    peft_config = get_peft_config(model_args)
    save_policy_for_reference(model, training_args, model_args, peft_config, tokenizer)
    dataset = built_in_prompts(script_args, training_args)
    rollout_func = None
    if script_args.rollouts != "generate":
        rollout_func = SyntheticRollouts(script_args.rollouts, script_args.length_distribution, training_args.seed)
    return make_trainer(
        ODCGRPOTrainer,
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


def make_parser() -> ExampleParser:
    parser = ExampleParser((GRPOScriptArguments, ODCGRPOConfig, ModelConfig), check_dataset=None)  # built-in prompts
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
