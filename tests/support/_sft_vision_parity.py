"""Stock TRL ``SFTTrainer`` on one process against ``ODCSFTTrainer`` on several, on the built-in tiny Qwen2.5-VL and
its synthetic image dataset (``hf_odc.demo.vision``).

``python tests/support/_sft_vision_parity.py trl MODEL_DIR OUT vision`` trains stock TRL with the whole global
minibatch (12 samples) in one batch, no accumulation: Qwen2.5-VL sets ``accepts_loss_kwargs = False``, so TRL's loss
under accumulation would be the mean of the accumulation batches' token means, while ODC's is the minibatch's token
mean, which is TRL's loss of one batch holding the minibatch. ``accelerate launch ... odc ...`` trains
``ODCSFTTrainer`` with 3 samples per process and 2 accumulation calls (the same 12 samples per optimizer step,
sequential sampling). The second step's samples hold one image between them, so one rank runs that step with no image
(no vision tower, no dummy batch). Rank 0 saves the logged steps and the full parameters.
"""

from __future__ import annotations

import os

from _parity import TRAINING, run_cases, trained_state
from transformers import Qwen2_5_VLForConditionalGeneration

from hf_odc.demo import build_vision_processor, vision_dataset

STEPS, MINIBATCH = 2, 12
COMMON = TRAINING | dict(max_steps=STEPS, max_length=96, train_sampling_strategy="sequential")
LONE_IMAGE = MINIBATCH  # the second step's one sample with images; its other samples have none


def parity_dataset():
    """The cases' samples: the demo's mixed image counts in the first step, one image sample in the second."""
    dataset = vision_dataset(MINIBATCH * STEPS, seed=0)
    return dataset.map(
        lambda row, index: row if index < MINIBATCH or index == LONE_IMAGE else {**row, "images": []},
        with_indices=True,
    )


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import SFTConfig, SFTTrainer

    from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa")
    processor, dataset = build_vision_processor(), parity_dataset()
    if kind == "trl":
        args = SFTConfig(output_dir, per_device_train_batch_size=MINIBATCH, **COMMON)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=processor)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args = ODCSFTConfig(
            output_dir, per_device_train_batch_size=MINIBATCH // world_size // 2, gradient_accumulation_steps=2,
            max_tokens_per_microbatch=190, cost_model="tokens", **COMMON,
        )  # fmt: skip
        trainer = ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=processor)
    trainer.train()
    return trained_state(trainer)


if __name__ == "__main__":
    run_cases(train_case)
