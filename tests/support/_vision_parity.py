"""Stock TRL on one process against the ODC trainers on several, on the built-in tiny Qwen2.5-VL and its synthetic
image data (``hf_odc.demo.vision``), per case: ``sft`` (``SFTTrainer`` / ``ODCSFTTrainer``, image conversations),
``dpo`` (``DPOTrainer`` / ``ODCDPOTrainer`` with a reference model, image preference pairs), ``grpo`` and ``rloo``
(``GRPOTrainer`` / ``ODCGRPOTrainer``, ``RLOOTrainer`` / ``ODCRLOOTrainer``: image prompts, TRL's own prompt processing
and scoring, the decoding replaced by the demo's synthetic completions, :class:`hf_odc.demo.SyntheticRollouts`), and
``grpo-generate`` (one GRPO step with transformers' own decoding of the image prompts: it runs, without parity, as
each rank samples its own completions).

``python tests/support/_vision_parity.py trl MODEL_DIR OUT CASE...`` trains stock TRL with each step's global minibatch
in one batch, no accumulation: Qwen2.5-VL sets ``accepts_loss_kwargs = False``, so TRL's SFT loss under accumulation
would be the mean of the accumulation batches' token means, while ODC's is the minibatch's token mean, which is TRL's
loss of one batch holding the minibatch. ``accelerate launch ... odc ...`` trains the ODC trainer with a quarter of
the minibatch per process and 2 accumulation calls (the same samples per optimizer step, sequential sampling). Each
case's second step holds one sample (pair) with images, so one rank runs that step with no image (no vision tower, no
dummy batch). The online cases have 4 prompts of 3 rollouts per step, no accumulation (each rank generating a half,
then re-planned); every prompt of their first step has images (1 or 2) and none of the second's has any: stock TRL
cannot process a batch of prompts with and without images (its processor is given ``None`` for the image-less ones),
so the second step is the one in which the vision-language policy trains without its vision tower. Rank 0 saves, per
case, the logged steps and the full parameters.
"""

from __future__ import annotations

import os

from _parity import TRAINING, run_cases, trained_state
from datasets import concatenate_datasets
from transformers import LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

from hf_odc.demo import (
    SyntheticRollouts,
    build_llava_processor,
    build_vision_processor,
    length_reward,
    vision_dataset,
    vision_preference_dataset,
    vision_prompt_dataset,
)

STEPS = 2
# (samples per step, ODC's microbatch tokens, dataset, other settings); the microbatch sizes give the ranks different
# microbatch counts in the first step and a microbatch each in the second
CASES = {
    "sft": (12, 190, vision_dataset, dict(max_length=96)),
    "dpo": (8, 160, vision_preference_dataset, dict(max_length=64, beta=0.5, gradient_checkpointing=False)),
    "sft-llava": (12, 130, vision_dataset, dict(max_length=96)),
}
LLAVA_CASES = {"sft-llava"}  # the LLaVA-style demo model (saved in MODEL_DIR/llava) and its processor
ONLINE = dict(num_generations=3, max_completion_length=16, shuffle_dataset=False)
ONLINE_CASES = {  # (rollouts per step, ODC's microbatch tokens, other settings)
    "grpo": (12, 112, dict(ONLINE, loss_type="grpo")),
    "rloo": (12, 112, dict(ONLINE, beta=0.0)),
    # transformers' generate with the images (ODC: the "gathered" mode), one step: it runs (sampling differs by rank)
    "grpo-generate": (12, 112, dict(ONLINE, loss_type="grpo", max_completion_length=4)),
}


def lone_image_dataset(name: str):
    """The case's samples: the demo's mixed image counts in the first step; in the second, images only in its first
    sample the demo gives images (it gives none to every third, from index 2)."""
    minibatch, _, dataset, _ = CASES[name]
    lone = minibatch + (minibatch % 3 == 2)
    return dataset(minibatch * STEPS, seed=0).map(
        lambda row, index: row if index < minibatch or index == lone else {**row, "images": []}, with_indices=True
    )


def online_prompts(per_step: int):
    """The online cases' prompts: the demo's with images (it gives none to every third) in the first step, then as
    many with their images removed."""
    demo = vision_prompt_dataset(3 * per_step, seed=0)
    imaged = [index for index in range(len(demo)) if index % 3 != 2]
    step_1, step_2 = demo.select(imaged[:per_step]), demo.select(imaged[per_step : 2 * per_step])
    return concatenate_datasets([step_1, step_2.map(lambda row: {**row, "images": []})])


def train_online_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    """GRPO's or RLOO's case: TRL's processing and scoring of the image prompts, the decoding replaced."""
    rollouts, max_tokens, settings = ONLINE_CASES[name]
    steps = 1 if name == "grpo-generate" else STEPS
    trainer_class, args = case_setup(
        kind, name, output_dir, rollouts, max_tokens, TRAINING | dict(max_steps=steps) | settings
    )
    prompts = online_prompts(rollouts // settings["num_generations"])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa")
    processor = build_vision_processor()
    processor.tokenizer.padding_side = "left"  # as TRL loads a processor: its prompts are left-padded
    trainer = trainer_class(
        model=model, reward_funcs=length_reward, args=args, train_dataset=prompts, processing_class=processor
    )
    completions = SyntheticRollouts("synthetic", "swe-smith", seed=0)
    complete = completions.complete
    if name == "grpo":  # GRPO's decoding returns the sampling log-probabilities too
        complete = lambda prompt_ids, trainer: (completions.complete(prompt_ids, trainer), None)  # noqa: E731
    if name != "grpo-generate":
        trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: complete(prompt_ids, trainer)
    trainer.train()
    return trained_state(trainer)


def case_setup(
    kind: str, name: str, output_dir: str, samples: int, max_tokens: int, settings: dict, accumulation: int = 1
) -> tuple[type, object]:
    """The case's trainer class and config: stock TRL's with the step's ``samples`` in one batch, ODC's with a share
    per process and accumulation call, token-costed microbatches of at most ``max_tokens``."""
    import trl

    from hf_odc import trainer as odc

    base = {"sft": "SFT", "sft-llava": "SFT", "dpo": "DPO", "grpo": "GRPO", "grpo-generate": "GRPO", "rloo": "RLOO"}[
        name
    ]
    module, prefix = (trl, "") if kind == "trl" else (odc, "ODC")
    config_class, trainer_class = getattr(module, f"{prefix}{base}Config"), getattr(module, f"{prefix}{base}Trainer")
    if kind == "trl":
        return trainer_class, config_class(output_dir, per_device_train_batch_size=samples, **settings)
    per_device = samples // int(os.environ.get("WORLD_SIZE", "1")) // accumulation
    return trainer_class, config_class(
        output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_tokens_per_microbatch=max_tokens, cost_model="tokens", **settings,
    )  # fmt: skip


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    if name in ONLINE_CASES:
        return train_online_case(kind, model_dir, name, output_dir)
    minibatch, max_tokens, _, settings = CASES[name]
    settings = TRAINING | dict(max_steps=STEPS, train_sampling_strategy="sequential") | settings
    # ODC: a quarter of the minibatch per process and accumulation call (2 of them)
    trainer_class, args = case_setup(kind, name, output_dir, minibatch, max_tokens, settings, accumulation=2)
    llava = name in LLAVA_CASES
    model_class = LlavaForConditionalGeneration if llava else Qwen2_5_VLForConditionalGeneration
    directory = os.path.join(model_dir, "llava") if llava else model_dir
    load = lambda: model_class.from_pretrained(directory, attn_implementation="sdpa")  # noqa: E731
    references = {"ref_model": load()} if name == "dpo" else {}
    processor = build_llava_processor() if llava else build_vision_processor()
    trainer = trainer_class(
        load(), args=args, train_dataset=lone_image_dataset(name), processing_class=processor, **references
    )
    trainer.train()
    return trained_state(trainer)


if __name__ == "__main__":
    run_cases(train_case)
