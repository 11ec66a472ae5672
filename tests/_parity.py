"""What the parity scripts (``_sft_parity.py``, ``_grpo_parity.py``, ``_dpo_parity.py``) save after training, and
how their tests launch them: a stock TRL trainer on one process against an ODC trainer on several, compared step by
step and parameter by parameter."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable

import pytest
import torch
from _machine import run_process, scaled
from _slow import require_slow
from _trainer_launch import ACCELERATE, EXAMPLES, ROOT


def trained_state(trainer) -> dict | None:
    """After ``trainer.train()``: the logged training steps and the full parameters (gathered from the shards for an
    ODC trainer, which is then closed), on the first process; ``None`` on the others."""
    from hf_odc.trainer._checkpoint import full_model_state_dict

    is_odc = hasattr(trainer, "close_odc")
    state = full_model_state_dict(trainer.model) if is_odc else trainer.model.state_dict()
    if is_odc:
        trainer.close_odc()
    if trainer.accelerator.process_index != 0:
        return None
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    return {"logs": logs, "params": {k: v.detach().cpu().clone() for k, v in state.items()}}


def run_checked(script: str, *args: str, processes: int = 1, env: dict | None = None, timeout: float = 600) -> None:
    """Run ``tests/<script>`` on one process (``python``) or on ``processes`` CPU processes (``accelerate launch`` with
    ``examples/odc_cpu.yaml``); fail with its output unless it exits 0."""
    require_slow(f"the script {script}")
    path = str(ROOT / "tests" / script)
    command = [sys.executable, path, *args]
    if processes > 1:
        config = str(EXAMPLES / "odc_cpu.yaml")
        command = [str(ACCELERATE), "launch", "--config_file", config, "--num_processes", str(processes), path, *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    returncode, out, err = run_process(
        command, scaled(timeout, processes), cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert returncode == 0, out[-4000:] + err[-8000:]


def finish() -> None:
    """Barrier, then destroy the process group, as the trainers' ``end()`` does: a process group left to interpreter
    exit can abort gloo ("terminate called without an active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_cases(train_case: Callable[[str, str, str, str], dict | None]) -> None:
    """A parity script's ``main``: ``SCRIPT KIND MODEL_DIR OUT CASE...`` trains each case with
    ``train_case(kind, model_dir, case, output_dir)`` and saves every case's :func:`trained_state` in ``OUT`` (on the
    first process)."""
    kind, model_dir, out, *names = sys.argv[1:]
    results = {name: train_case(kind, model_dir, name, f"{out}.{name}") for name in names}
    if all(result is not None for result in results.values()):
        torch.save(results, out)
    finish()


def assert_same_training(
    reference: dict,
    ours: dict,
    *,
    skip: Iterable[str] = (),
    absolute: dict[str, float] | None = None,
) -> None:
    """``ours`` (an ODC trainer's :func:`trained_state`) equals ``reference`` (stock TRL's) at every logged step:
    loss and gradient norm (rtol 1e-4), every float metric TRL logs but the names in ``skip`` (rtol 1e-4, absolute
    1e-6 or ``absolute[name]``), and the parameters after training (atol 5e-5)."""
    assert len(ours["logs"]) == len(reference["logs"]) > 0
    skip, absolute = set(skip), absolute or {}
    for expected, entry in zip(reference["logs"], ours["logs"], strict=True):
        step = expected["step"]
        assert entry["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6), f"loss at step {step}"
        assert entry["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), f"grad norm at step {step}"
        for name, value in expected.items():
            if name in skip or not isinstance(value, float) or math.isnan(value):
                continue
            assert name in entry, f"TRL logs {name!r}, ODC does not"
            tolerance = absolute.get(name, 1e-6)
            assert entry[name] == pytest.approx(value, rel=1e-4, abs=tolerance), f"{name} at step {step}"
    assert reference["params"].keys() == ours["params"].keys()
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(ours["params"][name], tensor, rtol=0, atol=5e-5, msg=name)
