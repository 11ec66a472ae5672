"""Stock TRL ``DPOTrainer`` on one process against ``ODCDPOTrainer`` on several, on the built-in tiny Qwen2.5-VL and
its synthetic image preference pairs (``hf_odc.demo.vision_preference_dataset``), with a reference model.

``python tests/support/_dpo_vision_parity.py trl MODEL_DIR OUT vision`` trains stock TRL with the global minibatch (8
pairs) in one batch; ``accelerate launch ... odc ...`` trains ``ODCDPOTrainer`` with 2 pairs per process and 2
accumulation calls (the same 8 pairs per optimizer step, sequential sampling). The second step's pairs hold one image
between them, so one rank runs that step, and its reference pass, with no image. Rank 0 saves the logged steps and the
full parameters.
"""

from __future__ import annotations

import os

from _parity import TRAINING, run_cases, trained_state
from transformers import Qwen2_5_VLForConditionalGeneration

from hf_odc.demo import build_vision_processor, vision_preference_dataset

STEPS, MINIBATCH = 2, 8
COMMON = TRAINING | dict(
    max_steps=STEPS, beta=0.5, max_length=64, train_sampling_strategy="sequential", gradient_checkpointing=False
)
LONE_IMAGE = MINIBATCH + 1  # the second step's one pair with images; its other pairs have none


def parity_dataset():
    """The cases' pairs: the demo's mixed image counts in the first step, one pair with images in the second."""
    dataset = vision_preference_dataset(MINIBATCH * STEPS, seed=0)
    return dataset.map(
        lambda row, index: row if index < MINIBATCH or index == LONE_IMAGE else {**row, "images": []},
        with_indices=True,
    )


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import DPOConfig, DPOTrainer

    from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer

    model, ref_model = (
        Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa") for _ in range(2)
    )
    processor, dataset = build_vision_processor(), parity_dataset()
    if kind == "trl":
        args = DPOConfig(output_dir, per_device_train_batch_size=MINIBATCH, **COMMON)
        trainer = DPOTrainer(model, ref_model, args=args, train_dataset=dataset, processing_class=processor)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args = ODCDPOConfig(
            output_dir, per_device_train_batch_size=MINIBATCH // world_size // 2, gradient_accumulation_steps=2,
            max_tokens_per_microbatch=160, cost_model="tokens", **COMMON,
        )  # fmt: skip
        trainer = ODCDPOTrainer(model, ref_model, args=args, train_dataset=dataset, processing_class=processor)
    trainer.train()
    return trained_state(trainer)


if __name__ == "__main__":
    run_cases(train_case)
