"""Stock TRL ``SFTTrainer`` on one process against ``ODCSFTTrainer`` on any number, per case, saving what to compare.

``python tests/support/_sft_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.SFTTrainer`` on one process;
``accelerate launch ... tests/support/_sft_parity.py odc MODEL_DIR OUT CASE...`` trains ``ODCSFTTrainer`` with
``batch / world_size`` samples per process and accumulation step, so each optimizer step sees the same samples
(sequential sampling), planned as one ODC minibatch. Cases (``CASES``): ``accumulation``, 8 samples per accumulation
step and 4 accumulation steps (32 samples per optimizer step); the MoE cases (a Mixture-of-Experts model in
``MODEL_DIR``): ``moe-aux``, the router's load-balancing loss on, the 32 samples in one TRL forward (whose loss is
then over the whole minibatch, as ODC's is: ``hf_odc.trainer.core._moe``), and ``moe-no-aux``, the loss off, with
accumulation; the long-document cases, launched with Accelerate's ``parallelism_config_sp_size: 2``, documents of up
to twice ODC's microbatch tokens mixed with short ones, with and without accumulation, and with a LoRA adapter. Rank 0
saves, per case, the logged steps and the full parameters.
"""

from __future__ import annotations

import os

from _parity import TRAINING, run_cases, sequence_parallel, trained_state
from transformers import AutoModelForCausalLM

from hf_odc.demo import build_tokenizer, chat_dataset

STEPS = 2
COMMON = TRAINING | dict(max_steps=STEPS, max_length=96, train_sampling_strategy="sequential")
# (samples per accumulation step, accumulation steps, ODC's microbatch tokens, other settings); 112 tokens give the
# MoE cases' ranks different numbers of microbatches in their second step
MOE_CASES = {
    "moe-aux": (32, 1, 112, {"router_aux_loss_coef": 0.2}),
    "moe-no-aux": (8, 4, 112, {"router_aux_loss_coef": 0.0}),
}
# Sequence parallelism (launched with `parallelism_config_sp_size: 2`): 32-token microbatches, documents of up to 59
LONG_DOCUMENT_CASES = {
    "long-documents": (16, 1, 32, {}),
    "long-documents-accumulation": (8, 2, 32, {}),
    "long-documents-lora": (16, 1, 32, {"lora": True}),
}
# On 4 processes, sequence parallelism set per case (ODC's `parallelism_config`): documents of up to 59 tokens on
# microbatches of 30 (groups of 2) or 15 (groups of 4), so each group splits documents of up to its whole capacity
FOUR_RANK_CASES = {
    "four-ranks-sp2": (16, 1, 30, {"sp_size": 2}),
    "four-ranks-sp4": (16, 1, 15, {"sp_size": 4}),
    "four-ranks-sp4-lora-accumulation": (8, 2, 15, {"sp_size": 4, "lora": True}),
}
CASES = {"accumulation": (8, 4, 160, {}), **MOE_CASES, **LONG_DOCUMENT_CASES, **FOUR_RANK_CASES}


def demo_token_fields() -> dict:
    """The model config fields of the demo tokenizer's vocabulary and special tokens (what :func:`_parity.parity_runs`
    takes as ``config``), for the cases trained on TRL's tokenization of chats."""
    tokenizer = build_tokenizer()
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id)  # fmt: skip


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer

    batch, accumulation, max_tokens, settings = CASES[name]
    settings = COMMON | {"gradient_accumulation_steps": accumulation} | settings
    lora = settings.pop("lora", False)
    sp_size = settings.pop("sp_size", None)
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]) if lora else None
    dataset = chat_dataset(batch * accumulation * STEPS, COMMON["max_length"], "swe-smith", seed=0)
    if kind == "trl":
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        args = SFTConfig(output_dir, per_device_train_batch_size=batch, **settings)
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=build_tokenizer(), peft_config=peft_config
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args = ODCSFTConfig(
            output_dir, per_device_train_batch_size=batch // world_size, max_tokens_per_microbatch=max_tokens,
            cost_model="tokens", parallelism_config=sequence_parallel(sp_size), **settings,
        )  # fmt: skip
        trainer = ODCSFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=build_tokenizer(), peft_config=peft_config
        )
    trainer.train()
    return trained_state(trainer)


if __name__ == "__main__":
    run_cases(train_case)
