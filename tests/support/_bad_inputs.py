"""Bad inputs a user gives the examples or ``hf-odc``, made in a test's folder: each function takes ``tmp_path`` and
returns the flags that name the input (``tests/distributed/test_examples_bad_input.py`` runs the scripts on them under
``accelerate launch``, ``tests/unit/test_cli_train.py`` the command line)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from _trainer_launch import EXAMPLES
from datasets import Dataset

from hf_odc.demo import build_tokenizer
from hf_odc.demo.models import MODEL_CONFIGS
from hf_odc.trainer.core._checkpoint_format import COMPLETE_MARKER, STATE_DIR

Flags = Callable[[Path], list[str]]


def truncated_scheduler(tmp_path: Path) -> list[str]:
    """A complete checkpoint whose ``scheduler.pt`` was cut short after its save."""
    checkpoint = tmp_path / "out" / "checkpoint-1"
    (checkpoint / STATE_DIR).mkdir(parents=True)
    (checkpoint / STATE_DIR / ".metadata").write_bytes(b"")
    (checkpoint / COMPLETE_MARKER).write_text("1\n")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    torch.save({"last_epoch": 1, "_step_count": 2}, checkpoint / "scheduler.pt")
    data = (checkpoint / "scheduler.pt").read_bytes()
    (checkpoint / "scheduler.pt").write_bytes(data[: len(data) // 2])
    return ["--resume_from_checkpoint", str(checkpoint), "--output_dir", str(tmp_path / "out")]


def data_file(name: str, text: str) -> Flags:
    """``--dataset_name`` naming a file ``name`` that holds ``text``."""

    def make(tmp_path: Path) -> list[str]:
        (tmp_path / name).write_text(text)
        return ["--dataset_name", str(tmp_path / name)]

    return make


def empty_saved_dataset(tmp_path: Path) -> list[str]:
    Dataset.from_list([]).save_to_disk(tmp_path / "empty")
    return ["--dataset_name", str(tmp_path / "empty")]


def model_without_tokenizer(tmp_path: Path) -> list[str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return ["--model_name_or_path", str(tmp_path / "model")]


def moe_config_without_router_coefficient(flag: str) -> Flags:
    """``flag`` (``--model_config`` or ``--model_name_or_path``, a folder with the demo tokenizer) naming the tiny
    Qwen3-MoE's ``config.json`` with ``"router_aux_loss_coef": null``, which transformers' config refuses."""

    def make(tmp_path: Path) -> list[str]:
        folder = tmp_path / "moe"
        folder.mkdir()
        config = MODEL_CONFIGS["tiny-moe"] | {"vocab_size": len(build_tokenizer()), "router_aux_loss_coef": None}
        (folder / "config.json").write_text(json.dumps(config))
        build_tokenizer().save_pretrained(folder)
        return [flag, str(folder)]

    return make


def accelerate_config(tmp_path: Path, change: Callable[[str], str], name: str = "accelerate.yaml") -> Path:
    """``examples/odc_cpu.yaml`` with ``change`` applied to its text, saved in ``tmp_path``."""
    path = tmp_path / name
    path.write_text(change((EXAMPLES / "odc_cpu.yaml").read_text()))
    return path


def offload_config(tmp_path: Path) -> Path:
    """``examples/odc_cpu.yaml`` with ``fsdp_offload_params: true``."""
    return accelerate_config(tmp_path, lambda text: text.replace("offload_params: false", "offload_params: true"))
