"""Two optimizer steps of DPO per case, saving what to compare.

``python tests/support/_dpo_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.DPOTrainer`` on one process with
the whole minibatch (8 pairs per accumulation step); ``accelerate launch ... tests/support/_dpo_parity.py odc MODEL_DIR
OUT CASE...`` trains ``ODCDPOTrainer`` with ``8 / world_size`` pairs per process and accumulation step, so each
optimizer step sees the same pairs (sequential sampling), planned as one ODC minibatch. The pairs are the DPO example's
(``hf_odc.demo.preference_dataset``), many longer than ``max_length`` (truncated). The long-pair cases
(:data:`LONG_PAIR_CASES`, launched with Accelerate's ``parallelism_config_sp_size: 2``) give ODC microbatches of 56
tokens, so the pairs of up to 96 tokens longer than that are split over both ranks; the four-rank cases
(:data:`FOUR_RANK_CASES`, on 4 processes) set groups of 2 ranks in their config. Rank 0 saves, per case, the logged step
entries and the full parameters."""

from __future__ import annotations

from _parity import TRAINING, run_cases, train_with_reference

from hf_odc.demo import preference_dataset

QUIET = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
TIMINGS = ("step_time",)
PER_SLICE = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")  # TRL's per-slice token means
# beta x the difference of two sums of ~50 fp32 log-probabilities: a few 1e-6 apart however they are summed
DIFFERENCES = ("rewards/chosen", "rewards/rejected", "rewards/margins")
MINIBATCH, MAX_LENGTH = 8, 48
COMMON = TRAINING | dict(
    max_steps=2, beta=0.5, max_length=MAX_LENGTH, train_sampling_strategy="sequential", gradient_checkpointing=False
)
_EVERY_LOSS = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
               "apo_down", "discopop", "sigmoid_norm", "sft"]  # fmt: skip
CASES = {
    "sigmoid": {},
    # No reference model: its log-probabilities are the initial policy's, computed before training.
    "precompute": {"precompute_ref_log_probs": True},
    # Two accumulation steps per optimizer step: 16 pairs, one ODC minibatch (TRL: two slices of 8).
    "accumulation": {"gradient_accumulation_steps": 2},
    # Every loss type ODCDPOTrainer supports at once (weighted), with LD-DPO's weighting of the longer completion.
    "every-loss": {
        "loss_type": _EVERY_LOSS,
        "loss_weights": [0.3 + 0.1 * i for i in range(len(_EVERY_LOSS))],
        "label_smoothing": 0.01,
        "ld_alpha": 0.5,
    },
    "alpha-divergence": {
        "loss_type": ["sigmoid", "hinge", "ipo", "robust", "discopop", "sigmoid_norm"],
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.3,
        "label_smoothing": 0.1,
    },
    # LoRA: the reference is the policy with its adapter disabled.
    "peft": {"learning_rate": 2.0},
}
# A Mixture-of-Experts model (tests/parity/test_trainer_moe.py): the router's load-balancing loss on (over the whole
# minibatch, as TRL's one forward of it computes it) and off.
MOE_CASES = {"moe-aux": {"router_aux_loss_coef": 0.2}, "moe-no-aux": {"router_aux_loss_coef": 0.0}}
# Sequence parallelism: pairs longer than ODC's 56-token microbatch (up to 2 x 48) split over both ranks, with a
# reference model, precomputed reference log-probabilities, gradient accumulation and LoRA.
LONG_PAIR_CASES = {
    "long-pairs": {},
    "long-pairs-precompute": {"precompute_ref_log_probs": True},
    "long-pairs-accumulation": {"gradient_accumulation_steps": 2},
    "long-pairs-lora": {"learning_rate": 2.0},
}
# On 4 processes, sequence parallelism set per case (ODC's `parallelism_config`): pairs of up to 96 tokens on
# microbatches of 48, split over two groups of 2 ranks (GRPO's four-rank case has one group of 4)
FOUR_RANK_CASES = {"four-ranks-sp2": {"sp_size": 2}}
PEFT_CASES = ("peft", "long-pairs-lora")
# each case's microbatch size gives the ranks different counts in some step
ODC_MAX_TOKENS = {"accumulation": 112} | dict.fromkeys(LONG_PAIR_CASES, 56)
ODC_MAX_TOKENS |= {"four-ranks-sp2": 48}


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import DPOConfig, DPOTrainer

    from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer

    return train_with_reference(
        kind,
        {"trl": (DPOConfig, DPOTrainer), "odc": (ODCDPOConfig, ODCDPOTrainer)},
        model_dir,
        output_dir,
        COMMON | (CASES | MOE_CASES | LONG_PAIR_CASES | FOUR_RANK_CASES)[name],
        peft=name in PEFT_CASES,
        minibatch=MINIBATCH,
        max_tokens=ODC_MAX_TOKENS.get(name, 2 * MAX_LENGTH),
        dataset=lambda count: preference_dataset(count, 96, "swe-smith", seed=2),
    )


if __name__ == "__main__":
    run_cases(train_case)
