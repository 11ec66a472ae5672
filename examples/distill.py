# Copyright 2026 The hf_odc authors. Apache-2.0.
"""On-policy distillation with On-Demand Communication (ODC): the student's updates packed and balanced across ranks
(LB-Mini), the teacher sharded and scoring the packed rows, in TRL's script style.

With no argument it runs on CPU in a couple of minutes, on the GRPO example's parts (`hf_odc.demo`): a tiny
Llama-style student built from a config, a teacher of the same shape with other random weights (`--teacher_config`
for another shape of the same vocabulary), the word-level tokenizer and the built-in prompts. Each rank decodes its
prompts with the student (`--odc_generation`); the teacher's next-token distributions on the completions are the
target, through TRL's divergence (`--beta`: 1.0, TRL's default, the reverse KL; 0.0 the forward KL; between, the
generalized JSD; `--temperature`).

```bash
# one process
python examples/distill.py

# two CPU processes, ODC + LB-Mini
accelerate launch --config_file examples/odc_cpu.yaml examples/distill.py
hf-odc distill  # the same, through hf_odc's command line (hf_odc/cli): every input checked before a process starts

# the generalized JSD, a LoRA student
accelerate launch --config_file examples/odc_cpu.yaml examples/distill.py --beta 0.5 --use_peft

# real models from local disk (the same vocabulary)
accelerate launch --config_file examples/odc.yaml examples/distill.py \
    --model_name_or_path /models/Qwen2.5-0.5B-Instruct --teacher_model_name_or_path /models/Qwen2.5-1.5B-Instruct
```
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from hf_odc.demo import (
    ExampleParser,
    PromptScriptArguments,
    SyntheticRollouts,
    build_model,
    built_in_prompts,
    load_tokenizer,
    make_trainer,
    train_and_save,
)
from hf_odc.trainer import ODCDistillationConfig, ODCDistillationTrainer


@dataclass
class DistillationScriptArguments(PromptScriptArguments):
    """The generating examples' script arguments (`hf_odc.demo.PromptScriptArguments`: TRL's, plus `model_config`,
    here the student's, `length_distribution` and `num_prompts`), plus this example's teacher and where its
    completions come from.

    Args:
        teacher_config (`str`, *optional*, defaults to `"tiny"`):
            Teacher built from a config (other random weights than the student's) when `teacher_model_name_or_path`
            is not set; the same choices as `model_config`.
        rollouts (`str`, *optional*, defaults to `"generate"`):
            `"generate"` (transformers `generate`, or vLLM) or `"synthetic"`: completions drawn reproducibly (lengths
            from `length_distribution` scaled to `max_completion_length`) in place of the decoding
            (`hf_odc.demo.SyntheticRollouts.replace_decoding`), for benchmarks of the updates alone.
    """

    teacher_config: str = field(
        default="tiny",
        metadata={"help": "Teacher config when teacher_model_name_or_path is unset (the same choices)."},
    )
    rollouts: str = field(
        default="generate",
        metadata={"help": "Where completions come from.", "choices": ["generate", "synthetic"]},
    )


def main(
    script_args: DistillationScriptArguments, training_args: ODCDistillationConfig, model_args: ModelConfig
) -> None:
    tokenizer = load_tokenizer(model_args)
    model = build_model(script_args.model_config, model_args, tokenizer, seed=training_args.seed)
    teacher = training_args.teacher_model_name_or_path
    if teacher is None:
        built = dataclasses.replace(model_args, model_name_or_path=None)
        teacher = build_model(script_args.teacher_config, built, tokenizer, seed=training_args.seed + 1)
    trainer = make_trainer(
        ODCDistillationTrainer,
        model=model,
        teacher_model=teacher,
        args=training_args,
        train_dataset=built_in_prompts(script_args, training_args),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    if script_args.rollouts == "synthetic":
        SyntheticRollouts("synthetic", script_args.length_distribution, training_args.seed).replace_decoding(trainer)
    train_and_save(trainer)


def make_parser() -> ExampleParser:
    parser = ExampleParser((DistillationScriptArguments, ODCDistillationConfig, ModelConfig), check_dataset=None)
    # Defaults for the no-argument CPU demo; every one of them can be overridden on the command line.
    parser.set_defaults(
        output_dir="odc-distill-output",
        per_device_train_batch_size=8,
        max_completion_length=48,
        max_steps=10,
        learning_rate=1e-3,
    )
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
