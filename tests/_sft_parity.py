"""Stock TRL ``SFTTrainer`` on one process against ``ODCSFTTrainer`` on any number, both with gradient accumulation.

``python tests/_sft_parity.py trl MODEL_DIR OUT`` trains stock ``trl.SFTTrainer`` on one process (8 samples per
accumulation step, 4 accumulation steps: 32 samples per optimizer step); ``accelerate launch ... tests/_sft_parity.py
odc MODEL_DIR OUT`` trains ``ODCSFTTrainer`` with ``8 / world_size`` samples per process and accumulation step, so
each optimizer step sees the same 32 samples (sequential sampling), planned as one ODC minibatch. Rank 0 saves the
logged steps and the full parameters.
"""

from __future__ import annotations

import os
import sys

import torch
from _parity import finish, trained_state
from transformers import AutoModelForCausalLM

from hf_odc.demo import build_tokenizer, chat_dataset

BATCH, ACCUMULATION, STEPS = 8, 4, 2
COMMON = dict(
    gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=0.5, optim="sgd", logging_steps=1,
    save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=7, disable_tqdm=True, max_length=96,
    train_sampling_strategy="sequential",
)  # fmt: skip


def main() -> None:
    from trl import SFTConfig, SFTTrainer

    from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer

    kind, model_dir, out = sys.argv[1:]
    dataset = chat_dataset(BATCH * ACCUMULATION * STEPS, COMMON["max_length"], "swe-smith", seed=0)
    if kind == "trl":
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        args = SFTConfig(f"{out}.run", per_device_train_batch_size=BATCH, **COMMON)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=build_tokenizer())
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args = ODCSFTConfig(
            f"{out}.run", per_device_train_batch_size=BATCH // world_size, max_tokens_per_microbatch=160,
            cost_model="tokens", **COMMON,
        )  # fmt: skip
        trainer = ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=build_tokenizer())
    trainer.train()
    result = trained_state(trainer)
    if result is not None:
        torch.save(result, out)
    finish()


if __name__ == "__main__":
    main()
