"""ODCRewardTrainer, ODCKTOTrainer, ODCRLOOTrainer, ODCDistillationTrainer and ODCSFTTrainer on a vision-language
model, each under three schemes side by side
(FSDP2 on TRL's own split, FSDP2 + LB-Micro, ODC + LB-Mini: ``_common.TRAINER_SCHEMES``), with a table and JSON.

Each trainer is trained by its example script's own setup (``examples/{reward,kto,rloo,distill,sft_vlm}.py``: the
built-in model shape, tokenizer and long-tailed data), the same seed in every scheme, so every scheme trains on the same
minibatches. The driver (this script without ``--worker``) starts one ``accelerate launch`` of this script per
trainer; that worker runs the schemes one after the other in its process (one launch per row would spend most of a
GPU lease on starting processes): per scheme it parses the example's command line with the scheme's flags and calls
the example's ``main``, whose ``train_and_save`` is replaced by :func:`train_and_release` (train, keep the log,
release ODC and the model; no saving). On GPUs the example's randomly initialised models (the policy, KTO's
reference, the distillation teacher) are built on the GPU (a 1.5B model's random initialisation is slow on the CPU,
and every scheme builds its own), then sharded as the example's would be.

The data (``--max-length`` is the longest sequence; ``swe-smith``-shaped lengths, mean about a quarter of it):

* reward: ``--global-batch-size`` preference pairs per step, chosen and rejected up to ``--max-length`` tokens each;
* KTO: ``--global-batch-size`` unpaired examples per step up to ``--max-length`` tokens, each with its mismatched
  completion for TRL's KL estimate, and a reference model (the initial policy);
* RLOO: ``--global-batch-size`` completions per step (groups of ``--num-generations``) up to ``--max-length`` tokens,
  injected (``--rollouts synthetic``: drawn, not generated, so no time goes to generation), ``--beta 0`` (no KL
  reference: the policy update is what the schemes change);
* distillation: ``--global-batch-size`` completions per step up to ``--max-length / 2`` tokens (the teacher
  runs on each microbatch's rows beside the student, and the divergence in ``divergence_chunk_size`` token chunks),
  injected likewise, and a teacher of the same shape (other random weights), sharded, scoring forward-only;
* sft_vlm: ``--global-batch-size`` image conversations per step (``examples/sft_vlm.py --long_tailed``: replies up to
  ``--max-length / 4`` words, long-tailed; 1 to ``--max-images`` random images each, their count long-tailed: every
  sample has one, as FSDP2's per-layer collectives need every rank to run the vision tower in each microbatch;
  microbatches of ``4 x --max-length`` tokens plus patches), on the built-in Qwen2.5-VL of ``--model-config``
  (``tiny``, or ``qwen2.5-vl-3b``: Qwen2.5-VL-3B's shape, random weights, 14-pixel patches, images up to 448 pixels
  a side).
  Its rows' tokens count text tokens plus image patches (the planner's weights), and ``mfu_vision`` is the logged MFU
  (which prices a patch as a token of the language model) with the patches priced by the vision tower's parameters
  instead: ``mfu x (text + r x patches) / (text + patches)``, ``r`` the tower's parameters over the language model's
  non-embedding ones (linear layers only: the attention's share is priced alike for both).

Per scheme, over the steps after ``--warmup``: the median device-timed step (``step_s``: the minibatch between its
two meeting points, what the schemes change) and the median wall-clock step (``wall_s``: from one step's end to the
next, after a device synchronize, so scoring, the teacher and the KL pass count), tokens/s (the steps' tokens over
their summed ``step_s``; in the JSON also over their wall-clock time), the largest rank's peak memory, the measured
and predicted bubble, the MFU the trainer logs (``hf_odc.packing.flops``; none on CPU unless ``HF_ODC_PEAK_TFLOPS``
is set) and tokens/s over TRL's split's and over LB-Micro's. FSDP2's measured bubble is not comparable with ODC's:
its waits happen inside the per-layer collectives.

``--budget`` bounds the whole run: a trainer, or a scheme within one, is not started once it would not end in time,
so the table still prints before an outer time limit; a trainer that fails or overruns is reported and the others
still run. On 2 GPUs (``STEPS=trainers bash benchmarks/gpu_suite.sh``)::

    python benchmarks/trainer_points.py --num-processes 2 --budget 450 --logs out/trainer_logs \\
        --json out/trainer_points.json

the vision-language point on 4 GPUs (Qwen2.5-VL-3B's shape; ``--max-length`` in words of a reply, its tokens plus
up to 8 images of up to 256 tokens and 1024 patches each)::

    python benchmarks/trainer_points.py --trainers sft_vlm --model-config qwen2.5-vl-3b --num-processes 4 \
        --max-length 4096 --global-batch-size 32 --steps 7 --warmup 2 --budget 300 \
        --schemes "FSDP2 + LB-Micro,ODC + LB-Mini" --json out/sft_vlm_point.json

``--profile`` profiles one more step after the timed ones of each ODC scheme (``torch.profiler``, CPU and CUDA
activity, no shapes; the step is not timed) on every rank, to say why ranks with equal tokens are busy for different
times. Each rank writes a compact summary, ``profile_{trainer}_{scheme}_rank{R}.json`` in ``--logs`` (the scheme's
name in lower case, ``_`` for anything else: ``odc_lb_mini``), and rank 0's and the busiest rank's gzipped chrome
traces where under 5 MiB; the driver prints, per rank: the step's wall time, the engine's busy and wait, the
minibatch's device busy and idle time (gaps between kernels from its first kernel's start to its last's end), the
time in which kernels overlapped, its kernels and tokens, the device time by kind (``_profile.KINDS``: GEMM,
attention, ODC's pushes, copies, NCCL, elementwise and norms, the optimizer, memsets, the rest; overlapped time
shared, so the kinds add up to the busy time), then per microbatch its tokens, device seconds and host seconds, the
longest device gaps with the kernels either side and the host operator the host was in meanwhile, and the host's
biggest CUDA runtime calls and watched operators (``.item()``, cuDNN, Triton, collectives, the optimizer) inside the
minibatch and over the step (:mod:`_profile`). On 4 GPUs::

    python3 benchmarks/trainer_points.py --num-processes 4 --trainers reward --schemes "ODC + LB-Mini" --steps 4 \
        --warmup 2 --budget 150 --profile --logs $OUT/trainer_logs --json $OUT/profile_reward.json

and on 2 CPU processes (the smoke test)::

    python benchmarks/trainer_points.py --model-config tiny --max-length 64 --global-batch-size 8 --steps 2 \\
        --warmup 1 --extra "" --accelerate-config examples/odc_cpu.yaml --json /tmp/points.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import TRAINER_SCHEMES as SCHEMES  # noqa: E402
from _profile import print_profile, step_summary  # noqa: E402

BASELINE, LB_MICRO = "FSDP2 + TRL's split (local-sort)", "FSDP2 + LB-Micro"


@dataclass(frozen=True)
class Point:
    """One trainer's example script and its data flags (``{length}``, ``{batch}``, ``{samples}``, ``{per_device}``,
    ``{model}`` and ``{generations}`` filled from the command line)."""

    script: str
    trainer: str
    flags: str


TRAINERS = {
    "reward": Point(
        "reward.py", "ODCRewardTrainer", "--max_length {length} --num_pairs {samples} --global_batch_size {batch}"
    ),
    "kto": Point(
        "kto.py", "ODCKTOTrainer", "--max_length {length} --num_examples {samples} --global_batch_size {batch}"
    ),
    "rloo": Point(
        "rloo.py",
        "ODCRLOOTrainer",
        "--rollouts synthetic --max_completion_length {length} --per_device_train_batch_size {per_device} "
        "--num_generations {generations} --beta 0",
    ),
    "sft_vlm": Point(
        "sft_vlm.py",
        "ODCSFTTrainer",
        "--max_length {length} --num_samples {samples} --global_batch_size {batch} --long_tailed true "
        "--max_images {images} --max_tokens_per_microbatch {vision_tokens}",
    ),
    "distill": Point(
        "distill.py",
        "ODCDistillationTrainer",
        "--rollouts synthetic --teacher_config {model} --max_completion_length {half_length} "
        "--per_device_train_batch_size {per_device}",
    ),
}


def example_flags(args: argparse.Namespace, name: str, output_dir: str, steps: int) -> list[str]:
    """The example script's command line for trainer ``name``, without the scheme's flags, training ``steps`` steps
    (the data is the same for every scheme: ``--steps``, and the profiled step's with ``--profile``)."""
    fields = {
        "length": args.max_length,
        "half_length": args.max_length // 2,
        "batch": args.global_batch_size,
        "samples": args.global_batch_size * (args.steps + args.profile),
        "per_device": args.global_batch_size // args.num_processes,
        "model": args.model_config,
        "generations": args.num_generations,
        "images": args.max_images,
        "vision_tokens": 4 * args.max_length,
    }
    return [
        "--model_config", args.model_config, *TRAINERS[name].flags.format(**fields).split(),
        "--length_distribution", args.distribution, "--max_steps", str(steps), "--seed", str(args.seed),
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--output_dir", output_dir, *args.extra.split(),
    ]  # fmt: skip


# -- the worker: one trainer, every scheme, in one process ------------------------------------------------------------


def _wall_clock_callback() -> Any:
    """A ``TrainerCallback`` recording each optimizer step's wall-clock time, from the previous step's end (or the
    start of training) to its own, both after a device synchronize (transformers is imported by the worker only)."""
    import torch
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._last: float | None = None

        def _now(self) -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now()
            self.times.append(now - self._last)
            self._last = now

    return Callback()


def profiled(scheme: str) -> bool:
    """Whether ``--profile`` profiles ``scheme`` (the ODC ones)."""
    flags = SCHEMES[scheme]
    return flags[flags.index("--odc") + 1] == "true"


class StepProfiler:
    """``--profile``: ``torch.profiler`` (CPU, and CUDA where there is a GPU; no shapes) over the step after
    ``after`` (from the previous step's end to its own, both after a device synchronize) on every rank; each rank
    summarises its trace (:func:`_profile.step_summary`) with the step's plan for it (its microbatches' tokens) and
    the engine's timings, writes the summary to ``directory/profile_{label}_rank{R}.json``, and the summaries are
    gathered into :attr:`ranks`. Rank 0's trace and the busiest rank's are kept (gzipped) where small enough."""

    TRACE_LIMIT = 5 * 2**20

    def __init__(self, trainer: Any, after: int, directory: Path, label: str):
        import torch
        from transformers import TrainerCallback

        self.ranks: list[dict] | None = None
        self._step: Any = None
        plan = trainer._plan_step

        def remember(window: list[Any]) -> Any:
            self._step = plan(window)
            return self._step

        trainer._plan_step = remember  # the profiled step's plan: its microbatches' tokens
        profile = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step in (after, after + 1) and torch.cuda.is_available():
                    torch.cuda.synchronize()
                if state.global_step == after:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if torch.cuda.is_available():
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    profile.profiler = torch.profiler.profile(activities=activities)
                    profile.profiler.__enter__()
                    profile.started = time.perf_counter()
                elif state.global_step == after + 1 and profile.profiler is not None:
                    wall = time.perf_counter() - profile.started
                    profile.profiler.__exit__(None, None, None)
                    profile.summarise(trainer, wall, directory, label)

        self.profiler, self.started = None, 0.0
        self.callback = Callback()

    def summarise(self, trainer: Any, wall: float, directory: Path, label: str) -> None:
        import gzip

        import torch
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        with tempfile.TemporaryDirectory() as temporary:
            trace = Path(temporary) / "trace.json"
            self.profiler.export_chrome_trace(str(trace))
            text = trace.read_text()
        self.profiler = None
        summary = step_summary(json.loads(text)["traceEvents"], torch.cuda.is_available())
        step = self._step
        summary.update(
            rank=rank, wall_s=wall, engine_busy_s=trainer.odc.last.busy, engine_wait_s=trainer.odc.last.wait,
            tokens=step.rank_tokens(rank), microbatch_tokens=[sum(mb) for mb in step.microbatch_lengths[rank]],
            shared_microbatches=len(step.microbatches) - len(step.microbatch_lengths[rank]),
        )  # fmt: skip
        (directory / f"profile_{label}_rank{rank}.json").write_text(json.dumps(summary, indent=1))
        ranks = [summary]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, summary)
        busiest = max(range(len(ranks)), key=lambda r: ranks[r]["busy_s"])
        if rank in (0, busiest):
            packed = gzip.compress(text.encode(), compresslevel=3)
            if len(packed) <= self.TRACE_LIMIT:
                (directory / f"trace_{label}_rank{rank}.json.gz").write_bytes(packed)
        self.ranks = ranks


def train_and_release(trainer: Any, record: dict, args: argparse.Namespace, scheme: str) -> None:
    """The examples' ``train_and_save`` for one scheme of the worker: train, put the step log and the wall-clock
    step times in ``record`` (with ``--profile``, an ODC scheme's profiled step's log entry and every rank's
    profile summary apart), then release ODC and the accelerator's references (the process group stays for the
    next scheme; nothing is saved)."""
    import torch

    clock = _wall_clock_callback()
    trainer.add_callback(clock)
    profiler = None
    if args.profile and profiled(scheme):
        label = f"{args.worker}_{re.sub(r'[^a-z0-9]+', '_', scheme.lower()).strip('_')}"
        profiler = StepProfiler(trainer, args.steps, Path(args.logs), label)
        trainer.add_callback(profiler.callback)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the trainer logs the peak since this: training's, not the build's
    trainer.train()
    entries = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    record["entries"], record["wall_s"] = entries[: args.steps], clock.times[: args.steps]
    if profiler is not None:
        record["profiled_entry"], record["profile"] = entries[args.steps], profiler.ranks
    record["vision_ratio"] = _vision_ratio(trainer.accelerator.unwrap_model(trainer.model))
    trainer.close_odc()
    trainer.accelerator.free_memory()


def _vision_ratio(model: Any) -> float | None:
    """A vision-language model's vision-tower parameters over its language model's non-embedding ones (the FLOPs of a
    patch over a token's, linear layers only); ``None`` for a language model."""
    inner = getattr(model, "model", model)
    visual, language = getattr(inner, "visual", None), getattr(inner, "language_model", None)
    if visual is None or language is None:
        return None
    embeddings = sum(p.numel() for p in language.get_input_embeddings().parameters())
    return sum(p.numel() for p in visual.parameters()) / (sum(p.numel() for p in language.parameters()) - embeddings)


@contextlib.contextmanager
def built_on_device(module: Any) -> Any:
    """While open, the example ``module``'s ``build_model`` (and ``hf_odc.demo.script``'s, which builds DPO's and
    KTO's reference) or ``build_vision_model`` build on this rank's GPU when there is one; restored on exit."""
    import torch

    import hf_odc.demo.script as demo_script

    if not torch.cuda.is_available():
        yield
        return
    original, vision = demo_script.build_model, getattr(module, "build_vision_model", None)
    if getattr(module, "build_model", original) is not original:
        raise RuntimeError(f"{module.__name__} builds its model with another build_model than hf_odc.demo's.")

    def on_device(build: Any) -> Any:
        def build_here(*args: Any, **kwargs: Any) -> Any:
            with torch.device("cuda", torch.cuda.current_device()):
                return build(*args, **kwargs)

        return build_here

    module.build_model = demo_script.build_model = on_device(original)
    if vision is not None:
        module.build_vision_model = on_device(vision)
    try:
        yield
    finally:
        module.build_model = demo_script.build_model = original
        if vision is not None:
            module.build_vision_model = vision


def load_example(script: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"odc_example_{Path(script).stem}", ROOT / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_worker(args: argparse.Namespace) -> None:
    """Every scheme of ``--worker``'s trainer in this process; rank 0 rewrites ``--worker-json`` after each."""
    import torch
    import torch.distributed as dist

    point = TRAINERS[args.worker]
    example = load_example(point.script)
    results: dict[str, dict] = {}
    last_duration = 0.0
    for name in args.schemes.split(","):
        # The first scheme runs (the driver launched this with time enough). A later one that would not end before
        # the deadline is skipped, on rank 0's clock for every rank (the training config joined the process group).
        go = [not results or time.time() + last_duration < args.deadline]
        if results and dist.is_initialized():
            dist.broadcast_object_list(go, src=0)
        if not go[0]:
            results[name] = {"skipped": "budget"}
            continue
        start = time.perf_counter()
        # What the earlier schemes left allocated (0 when they released everything): their memory is not this one's.
        allocated = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        record: dict = {"allocated_at_start_gib": allocated}
        example.train_and_save = lambda trainer, record=record, name=name: train_and_release(
            trainer, record, args, name
        )
        with tempfile.TemporaryDirectory() as out, built_on_device(example):
            steps = args.steps + (args.profile and profiled(name))
            flags = [*example_flags(args, args.worker, out, steps), *SCHEMES[name]]
            example.main(*example.make_parser().parse_args_and_config(flags))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        last_duration = time.perf_counter() - start
        record["scheme_s"] = last_duration
        results[name] = record
        if not dist.is_initialized() or dist.get_rank() == 0:
            environment = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
            for package in ("torch", "transformers", "trl"):
                environment[package] = sys.modules[package].__version__ if package in sys.modules else None
            Path(args.worker_json).write_text(json.dumps({"environment": environment, "schemes": results}))
            print(f"{args.worker}: {name} done in {last_duration:.0f} s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, name: str, log: Path, deadline: float) -> dict:
    """One trainer's worker launch; its JSON (whatever schemes finished), with an ``error`` if the launch failed or
    ran past the deadline (its processes are then ended)."""
    with tempfile.TemporaryDirectory() as directory:
        return _launch(args, name, log, deadline, Path(directory) / "worker.json")


def _launch(args: argparse.Namespace, name: str, log: Path, deadline: float, out: Path) -> dict:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
        "--num_processes", str(args.num_processes), str(Path(__file__).resolve()), "--worker", name,
        "--worker-json", str(out), "--deadline", str(deadline), *sys.argv[1:], "--logs", str(log.parent),
    ]  # fmt: skip
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONUNBUFFERED": "1"}
    error = None
    with open(log, "w") as f:
        # A session of its own, so that an overrun ends the launcher and its ranks together.
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=max(deadline - time.time(), 0) + args.grace)
            if code != 0:
                error = f"exit status {code}"
        except subprocess.TimeoutExpired:
            error = "ran past the budget; ended"
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)  # the launcher's session: the launcher and its ranks
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
    result = json.loads(out.read_text()) if out.exists() else {"schemes": {}}
    if error is not None:
        result["error"] = f"{error}; see {log}\n" + log.read_text()[-1500:]
    return result


STEP_PHASES = ("minibatch_s", "reference_s", "kl_s", "generation_s", "scoring_s", "attention_warm_s")
"""The parts of a step the trainers log on their own (see docs/api.md's metrics)."""


def summarise(record: dict, warmup: int, world_size: int) -> dict:
    """One scheme's numbers over its timed steps (those after ``warmup``)."""
    entries = record["entries"][warmup:] or record["entries"]
    wall = record["wall_s"][warmup:] or record["wall_s"]
    mean = lambda key: statistics.fmean(e[key] for e in entries) if all(key in e for e in entries) else None  # noqa: E731
    tokens = sum(e[f"tokens/rank_{r}"] for e in entries for r in range(world_size))
    mfu_vision = None
    if record.get("vision_ratio") is not None and all(e.get("mfu") is not None for e in entries):
        patches = [e["image_patches"] for e in entries]
        weights = [sum(e[f"tokens/rank_{r}"] for r in range(world_size)) for e in entries]
        mfu_vision = statistics.fmean(
            e["mfu"] * (w - p + record["vision_ratio"] * p) / w
            for e, w, p in zip(entries, weights, patches, strict=True)
        )
    return {
        "steps": len(entries),
        "step_s_median": statistics.median(e["step_s"] for e in entries),
        "wall_s_median": statistics.median(wall),
        "tokens_per_second": tokens / sum(e["step_s"] for e in entries),
        "tokens_per_step": tokens / len(entries),
        "tokens_per_second_wall": tokens / sum(wall) if len(wall) == len(entries) else None,
        "peak_memory_gib": max((e.get("peak_memory_gib", 0.0) for e in entries), default=0.0),
        "bubble_rate": mean("bubble_rate"),
        "predicted_bubble_rate": mean("predicted_bubble_rate"),
        "mfu": mean("mfu"),
        "mfu_vision": mfu_vision,
        "image_patches_per_step": mean("image_patches"),
        "scoring_s": mean("scoring_s"),
        "microbatches_per_rank": [mean(f"microbatches/rank_{r}") for r in range(world_size)],
        "loss": [e["loss"] for e in record["entries"]],
        "step_s": [e["step_s"] for e in entries],
        # Per timed step, where the step's time went (the trainer's own timings, where it logs them): the training
        # minibatch, the forward-only passes, generation, and building attention plans for new lengths.
        "phases": {key: [e.get(key) for e in entries] for key in STEP_PHASES if any(key in e for e in entries)},
        # Per timed step, one value per rank: whether a rank is slower at equal work, and what the plan gave it.
        "per_rank": {
            key: [[e.get(f"{key}/rank_{r}") for r in range(world_size)] for e in entries]
            for key in ("busy_s", "tokens", "documents", "microbatches", "calibration/speed")
        },
        "wall_s": wall,
        "scheme_s": record["scheme_s"],
        "allocated_at_start_gib": record["allocated_at_start_gib"],
        "profiled_entry": record.get("profiled_entry"),
        "profile": record.get("profile"),
    }


def add_ratios(schemes: dict) -> None:
    """Each scheme's tokens/s over TRL's split's and over LB-Micro's (when those ran)."""
    for reference, key in ((BASELINE, "x_trl_split"), (LB_MICRO, "x_lb_micro")):
        if "tokens_per_second" in schemes.get(reference, {}):
            for row in schemes.values():
                if "tokens_per_second" in row:
                    row[key] = row["tokens_per_second"] / schemes[reference]["tokens_per_second"]


def print_table(trainers: dict) -> None:
    percent = lambda value: "—" if value is None else f"{value:.1%}"  # noqa: E731
    ratio = lambda value: "—" if value is None else f"{value:.2f}x"  # noqa: E731
    print(f"\n{'trainer':8s} {'scheme':33s} {'step s':>7s} {'wall s':>7s} {'tokens/s':>9s} {'x TRL':>6s} "
          f"{'x LBmi':>6s} {'bubble':>7s} {'pred.':>6s} {'MFU':>6s} {'peak GiB':>8s}  microbatches/rank")  # fmt: skip
    for trainer, result in trainers.items():
        for scheme, row in result["schemes"].items():
            if "tokens_per_second" not in row:
                print(f"{trainer:8s} {scheme:33s} " + (f"skipped ({row['skipped']})" if "skipped" in row else "failed"))
                continue
            mbs = "/".join("—" if m is None else f"{m:.1f}" for m in row["microbatches_per_rank"])
            print(f"{trainer:8s} {scheme:33s} {row['step_s_median']:7.2f} {row['wall_s_median']:7.2f} "
                  f"{row['tokens_per_second']:9.0f} {ratio(row.get('x_trl_split')):>6s} "
                  f"{ratio(row.get('x_lb_micro')):>6s} {percent(row['bubble_rate']):>7s} "
                  f"{percent(row['predicted_bubble_rate']):>6s} {percent(row.get('mfu_vision') or row['mfu']):>6s} "
                  f"{row['peak_memory_gib']:8.1f}  {mbs}")  # fmt: skip
        if "error" in result:
            print(f"{trainer:8s} error: {result['error'].splitlines()[0]}")
    if any(row.get("mfu_vision") is not None for result in trainers.values() for row in result["schemes"].values()):
        print("note: sft_vlm's MFU counts the vision tower's FLOPs per patch (mfu_vision in the JSON)")
    for trainer, result in trainers.items():
        for scheme, row in result["schemes"].items():
            if row.get("allocated_at_start_gib", 0.0) > 0.1:  # counted in its peak
                print(f"note: {trainer} {scheme} started with {row['allocated_at_start_gib']:.1f} GiB still allocated")


def print_phases(trainers: dict) -> None:
    """Where the timed steps went, medians over the steps in seconds: the training minibatch, the forward-only passes
    (a reference, the KL estimate, scoring), generation, building attention plans for new lengths, and the rest of
    the step's wall time (planning, gathers, the optimizer, logging)."""
    passes = ("reference_s", "kl_s", "scoring_s")
    print(f"\n{'trainer':8s} {'scheme':33s} {'step s':>7s} {'minibatch':>9s} {'fwd-only':>8s} {'generate':>8s} "
          f"{'plans':>6s} {'other':>6s}")  # fmt: skip
    for trainer, result in trainers.items():
        for scheme, row in result["schemes"].items():
            phases = row.get("phases")
            if not phases:
                continue
            steps = len(row["step_s"])
            groups = (("minibatch_s",), passes, ("generation_s",), ("attention_warm_s",))
            parts = [_phase_seconds(phases, keys, steps) for keys in groups]
            other = [row["step_s"][i] - sum(part[i] for part in parts) for i in range(steps)]
            medians = [statistics.median(values) for values in (*parts, other)]
            cells = " ".join(f"{value:{width}.2f}" for value, width in zip(medians, (9, 8, 8, 6, 6), strict=True))
            print(f"{trainer:8s} {scheme:33s} {statistics.median(row['step_s']):7.2f} {cells}")


def _phase_seconds(phases: dict, keys: tuple[str, ...], steps: int) -> list[float]:
    """Per timed step, the seconds of the phases ``keys`` together (a phase a step did not log counts 0)."""
    return [sum(phases[key][i] or 0.0 for key in keys if key in phases) for i in range(steps)]


def run_driver(args: argparse.Namespace) -> None:
    start = time.time()
    deadline = start + (args.budget if args.budget is not None else float("inf"))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="trainer_points_"))
    logs.mkdir(parents=True, exist_ok=True)
    trainers: dict[str, dict] = {}
    environment = None
    for name in args.trainers.split(","):
        if time.time() + args.min_launch_s > deadline:
            trainers[name] = {"schemes": {scheme: {"skipped": "budget"} for scheme in args.schemes.split(",")}}
            continue
        began = time.time()
        raw = launch(args, name, logs / f"{name}.log", deadline)
        environment = raw.get("environment", environment)
        schemes = {
            scheme: summarise(record, args.warmup, args.num_processes) if "entries" in record else record
            for scheme, record in raw["schemes"].items()
        }
        for scheme in args.schemes.split(","):
            schemes.setdefault(scheme, {"skipped": "its launch ended first"})
        add_ratios(schemes)
        trainers[name] = {"trainer": TRAINERS[name].trainer, "launch_s": time.time() - began, "schemes": schemes}
        if "error" in raw:
            trainers[name]["error"] = raw["error"]
        print(f"{name}: {trainers[name]['launch_s']:.0f} s" + (" (failed)" if "error" in raw else ""), flush=True)
        if args.json:  # after every trainer, so that an outer time limit leaves what finished
            write_json(args, environment, trainers, time.time() - start)
    if args.json:
        write_json(args, environment, trainers, time.time() - start)
    print(f"\n{args.model_config}, {environment and environment['device']}, {args.num_processes} processes, "
          f"{args.steps - args.warmup} timed steps of {args.steps}; total {time.time() - start:.0f} s")  # fmt: skip
    print_table(trainers)
    print_phases(trainers)
    for trainer, result in trainers.items():
        for scheme, row in result["schemes"].items():
            if row.get("profile"):
                print_profile(f"{trainer}, {scheme}", row["profile"])


def write_json(args: argparse.Namespace, environment: dict | None, trainers: dict, total_s: float) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    config = {key: value for key, value in vars(args).items() if key not in ("worker", "worker_json", "deadline")}
    payload = {"config": config, "environment": environment, "total_s": total_s, "trainers": trainers}
    Path(args.json).write_text(json.dumps(payload, indent=2))


PROFILE_HELP = (
    "profile one more step after the timed ones of each ODC scheme on every rank; each rank's summary goes to "
    "--logs, and a per-rank table is printed"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trainers", default="reward,kto,rloo,distill", help="comma list of " + ", ".join(TRAINERS)
    )  # sft_vlm takes its own --model-config (a vision shape)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma list of scheme names")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--accelerate-config", default=str(ROOT / "examples" / "odc.yaml"))
    parser.add_argument("--model-config", default="qwen2.5-1.5b")
    parser.add_argument("--distribution", default="swe-smith", help="length shape (hf_odc.packing.DISTRIBUTIONS)")
    parser.add_argument("--max-length", type=int, default=8192, help="longest sequence (distillation: half)")
    parser.add_argument("--global-batch-size", type=int, default=16, help="pairs / examples / completions per step")
    parser.add_argument("--num-generations", type=int, default=8, help="RLOO's group size")
    parser.add_argument("--max-images", type=int, default=8, help="sft_vlm: most images of a sample")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", default="--gradient_checkpointing true", help="more arguments for every example")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: no limit)")
    parser.add_argument("--min-launch-s", type=float, default=60, help="no trainer starts with less budget left")
    parser.add_argument("--grace", type=float, default=60, help="seconds past the budget before a launch is ended")
    parser.add_argument("--logs", default=None, help="directory for the launches' logs (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help=PROFILE_HELP)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.trainers.split(","):
        if name not in TRAINERS:
            parser.error(f"--trainers: unknown trainer {name!r}; choose from {', '.join(TRAINERS)}")
    for name in args.schemes.split(","):
        if name not in SCHEMES:
            parser.error(f"--schemes: unknown scheme {name!r}; choose from {'; '.join(SCHEMES)}")
    if args.profile and not any(profiled(name) for name in args.schemes.split(",")):
        parser.error("--profile profiles the ODC schemes: add 'ODC + LB-Mini' to --schemes")
    if args.global_batch_size % args.num_processes:
        parser.error("--global-batch-size must be a multiple of --num-processes")
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and less than --steps")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    run_worker(arguments) if arguments.worker else run_driver(arguments)
