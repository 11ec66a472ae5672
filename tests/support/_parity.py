"""What the parity scripts (``_sft_parity.py``, ``_grpo_parity.py``, ``_dpo_parity.py``, ...) share (their settings,
:data:`TRAINING`; a case trained by stock TRL or by ODC, :func:`train_with`, with a reference model,
:func:`train_with_reference`) and save after training, and how their tests launch them (:func:`parity_runs`, a test
module's ``runs`` fixture :func:`parity_fixture`): a stock TRL trainer on one process against an ODC trainer on
several, compared step by step and parameter by parameter (:func:`assert_same_case`)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from _machine import Concurrently
from _models import tiny_qwen2_config
from _trainer_launch import EXAMPLES, SUPPORT, launch, logged_steps, run
from transformers import Qwen2ForCausalLM

TRAINING = dict(
    learning_rate=0.5, optim="sgd", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
    seed=7, disable_tqdm=True,
)  # fmt: skip
"""Every parity script's settings (each adds its own): fp32 on CPU, plain SGD with a learning rate large enough for a
wrong gradient to show in the parameters, every step logged, nothing saved."""
SEQUENCE_PARALLEL = "parallelism_config:\n  parallelism_config_sp_size: 2\n"
"""The Accelerate yaml the sequence-parallel parity tests add to ``examples/odc_cpu.yaml`` (:func:`parity_runs`'s
``accelerate``): groups of 2 ranks split the documents longer than a microbatch."""


def sequence_parallel(sp_size: int | None) -> dict | None:
    """An ODC config's ``parallelism_config`` for a case's ``sp_size`` (``None``: Accelerate's launcher decides), so
    that one launch runs cases with different group sizes (``tests/parity/test_sequence_parallel_four_ranks.py``)."""
    return None if sp_size is None else {"sp_size": sp_size}


def trained_state(trainer) -> dict | None:
    """After ``trainer.train()``: the logged training steps and the full parameters (gathered from the shards for an
    ODC trainer, which is then closed), on the first process; ``None`` on the others."""
    from hf_odc.trainer.core._checkpoint_format import full_model_state_dict

    is_odc = hasattr(trainer, "close_odc")
    state = full_model_state_dict(trainer.model) if is_odc else trainer.model.state_dict()
    if is_odc:
        trainer.close_odc()
    if trainer.accelerator.process_index != 0:
        return None
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    return {"logs": logs, "params": {k: v.detach().cpu().clone() for k, v in state.items()}}


def run_checked(script: str, *args: str, processes: int = 1, env: dict | None = None, **launched: Any) -> None:
    """Run ``tests/support/<script>`` as :func:`_trainer_launch.launch` runs an example (``launched``: its ``timeout``,
    default 600 s, ``config``, an Accelerate config in place of ``examples/odc_cpu.yaml``, and ``background``); fail
    with its output unless it exits 0."""
    returncode, output = launch(
        str(SUPPORT / script), *args, processes=processes, env=env, preimported=True, **({"timeout": 600} | launched)
    )
    assert returncode == 0, output[-12000:]


def train_with_reference(
    kind: str,
    classes: dict[str, tuple[type, type]],
    model_dir: str,
    output_dir: str,
    settings: dict,
    *,
    peft: bool,
    minibatch: int,
    max_tokens: int,
    dataset: Callable[[int], Any],
) -> dict | None:
    """DPO's and KTO's cases, :func:`train_with`: the policy from ``model_dir`` and its reference (loaded again; none
    with ``peft``, the policy with its LoRA adapter disabled, nor with ``precompute_ref_log_probs``, reference
    log-probabilities computed before training), on ``dataset(n)``, the ``n`` examples of every optimizer step."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    ref_model, peft_config = None, None
    if peft:
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    elif not settings.get("precompute_ref_log_probs", False):
        ref_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    accumulation = settings.get("gradient_accumulation_steps", 1)
    return train_with(
        kind,
        classes,
        output_dir,
        settings,
        minibatch=minibatch,
        max_tokens=max_tokens,
        model=model,
        ref_model=ref_model,
        train_dataset=dataset(minibatch * accumulation * settings["max_steps"]),
        peft_config=peft_config,
    )


def train_with(
    kind: str,
    classes: dict[str, tuple[type, type]],
    output_dir: str,
    settings: dict,
    *,
    minibatch: int,
    max_tokens: int,
    **trainer_kwargs: Any,
) -> dict | None:
    """Train one case and return its :func:`trained_state`: ``classes[kind]``'s (config, trainer) pair, ``"trl"`` on
    one process with the whole ``minibatch`` per accumulation step, ``"odc"`` with ``minibatch / world_size`` per
    process and accumulation step, token-costed microbatches of at most ``max_tokens`` (and, where ``settings`` has
    ``sp_size``, groups of that many ranks: :func:`sequence_parallel`); the demo tokenizer."""
    from hf_odc.demo import build_tokenizer

    config_class, trainer_class = classes[kind]
    settings, sp_size = dict(settings), settings.get("sp_size")
    settings.pop("sp_size", None)
    if kind == "trl":
        args = config_class(output_dir, per_device_train_batch_size=minibatch, **settings)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args = config_class(output_dir, per_device_train_batch_size=minibatch // world_size, cost_model="tokens",
                            max_tokens_per_microbatch=max_tokens, parallelism_config=sequence_parallel(sp_size),
                            **settings)  # fmt: skip
    trainer = trainer_class(args=args, processing_class=build_tokenizer(), **trainer_kwargs)
    trainer.train()
    return trained_state(trainer)


def parity_runs(directory: Path, script: str, cases: Iterable[str], **launch: Any) -> tuple[dict, dict]:
    """A parity test's launches (:func:`parity_jobs`: ``launch``, its keywords), the two side by side
    (:class:`~_machine.Concurrently`: the reference's one process leaves a core idle, and the ODC ranks wait for each
    other); their saved states, by case. Either failing ends the other."""
    with Concurrently(parity_jobs(directory, script, cases, **launch), one_test=True) as launches:
        launches.result("trl")
        launches.result("odc")
    return torch.load(directory / "trl.pt"), torch.load(directory / "odc.pt")


def parity_jobs(
    directory: Path,
    script: str,
    cases: Iterable[str],
    *,
    model: torch.nn.Module | None = None,
    model_class: type = Qwen2ForCausalLM,
    env: dict | None = None,
    accelerate: str = "",
    processes: int = 2,
    **config: Any,
) -> dict[str, Callable[[Concurrently], None]]:
    """A parity test's two launches, as :class:`~_machine.Concurrently` jobs ``"trl"`` and ``"odc"``: ``model``
    (default: a tiny ``model_class`` Qwen2, seed 0, ``config`` setting its fields) saved in ``directory`` now, the
    ``cases`` of ``tests/support/<script>`` trained on it by stock TRL on one process and by ODC on ``processes``
    (``accelerate``: yaml added to ``examples/odc_cpu.yaml`` for that launch), each saving its states in
    ``directory`` (``trl.pt``, ``odc.pt``)."""
    if model is None:
        torch.manual_seed(0)
        fields = dict(vocab_size=507, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=3)  # fmt: skip
        model = model_class(tiny_qwen2_config(**(fields | config)))
    model.save_pretrained(directory / "model")
    model, names = str(directory / "model"), list(cases)
    accelerate_config = directory / "odc_cpu.yaml"
    accelerate_config.write_text((EXAMPLES / "odc_cpu.yaml").read_text() + accelerate)
    return {
        "trl": lambda background: run_checked(script, "trl", model, str(directory / "trl.pt"), *names, env=env,
                                              background=background),
        "odc": lambda background: run_checked(script, "odc", model, str(directory / "odc.pt"), *names,
                                              processes=processes, env=env, config=accelerate_config,
                                              background=background),
    }  # fmt: skip


class ParityRuns:
    """A module's ``runs`` (:func:`parity_fixture`): ``runs[0]`` and ``runs[1]``, stock TRL's and ODC's saved states
    by case (once both launches ended; what a launch raised otherwise); ``runs.example(request)``, what the running
    test's own launch returned."""

    def __init__(self, launches: Concurrently, directory: Path):
        self._launches, self._directory, self._states = launches, directory, None

    def __getitem__(self, index: int) -> dict:
        if self._states is None:
            self._launches.result("trl")
            self._launches.result("odc")
            self._states = torch.load(self._directory / "trl.pt"), torch.load(self._directory / "odc.pt")
        return self._states[index]

    def example(self, request) -> Any:
        return self._launches.result(request.node.nodeid)


def parity_fixture(script: str, cases: Iterable[str], examples: dict | None = None, **launch: Any) -> Callable:
    """A test module's ``runs`` fixture (``runs = parity_fixture(...)``), module-scoped so that one launch of each side
    serves all its tests: :func:`parity_jobs` of ``cases`` (``launch``: its keywords), a :class:`ParityRuns`.
    ``examples``: the launches of the module's other tests that take ``runs``, by test name (a job of
    :meth:`~_machine.Concurrently.of_tests`), queued behind the two in the same pool, two at a time, while the tests
    go on: the reference's one process ends first, and such a launch fills its core."""

    @pytest.fixture(scope="module", name="runs")
    def runs(request, tmp_path_factory) -> ParityRuns:
        directory = tmp_path_factory.mktemp(Path(script).stem.strip("_"))
        shared = parity_jobs(directory, script, cases, **launch)
        with Concurrently.of_tests(request, tmp_path_factory, examples or {}, shared=shared) as launches:
            yield ParityRuns(launches, directory)

    return runs


def assert_same_case(
    runs: tuple[dict, dict],
    cases: dict[str, dict],
    case: str,
    *,
    skip: Iterable[str] = (),
    per_slice: Iterable[str] = (),
    absolute: dict[str, float] | None = None,
) -> tuple[dict, dict]:
    """Case ``case`` of :func:`parity_runs` trained alike (:func:`assert_same_training`, skipping ``skip`` and, when
    the case accumulates gradients, the metrics TRL logs per accumulation slice, ``per_slice``): stock TRL's and ODC's
    states, for the case's own asserts."""
    reference, ours = runs[0][case], runs[1][case]
    accumulating = cases[case].get("gradient_accumulation_steps", 1) > 1
    assert_same_training(reference, ours, skip=(*skip, *(per_slice if accumulating else ())), absolute=absolute)
    return reference, ours


def assert_unequal_microbatches(results: Iterable[dict]) -> None:
    """Some step of the ODC ``results`` (:func:`trained_state`) gave the two ranks different microbatch counts: the
    case tested what ODC is for."""
    entries = [entry for result in results for entry in result["logs"]]
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in entries)


def example_steps(
    script: str,
    output_dir: Path,
    *flags: str,
    steps: int = 2,
    env: dict | None = None,
    background: Concurrently | None = None,
) -> dict:
    """``examples/<script>`` run on two processes for ``steps`` steps with ``flags`` (no progress bar; ``background``:
    as a job of it): its logged steps, by step, once they are checked to be all of them."""
    run(script, *flags, "--max_steps", str(steps), "--disable_tqdm", "true", "--output_dir", str(output_dir),
        processes=2, env=env, background=background, timeout=180 if background is None else 360)  # fmt: skip
    logs = logged_steps(output_dir)
    assert sorted(logs) == list(range(1, steps + 1))
    return logs


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
