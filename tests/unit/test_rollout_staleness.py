"""``max_rollout_staleness`` (:mod:`hf_odc.trainer.online._overlap`): its refusals, and on one process (fp32, plain
SGD at a constant rate) that each generation batch after the first is decoded by the weights the previous batch
trained from, its importance ratio taken against them, and that a failure of the background decoding surfaces as
``RolloutPrefetchError`` and ends the process. Staleness 0 is the synchronous trainer, which the GRPO and RLOO parity
tests cover (tests/parity/test_grpo_parity.py, test_rloo_parity.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _models import tiny_qwen2_config
from transformers import Qwen2ForCausalLM

from hf_odc.demo import build_tokenizer, prompt_dataset
from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer, ODCRLOOConfig

STEPS, LEARNING_RATE, SEED, GROUP = 3, 2.0, 7, 4


def _config(tmp_path: Path, config_class: type = ODCGRPOConfig, **fields) -> object:
    return config_class(str(tmp_path), per_device_train_batch_size=4, num_generations=GROUP, **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_rollout_staleness": 2}, r"max_rollout_staleness must be 0 \(synchronous\) or 1"),
        ({"max_rollout_staleness": -1}, r"max_rollout_staleness must be 0 \(synchronous\) or 1"),
        ({"max_rollout_staleness": 1}, r"odc_generation=None is unset .* Set odc_generation='static'"),
        ({"max_rollout_staleness": 1, "odc_generation": "lockstep"}, r"in lockstep .* Set odc_generation='static'"),
        ({"max_rollout_staleness": 1, "odc_generation": "tensor-parallel"}, r"interleave .* odc_generation='static'"),
        ({"max_rollout_staleness": 1, "odc_generation": "gathered"}, r"update changes\. Set odc_generation='static'"),
        ({"max_rollout_staleness": 1, "odc_generation": "sharded"}, r"runs too\. Set odc_generation='static'"),
        ({"max_rollout_staleness": 1, "use_vllm": True}, r"not with vLLM; set use_vllm=False"),
    ],
)
@pytest.mark.parametrize("config_class", [ODCGRPOConfig, ODCRLOOConfig], ids=["grpo", "rloo"])
def test_a_staleness_the_run_cannot_overlap_is_refused_in_one_line(tmp_path, config_class, fields, message):
    with pytest.raises(ValueError, match=message) as raised:
        _config(tmp_path, config_class, **fields)
    assert "\n" not in str(raised.value)


def test_static_decoding_with_staleness_one_is_accepted(tmp_path):
    assert _config(tmp_path, odc_generation="static", max_rollout_staleness=1).max_rollout_staleness == 1


def test_with_checkpointing_the_checkpoints_leave_the_random_generators_alone(tmp_path):
    """A recomputation would rewind the generators the thread decoding ahead samples from: staleness 1 turns
    ``preserve_rng_state`` off in the checkpointing kwargs (under both transformers names), and refuses it on."""
    config = _config(tmp_path, odc_generation="static", max_rollout_staleness=1, gradient_checkpointing=True)
    for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        if hasattr(config, name):
            assert getattr(config, name)["preserve_rng_state"] is False, name
    kept = _config(tmp_path, odc_generation="static", gradient_checkpointing=True)
    assert "preserve_rng_state" not in (kept.gradient_checkpointing_kwargs or {})
    with pytest.raises(ValueError, match=r"preserve_rng_state=True rewinds .* set max_rollout_staleness=0") as raised:
        _config(tmp_path, odc_generation="static", max_rollout_staleness=1, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"preserve_rng_state": True})  # fmt: skip
    assert "\n" not in str(raised.value)


def test_a_policy_with_dropout_is_refused_under_checkpointing(tmp_path):
    """Without the generators' state restored, a dropout mask would be recomputed otherwise than drawn."""
    tokenizer = build_tokenizer()
    model = _model(tokenizer)
    model.config.attention_dropout = 0.1
    args = _config(tmp_path, odc_generation="static", max_rollout_staleness=1, gradient_checkpointing=True,
                   report_to="none", use_cpu=True, max_completion_length=6)  # fmt: skip
    with pytest.raises(ValueError, match=r"dropout to 0, turn off gradient checkpointing, or set max_rollout_st"):
        ODCGRPOTrainer(model=model, reward_funcs=_content_reward, args=args,
                       train_dataset=prompt_dataset(8, 6, "swe-smith", seed=0), processing_class=tokenizer)  # fmt: skip


def _model(tokenizer) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    special = {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = tiny_qwen2_config(vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True,
                               attn_implementation="sdpa", **special)  # fmt: skip
    return Qwen2ForCausalLM(config)


def _content_reward(completions: list, **kwargs) -> list[float]:
    """Varies with the sampled text, so that every group has advantages."""
    return [float(sum(map(ord, completion[0]["content"])) % 11) for completion in completions]


class _Recording(ODCGRPOTrainer):
    """Keeps the policy's weights as each step starts and each generation batch's gathered rollouts."""

    def __init__(self, *args, **kwargs):
        self.weights: list[dict[str, torch.Tensor]] = []
        self.batches = []
        super().__init__(*args, **kwargs)

    def _plan_step(self, window):
        self.weights.append({name: value.detach().clone() for name, value in self.model.state_dict().items()})
        return super()._plan_step(window)

    def _after_scoring(self, rollouts, planned):
        self.batches.append(rollouts)
        super()._after_scoring(rollouts, planned)


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    """Three GRPO steps with ``max_rollout_staleness=1``, one generation batch each; without activation checkpointing,
    whose recomputation restores the process's random generator while the thread samples from it."""
    tokenizer = build_tokenizer()
    args = _config(
        tmp_path_factory.mktemp("overlap"), odc_generation="static", max_rollout_staleness=1, max_steps=STEPS,
        max_completion_length=6, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", optim="sgd",
        max_grad_norm=1e9, loss_type="grpo", gradient_checkpointing=False, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=SEED, disable_tqdm=True,
    )  # fmt: skip
    dataset = prompt_dataset(32, 6, "swe-smith", seed=0)
    trainer = _Recording(model=_model(tokenizer), reward_funcs=_content_reward, args=args, train_dataset=dataset,
                         processing_class=tokenizer)  # fmt: skip
    trainer.train()
    trainer.weights.append({name: value.detach().clone() for name, value in trainer.model.state_dict().items()})
    yield trainer
    trainer.end()


def _decoded_by(trainer, weights, prompt_ids, seed) -> list[list[int]]:
    """What the synchronous path decodes from ``weights`` for ``prompt_ids``, sampling from ``seed``."""
    trainer.model.load_state_dict(weights)
    torch.manual_seed(seed)
    with trainer._generator.generation_batch():
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, GROUP)
    return completion_ids


def _log_probs(weights, tokenizer, prompt, completion) -> torch.Tensor:
    model = _model(tokenizer)
    model.load_state_dict(weights)
    ids = torch.cat([prompt, completion])[None]
    logps = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return logps.gather(-1, completion[:, None]).squeeze(-1)


@pytest.mark.slow  # trains
def test_each_batch_after_the_first_is_decoded_by_the_weights_one_batch_old(overlapped):
    trainer, tokenizer = overlapped, build_tokenizer()
    assert len(trainer.batches) == STEPS and trainer.batches[0].sampling_logps is None  # the first: synchronous
    for index in (1, 2):
        batch = trainer.batches[index]
        prompts = [ids.tolist() for ids in batch.prompt_ids]
        seed = SEED + index
        decoded = [ids.tolist() for ids in batch.completion_ids]
        assert decoded == _decoded_by(trainer, trainer.weights[index - 1], prompts, seed)
        assert decoded != _decoded_by(trainer, trainer.weights[index], prompts, seed)  # the current weights differ
        scored = zip(batch.prompt_ids, batch.completion_ids, batch.sampling_logps, strict=True)
        for prompt, completion, behaviour in scored:
            expected = _log_probs(trainer.weights[index - 1], tokenizer, prompt, completion)
            torch.testing.assert_close(behaviour, expected, rtol=1e-5, atol=1e-5)


def _grpo_gradient(weights, tokenizer, batch) -> dict[str, torch.Tensor]:
    """TRL's ``grpo`` loss on ``batch`` by a plain model holding ``weights``, the ratio against the behaviour
    log-probabilities the batch carries (clip 0.2): the gradient of every parameter."""
    model = _model(tokenizer)
    model.load_state_dict(weights)
    losses = []
    for i, (prompt, completion) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
        ids = torch.cat([prompt, completion])[None]
        logps = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        logps = logps.gather(-1, completion[:, None]).squeeze(-1)
        ratio = torch.exp(logps - batch.sampling_logps[i])
        advantage = batch.advantages[i]
        per_token = -torch.min(ratio * advantage, torch.clamp(ratio, 0.8, 1.2) * advantage)
        mask = batch.loss_mask[i]
        losses.append((per_token * mask).sum() / mask.sum().clamp(min=1.0))
    torch.stack(losses).mean().backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.slow  # trains
def test_the_update_takes_its_ratio_against_the_policy_that_decoded(overlapped):
    """Each overlapped step's SGD update equals the one computed by a plain model from the weights it trained from,
    on the batch's rollouts, the ratio against the behaviour log-probabilities (not 1, as against the current
    weights)."""
    trainer, tokenizer = overlapped, build_tokenizer()
    for index in (1, 2):
        batch = trainer.batches[index]
        assert any((advantage != 0).item() for advantage in batch.advantages)
        gradient = _grpo_gradient(trainer.weights[index], tokenizer, batch)
        before, after = trainer.weights[index], trainer.weights[index + 1]
        for name, grad in gradient.items():
            torch.testing.assert_close(after[name] - before[name], -LEARNING_RATE * grad, rtol=1e-4, atol=1e-6)


FAILING = """
import sys, torch
sys.path.insert(0, {support!r})
from test_rollout_staleness import _content_reward, _config, _model
from hf_odc.demo import build_tokenizer, prompt_dataset
from hf_odc.trainer import ODCGRPOTrainer
from hf_odc.trainer.online import _rollout_trainer

def broken(*args, **kwargs):
    raise OSError("the decoding copy went away")

_rollout_trainer.behaviour_log_probs = broken
tokenizer = build_tokenizer()
args = _config({out!r}, odc_generation="static", max_rollout_staleness=1, max_steps=2, max_completion_length=6,
               save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
trainer = ODCGRPOTrainer(model=_model(tokenizer), reward_funcs=_content_reward, args=args,
                         train_dataset=prompt_dataset(32, 6, "swe-smith", seed=0), processing_class=tokenizer)
try:
    trainer.train()
finally:
    trainer.end()
"""


@pytest.mark.slow  # starts a training process
def test_a_failure_while_decoding_ahead_ends_the_run_naming_it(tmp_path):
    tests = Path(__file__).resolve().parents[1]
    script = textwrap.dedent(FAILING).format(support=str(tests / "unit"), out=str(tmp_path))
    env_path = f"{tests / 'support'}:{tests.parent}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": env_path})  # fmt: skip
    assert done.returncode != 0
    assert "RolloutPrefetchError: Decoding the next generation batch in the background" in done.stderr, done.stderr
    assert "OSError: the decoding copy went away" in done.stderr


@pytest.mark.slow  # trains
def test_rloo_takes_the_behaviour_log_probabilities_as_its_old_policy(tmp_path):
    """ODCRLOOTrainer, two iterations per generation batch: the first batch scores its old policy (the weights it
    decoded with), the one decoded ahead takes the behaviour log-probabilities in place of that pass, for both of its
    iterations."""
    from hf_odc.trainer import ODCRLOOTrainer

    class Recording(ODCRLOOTrainer):
        def __init__(self, *args, **kwargs):
            self.batches = []
            super().__init__(*args, **kwargs)

        def _after_scoring(self, rollouts, planned):
            microbatches = [microbatch["loss"] for step in planned for microbatch in step.microbatches]
            self.batches.append((rollouts, microbatches))
            super()._after_scoring(rollouts, planned)

    tokenizer = build_tokenizer()
    args = _config(
        tmp_path, ODCRLOOConfig, odc_generation="static", max_rollout_staleness=1, max_steps=3, num_iterations=2,
        beta=0.0, max_completion_length=6, gradient_checkpointing=False, save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    dataset = prompt_dataset(32, 6, "swe-smith", seed=0)
    trainer = Recording(model=_model(tokenizer), reward_funcs=_content_reward, args=args, train_dataset=dataset,
                        processing_class=tokenizer)  # fmt: skip
    try:
        trainer.train()
    finally:
        trainer.end()
    (first, first_losses), (ahead, ahead_losses) = trainer.batches
    assert first.sampling_logps is None and all(loss["old_logps"] is not None for loss in first_losses)
    assert ahead.sampling_logps is not None
    for loss in ahead_losses:
        assert loss["old_logps"] is loss["sampling_logps"] and loss["sampling_logps"] is not None
