# Copyright 2026 The hf_odc authors. Apache-2.0.
"""GRPO with tool calling (TRL's ``tools=``) and On-Demand Communication (ODC), in TRL's script style: multi-turn
rollouts (the policy calls a tool, the tool's result is appended, the policy answers) packed and balanced whole across
ranks, the tool's results never trained on.

With no argument it runs on CPU in a couple of minutes: a tiny Llama-style model built from a config, the demo's
word-level tokenizer with a tool role and a chat template that renders tool calls, the GRPO example's built-in
prompts, one tool (`hf_odc.demo.lookup`) and a reward for each successful tool result (`hf_odc.demo.tool_use_reward`).

**The scripted policy is a demo device.** A random model never writes a well-formed tool call, so with no
`--model_name_or_path` every token is forced by a logits processor (`hf_odc.demo.scripted_generation` with a
`LookupScript`): the `g`-th generation of each prompt calls the tool `min(g, --max_calls)` times, one call per turn,
then answers with words (longer for larger `g`, the longest completion filling `--max_completion_length`). TRL's tool
loop parses the calls, runs the tool and generates the next turns; the trainer masks the tool results out of the loss
(TRL's `tool_mask`) and trains on the rest. The forced rollouts do not improve as the model trains. A real model from
`--model_name_or_path` writes its own calls (its tokenizer's chat template must render tools, and TRL must know how
to parse its calls) and nothing is forced.

```bash
# one process
python examples/grpo_tools.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/grpo_tools.py

# GPUs: a random Qwen2.5-1.5B-shaped policy, scripted multi-turn completions up to 512 tokens, bf16
accelerate launch --config_file examples/odc.yaml --num_processes 2 examples/grpo_tools.py \
    --model_config qwen2.5-1.5b --max_completion_length 512 --num_generations 8 \
    --per_device_train_batch_size 16 --max_steps 20
```

Each step logs TRL's `tools/call_frequency` (tool calls per rollout) and `tools/failure_frequency`, and hf_odc's
`generation_s` (TRL's generation with its tool loop, and the rewards), `step_time` (the whole step, generation
included), `step_s` and `tokens_per_second` (the policy update); the run ends with one line summing them up: the
rollouts' share of the step and the tokens decoded per second (the first step, which compiles the static decoder on a
GPU, left out when there are others).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from hf_odc.demo import (
    ExampleParser,
    LookupScript,
    PromptScriptArguments,
    build_model,
    build_tool_tokenizer,
    built_in_prompts,
    load_tokenizer,
    lookup,
    make_trainer,
    save_policy_for_reference,
    scripted_generation,
    tool_use_reward,
    train_and_save,
)
from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer


@dataclass
class ToolScriptArguments(PromptScriptArguments):
    """The generating examples' script arguments (`hf_odc.demo.PromptScriptArguments`: TRL's, plus `model_config`,
    `length_distribution` and `num_prompts`), plus the scripted policy's number of calls.

    Args:
        max_calls (`int`, *optional*, defaults to `2`):
            Most tool calls of a scripted rollout (the `g`-th generation of a prompt makes `min(g, max_calls)`).
            Unused with `model_name_or_path`.
    """

    max_calls: int = field(default=2, metadata={"help": "Most tool calls of a scripted rollout."})


def scripted_policy(script_args: ToolScriptArguments, training_args: ODCGRPOConfig) -> LookupScript:
    """The scripted policy, its longest completion filling ``max_completion_length``."""
    script = LookupScript(training_args.num_generations, max_calls=script_args.max_calls)
    return script.filling(training_args.max_completion_length)


def build_trainer(
    script_args: ToolScriptArguments, training_args: ODCGRPOConfig, model_args: ModelConfig
) -> ODCGRPOTrainer:
    tokenizer = load_tokenizer(model_args) if model_args.model_name_or_path else build_tool_tokenizer()
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)
    peft_config = get_peft_config(model_args)
    save_policy_for_reference(model, training_args, model_args, peft_config)
    return make_trainer(
        ODCGRPOTrainer,
        model=model,
        reward_funcs=[tool_use_reward],
        args=training_args,
        train_dataset=built_in_prompts(script_args, training_args),
        processing_class=tokenizer,
        tools=[lookup],
        peft_config=peft_config,
    )


def rollout_summary(log_history: list[dict], generation_batch_size: int) -> str:
    """One line from the steps' logs: tool calls per rollout, the rollouts' share of the step (``generation_s`` over
    ``step_time``), the tokens the policy decoded per second of it (TRL's ``completions/mean_length`` counts the
    policy's tokens only, not the tools'), and the update's ``tokens_per_second``; over the steps after the first
    when there are others (the first compiles the static decoder on a GPU)."""
    steps = [entry for entry in log_history if "generation_s" in entry and "step_time" in entry]
    if len(steps) > 1:
        steps = steps[1:]
    generation = sum(entry["generation_s"] for entry in steps)
    decoded = sum(entry["completions/mean_length"] * generation_batch_size for entry in steps)
    share = generation / max(sum(entry["step_time"] for entry in steps), 1e-9)
    calls = sum(entry["tools/call_frequency"] for entry in steps) / len(steps)
    update = sum(entry["tokens_per_second"] for entry in steps) / len(steps)
    return (
        f"Over {len(steps)} steps: {calls:.2f} tool calls per rollout; rollouts (generation, tools, rewards) "
        f"{share:.1%} of the step, {decoded / max(generation, 1e-9):.0f} decoded tokens/s; update "
        f"{update:.0f} tokens/s."
    )


def main(script_args: ToolScriptArguments, training_args: ODCGRPOConfig, model_args: ModelConfig) -> None:
    trainer = build_trainer(script_args, training_args, model_args)
    if model_args.model_name_or_path:
        train_and_save(trainer)
    else:
        with scripted_generation(trainer.processing_class, scripted_policy(script_args, training_args)):
            train_and_save(trainer)
    trainer.accelerator.print(rollout_summary(trainer.state.log_history, training_args.generation_batch_size))


class ToolParser(ExampleParser):
    """:class:`~hf_odc.demo.ExampleParser`, decoding with ``odc_generation="static"`` unless vLLM decodes, which the
    scripted policy cannot force (it needs ``--model_name_or_path``)."""

    def complete(self, namespace: argparse.Namespace, given: set[str]) -> None:
        super().complete(namespace, given)
        if namespace.use_vllm:
            if not namespace.model_name_or_path:
                self.error("--use_vllm needs --model_name_or_path: the scripted policy forces transformers' generate")
            if "odc_generation" not in given:
                namespace.odc_generation = None


def make_parser() -> ToolParser:
    parser = ToolParser((ToolScriptArguments, ODCGRPOConfig, ModelConfig), check_dataset=None)  # built-in prompts
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(
        output_dir="odc-grpo-tools-output",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=48,
        max_steps=4,
        learning_rate=1e-3,
        odc_generation="static",
    )
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
