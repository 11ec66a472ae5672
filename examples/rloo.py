# Copyright 2026 The hf_odc authors. Apache-2.0.
"""REINFORCE Leave-One-Out (RLOO) with On-Demand Communication (ODC): policy updates packed and balanced across ranks
(LB-Mini), in TRL's script style.

With no argument it runs on CPU in a couple of minutes, on the GRPO example's parts (`hf_odc.demo`): a tiny
Llama-style model built from a config, the word-level tokenizer, the built-in prompts asking for long-tailed reply
lengths and two rule-based rewards. Each rank decodes its prompts with transformers (`--odc_generation`); TRL's RLOO
then scores them, and hf_odc plans the policy updates. TRL's default `--beta 0.05` keeps a reference model (the initial
policy, saved under the output directory) for the KL penalty in the rewards; `--use_peft` trains a LoRA adapter, whose
KL reference is the same model with the adapter disabled.

```bash
# one process
python examples/rloo.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/rloo.py
hf-odc rloo  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the plain-FSDP2 baseline (every rank trains on the same number of microbatches)
accelerate launch --config_file examples/odc_cpu.yaml examples/rloo.py --odc false --balance lb-micro

# a LoRA adapter, no reference model
accelerate launch --config_file examples/odc_cpu.yaml examples/rloo.py --use_peft --beta 0

# a real model from local disk
accelerate launch --config_file examples/odc.yaml examples/rloo.py --model_name_or_path /models/Qwen2.5-1.5B-Instruct
```
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
from hf_odc.trainer import ODCRLOOConfig, ODCRLOOTrainer


@dataclass
class RLOOScriptArguments(PromptScriptArguments):
    """The generating examples' script arguments (`hf_odc.demo.PromptScriptArguments`: TRL's, plus `model_config`,
    `length_distribution` and `num_prompts`), plus where this example's completions come from.

    Args:
        rollouts (`str`, *optional*, defaults to `"generate"`):
            `"generate"` (transformers `generate`, or vLLM) or `"synthetic"`: completions drawn reproducibly (lengths
            from `length_distribution` scaled to `max_completion_length`) in place of the decoding
            (`hf_odc.demo.SyntheticRollouts.replace_decoding`), for benchmarks of the updates alone.
    """

    rollouts: str = field(
        default="generate",
        metadata={"help": "Where completions come from.", "choices": ["generate", "synthetic"]},
    )


def main(script_args: RLOOScriptArguments, training_args: ODCRLOOConfig, model_args: ModelConfig) -> None:
    tokenizer = load_tokenizer(model_args)
    model = build_model(policy_model_config(script_args, training_args), model_args, tokenizer, seed=training_args.seed)
    peft_config = get_peft_config(model_args)
    save_policy_for_reference(model, training_args, model_args, peft_config, tokenizer)
    trainer = make_trainer(
        ODCRLOOTrainer,
        model=model,
        reward_funcs=[length_reward, echo_reward],
        args=training_args,
        train_dataset=built_in_prompts(script_args, training_args),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if script_args.rollouts == "synthetic":
        SyntheticRollouts("synthetic", script_args.length_distribution, training_args.seed).replace_decoding(trainer)
    train_and_save(trainer)


def make_parser() -> ExampleParser:
    parser = ExampleParser((RLOOScriptArguments, ODCRLOOConfig, ModelConfig), check_dataset=None)  # built-in prompts
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(
        output_dir="odc-rloo-output",
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
