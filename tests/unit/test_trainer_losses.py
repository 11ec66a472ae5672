"""The pieces of ``ODCRLOOTrainer`` and ``ODCDistillationTrainer`` the parity tests reach only through whole runs:
RLOO's leave-one-out advantages with unscorable rollouts and a KL penalty, the distillation divergence against TRL's
own chunked kernel, value and gradient, for each ``beta`` kind, what the two trainers refuse, and the false warning of
TRL's that each rollout trainer drops."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

from hf_odc.trainer.online.distillation_trainer import generalized_jsd
from hf_odc.trainer.online.rloo_trainer import leave_one_out_advantages


def test_leave_one_out_advantages_skip_unscorable_rollouts_and_subtract_the_kl_penalty():
    """One group of 4: the second rollout unscored by every function (no advantage, not in its siblings' baseline),
    the first scored by one function only; the KL penalty enters the rewards before the baseline."""
    rewards = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [3.0, 1.0], [0.0, 0.0]])
    kwargs = {"num_generations": 4, "clip_range": None, "normalize": False}
    advantages, penalised = leave_one_out_advantages(rewards, torch.ones(2), kl_penalty=torch.zeros(4), **kwargs)
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 0.0, 3.5, -2.5]))
    assert math.isnan(penalised[1])
    advantages, _ = leave_one_out_advantages(rewards, torch.ones(2), kl_penalty=torch.tensor([0.1, 0, 0, 0]), **kwargs)
    torch.testing.assert_close(advantages, torch.tensor([-1.1, 0.0, 3.55, -2.45]))
    clipped, _ = leave_one_out_advantages(
        rewards, torch.ones(2), kl_penalty=torch.zeros(4), num_generations=4, clip_range=(0.0, 2.0), normalize=True
    )
    raw = torch.tensor([0.0, 1.5, -1.5])  # rewards 1, 2 (clipped), 0: each minus its scorable siblings' mean
    expected = (raw - raw.mean()) / (raw.std() + 1e-4)  # standardised over the scorable rollouts (sample std)
    torch.testing.assert_close(clipped, torch.tensor([expected[0], 0.0, expected[1], expected[2]]))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_equals_trls_chunked_kernel(beta):
    torch.manual_seed(0)
    hidden, vocab, temperature = 16, 50, 0.7
    student_h, teacher_h = torch.randn(6, hidden), torch.randn(6, hidden)
    student_w, teacher_w = torch.randn(vocab, hidden, requires_grad=True), torch.randn(vocab, hidden)
    theirs, _ = ChunkedDivergenceFunction.apply(
        student_h, student_w, None, teacher_h, teacher_w, None, beta, temperature, 1.0, None, 1.0, None
    )
    (their_grad,) = torch.autograd.grad(theirs.sum(), student_w)
    student = torch.log_softmax(student_h @ student_w.T / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_h @ teacher_w.T / temperature, dim=-1)
    ours = generalized_jsd(student, teacher, beta)
    (our_grad,) = torch.autograd.grad(ours.sum(), student_w)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # fp32, as TRL computes it
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-4, atol=1e-5)


def test_what_distillation_refuses_is_named_in_one_line(tmp_path):
    """A distillation without a local teacher (TRL's served teachers stay TRL's): one line saying what to set (RLOO's
    PEFT refusals: ``tests/unit/test_grpo_rollouts.py``)."""
    from transformers import AutoModelForCausalLM

    from hf_odc.demo import build_tokenizer
    from hf_odc.demo.models import MODEL_CONFIGS
    from hf_odc.trainer import ODCDistillationConfig, ODCDistillationTrainer

    tokenizer = build_tokenizer()
    config = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id} | MODEL_CONFIGS["tiny"]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    common = {"report_to": "none", "use_cpu": True, "per_device_train_batch_size": 4}
    with pytest.raises(ValueError, match="pass teacher_model"):
        ODCDistillationTrainer(model=model, args=ODCDistillationConfig(str(tmp_path), **common))


@pytest.mark.parametrize("trainer", ["ODCGRPOTrainer", "ODCRLOOTrainer", "ODCDistillationTrainer"])
def test_trls_ignored_model_init_kwargs_warning_is_dropped_for_each_rollout_trainer(trainer, caplog):
    """TRL's "``model_init_kwargs`` will be ignored" (false: the reference model loads with the ones hf_odc sets) is
    logged by the logger of the module of each TRL trainer: the one hf_odc drops it from for an ODC trainer is that
    trainer's own, and only that warning goes."""
    import hf_odc.trainer as trainers
    from hf_odc._compat import library_logger
    from hf_odc.trainer.core._quiet import without_ignored_model_init_kwargs_warning

    trainer_class = getattr(trainers, trainer)
    module = next(c for c in trainer_class.__mro__ if c.__name__ == trainer.removeprefix("ODC")).__module__
    logger = library_logger(module)
    with caplog.at_level("WARNING", logger=logger.name), without_ignored_model_init_kwargs_warning(trainer_class):
        logger.warning("You passed `model_init_kwargs`, but ... The `model_init_kwargs` will be ignored.")
        logger.warning("another warning")
    assert [record.getMessage() for record in caplog.records] == ["another warning"]
