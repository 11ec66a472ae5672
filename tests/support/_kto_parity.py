"""Two optimizer steps of KTO per case, saving what to compare.

``python tests/support/_kto_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.KTOTrainer`` on one process with
the whole minibatch (8 examples per accumulation step); ``accelerate launch ... tests/support/_kto_parity.py odc
MODEL_DIR OUT CASE...`` trains ``ODCKTOTrainer`` with ``8 / world_size`` examples per process and accumulation step, so
each optimizer step sees the same examples (sequential sampling, as TRL's KL estimate needs), planned as one ODC
minibatch. The examples are the KTO example's (``hf_odc.demo.unpaired_dataset``), some longer than ``max_length``
(truncated). Rank 0 saves, per case, the logged step entries and the full parameters."""

from __future__ import annotations

from _parity import TRAINING, run_cases, train_with_reference

from hf_odc.demo import unpaired_dataset

MINIBATCH, MAX_LENGTH = 8, 40
COMMON = TRAINING | dict(
    max_steps=2, beta=0.5, max_length=MAX_LENGTH, train_sampling_strategy="sequential", gradient_checkpointing=False
)
CASES = {
    "kto": {},
    # No reference model: its log-probabilities (of both sequences) are the initial policy's, computed before training.
    "precompute": {"precompute_ref_log_probs": True, "desirable_weight": 1.3, "undesirable_weight": 0.7},
    # Two accumulation steps per optimizer step: 16 examples, one ODC minibatch, a KL estimate per accumulation call.
    "accumulation": {"gradient_accumulation_steps": 2},
    # The other loss type: no KL estimate, no mismatched sequences.
    "apo-zero-unpaired": {"loss_type": "apo_zero_unpaired", "desirable_weight": 0.8, "undesirable_weight": 1.2},
    # LoRA: the reference is the policy with its adapter disabled.
    "peft": {"learning_rate": 2.0},
}
# Microbatch sizes that give the ranks different training microbatch counts in some step (the training minibatch is
# planned on the examples' own sequences; the reference pass packs each example's two together, up to 56 tokens).
ODC_MAX_TOKENS, CASE_MAX_TOKENS = 76, {"accumulation": 85, "apo-zero-unpaired": 40}


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import KTOConfig, KTOTrainer

    from hf_odc.trainer import ODCKTOConfig, ODCKTOTrainer

    return train_with_reference(
        kind,
        {"trl": (KTOConfig, KTOTrainer), "odc": (ODCKTOConfig, ODCKTOTrainer)},
        model_dir,
        output_dir,
        COMMON | CASES[name],
        peft=name == "peft",
        minibatch=MINIBATCH,
        max_tokens=CASE_MAX_TOKENS.get(name, ODC_MAX_TOKENS),
        dataset=lambda count: unpaired_dataset(count, 64, "swe-smith", seed=2),
    )


if __name__ == "__main__":
    run_cases(train_case)
