"""``ODCSFTConfig`` validation and defaults, and what ``ODCSFTTrainer`` refuses at construction."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _models import tiny_qwen2_config
from _trainer_launch import run
from accelerate import ParallelismConfig
from transformers import AutoModelForCausalLM

from hf_odc.demo import build_tokenizer, chat_dataset
from hf_odc.trainer import ODCDistillationConfig, ODCGRPOConfig, ODCRLOOConfig, ODCSFTConfig, ODCSFTTrainer


def config(tmp_path, **kwargs) -> ODCSFTConfig:
    return ODCSFTConfig(str(tmp_path), report_to="none", **kwargs)


def test_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_ODC_ENABLED", raising=False)
    args = config(tmp_path)
    assert args.odc is True and args.balance == "lb-mini" and args.cost_model == "calibrated" and args.packed_attention
    assert args.max_tokens_for(args.max_length) == args.max_length == 1024
    # CPU processes must know it, whatever the launcher told them; CUDA ones keep TrainingArguments' defaults
    cpu = not torch.cuda.is_available()
    assert args.use_cpu is cpu and (args.bf16 is False if cpu else args.bf16 is not False)


@pytest.mark.parametrize("checkpointing", [{}, {"gradient_checkpointing": True}], ids=["default", "old-name"])
def test_the_readme_configs_warn_about_nothing_the_user_did(tmp_path, checkpointing):
    """The README's ``ODCSFTConfig(...)`` and an ``ODCGRPOConfig``, with TRL's default or the examples' documented
    ``gradient_checkpointing``: transformers 5.23 renamed that field and warns whenever the old name is set, which
    TRL's own default does; the ODC configs take the old name as the new one, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sft = ODCSFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, **checkpointing)
        grpo = ODCGRPOConfig(output_dir=str(tmp_path), **checkpointing)
    assert sft.gradient_checkpointing is True and grpo.gradient_checkpointing is True  # TRL's default, kept
    assert grpo.model_init_kwargs is None  # set by the trainer only when it loads a model


def test_odc_follows_the_environment_and_the_baseline_uses_lb_micro(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ODC_ENABLED", "0")
    args = config(tmp_path)
    assert args.odc is False and args.balance == "lb-micro"
    assert config(tmp_path, odc=True).odc is True


def test_max_tokens_from_packing_ratio_or_explicit(tmp_path):
    assert config(tmp_path, max_length=100, packing_ratio=2.5).max_tokens_for(100) == 250
    assert config(tmp_path, max_tokens_per_microbatch=777).max_tokens_for(1024) == 777


@pytest.mark.parametrize("config_class", [ODCGRPOConfig, ODCRLOOConfig, ODCDistillationConfig])
def test_a_rollout_microbatch_holds_one_stock_trl_forward_pass_by_default(tmp_path, config_class):
    """Unset, a rollout trainer's microbatch holds per_device_train_batch_size longest rollouts (stock TRL's padded
    forward pass), not one; the explicit fields still decide when given."""
    make = lambda **kwargs: config_class(str(tmp_path), report_to="none", per_device_train_batch_size=8, **kwargs)  # noqa: E731
    assert make().max_tokens_for(100) == 800
    assert make(packing_ratio=1.0).max_tokens_for(100) == 100
    assert make(max_tokens_per_microbatch=777).max_tokens_for(100) == 777
    assert make(min_tokens_per_microbatch=5000).max_tokens_for(100) == 5000  # short rollouts fill the floor
    assert make(packing_ratio=1.0, min_tokens_per_microbatch=64).max_tokens_for(100) == 100
    assert make(max_tokens_per_microbatch=777, min_tokens_per_microbatch=5000).max_tokens_for(100) == 777


@pytest.mark.parametrize(
    ("variable", "kwargs", "source"),
    [
        ("true", {}, "fsdp_offload_params: true in the Accelerate config"),
        ("false", {"fsdp": "full_shard offload"}, "fsdp='full_shard offload'"),
        ("false", {"fsdp_config": {"offload_params": True}}, "fsdp_config's offload_params"),
    ],
)
def test_cpu_offload_is_refused_not_ignored(tmp_path, monkeypatch, variable, kwargs, source):
    """hf_odc shards without FSDP's CPU offload: asked for in the Accelerate config (which exports it to the processes)
    or in the config, it is refused in one line rather than silently ignored."""
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", variable)
    with pytest.raises(ValueError, match=re.escape(source) + ".* asks for FSDP's CPU offload"):
        config(tmp_path, **kwargs)


@pytest.mark.slow
def test_max_tokens_below_the_longest_sample_is_refused_before_the_first_step(tmp_path):
    """The whole dataset is checked up front (the planner alone would only fail at the minibatch drawing it)."""
    with pytest.raises(AssertionError) as failure:
        run("sft.py", "--max_steps", "3", "--num_samples", "64", "--max_tokens_per_microbatch", "10",
            "--output_dir", str(tmp_path), "--disable_tqdm", "true")  # fmt: skip
    message = str(failure.value)
    found = re.search(r"Sample (\d+) of the training dataset has (\d+) tokens, more than one microbatch holds \(10 "
                      r"tokens, from max_tokens_per_microbatch=10\)\. Set --max_tokens_per_microbatch to at least "
                      r"(\d+)", message)  # fmt: skip
    assert found is not None, message[-2000:]
    assert found.group(2) == found.group(3) and int(found.group(2)) > 10
    assert "'loss'" not in message, "refused before any step ran"


@pytest.mark.slow
def test_more_ranks_than_samples_is_refused_before_the_first_step(tmp_path):
    """2 processes, 1 sample: fewer samples than one global minibatch, refused naming what to change."""
    with pytest.raises(AssertionError) as failure:
        run("sft.py", "--max_steps", "3", "--num_samples", "1", "--output_dir", str(tmp_path), "--disable_tqdm",
            "true", processes=2)  # fmt: skip
    message = str(failure.value)
    expected = (r"The dataset has 1 samples, fewer than one global minibatch \(\d+ = per_device_train_batch_size x the "
                r"number of processes\): lower --per_device_train_batch_size, run fewer processes")  # fmt: skip
    assert re.search(expected, message), message[-2000:]
    assert "'loss'" not in message, "refused before any step ran"


@pytest.mark.parametrize(
    ("attention", "shape", "message"),
    [
        ("sdpa", {}, r"sp_size=2 must divide the number of processes \(1\)"),
        ("flex_attention", {}, "splits long documents inside hf_odc's 'odc_packed' attention, and the model uses "
         "'flex_attention'"),
        ("sdpa", {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48},
         "the model's 3 query heads do not split into 2; use an sp_size that divides 3"),
    ],
    ids=["one-process", "own-attention", "heads"],
)  # fmt: skip
def test_sequence_parallelism_the_trainer_cannot_run_is_refused(tmp_path, attention, shape, message):
    """``ParallelismConfig(sp_size=2)`` reaches the trainer, not the ``Accelerator`` (which refuses any on CPU, with
    its own message), and the trainer refuses it in one line on one process, or with a model whose attention would
    not split (its own implementation, or heads that 2 does not divide)."""
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_config(
        tiny_qwen2_config(vocab_size=len(tokenizer), attn_implementation=attention, **shape)
    )
    args = config(tmp_path, parallelism_config=ParallelismConfig(sp_size=2), max_length=64)
    with pytest.raises(ValueError, match=message) as refusal:
        ODCSFTTrainer(model=model, args=args, train_dataset=chat_dataset(4, 64, "swe-smith", seed=0),
                      processing_class=tokenizer)  # fmt: skip
    assert "\n" not in str(refusal.value)
