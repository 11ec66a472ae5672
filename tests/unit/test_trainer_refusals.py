"""What the ODC trainers and their configs refuse at construction, each with what to use instead: one table per kind
of refusal, a row per trainer and input (a trainer's other refusals are in its own ``test_<trainer>_*.py``)."""

from __future__ import annotations

import pytest
from accelerate import ParallelismConfig
from datasets import Dataset
from trl import DPOConfig, SFTConfig

from hf_odc.demo import preference_dataset
from hf_odc.trainer import (
    ODCDPOConfig,
    ODCDPOTrainer,
    ODCGRPOConfig,
    ODCKTOConfig,
    ODCKTOTrainer,
    ODCRewardTrainer,
    ODCSFTConfig,
    ODCSFTTrainer,
)

CONFIGS = {"sft": ODCSFTConfig, "dpo": ODCDPOConfig, "kto": ODCKTOConfig, "grpo": ODCGRPOConfig}
TRAINERS = {"sft": ODCSFTTrainer, "dpo": ODCDPOTrainer, "kto": ODCKTOTrainer}


def config(trainer: str, tmp_path, **fields):
    """``trainer``'s ODC config for a test: its output in ``tmp_path``, reporting nowhere; GRPO's with 4 prompts of 4
    generations per process (the batch must hold whole groups)."""
    if trainer == "grpo":
        return ODCGRPOConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4, **fields)
    return CONFIGS[trainer](str(tmp_path), report_to="none", **fields)


def _rows(trainer: str, rows: list[tuple]) -> list:
    return [pytest.param(trainer, *row, id=f"{trainer}-{i}") for i, row in enumerate(rows)]


INVALID_CONFIGS = [
    *_rows("sft", [
        ({"odc": False, "balance": "lb-mini"}, "deadlock"),
        ({"balance": "greedy"}, "balance must be one of"),
        ({"cost_model": "flops"}, "cost_model must be one of"),
        ({"cost_model": "attention", "calibration_file": "c.json"}, "starting point of cost_model='calibrated'"),
        ({"calibration_file": "/nonexistent/odc_calibration.json"}, "calibration_file /nonexistent/.* no such file"),
        ({"freeze_calibration": True}, "freeze_calibration keeps a calibration as it is: pass calibration_file"),
        ({"max_tokens_per_microbatch": 10, "packing_ratio": 1.0}, "not both"),
        ({"max_tokens_per_microbatch": 0}, ">= 1"),
        ({"packing_ratio": 0.0}, "> 0"),
        ({"min_tokens_per_microbatch": -1}, "min_tokens_per_microbatch must be >= 0"),
        ({"max_length": None}, "max_tokens_per_microbatch when max_length is None"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({"packing": True}, "packs each microbatch itself"),
        ({"padding_free": True}, "packs each microbatch itself"),
        ({"odc_timeout": -5}, "positive"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be >= 1"),
        ({"odc_shard_size": 0}, "odc_shard_size / HF_ODC_SHARD_SIZE\\) must be a positive integer"),
        ({"parallelism_config": ParallelismConfig(cp_size=2)}, r"cp_size=2 \(ring attention\) .* use sp_size=2"),
        ({"parallelism_config": ParallelismConfig(tp_size=2)}, "tp_size=2 is not supported by hf_odc"),
        ({"parallelism_config": ParallelismConfig(sp_size=2), "odc": False, "balance": "lb-micro"}, "needs odc=True"),
        ({"parallelism_config": ParallelismConfig(sp_size=2), "balance": "lb-micro"}, "and balance='lb-mini'"),
        ({"parallelism_config": ParallelismConfig(sp_size=2), "packed_attention": False}, "packed_attention=True"),
    ]),
    *_rows("dpo", [
        ({"loss_type": "aot"}, r"loss_type='aot': it sorts the log-ratios of every pair .* Use one of"),
        ({"loss_type": ["sigmoid", "aot_unpaired"]}, "loss_type='aot_unpaired'"),
        ({"loss_type": "sigmoid2"}, "Unknown DPO loss_type 'sigmoid2'; ODCDPOTrainer supports"),
        ({"use_weighting": True}, "use_weighting .* set use_weighting=False, or use trl.DPOTrainer"),
        ({"sync_ref_model": True}, "sync_ref_model .* Set sync_ref_model=False"),
        ({"padding_free": True}, "packs each microbatch itself"),
        ({"odc": False, "balance": "lb-mini"}, "deadlock"),
        ({"parallelism_config": ParallelismConfig(sp_size=2), "balance": "lb-micro"}, "and balance='lb-mini'"),
    ]),
    *_rows("kto", [
        ({"loss_type": "bco"}, r"Unknown KTO loss_type 'bco'; ODCKTOTrainer supports \('kto', 'apo_zero_unpaired'\)"),
        ({"sync_ref_model": True}, "sync_ref_model .* Set sync_ref_model=False, or use trl.KTOTrainer"),
        ({"parallelism_config": ParallelismConfig(sp_size=2)}, "ODCKTOConfig: sp_size=2 .* only; set sp_size to 1"),
    ]),
    *_rows("grpo", [
        ({"use_vllm": True, "odc_generation": "gathered"}, "Leave odc_generation unset"),
        ({"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching=False"),
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 3}, "must be a multiple of gradient_accumulation"),
        ({"odc": False, "balance": "lb-mini"}, "--balance lb-micro"),
        ({"parallelism_config": ParallelismConfig(sp_size=2), "loss_type": "vespo"}, "loss_type='vespo' weighs each"),
        ({"parallelism_config": ParallelismConfig(sp_size=2), "off_policy_mask_threshold": 0.1}, "splits over ranks"),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("trainer", "kwargs", "message"), INVALID_CONFIGS)
def test_invalid_configs_are_refused(tmp_path, trainer, kwargs, message):
    with pytest.raises(ValueError, match=message) as refusal:
        config(trainer, tmp_path, **kwargs)
    assert "\n" not in str(refusal.value)


CANNOT_HONOUR = [
    *_rows("sft", [
        ({"data_collator": lambda batch: batch}, ValueError, "data_collator"),
        ({"compute_loss_func": lambda *a, **k: 0}, ValueError, "compute_loss_func"),
        ({"train_dataset": Dataset.from_dict({"input_ids": [[1, 2]]}).to_iterable_dataset()}, TypeError, "map-style"),
    ]),
    *_rows("dpo", [
        ({"data_collator": lambda batch: batch}, ValueError, "data_collator"),
        ({"train_dataset": preference_dataset(2, 32, "swe-smith", 0).to_iterable_dataset()}, TypeError, "map-style"),
    ]),
    *_rows("kto", [
        ({"train_dataset": Dataset.from_dict({"images": [[]], "prompt": ["a"]})}, NotImplementedError, "vision"),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("trainer", "kwargs", "error", "message"), CANNOT_HONOUR)
def test_trainer_refuses_what_it_cannot_honour(tmp_path, trainer, kwargs, error, message):
    with pytest.raises(error, match=message):
        TRAINERS[trainer](model="unused", args=config(trainer, tmp_path), **kwargs)


@pytest.mark.parametrize(
    ("trainer_class", "other_config", "message"),
    [
        pytest.param(
            ODCSFTTrainer,
            lambda path: SFTConfig(path, report_to="none", use_cpu=True, bf16=False),
            "ODCSFTConfig",
            id="sft",
        ),
        pytest.param(
            ODCDPOTrainer,
            lambda path: DPOConfig(path, report_to="none", use_cpu=True, bf16=False),
            "ODCDPOConfig",
            id="dpo",
        ),
        pytest.param(
            ODCKTOTrainer,
            lambda path: ODCDPOConfig(path, report_to="none"),
            "ODCKTOTrainer needs an ODCKTOConfig, got ODCDPOConfig",
            id="kto",
        ),
        pytest.param(
            ODCRewardTrainer,
            lambda path: ODCDPOConfig(path, report_to="none"),
            "ODCRewardTrainer needs an ODCRewardConfig, got ODCDPOConfig",
            id="reward",
        ),
    ],
)
def test_trainer_needs_its_own_config(tmp_path, trainer_class, other_config, message):
    with pytest.raises(TypeError, match=message):
        trainer_class("unused", args=other_config(str(tmp_path)))
