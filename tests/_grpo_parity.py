"""One optimizer step (two with ``num_iterations=2``) of GRPO per case, on fixed rollouts, saving what to compare.

``python tests/_grpo_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.GRPOTrainer`` on one process with the
whole minibatch (8 rollouts); ``accelerate launch ... tests/_grpo_parity.py odc MODEL_DIR OUT CASE...`` trains
``ODCGRPOTrainer`` on each process with its share (``8 / world_size`` generated per rank, then re-planned). Rollouts
are ``examples/grpo.py``'s synthetic ones, the same whatever the number of ranks. Rank 0 saves, per case, the logged
step entries and the full parameters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from grpo import SyntheticRollouts, echo_reward, length_reward, prompt_dataset
from sft import build_tokenizer

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
}


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import GRPOConfig, GRPOTrainer

    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer
    from hf_odc.trainer._checkpoint import full_model_state_dict
    from hf_odc.trainer.attention import attention_implementation

    overrides = {"max_steps": 1} | CASES[name]
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    if kind == "trl":
        args = GRPOConfig(output_dir, per_device_train_batch_size=MINIBATCH, **COMMON, **overrides)
        trainer_class = GRPOTrainer
    else:
        args = ODCGRPOConfig(
            output_dir, per_device_train_batch_size=MINIBATCH // int(os.environ.get("WORLD_SIZE", "1")),
            max_tokens_per_microbatch=48, cost_model="tokens", **COMMON, **overrides,
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
    if kind == "odc":
        state = full_model_state_dict(trainer.model)
        trainer.close_odc()
    else:
        state = trainer.model.state_dict()
    if trainer.accelerator.process_index != 0:
        return None
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    reference = None if trainer.ref_model is None else attention_implementation(trainer.ref_model)
    return {"logs": logs, "params": {k: v.detach().cpu().clone() for k, v in state.items()}, "ref_attention": reference}


def main() -> None:
    kind, model_dir, out, *names = sys.argv[1:]
    results = {name: train_case(kind, model_dir, name, f"{out}.{name}") for name in names}
    if all(result is not None for result in results.values()):
        torch.save(results, out)
    if torch.distributed.is_initialized():
        # As the trainers' end(): a process group left to interpreter exit can abort gloo ("terminate called
        # without an active exception"), which failed this script once in the full suite.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
