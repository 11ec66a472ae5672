"""The headline benchmark runs end to end on 2 CPU processes (a tiny model, shrunk lengths) and reports every
scheme with self-consistent numbers, so that the GPU command cannot rot unnoticed."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _machine import Concurrently, scaled

pytestmark = pytest.mark.slow  # every test starts processes
ROOT = Path(__file__).resolve().parents[2]
AT_ONCE = 2
"""Tests whose benchmark runs go side by side (:class:`~_machine.Concurrently`): a run leaves the cores idle for part
of its time (its launcher's start and teardown, a rank waiting for the other), which another's fill."""
PROCESSES = 2 * AT_ONCE  # on the machine at once: what the timeouts scale with
PEAK = {**os.environ, "HF_ODC_PEAK_TFLOPS": "0.001"}  # a peak for the CPU, so that MFU is computed


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory):
    """Every selected test's commands (:data:`COMMANDS`), :data:`AT_ONCE` tests at a time while the tests go on; by
    test id, what :func:`_in_turn` returns."""
    jobs = {name: functools.partial(_in_turn, commands) for name, commands in COMMANDS.items()}
    with Concurrently.of_tests(request, tmp_path_factory, jobs, AT_ONCE) as runs:
        yield runs


def _in_turn(commands, background: Concurrently, directory: Path, **params) -> tuple[Path, list[SimpleNamespace]]:
    """A test's ``commands(directory, **params)``, ``(command, environment or None, timeout before scaling)`` each,
    in turn in ``directory``: the directory, and each one's ``returncode``, ``stdout`` and ``stderr``."""
    done = []
    for command, env, timeout in commands(directory, **params):
        returncode, stdout, stderr = background.run(command, scaled(timeout, PROCESSES), cwd=directory, env=env)
        done.append(SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr))
    return directory, done


def _sft_throughput(directory: Path) -> list:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "benchmarks" / "sft_throughput.py"), "--model", "tiny", "--distribution", "longalign",
        "--samples-per-device", "4", "--length-scale", "0.004", "--steps", "2", "--warmup", "1",
        "--predict-world-sizes", "8", "--json", str(directory / "sft.json"), "--plot", str(directory / "sft.png"),
        "--warm-attention-plans",  # (a GPU's: nothing to warm on the CPU)
        "--memory-phases",
    ]  # fmt: skip
    return [(command, PEAK, 240)]


def test_sft_throughput_runs_every_scheme_on_cpu(ran, request):
    directory, (done,) = ran.result(request.node.nodeid)
    out, png = directory / "sft.json", directory / "sft.png"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ODC+LB-Mini" in done.stdout and png.stat().st_size > 0
    result = json.loads(out.read_text())["results"][0]
    schemes = result["summary"]["schemes"]
    assert list(schemes) == [
        "Collective+LocalSort", "Collective+LB-Micro", "ODC+LB-Micro", "ODC+LB-Mini", "ODC+LB-Mini calibrated"
    ]  # fmt: skip
    for row in schemes.values():
        assert row["tokens_per_second"] > 0 and 0 <= row["bubble_measured"] < 1 and row["mfu"] > 0
        assert len(row["microbatches"]) == 2  # the warm-up minibatch is not timed
    assert schemes["Collective+LB-Micro"]["speedup_vs_Collective+LB-Micro"] == pytest.approx(1.0)
    # LocalSort runs one sample per microbatch; the collective schemes run equal counts on every rank
    assert all(counts == [4, 4] for counts in schemes["Collective+LocalSort"]["microbatches"])
    assert all(len(set(counts)) == 1 for counts in schemes["Collective+LB-Micro"]["microbatches"])
    calibration = result["summary"]["calibration"]
    assert calibration["samples"] > 0 and sum(calibration["cost"].values()) > 0  # tiny CPU runs: maybe fixed costs only
    # the memory report: each scheme's largest microbatch and peak rank-step with its phases; ODC+LB-Micro ran
    # Collective+LB-Micro's plans, so every timed rank-step compares the engines on the same microbatches
    for name, row in schemes.items():
        ran = [sum(m) for rank in result["records"] for step in rank[name] for m in step["microbatch_lengths"]]
        assert row["largest_microbatch"] == max(ran)
        at = row["at_peak"]
        assert [p[0] for p in at["phases"]][:3] == ["start", "entered", "forward 0"]
        assert len(at["phases"]) == 4 + 2 * len(at["microbatch_tokens"])
    assert schemes["ODC+LB-Micro"]["same_microbatches_vs_baseline"]["rank_steps"] == 4
    assert "Peak memory" in done.stdout


def _sft_throughput_moe(directory: Path) -> list:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "benchmarks" / "sft_throughput.py"), "--model", "tiny-moe", "--num-layers", "1",
        "--distribution", "longalign", "--samples-per-device", "2", "--length-scale", "0.004", "--steps", "2",
        "--warmup", "1", "--schemes", "Collective+LB-Micro,ODC+LB-Mini,ODC+LB-Mini calibrated",
        "--predict-world-sizes", "8", "--unfused",
        "--json", str(directory / "moe.json"),
    ]  # fmt: skip
    return [(command, None, 240)]


def test_sft_throughput_builds_and_trains_a_moe_shape_on_cpu(ran, request):
    """The MoE shapes (``--model tiny-moe`` here, ``qwen3-30b-a3b-8l`` on GPUs) build through the same path: a
    Qwen3-MoE, its expert weights sharded, trained by ODC and by plain FSDP2; here with transformers' own norms
    (``--unfused``; the other run has the fused ones). Every microbatch's active (layer, expert) pairs are counted
    (the routers' top-2 of 8 experts in 1 layer), for the calibrated cost's expert term."""
    directory, (done,) = ran.result(request.node.nodeid)
    out = directory / "moe.json"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["model_type"] == "qwen3_moe" and result["args"]["num_layers"] == 1 and result["args"]["unfused"]
    schemes = result["results"][0]["summary"]["schemes"]
    assert list(schemes) == ["Collective+LB-Micro", "ODC+LB-Mini", "ODC+LB-Mini calibrated"]
    assert all(row["tokens_per_second"] > 0 for row in schemes.values())
    config = result["results"][0]
    assert config["expert_slots"] == 8 and config["summary"]["calibration"]["cost"]["expert_slots"] == 8
    steps = [step for rank in config["records"] for runs in rank.values() for step in runs]
    assert all(len(step["active_experts"]) == len(step["microbatch_lengths"]) for step in steps)
    assert all(2 <= active <= 8 for step in steps for active in step["active_experts"])


VS_TRL = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py")]
FREE = ("--trainer", "grpo", "--num-generations", "2", "--max-completion-length", "16", "--rows", "odc")
"""The free-completions test's options, run and refused."""


def _vs_trl(*options: str, refused: tuple[str, ...] = ()):
    """benchmarks/vs_trl.py's rows on a tiny model, 2 CPU processes each, 1 warm-up and 2 timed steps (their JSON:
    :func:`vs_trl_rows`), then, with ``refused``, the command line it refuses."""

    def commands(directory: Path) -> list:
        command = [
            *VS_TRL, "--model", "tiny", "--samples-per-device", "2", "--steps", "2", "--warmup", "1",
            "--no-checkpointing", "--json", str(directory / "vs_trl.json"), *options,
        ]  # fmt: skip
        return [(command, PEAK, 300), *([([*VS_TRL, *refused], None, 60)] if refused else [])]

    return commands


def vs_trl_rows(directory: Path, done: SimpleNamespace) -> dict:
    """The rows :func:`_vs_trl` ran (``done``), each checked to have run with tokens/s and MFU."""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads((directory / "vs_trl.json").read_text())["rows"]
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["tokens_per_second"] > 0 and row["mfu"] > 0 and len(row["step_s"]) == 2
    return rows


def test_vs_trl_runs_stock_trl_and_odc_on_the_same_samples_on_cpu(ran, request):
    """benchmarks/vs_trl.py's three rows, each its own 2-process accelerate launch: every row trains the same
    samples in each timed step, and only the ODC row logs a bubble."""
    directory, (done,) = ran.result(request.node.nodeid)
    rows = vs_trl_rows(directory, done)
    assert list(rows) == ["trl-default", "trl-best", "odc"]
    for row in rows.values():
        assert row["tokens"] == rows["odc"]["tokens"]  # the same samples in each timed step
    assert rows["odc"]["bubble"] is not None and rows["trl-best"]["bubble"] is None
    assert rows["trl-best"]["x_trl-best"] == pytest.approx(1.0)


def test_vs_trl_dpo_runs_stock_trl_and_odc_on_the_same_pairs_on_cpu(ran, request):
    """``--trainer dpo``: stock DPOTrainer and ODCDPOTrainer train the same pairs (chosen + rejected tokens) in each
    timed step, each with its reference model's forward counted in MFU."""
    directory, (done, refused) = ran.result(request.node.nodeid)
    rows = vs_trl_rows(directory, done)
    assert list(rows) == ["trl-default", "odc"]
    assert rows["trl-default"]["tokens"] == rows["odc"]["tokens"]
    assert rows["odc"]["bubble"] is not None and rows["trl-default"]["generation_share"] is None
    assert refused.returncode == 2 and "--trainer dpo has no trl-best row" in refused.stderr, refused.stderr


def test_vs_trl_grpo_generates_and_trains_in_every_row_on_cpu(ran, request):
    """``--trainer grpo``: stock GRPOTrainer (transformers generate) and ODCGRPOTrainer generate completions of the
    same long-tailed lengths for the same prompts, so every timed step trains the same tokens, with generation's
    share of the step recorded."""
    rows = vs_trl_rows(*_only(ran.result(request.node.nodeid)))
    assert list(rows) == ["trl-default", "odc"]
    assert rows["trl-default"]["tokens"] == rows["odc"]["tokens"]
    assert all(0 < row["generation_share"] < 1 for row in rows.values())
    assert rows["odc"]["bubble"] is not None and rows["trl-default"]["bubble"] is None


def test_vs_trl_grpo_free_completions_decode_with_odcs_loop_on_cpu(ran, request):
    """``--completions free --decoding-loop --max-rollout-staleness 1``: nothing ends the completions early, ODC
    decodes its static copy with its own loop, each step's rollouts after the first decoded while the previous step
    trains, and generation's share is recorded (the steps' waits for them); the loop without free completions (a
    logits processor would send it back to ``generate``) is refused."""
    directory, (done, refused) = ran.result(request.node.nodeid)
    rows = vs_trl_rows(directory, done)
    assert 0 < rows["odc"]["generation_share"] < 1 and rows["odc"]["generation_mode"] == "static"
    assert rows["odc"]["max_rollout_staleness"] == 1
    assert refused.returncode == 2 and "--decoding-loop needs --trainer grpo --completions free" in refused.stderr


def _calibrated_balance(directory: Path) -> list:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "benchmarks" / "calibrated_balance.py"), "--model", "tiny", "--samples-per-device", "8",
        "--length-scale", "0.004", "--steps", "2", "--warmup", "3", "--straggler", "--neighbour-size", "256",
        "--json", str(directory / "calibrated.json"),
    ]  # fmt: skip
    return [(command, None, 240)]


def test_calibrated_balance_runs_its_three_schemes_with_a_straggler_on_cpu(ran, request):
    directory, done = _only(ran.result(request.node.nodeid))
    out = directory / "calibrated.json"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["ideal_time_s"] > 0
    for name in ("Collective+LB-Micro", "ODC+LB-Mini", "ODC+LB-Mini calibrated"):
        row = summary[name]
        assert row["tokens_per_second"] > 0 and 0 <= row["busy_gap"] < 1 and row["ideal_over_time"] > 0
    records = json.loads(out.read_text())["records"]
    assert all(step["calibration"] is not None for step in records["ODC+LB-Mini calibrated"]), "fitted by warm-up's end"
    assert all(step["calibration"] is None for step in records["ODC+LB-Mini"])


def _hybrid_step(directory: Path) -> list:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "benchmarks" / "hybrid_step.py"), "--model", "tiny", "--samples-per-device", "4",
        "--length-scale", "0.004", "--steps", "2", "--no-checkpointing", "--unfused",
        "--json", str(directory / "hybrid.json"),
    ]  # fmt: skip
    return [(command, None, 240)]


def test_hybrid_step_runs_its_three_schemes_on_cpu(ran, request):
    """The GPU command of benchmarks/hybrid_step.py, shrunk: both layouts build, hybrid ODC all-reduces every step
    (with transformers' own norms and MLPs, ``--unfused``, the workload benchmarks' flag)."""
    directory, done = _only(ran.result(request.node.nodeid))
    out = directory / "hybrid.json"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["Hybrid ODC+LB-Mini (2 hosts x 1)"]["all_reduce_s_median"] > 0
    assert summary["ODC+LB-Mini (1 host x 2)"]["all_reduce_s_median"] == 0
    assert all(row["tokens_per_second"] > 0 for row in summary.values())


def _grpo_generation(directory: Path) -> list:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "benchmarks" / "grpo_generation.py"), "--model-config", "tiny", "--prompts", "4",
        "--max-new-tokens", "24", "--prompt-length", "8", "--lockstep-tokens", "8", "--row-tokens", "256",
        "--static-ends", "eos", "--json", str(directory / "generation.json"),
    ]  # fmt: skip
    return [(command, None, 240)]


def test_grpo_generation_runs_every_mode_on_cpu(ran, request):
    directory, done = _only(ran.result(request.node.nodeid))
    out = directory / "generation.json"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"static", "gathered", "sharded", "lockstep", "tensor-parallel"}
    assert result["update_s"] > 0
    ranks = result["per_rank"]
    # Each rank decodes to its own longest completion, except in lockstep (capped), where both step together.
    for mode in ("static", "gathered", "sharded"):
        assert [r[mode]["steps"] for r in ranks] == [r[mode]["longest"] - 1 for r in ranks], mode
        assert ranks[0][mode]["steps"] < ranks[1][mode]["steps"], mode
    assert all({"first_batch_s", "refresh_s", "compile_s"} <= set(r["static"]) for r in ranks)
    # Every completion ended by its EOS at its drawn length: by the logits processor, or (static, --static-ends eos)
    # by the copy's LM head inside the loop's step.
    assert all(r[mode]["ended_at_length"] == 4 for r in ranks for mode in ("static", "gathered", "sharded")), ranks
    assert ranks[0]["lockstep"]["steps"] == ranks[1]["lockstep"]["steps"] == 8 - 1
    # Tensor-parallel: the ranks decode their prompts together, to the longest completion of either, each with half the
    # heads (2 of 4, 1 key/value head of 2), MLP rows and LM head rows. The copies' projections fused, by default.
    longest = max(r["tensor-parallel"]["longest"] for r in ranks)
    assert [r["tensor-parallel"]["steps"] for r in ranks] == [longest - 1] * 2
    local = {"heads": 2, "kv_heads": 1, "mlp_rows": 64, "head_rows": 151936 // 2}
    assert all(r["tensor-parallel"]["local"] == local for r in ranks)
    assert all(r[mode]["fused"] for r in ranks for mode in ("static", "tensor-parallel"))


def _packed_attention(directory: Path, mode: str) -> list:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "packed_attention.py"), "--mode", mode, "--tiny", "--rows",
        "4x16,grpo", "--tokens", "64", "--warmup", "0", "--reps", "1",
        "--json", str(directory / "attention.json"),
    ]  # fmt: skip
    return [(command, None, 240)]


@pytest.mark.parametrize("mode", ["model", "forward"])
def test_packed_attention_whole_model_modes_run_on_cpu(ran, request, mode):
    """The whole-model and reference-pass modes on a 2-layer model (per-document SDPA: varlen is CUDA-only)."""
    directory, done = _only(ran.result(request.node.nodeid))
    out = directory / "attention.json"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows["4x16"]["lengths"] == [16] * 4 and sum(rows["grpo"]["lengths"]) == 64
    columns = {"model": ["sdpa", "auto"], "forward": ["policy", "reference", "reference-dense"]}[mode]
    assert all(list(row["ms"]) == columns and min(row["ms"].values()) > 0 for row in rows.values())


def _decode_attention(directory: Path) -> list:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "decode_attention.py"), "--batch", "2", "--slots", "300",
        "--fills", "100,299", "--layers", "2", "--json", str(directory / "decode.json"),
    ]  # fmt: skip
    return [(command, {**os.environ, "TRITON_INTERPRET": "1"}, 180)]


def test_decode_attention_compares_the_kernel_with_sdpa_on_cpu(ran, request):
    """benchmarks/decode_attention.py under Triton's interpreter (the times are a GPU's alone): every shape and fill,
    SDPA given the fill rounded up to 256 slots, the kernel's output within bf16's rounding of SDPA's."""
    pytest.importorskip("triton")
    directory, done = _only(ran.result(request.node.nodeid))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads((directory / "decode.json").read_text())["rows"]
    assert [(r["shape"], r["fill"], r["sdpa_width"]) for r in rows] == [
        (shape, fill, width) for shape in ("qwen2.5-1.5b", "qwen2.5-7b") for fill, width in ((100, 256), (299, 300))
    ]
    assert all(0 < r["max_abs_diff"] < 2**-6 for r in rows), rows  # (not 0: the kernel ran, not SDPA twice)


def _trainer_points(directory: Path) -> list:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "trainer_points.py"), "--model-config", "tiny", "--max-length",
        "64", "--global-batch-size", "8", "--steps", "2", "--warmup", "1", "--extra", "",
        "--accelerate-config", str(ROOT / "examples" / "odc_cpu.yaml"), "--json", str(directory / "points.json"),
        "--profile", "--logs", str(directory / "logs"),
    ]  # fmt: skip
    return [(command, PEAK, 400)]


def test_trainer_points_run_every_trainer_under_every_scheme_on_cpu(ran, request):
    """benchmarks/trainer_points.py's GPU command, shrunk: one 2-process launch per trainer, its three schemes in
    turn in that process; every scheme trains the same minibatches (the same tokens and losses) with its own split.
    With ``--profile`` (:func:`assert_profiled`), the ODC scheme's extra profiled step leaves the timed ones as
    they were."""
    directory, done = _only(ran.result(request.node.nodeid))
    out = directory / "points.json"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trainers = json.loads(out.read_text())["trainers"]
    assert list(trainers) == ["reward", "kto", "rloo", "distill"]
    for name, result in trainers.items():
        assert "error" not in result, (name, result["error"])
        schemes = result["schemes"]
        assert list(schemes) == ["FSDP2 + TRL's split (local-sort)", "FSDP2 + LB-Micro", "ODC + LB-Mini"], name
        split, micro = schemes["FSDP2 + TRL's split (local-sort)"], schemes["FSDP2 + LB-Micro"]
        for row in schemes.values():
            assert row["steps"] == 1 and row["tokens_per_second"] > 0 and row["mfu"] > 0, (name, row)
            assert row["tokens_per_step"] == split["tokens_per_step"], name
            assert row["loss"] == pytest.approx(split["loss"], rel=1e-3, abs=1e-6), name
            per_rank = row["per_rank"]  # each timed step's values per rank: the step's tokens, split as planned
            assert [sum(tokens) for tokens in per_rank["tokens"]] == [row["tokens_per_step"]], name
            assert per_rank["microbatches"] == [row["microbatches_per_rank"]], name
            assert all(busy > 0 for busy in per_rank["busy_s"][0]), name
            assert sum(per_rank["documents"][0]) == sum(split["per_rank"]["documents"][0]), name  # the same items
            phases = row["phases"]  # each timed step's parts, as the trainer logs them
            assert len(phases["minibatch_s"]) == 1 and len(phases["attention_warm_s"]) == 1, (name, phases)
            assert {"kto": {"reference_s", "kl_s"}, "rloo": {"generation_s"}}.get(name, set()) <= set(phases), name
        assert split["x_trl_split"] == pytest.approx(1.0) and micro["x_lb_micro"] == pytest.approx(1.0)
        assert split["microbatches_per_rank"] == [4, 4], name  # TRL's split: one sample per microbatch
        assert split["per_rank"]["documents"] == [[4, 4]], name
        assert micro["microbatches_per_rank"][0] == micro["microbatches_per_rank"][1], name
    assert "distill  ODC + LB-Mini" in done.stdout
    assert "fwd-only" in done.stdout and done.stdout.count("kto      ODC + LB-Mini") == 2  # the rates, the phases
    assert_profiled(trainers, directory / "logs", done.stdout)


def assert_profiled(trainers: dict, logs: Path, stdout: str) -> None:
    """``--profile``: one step after the timed ones of the ODC scheme, profiled on every rank, each rank's summary
    in the JSON and in ``--logs`` (no file name with a space or a '+'); the device time by kind adds up to the busy
    time, and the microbatches are the step's plan for the rank (as many, with its tokens)."""
    assert not [path.name for path in logs.iterdir() if " " in path.name or "+" in path.name]
    for name, result in trainers.items():
        schemes = result["schemes"]
        assert schemes["FSDP2 + LB-Micro"]["profile"] is None, name
        odc = schemes["ODC + LB-Mini"]
        entry, ranks = odc["profiled_entry"], odc["profile"]
        assert [r["rank"] for r in ranks] == [0, 1], name
        assert f"profile: {name}, ODC + LB-Mini" in stdout
        for r in ranks:
            rank = r["rank"]
            assert json.loads((logs / f"profile_{name}_odc_lb_mini_rank{rank}.json").read_text()) == r
            assert r["busy_s"] > 0 and r["wall_s"] > 0 and r["events"] > 0, (name, r)
            assert sum(r["kinds_s"].values()) == pytest.approx(r["busy_s"], rel=1e-6), (name, r["kinds_s"])
            assert r["idle_s"] == pytest.approx(r["span_s"] - r["busy_s"]) and r["idle_s"] >= -1e-9, name
            counts, tokens = entry[f"microbatches/rank_{rank}"], entry[f"tokens/rank_{rank}"]
            assert len(r["microbatches"]) == len(r["microbatch_tokens"]) == counts > 0, (name, rank)
            assert [mb["name"] for mb in r["microbatches"]] == [f"microbatch {i}" for i in range(int(counts))]
            assert sum(r["microbatch_tokens"]) == r["tokens"] == tokens, (name, rank)
            assert all(mb["device_s"] > 0 and mb["events"] > 0 for mb in r["microbatches"]), (name, rank)
            # a CPU runs one operator at a time: the microbatches' device seconds are the minibatch's busy ones
            assert sum(mb["device_s"] for mb in r["microbatches"]) == pytest.approx(r["busy_s"]), (name, rank)


def _only(ran: tuple[Path, list[SimpleNamespace]]) -> tuple[Path, SimpleNamespace]:
    """A test's directory and its one command's outcome."""
    directory, (done,) = ran
    return directory, done


COMMANDS = {
    "test_sft_throughput_runs_every_scheme_on_cpu": _sft_throughput,
    "test_sft_throughput_builds_and_trains_a_moe_shape_on_cpu": _sft_throughput_moe,
    "test_vs_trl_runs_stock_trl_and_odc_on_the_same_samples_on_cpu": _vs_trl("--length-scale", "0.004"),
    "test_vs_trl_dpo_runs_stock_trl_and_odc_on_the_same_pairs_on_cpu": _vs_trl(
        "--trainer", "dpo", "--length-scale", "0.004", refused=("--trainer", "dpo", "--rows", "trl-best")
    ),
    "test_vs_trl_grpo_generates_and_trains_in_every_row_on_cpu": _vs_trl(
        "--trainer", "grpo", "--num-generations", "2", "--max-completion-length", "32"
    ),
    "test_vs_trl_grpo_free_completions_decode_with_odcs_loop_on_cpu": _vs_trl(
        *FREE,
        "--completions",
        "free",
        "--decoding-loop",
        "--max-rollout-staleness",
        "1",
        refused=(*FREE, "--decoding-loop"),
    ),
    "test_calibrated_balance_runs_its_three_schemes_with_a_straggler_on_cpu": _calibrated_balance,
    "test_hybrid_step_runs_its_three_schemes_on_cpu": _hybrid_step,
    "test_grpo_generation_runs_every_mode_on_cpu": _grpo_generation,
    "test_packed_attention_whole_model_modes_run_on_cpu": _packed_attention,
    "test_trainer_points_run_every_trainer_under_every_scheme_on_cpu": _trainer_points,
    "test_decode_attention_compares_the_kernel_with_sdpa_on_cpu": _decode_attention,
}
"""Each test's commands, by test name: a function of its directory (and its parameters) that gives each command, its
environment (None: this one's) and its timeout before scaling."""
