"""Stock TRL on one process against the ODC trainers on several, on the built-in tiny Qwen2.5-VL and its synthetic
image data (``hf_odc.demo.vision``), per case: ``sft`` (``SFTTrainer`` / ``ODCSFTTrainer``, image conversations) and
``dpo`` (``DPOTrainer`` / ``ODCDPOTrainer`` with a reference model, image preference pairs).

``python tests/support/_vision_parity.py trl MODEL_DIR OUT CASE...`` trains stock TRL with each step's global minibatch
in one batch, no accumulation: Qwen2.5-VL sets ``accepts_loss_kwargs = False``, so TRL's SFT loss under accumulation
would be the mean of the accumulation batches' token means, while ODC's is the minibatch's token mean, which is TRL's
loss of one batch holding the minibatch. ``accelerate launch ... odc ...`` trains the ODC trainer with a quarter of
the minibatch per process and 2 accumulation calls (the same samples per optimizer step, sequential sampling). Each
case's second step holds one sample (pair) with images, so one rank runs that step with no image (no vision tower, no
dummy batch). Rank 0 saves, per case, the logged steps and the full parameters.
"""

from __future__ import annotations

import os

from _parity import TRAINING, run_cases, trained_state
from transformers import Qwen2_5_VLForConditionalGeneration

from hf_odc.demo import build_vision_processor, vision_dataset, vision_preference_dataset

STEPS = 2
# (samples per step, ODC's microbatch tokens, dataset, other settings); the microbatch sizes give the ranks different
# microbatch counts in the first step and a microbatch each in the second
CASES = {
    "sft": (12, 190, vision_dataset, dict(max_length=96)),
    "dpo": (8, 160, vision_preference_dataset, dict(max_length=64, beta=0.5, gradient_checkpointing=False)),
}


def lone_image_dataset(name: str):
    """The case's samples: the demo's mixed image counts in the first step; in the second, images only in its first
    sample the demo gives images (it gives none to every third, from index 2)."""
    minibatch, _, dataset, _ = CASES[name]
    lone = minibatch + (minibatch % 3 == 2)
    return dataset(minibatch * STEPS, seed=0).map(
        lambda row, index: row if index < minibatch or index == lone else {**row, "images": []}, with_indices=True
    )


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer, ODCSFTConfig, ODCSFTTrainer

    minibatch, max_tokens, _, settings = CASES[name]
    settings = TRAINING | dict(max_steps=STEPS, train_sampling_strategy="sequential") | settings
    config_class, trainer_class = {
        ("trl", "sft"): (SFTConfig, SFTTrainer),
        ("odc", "sft"): (ODCSFTConfig, ODCSFTTrainer),
        ("trl", "dpo"): (DPOConfig, DPOTrainer),
        ("odc", "dpo"): (ODCDPOConfig, ODCDPOTrainer),
    }[kind, name]
    if kind == "trl":
        args = config_class(output_dir, per_device_train_batch_size=minibatch, **settings)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args = config_class(
            output_dir, per_device_train_batch_size=minibatch // world_size // 2, gradient_accumulation_steps=2,
            max_tokens_per_microbatch=max_tokens, cost_model="tokens", **settings,
        )  # fmt: skip
    load = lambda: Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa")  # noqa: E731
    references = {"ref_model": load()} if name == "dpo" else {}
    trainer = trainer_class(
        load(), args=args, train_dataset=lone_image_dataset(name), processing_class=build_vision_processor(),
        **references,
    )  # fmt: skip
    trainer.train()
    return trained_state(trainer)


if __name__ == "__main__":
    run_cases(train_case)
