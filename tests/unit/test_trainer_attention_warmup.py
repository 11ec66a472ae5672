"""Which attention plans the trainers warm, and when (``warm_attention_plans``): the training passes' for the
documents a trainer knows it will train on, when ``train`` starts, and the forward-only passes' (a reference, the
policy's KL estimate, rollout scoring), which cuDNN plans apart, before the pass that would first meet a length, on
every rank alike. The warm-up itself is recorded here (on the CPU it attends nothing)."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_qwen2_config
from transformers import Qwen2ForCausalLM

import hf_odc.trainer.core._base_trainer as base_trainer
from hf_odc.demo import build_tokenizer, preference_dataset, prompt_dataset, unpaired_dataset
from hf_odc.kernels.attention import sdpa_length
from hf_odc.trainer import ODCDPOConfig, ODCDPOTrainer, ODCGRPOConfig, ODCGRPOTrainer, ODCKTOConfig, ODCKTOTrainer

COMMON = {"report_to": "none", "use_cpu": True, "per_device_train_batch_size": 4, "max_steps": 1, "save_strategy": "no",
          "disable_tqdm": True}  # fmt: skip


def _model(tokenizer, **shape) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    special = {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = tiny_qwen2_config(vocab_size=len(tokenizer), max_position_embeddings=1024, **special, **shape)
    return Qwen2ForCausalLM(config)


def _record(monkeypatch, trainer, score: str) -> list:
    """The warm-ups (model, the lengths handed over, sorted, whether with a backward) and the calls of ``trainer``'s
    forward-only scoring method ``score``, in order."""
    events = []

    def warm(model, lengths, device, dtype, backward):
        events.append((model, sorted(lengths), backward))

    monkeypatch.setattr(base_trainer, "warm_attention_plans", warm)
    scoring = getattr(trainer, score)
    monkeypatch.setattr(trainer, score, lambda *args, **kwargs: events.append(score) or scoring(*args, **kwargs))
    return events


@pytest.mark.parametrize("known", [True, False], ids=["dataset-known", "per-step"])
def test_dpo_warms_the_references_forward_only_plans_before_the_reference_meets_them(tmp_path, monkeypatch, known):
    """With its dataset's lengths known, DPO warms the policy's training plans and the reference's forward-only plans
    for all of them when ``train`` starts, and the step warms nothing more; without them (``known=False``), the step
    warms both kinds for the whole minibatch's lengths before the reference's pass."""
    tokenizer = build_tokenizer()
    args, pairs = ODCDPOConfig(str(tmp_path), max_length=512, **COMMON), preference_dataset(8, 512, "swe-smith", 0)
    trainer = ODCDPOTrainer(model=_model(tokenizer), ref_model=_model(tokenizer), args=args, train_dataset=pairs,
                            processing_class=tokenizer)  # fmt: skip
    events = _record(monkeypatch, trainer, "_score_reference")
    if not known:
        monkeypatch.setattr(trainer, "_training_documents", lambda: None)
    trainer.train()
    trainer.end()
    (policy, lengths, backward), (reference, same, forward_only), scored = events
    assert policy is trainer.model and reference is trainer.ref_model and reference is not policy
    assert (backward, forward_only, scored) == (True, False, "_score_reference") and lengths == same
    everything = sorted(trainer._sequence_lengths)
    if known:
        assert lengths == everything and len({sdpa_length(n) for n in lengths}) > 1
    else:  # one minibatch: 4 pairs of the 8, their 8 sequences
        assert len(lengths) == 8 and set(lengths) <= set(everything)


@pytest.mark.parametrize("known", [True, False], ids=["dataset-known", "per-step"])
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_warms_the_reference_and_with_the_kl_estimate_the_policys_forward_only_plans(
    tmp_path, monkeypatch, loss_type, known
):
    """KTO's forward-only passes: the reference's, and with the KL estimate the policy's over the mismatched
    sequences, whose lengths the warm-up covers too: every example's sequences are warmed when ``train`` starts, or
    without them known (``known=False``) the step's, before its passes. ``apo_zero_unpaired`` has no KL estimate. The
    reference here has another head size, so its plans are its own (a reference of the policy's shape shares the
    policy's forward-only plans)."""
    tokenizer = build_tokenizer()
    args = ODCKTOConfig(str(tmp_path), max_length=512, loss_type=loss_type, **COMMON)
    calculate_kl = args.calculate_kl
    assert calculate_kl == (loss_type == "kto")
    reference, examples = _model(tokenizer, num_attention_heads=8), unpaired_dataset(8, 512, "swe-smith", 0)
    trainer = ODCKTOTrainer(model=_model(tokenizer), ref_model=reference, args=args, train_dataset=examples,
                            processing_class=tokenizer)  # fmt: skip
    events = _record(monkeypatch, trainer, "_score_reference")
    sequences = trainer._training_documents()
    if not known:
        monkeypatch.setattr(trainer, "_training_documents", lambda: None)
    trainer.train()
    trainer.end()
    *warmed, scored = events
    expected = [(trainer.model, True), (trainer.ref_model, False)] + [(trainer.model, False)] * calculate_kl
    assert [(model, backward) for model, _, backward in warmed] == expected and scored == "_score_reference"
    assert len(sequences) == 8 * (1 + calculate_kl)
    if known:
        assert all(lengths == sorted(sequences) for _, lengths, _ in warmed)
    else:  # one minibatch: 4 examples of the 8, their sequences
        per_step = 4 * (1 + calculate_kl)
        assert all(len(lengths) == per_step and set(lengths) <= set(sequences) for _, lengths, _ in warmed)


def test_rollout_scoring_warms_the_generation_batchs_forward_only_plans_before_its_passes(tmp_path, monkeypatch):
    """GRPO scoring the old policy (``num_iterations=2``): once the generation batch is decoded and planned, its
    lengths (every rank's rollouts) are warmed for the policy's forward-only pass and its training, before the pass;
    the step that trains on it then warms nothing more."""
    tokenizer = build_tokenizer()
    args = ODCGRPOConfig(str(tmp_path), num_generations=4, max_completion_length=6, num_iterations=2, **COMMON)
    trainer = ODCGRPOTrainer(model=_model(tokenizer), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                             args=args, train_dataset=prompt_dataset(8, 6, "swe-smith", seed=0),
                             processing_class=tokenizer)  # fmt: skip
    events = _record(monkeypatch, trainer, "_score_rollouts")
    trainer.train()
    trainer.end()
    (policy, lengths, backward), (scorer, same, forward_only), scored = events
    assert policy is scorer is trainer.model and (backward, forward_only) == (True, False) and lengths == same
    assert scored == "_score_rollouts" and lengths
