"""One optimizer step (two with ``num_iterations=2``) of GRPO per case, on fixed rollouts, saving what to compare.

``python tests/_grpo_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.GRPOTrainer`` on one process with the
whole minibatch (8 rollouts); ``accelerate launch ... tests/_grpo_parity.py odc MODEL_DIR OUT CASE...`` trains
``ODCGRPOTrainer`` on each process with its share (``8 / world_size`` generated per rank, then re-planned). Rollouts
are the GRPO example's synthetic ones (``hf_odc.demo.SyntheticRollouts``), the same whatever the number of ranks.
Rank 0 saves, per case, the logged step entries and the full parameters.
"""

from __future__ import annotations

import os

from _parity import run_cases, trained_state
from transformers import AutoModelForCausalLM

from hf_odc.demo import SyntheticRollouts, build_tokenizer, echo_reward, length_reward, prompt_dataset
from hf_odc.trainer.attention import attention_implementation

MINIBATCH = 8
COMMON = dict(
    num_generations=4, max_completion_length=40, learning_rate=0.5, optim="sgd", logging_steps=1,
    save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=7, disable_tqdm=True,
)  # fmt: skip
CASES = {
    **{loss: {"loss_type": loss} for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")},
    "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "kl": {"loss_type": "grpo", "beta": 0.2, "max_steps": 2},  # step 2: the policy has left the reference
    "entropy": {"loss_type": "dapo", "entropy_coef": 0.05},
    "adaptive-entropy": {"loss_type": "bnpo", "use_adaptive_entropy": True, "entropy_coef": 0.05, "max_steps": 2},
    # Two steps on one generation batch: the second scores against the old policy's log-probabilities.
    "iterations": {"loss_type": "dapo", "num_iterations": 2, "epsilon": 0.02, "max_steps": 2},
    "off-policy-mask": {"loss_type": "grpo", "num_iterations": 2, "off_policy_mask_threshold": 1e-4, "max_steps": 2},
    # Four accumulation steps per optimizer step: 32 rollouts, one ODC minibatch (TRL: four slices of 8).
    "accumulation": {"loss_type": "grpo", "gradient_accumulation_steps": 4},
    "accumulation-dapo": {"loss_type": "dapo", "gradient_accumulation_steps": 4, "max_steps": 2},
}
ODC_TOKEN_CAP = {"accumulation": 64, "accumulation-dapo": 64}  # their larger generation batches draw longer rollouts


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import GRPOConfig, GRPOTrainer

    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    overrides = {"max_steps": 1} | CASES[name]
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    if kind == "trl":
        args = GRPOConfig(output_dir, per_device_train_batch_size=MINIBATCH, **COMMON, **overrides)
        trainer_class = GRPOTrainer
    else:
        args = ODCGRPOConfig(
            output_dir, per_device_train_batch_size=MINIBATCH // int(os.environ.get("WORLD_SIZE", "1")),
            max_tokens_per_microbatch=ODC_TOKEN_CAP.get(name, 48), cost_model="tokens", **COMMON, **overrides,
        )  # fmt: skip
        trainer_class = ODCGRPOTrainer
    trainer = trainer_class(
        model=model,
        reward_funcs=[length_reward, echo_reward],
        args=args,
        train_dataset=prompt_dataset(64, COMMON["max_completion_length"], "swe-smith", seed=0),
        processing_class=tokenizer,
        rollout_func=SyntheticRollouts("synthetic", "swe-smith", seed=0),
    )
    trainer.train()
    result = trained_state(trainer)
    if result is not None:  # the reference model's attention (GRPO with beta > 0): hf_odc switches it to packed
        result["ref_attention"] = None if trainer.ref_model is None else attention_implementation(trainer.ref_model)
    return result


if __name__ == "__main__":
    run_cases(train_case)
