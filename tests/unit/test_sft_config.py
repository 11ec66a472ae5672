"""``ODCSFTConfig`` validation and defaults, and what ``ODCSFTTrainer`` refuses at construction."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _trainer_launch import run
from datasets import Dataset

from hf_odc.trainer import ODCGRPOConfig, ODCSFTConfig, ODCSFTTrainer


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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"odc": False, "balance": "lb-mini"}, "deadlock"),
        ({"balance": "greedy"}, "balance must be one of"),
        ({"cost_model": "flops"}, "cost_model must be one of"),
        ({"cost_model": "attention", "calibration_file": "c.json"}, "starting point of cost_model='calibrated'"),
        ({"calibration_file": "/nonexistent/odc_calibration.json"}, "calibration_file /nonexistent/.* no such file"),
        ({"freeze_calibration": True}, "freeze_calibration keeps a calibration as it is: pass calibration_file"),
        ({"max_tokens_per_microbatch": 10, "packing_ratio": 1.0}, "not both"),
        ({"max_tokens_per_microbatch": 0}, ">= 1"),
        ({"packing_ratio": 0.0}, "> 0"),
        ({"max_length": None}, "max_tokens_per_microbatch when max_length is None"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({"packing": True}, "packs each microbatch itself"),
        ({"padding_free": True}, "packs each microbatch itself"),
        ({"odc_timeout": -5}, "positive"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be >= 1"),
        ({"odc_shard_size": 0}, "odc_shard_size / HF_ODC_SHARD_SIZE\\) must be a positive integer"),
    ],
)
def test_invalid_configs_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **kwargs)


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


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"data_collator": lambda batch: batch}, ValueError, "data_collator"),
        ({"compute_loss_func": lambda *a, **k: 0}, ValueError, "compute_loss_func"),
        ({"train_dataset": Dataset.from_dict({"input_ids": [[1, 2]]}).to_iterable_dataset()}, TypeError, "map-style"),
    ],
)
def test_trainer_refuses_what_it_cannot_honour(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        ODCSFTTrainer(model="unused", args=config(tmp_path), **kwargs)


def test_trainer_needs_its_own_config(tmp_path):
    from trl import SFTConfig

    with pytest.raises(TypeError, match="ODCSFTConfig"):
        ODCSFTTrainer(model="unused", args=SFTConfig(str(tmp_path), report_to="none", use_cpu=True, bf16=False))


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
