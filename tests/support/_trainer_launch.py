"""Run the example scripts the way a user does (``accelerate launch`` or plain ``python``), never hanging a test."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import _zygote
import pytest
from _machine import Concurrently, run_process, scaled, within_test
from _slow import require_slow

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
"""This folder: the helpers and the scripts the tests launch by path (``SUPPORT / "_stall_sft.py"``)."""
SFT_STEPS = 5
# examples/sft.py's flags for the runs compared step by step (tests/parity/test_sft_parity.py, the checkpoint tests): a
# higher learning rate than the demo's, so that five steps move the weights enough for a wrong gradient to show.
SFT_FLAGS = ("--max_steps", str(SFT_STEPS), "--learning_rate", "1e-2", "--num_samples", "128", "--disable_tqdm", "true")
EXAMPLES = ROOT / "examples"
ACCELERATE = Path(sys.executable).with_name("accelerate")


def run(
    script: str,
    *args: str,
    processes: int = 1,
    env: dict | None = None,
    timeout: float = 180.0,
    background: Concurrently | None = None,
    preimported: bool = False,
) -> str:
    """Run ``examples/<script>`` on one process (``python``) or ``processes`` CPU processes (``accelerate launch``
    with ``examples/odc_cpu.yaml``); return its output, or fail with it. ``background``, ``preimported``: as
    :func:`launch` takes them."""
    returncode, output = launch(script, *args, processes=processes, env=env, timeout=timeout, background=background,
                                preimported=preimported)  # fmt: skip
    if returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited with {returncode}:\n{output[-8000:]}")
    return output


def launch(
    script: str,
    *args: str,
    processes: int = 1,
    env: dict | None = None,
    timeout: float = 180.0,
    config: Path | None = None,
    background: Concurrently | None = None,
    preimported: bool = False,
) -> tuple[int, str]:
    """:func:`run`, returning the exit status and the output whatever the status (it still fails on a timeout, which
    :func:`~_machine.scaled` stretches on a busy machine); ``config``: an Accelerate config in place of
    ``examples/odc_cpu.yaml``; ``background``: the :class:`~_machine.Concurrently` whose job this launch is (the
    timeout as its :meth:`~_machine.Concurrently.run` takes it). ``preimported``: the ranks forked by the test zygote
    (:func:`_zygote.launch`), in the environment the launcher would give them, for a launch whose training results
    are checked, not the launch itself."""
    require_slow(f"the script {Path(script).name}")
    command, timeout = _command(script, args, processes, config), scaled(timeout, processes)
    if preimported:
        limit = within_test(timeout) if background is None else background.limit(timeout)
        track = None if background is None else background.track
        config = config or EXAMPLES / "odc_cpu.yaml"
        return _zygote.launch(str(EXAMPLES / script), list(args), processes=processes, env=_popen_options(env)["env"],
                              timeout=limit, config=config, track=track)  # fmt: skip
    if background is None:
        returncode, output, _ = run_process(command, timeout, stdout=subprocess.PIPE, **_popen_options(env))
    else:
        returncode, output, _ = background.run(command, timeout, **_popen_options(env))
    return returncode, output


def start(script: str, *args: str, log: Path, processes: int = 2, env: dict | None = None) -> subprocess.Popen:
    """Start what :func:`launch` runs, its output going to ``log``, and return at once (the caller ends it: with
    ``os.killpg(process.pid, signal.SIGKILL)``, every rank with the launcher)."""
    require_slow(f"the script {Path(script).name}")
    with open(log, "w") as out:
        # A session of its own, so that the caller's killpg ends the launcher and every rank it started.
        return subprocess.Popen(
            _command(script, args, processes), stdout=out, start_new_session=True, **_popen_options(env)
        )


def _command(script: str, args: tuple[str, ...], processes: int, config: Path | None = None) -> list[str]:
    if processes == 1:
        return [sys.executable, str(EXAMPLES / script), *args]
    config = str(config or EXAMPLES / "odc_cpu.yaml")
    command = [str(ACCELERATE), "launch", "--config_file", config, "--num_processes", str(processes)]
    return [*command, str(EXAMPLES / script), *args]


def _popen_options(env: dict | None) -> dict:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", **(env or {})}
    return dict(cwd=ROOT, env=full_env, stderr=subprocess.STDOUT)


def load_example(script: str) -> ModuleType:
    """``examples/<script>`` as a module, its ``__main__`` block not run, for tests of the script's own command line
    (what the examples share comes from :mod:`hf_odc.demo`)."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses' annotations are resolved
    spec.loader.exec_module(module)
    return module


def logged_steps(output_dir: str | Path) -> dict[int, dict]:
    """The per-step logs the Trainer saved in ``trainer_state.json``, by global step."""
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry for entry in history if "loss" in entry}


def assert_same_steps(
    ours: dict[int, dict], reference: dict[int, dict], steps=range(1, SFT_STEPS + 1), rel: float = 1e-4
) -> None:
    """Two runs of :data:`SFT_FLAGS` (:func:`logged_steps`) logged every step, and the same loss and gradient norm
    (``rel``) at ``steps``."""
    assert sorted(ours) == sorted(reference) == list(range(1, SFT_STEPS + 1))
    for step in steps:
        assert ours[step]["loss"] == pytest.approx(reference[step]["loss"], rel=rel), f"loss at step {step}"
        assert ours[step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=rel), f"grad at step {step}"
