"""Two optimizer steps of reward modelling per case, saving what to compare.

``python tests/support/_reward_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.RewardTrainer`` on one process
with the whole minibatch (8 pairs per accumulation step); ``accelerate launch ... tests/support/_reward_parity.py odc
MODEL_DIR OUT CASE...`` trains ``ODCRewardTrainer`` with ``8 / world_size`` pairs per process and accumulation step, so
each optimizer step sees the same pairs (sequential sampling), planned as one ODC minibatch. The pairs are the DPO
example's (``hf_odc.demo.preference_dataset``), long-tailed, the whole conversation scored by a one-label
sequence-classification head. Rank 0 saves, per case, the logged step entries and the full parameters."""

from __future__ import annotations

from _parity import TRAINING, run_cases, train_with
from transformers import AutoModelForSequenceClassification

from hf_odc.demo import preference_dataset

MINIBATCH, MAX_LENGTH = 8, 64
COMMON = TRAINING | dict(
    max_steps=2, max_length=MAX_LENGTH, train_sampling_strategy="sequential", gradient_checkpointing=False
)
CASES = {
    "pairwise": {},
    # A per-pair margin column (TRL subtracts it inside the log-sigmoid) and the mean-zero rewards term.
    "margin-centered": {"center_rewards_coefficient": 0.05},
    # Two accumulation steps per optimizer step: 16 pairs, one ODC minibatch (TRL: two slices of 8).
    "accumulation": {"gradient_accumulation_steps": 2},
    # LoRA on the attention projections; PEFT trains a copy of the score head (task_type SEQ_CLS).
    "peft": {"learning_rate": 2.0},
}
# Microbatch sizes that give the ranks different microbatch counts in some step (the longest pair has 65 tokens).
ODC_MAX_TOKENS, ACCUMULATION_MAX_TOKENS = 66, 80


def pairs(name: str, count: int):
    dataset = preference_dataset(count, 48, "swe-smith", seed=2)
    if name == "margin-centered":
        dataset = dataset.add_column("margin", [0.25 * (i % 5) for i in range(count)])
    return dataset


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from peft import LoraConfig
    from trl import RewardConfig, RewardTrainer

    from hf_odc.trainer import ODCRewardConfig, ODCRewardTrainer

    settings = COMMON | CASES[name]
    accumulation = settings.get("gradient_accumulation_steps", 1)
    peft_config = None
    if name == "peft":
        peft_config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj"])  # fmt: skip
    return train_with(
        kind,
        {"trl": (RewardConfig, RewardTrainer), "odc": (ODCRewardConfig, ODCRewardTrainer)},
        output_dir,
        settings,
        minibatch=MINIBATCH,
        max_tokens=ACCUMULATION_MAX_TOKENS if accumulation > 1 else ODC_MAX_TOKENS,
        model=AutoModelForSequenceClassification.from_pretrained(model_dir, attn_implementation="sdpa"),
        train_dataset=pairs(name, MINIBATCH * accumulation * settings["max_steps"]),
        peft_config=peft_config,
    )


if __name__ == "__main__":
    run_cases(train_case)
