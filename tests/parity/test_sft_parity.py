"""End to end, as a user runs it: ``accelerate launch --config_file examples/odc_cpu.yaml examples/sft.py`` on 2 CPU
processes must train exactly like one process on the same global minibatches (loss and gradient norm, rtol 1e-4),
with ODC + LB-Mini, and with LB-Micro with and without ODC; it must save and resume to an identical continuation.

The launches run two at a time (:class:`~_machine.Concurrently`) while the tests go on: each starts as a 1- or
2-process launch that leaves the cores idle for part of its time (its launcher's start and teardown, a rank waiting for
the other), which another's fill."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from _machine import Concurrently
from _trainer_launch import SFT_FLAGS, SFT_STEPS, SUPPORT, assert_same_steps, logged_steps, run
from safetensors.torch import load_file

from hf_odc.packing import AttentionCost, Calibration

pytestmark = pytest.mark.slow  # every test starts processes
PEAK_TFLOPS = 1e-3
LORA = (
    "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
    "--lora_target_modules", "q_proj", "v_proj", "--assistant_only_loss", "true", "--gradient_checkpointing", "true",
)  # fmt: skip


AT_ONCE = 2
"""Launches side by side; their timeouts scale with the processes they start together."""


def train(
    background: Concurrently,
    output_dir,
    *args: str,
    processes: int,
    env: dict | None = None,
    script: str = "sft.py",
    preimported: bool = True,
) -> dict[int, dict]:
    """Run examples/sft.py (or ``script``) as a job of ``background``; the global minibatch is 16 samples either
    way. ``preimported``: its ranks forked by the test zygote (``_zygote.py``), in the environment ``accelerate
    launch`` gives them; LB-Mini's run (:func:`_lb_mini`) is launched as a user launches it."""
    batch = str(16 // processes)
    run(script, *SFT_FLAGS, "--per_device_train_batch_size", batch, "--output_dir", str(output_dir), *args,
        processes=processes, env=env, background=background, timeout=180 * AT_ONCE,
        preimported=preimported)  # fmt: skip
    return logged_steps(output_dir)


def assert_step_metrics(entry: dict) -> None:
    """The per-step timings of 2 ranks are consistent with their definitions (docs/api.md's metric table)."""
    assert entry["tokens_per_second"] > 0 and 0 <= entry["predicted_bubble_rate"] < 1
    busy = [entry[f"busy_s/rank_{rank}"] for rank in (0, 1)]
    for rank in (0, 1):
        assert busy[rank] > 0 and entry[f"wait_s/rank_{rank}"] >= 0
        assert busy[rank] + entry[f"wait_s/rank_{rank}"] == pytest.approx(entry["minibatch_s"], abs=0.02)
    assert entry["bubble_rate"] == pytest.approx(1 - sum(busy) / (2 * entry["minibatch_s"]), abs=1e-6)
    # the wall clock's step holds the minibatch and the rest (the optimizer, loading, logging)
    assert entry["step_s"] > entry["minibatch_s"] or entry["step"] == 1
    assert entry["tokens_per_second"] == pytest.approx(
        (entry["tokens/rank_0"] + entry["tokens/rank_1"]) / entry["step_s"], rel=1e-3
    )


def _reference(background: Concurrently, directory: Path) -> tuple[Path, dict]:
    """One process, the reference of every comparison."""
    return directory, train(background, directory, processes=1)


def _lb_mini(background: Concurrently, directory: Path) -> tuple[Path, dict]:
    """ODC + LB-Mini on 2 processes, with checkpoints every 2 steps for the resume test. Token costs: on these
    lengths they give the ranks different numbers of microbatches at some step, which this test must exercise."""
    return directory, train(
        background, directory, "--save_strategy", "steps", "--save_steps", "2", "--cost_model", "tokens", processes=2,
        env={"HF_ODC_PEAK_TFLOPS": str(PEAK_TFLOPS)}, preimported=False,  # a peak for the CPU: MFU is logged
    )  # fmt: skip


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """The shared runs (``"reference"``, ``"lb_mini"``) and every selected test's own (:data:`LAUNCHES`),
    :data:`AT_ONCE` at a time while the tests go on; each test takes its own by its id."""
    shared = {key: functools.partial(job, directory=tmp_path_factory.mktemp(key))
              for key, job in {"reference": _reference, "lb_mini": _lb_mini}.items()}  # fmt: skip
    with Concurrently.of_tests(request, tmp_path_factory, LAUNCHES, AT_ONCE, shared=shared) as runs:
        yield runs


@pytest.fixture
def reference(launches):
    return launches.result("reference")


@pytest.fixture
def lb_mini(launches):
    return launches.result("lb_mini")


def test_odc_lb_mini_matches_a_single_process(reference, lb_mini):
    (reference_dir, expected), (directory, logs) = reference, lb_mini
    assert_same_steps(logs, expected)
    cost = AttentionCost.from_config(json.loads((directory / "config.json").read_text()))
    for entry in logs.values():
        assert_step_metrics(entry)
        # MFU: the step's training FLOPs (3 x the forward's, attention per document) over step_s x 2 ranks x peak
        flops = entry["mfu"] * entry["step_s"] * 2 * PEAK_TFLOPS * 1e12
        tokens = entry["tokens/rank_0"] + entry["tokens/rank_1"]
        assert 3 * cost.linear * tokens < flops < 3 * (cost.linear * tokens + cost.quadratic * tokens**2), entry
    # LB-Mini is only exercised if the ranks ran different numbers of microbatches at some step.
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in logs.values())
    # The model saved from the shards equals the single-process one (per tensor: Adam turns rounding-level gradient
    # differences into larger ones on the elements whose gradient is near zero, so elementwise tolerances don't fit).
    ours, theirs = load_file(directory / "model.safetensors"), load_file(reference_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert (tensor - theirs[name]).norm() <= 1e-4 * theirs[name].norm(), name


def _lb_micro(background: Concurrently, directory: Path, odc: str) -> dict:
    return train(background, directory, "--balance", "lb-micro", "--odc", odc, processes=2)


@pytest.mark.parametrize("odc", ["true", "false"], ids=["odc", "fsdp2"])
def test_lb_micro_matches_a_single_process(reference, launches, request, odc):
    logs = launches.result(request.node.nodeid)
    assert_same_steps(logs, reference[1])
    assert all(entry["microbatches/rank_0"] == entry["microbatches/rank_1"] for entry in logs.values())
    for entry in logs.values():  # device-timed metrics in both modes, the same definitions (docs/api.md)
        for rank in (0, 1):
            assert entry[f"busy_s/rank_{rank}"] + entry[f"wait_s/rank_{rank}"] == pytest.approx(
                entry["minibatch_s"], abs=0.02
            )


def _resume(background: Concurrently, directory: Path) -> dict:
    """From ``lb_mini``'s checkpoint of step 2 (waiting for that launch, begun before this one)."""
    checkpoint = background.result("lb_mini")[0] / "checkpoint-2"
    return train(background, directory, "--resume_from_checkpoint", str(checkpoint), "--cost_model", "tokens",
                 processes=2)  # fmt: skip


def test_resume_continues_identically(lb_mini, launches, request):
    resumed = launches.result(request.node.nodeid)
    assert_same_steps(resumed, lb_mini[1], steps=range(3, SFT_STEPS + 1), rel=1e-5)


def _lora(background: Concurrently, directory: Path) -> tuple[dict, dict, Path]:
    """One process, then two, which checkpoint half the layers: their logged steps and the two-process run's
    directory."""
    single = train(background, directory / "single", *LORA, processes=1)
    half = ("--checkpoint_layer_share", "0.5")
    return single, train(background, directory / "odc", *LORA, *half, processes=2), directory / "odc"


def test_lora_with_gradient_checkpointing_and_assistant_only_loss(launches, request):
    """Two processes with ODC, LoRA, assistant-only loss and half the layers checkpointed (``checkpoint_layer_share``)
    take the steps of one process checkpointing every layer."""
    single, odc, directory = launches.result(request.node.nodeid)
    assert_same_steps(odc, single)
    assert (directory / "adapter_model.safetensors").exists()


def _straggler(background: Concurrently, directory: Path) -> tuple[dict, Path]:
    env = {"HF_ODC_TEST_SLOW_RANK": "1", "HF_ODC_TEST_SLOWDOWN": "6"}
    logs = train(background, directory, "--cost_model", "calibrated", processes=2, env=env,
                 script=str(SUPPORT / "_straggler_sft.py"))  # fmt: skip
    return logs, directory


def test_a_slow_rank_gets_less_work_once_calibrated_and_training_is_unchanged(reference, launches, request):
    """``cost_model="calibrated"`` with rank 1 slowed to about a third of rank 0's speed: the first steps split the
    minibatch evenly (the attention cost), the calibration's first fit follows step 3 (step 1 is warm-up), and from
    step 4 rank 1 gets proportionally fewer tokens. Every rank must plan the same from the same gathered times, which
    the loss and gradient norms of a single process prove. (That the minibatch then finishes sooner is a measurement of
    CPU times, which other jobs on the machine disturb: ``benchmarks/calibrated_balance.py --straggler`` measures it,
    on GPUs, in benchmarks/RESULTS.md.)"""
    ours, directory = launches.result(request.node.nodeid)
    assert_same_steps(ours, reference[1])

    def share(step: int) -> float:
        return ours[step]["tokens/rank_1"] / (ours[step]["tokens/rank_0"] + ours[step]["tokens/rank_1"])

    assert all(0.4 < share(step) < 0.6 for step in (1, 2, 3)), [share(step) for step in (1, 2, 3)]
    assert "calibration/speed/rank_1" not in ours[2] and ours[3]["calibration/speed/rank_1"] < 0.8
    assert all(share(step) < 0.4 for step in (4, 5)), [share(step) for step in (4, 5)]
    saved = Calibration.load(directory / "odc_calibration.json")
    assert saved.speeds[1] == pytest.approx(ours[SFT_STEPS]["calibration/speed/rank_1"])  # the last step's fit
    assert saved.cost.quadratic == pytest.approx(ours[SFT_STEPS]["calibration/quadratic"])


def _hybrid(background: Concurrently, directory: Path) -> dict:
    return train(background, directory, "--odc_shard_size", "2", "--cost_model", "tokens", processes=4)


def test_hybrid_odc_on_two_replicas_matches_a_single_process(reference, launches, request):
    """4 processes with `--odc_shard_size 2`: two shard groups of 2 (hybrid ODC, HSDP's layout: what a job over two
    hosts gets by itself), LB-Mini over all 4 ranks, one all-reduce across replicas per step."""
    logs = launches.result(request.node.nodeid)
    assert_same_steps(logs, reference[1])
    assert all(entry["all_reduce_s"] > 0 for entry in logs.values())  # the cross-replica step ran every minibatch


LAUNCHES = {
    "test_lb_micro_matches_a_single_process": _lb_micro,
    "test_resume_continues_identically": _resume,
    "test_lora_with_gradient_checkpointing_and_assistant_only_loss": _lora,
    "test_a_slow_rank_gets_less_work_once_calibrated_and_training_is_unchanged": _straggler,
    "test_hybrid_odc_on_two_replicas_matches_a_single_process": _hybrid,
}
"""Each test's launches, by test name: a job of :class:`~_machine.Concurrently` (its directory, its parameters)."""
