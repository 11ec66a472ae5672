"""Fault trials on 2 CPU processes, run the way a user runs the examples (``accelerate launch``): what the issue #27
checks are measured with. Each trial prints one line; a table closes each mode.

    python benchmarks/fault_trials.py stall --trials 8 --timeout 5      # SIGSTOP of rank 1 at a random moment
    python benchmarks/fault_trials.py stall --script grpo --after 2     # the same in GRPO (mostly in generation)
    python benchmarks/fault_trials.py startup --trials 4 --timeout 5    # SIGSTOP of rank 1 5 s after the launch
    python benchmarks/fault_trials.py launcher --at 1 3 5 10            # SIGKILL of the launcher alone
    python benchmarks/fault_trials.py exits --repeats 20                # clean exits, each example, ODC and FSDP2
    python benchmarks/fault_trials.py hybrid --runs 200 --busy-every 2  # hybrid runs (2 replicas x 2) back to back
    python benchmarks/fault_trials.py chaos --trials 60 --hybrid-trials 20  # SIGKILL/SIGSTOP anywhere, then resume
    python benchmarks/fault_trials.py chaos --trials 15 --hybrid-trials 5 --after-first-checkpoint  # resumes
    python benchmarks/fault_trials.py cli --trials 20 --timeout 10       # hf-odc sft: SIGKILL/SIGSTOP, who speaks first

``stall``: ``examples/sft.py`` (or ``grpo.py``) with ``--odc_timeout T``; after step 20 (``--after``), at a random
moment (uniform over the next second and a half; for GRPO over the span one step took), rank 1 is stopped; the trial
records how long rank 0 lives on and whether its last error names rank 1. ``startup``: the same with the stop 5 s
after the launch (imports, process-group creation, dataset preparation).
``launcher``: the launcher is SIGKILLed at each time given; 10 s later, the trial counts the run's processes still
alive. ``exits``: the exit status of repeated runs, and how many printed gloo's "terminate called". ``hybrid``:
``examples/sft.py`` on 4 processes presented as 2 hosts x 2 (``--odc_shard_size 2``), run after run, every
``--busy-every``-th beside two CPU-bound loops (a shared CI machine); a run that has not ended ``--limit`` s after its
start is a hang (killed), and each run's exit status, duration and last error line are recorded. ``chaos``: SFT, GRPO
and DPO on 2 processes (and SFT as 2 replicas x 2 on 4), each trial sending SIGKILL or SIGSTOP to a random rank at a
random moment between the launch and the end of an uninterrupted run of the same command (timed once per script,
which also gives the reference parameters); measured: how long after the fault each survivor lived and whether the run
named the rank, the processes and ``/dev/shm`` entries left 10 s after the run ended (everything still alive is then
killed), and, when a checkpoint was saved before the fault, the largest parameter difference between the run resumed
from the last one and the uninterrupted run. ``cli``: ``hf-odc sft`` (the command line, whose process is the launcher)
with ``--odc_timeout T``; after step ``--after``, at a random moment within the next second and a half, rank 1 gets
SIGKILL (``--trials`` times) or SIGSTOP (as many); measured: whether the first line naming rank 1 is hf_odc's (a
survivor's, or the command's own), whether a traceback or torchrun's report came before it, and how long after the
fault the command ended (the target: within ``T + 5`` s), with its exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_odc.liveness import procfs

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
SFT_FAST = ["--num_samples", "64", "--disable_tqdm", "true", "--logging_steps", "1", "--save_strategy", "no"]
GRPO_FAST = ["--num_prompts", "64", "--disable_tqdm", "true", "--logging_steps", "1", "--save_strategy", "no"]
NAMED = re.compile(r"(hf_odc: |^\s+)(rank 1 \(pid|ranks \[1\] did not)", re.MULTILINE)


def _launch(script: str, args: list[str], log: Path, env: dict | None = None, processes: int = 2) -> subprocess.Popen:
    config = str(ROOT / "examples" / "odc_cpu.yaml")
    command = [str(ACCELERATE), "launch", "--config_file", config, "--num_processes", str(processes), script, *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _alive(pid: int) -> bool:
    return not procfs.gone(procfs.process_state(pid))


def _ranks(launcher: int) -> dict[int, int]:
    """The launcher's workers by rank."""
    found = {}
    for pid in procfs.pids():
        if procfs.parent(pid) != launcher:
            continue
        environ = procfs.environment(pid) or {}
        if b"RANK" in environ:
            found[int(environ[b"RANK"])] = pid
    return found


def _marked(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    return [pid for pid in procfs.pids() if marker.encode() in (procfs.command_line(pid) or b"") and _alive(pid)]


def _end(process: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _wait_until(condition, limit: float, step: float = 0.05) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return False


def _stop_rank_1(log: Path, process: subprocess.Popen, when, limit: float) -> dict:
    """Start, wait for ``when()`` to hold, SIGSTOP rank 1, and time how long rank 0 lives on (at most ``limit`` s)."""
    ranks: dict[int, int] = {}
    try:
        if not _wait_until(lambda: len(ranks.update(_ranks(process.pid)) or ranks) == 2 and when(), 300):
            return {"error": "did not get there", "log": log.read_text()[-2000:]}
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        said: list[float] = []

        def rank_0_ended() -> bool:
            if not said and NAMED.search(log.read_text()):
                said.append(time.monotonic() - stopped)
            return not _alive(ranks[0])

        ended = _wait_until(rank_0_ended, limit)
        seconds = time.monotonic() - stopped
        time.sleep(1.0)  # the launcher prints the failure
        text = log.read_text()
        lines = [line for line in text.splitlines() if NAMED.search(line)]
        said_s = said[0] if said else None
        return {"rank0_s": seconds if ended else None, "said_s": said_s, "named": bool(lines), "says": lines[-1:]}
    finally:
        _end(process, list(ranks.values()))


def stall(args: argparse.Namespace) -> None:
    results = []
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
            log = Path(tmp) / "log"
            script_args = SFT_FAST if args.script == "sft" else GRPO_FAST
            script_args = [*script_args, "--max_steps", "100000", "--odc_timeout", str(args.timeout)]
            process = _launch(f"examples/{args.script}.py", [*script_args, "--output_dir", tmp], log)
            state = {"at": None, "seen": None}

            def after_some_steps(state=state, log=log):
                steps = log.read_text().count("'loss'")
                if state["seen"] is None and steps >= args.after:
                    state["seen"] = time.monotonic()
                if state["at"] is None and steps >= args.after + 1:  # one step's span: where to stop at random
                    span = 1.5 if args.script == "sft" else time.monotonic() - state["seen"]
                    state["at"] = time.monotonic() + random.uniform(0, span)
                return state["at"] is not None and time.monotonic() >= state["at"]

            result = _stop_rank_1(log, process, after_some_steps, args.timeout + 60)
        results.append(result)
        print(f"stall trial {trial + 1}: {result}", flush=True)
    _table("stall", results, args.timeout, 5)


def startup(args: argparse.Namespace) -> None:
    results = []
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
            log = Path(tmp) / "log"
            sft_args = [*SFT_FAST, "--max_steps", "200", "--odc_timeout", str(args.timeout), "--output_dir", tmp]
            at = time.monotonic() + args.after
            process = _launch("examples/sft.py", sft_args, log)
            result = _stop_rank_1(log, process, lambda at=at: time.monotonic() >= at, args.timeout + 120)
        results.append(result)
        print(f"startup trial {trial + 1}: {result}", flush=True)
    _table("startup", results, args.timeout, 10)


CLI_NAMED = re.compile(r"(hf_odc: |^PeerFailureError: hf_odc: |^hf-odc sft: error: )(rank 1 \(pid|ranks \[1\] did not)")
FOREIGN = re.compile(r"Traceback|ChildFailedError|torch\.distributed\.elastic|Connection reset|^\[rank\d\]")


def cli(args: argparse.Namespace) -> None:
    rows = []
    for name, sent in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
        for trial in range(args.trials):
            row = _cli_trial(sent, args)
            rows.append({"signal": name, **row})
            print(f"cli {name} trial {trial + 1}: {row}", flush=True)
    print("\n| signal | trials | hf_odc named rank 1 first | no traceback or report before it | ended within "
          "timeout + 5 s | ended after the fault | exit status |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for name in ("SIGKILL", "SIGSTOP"):
        mine = [row for row in rows if row["signal"] == name]
        ends = [row["end_s"] for row in mine if row.get("end_s") is not None]
        span = f"{min(ends):.1f}-{max(ends):.1f} s" if ends else "-"
        statuses = ", ".join(sorted({str(row.get("status")) for row in mine}))
        cells = [name, len(mine), sum(row.get("named_first", False) for row in mine),
                 sum(row.get("clean", False) for row in mine),
                 sum(t <= args.timeout + 5 for t in ends), span, statuses]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


def _cli_trial(sent: signal.Signals, args: argparse.Namespace) -> dict:
    """One ``hf-odc sft`` run, rank 1 sent ``sent`` after step ``args.after``: what the output said first, and when
    the command ended."""
    with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
        log = Path(tmp) / "log"
        flags = [*SFT_FAST, "--max_steps", "100000", "--odc_timeout", str(args.timeout), "--output_dir", tmp]
        with open(log, "w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "hf_odc.cli", "sft", *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
            )  # fmt: skip
        ranks: dict[int, int] = {}
        try:
            if not _wait_until(lambda: log.read_text().count("'loss'") >= args.after, 300):
                return {"error": "did not get there", "log": log.read_text()[-2000:]}
            ranks.update(_ranks(process.pid))
            time.sleep(random.uniform(0, 1.5))
            os.kill(ranks[1], sent)
            faulted = time.monotonic()
            ended = _wait_until(lambda: process.poll() is not None, args.timeout + 60)
            end_s = time.monotonic() - faulted if ended else None
            lines = log.read_text().splitlines()
            first = next((i for i, line in enumerate(lines) if CLI_NAMED.search(line)), None)
            before = lines if first is None else lines[:first]
            return {"end_s": end_s, "status": process.poll(), "named_first": first is not None,
                    "clean": not any(FOREIGN.search(line) for line in before),
                    "says": lines[first][:160] if first is not None else None}  # fmt: skip
        finally:
            _end(process, list(ranks.values()))


def _table(mode: str, results: list[dict], timeout: float, slack: float) -> None:
    times = [r["rank0_s"] for r in results if r.get("rank0_s") is not None]
    named = sum(bool(r.get("named")) for r in results)
    within = sum(t <= timeout + slack for t in times)
    span = f"{min(times):.1f}-{max(times):.1f} s" if times else "-"
    print(f"\n| mode | trials | rank 1 named | rank 0 ended within timeout + {slack:g} s | rank 0 ended after |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(f"| {mode} (timeout {timeout:g} s) | {len(results)} | {named} | {within} | {span} |")


def launcher(args: argparse.Namespace) -> None:
    rows = []
    for at in args.at:
        with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
            marker = os.path.join(tmp, f"launcher-kill-{at}")
            process = _launch(
                "examples/sft.py", [*SFT_FAST, "--max_steps", "400", "--output_dir", marker], Path(tmp) / "l"
            )
            time.sleep(at)
            workers_at_kill = len(_marked(marker)) - 1  # the launcher's own command line holds it too
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            time.sleep(10)
            left = _marked(marker)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        rows.append((at, workers_at_kill, len(left)))
        print(f"launcher killed at {at:g} s: {workers_at_kill} workers then, {len(left)} alive 10 s later", flush=True)
    print("\n| launcher SIGKILLed at | workers at the kill | processes alive 10 s later |")
    print("| ---: | ---: | ---: |")
    for at, then, left in rows:
        print(f"| {at:g} s | {then} | {left} |")


def exits(args: argparse.Namespace) -> None:
    runs = {
        "accelerate_odc.py, ODC": ("examples/accelerate_odc.py", [], {}),
        "accelerate_odc.py, FSDP2": ("examples/accelerate_odc.py", [], {"HF_ODC_ENABLED": "0"}),
        "sft.py, ODC": ("examples/sft.py", [*SFT_FAST, "--max_steps", "3"], {}),
        "sft.py, FSDP2": ("examples/sft.py", [*SFT_FAST, "--max_steps", "3", "--odc", "false"], {}),
        "grpo.py, ODC": ("examples/grpo.py", ["--max_steps", "2", "--num_prompts", "32", "--disable_tqdm", "true"], {}),
        "grpo.py, FSDP2": (
            "examples/grpo.py",
            ["--max_steps", "2", "--num_prompts", "32", "--disable_tqdm", "true", "--odc", "false"],
            {},
        ),
    }
    rows = []
    for name, (script, script_args, env) in runs.items():
        if args.only and not any(word in name for word in args.only):
            continue
        codes, aborts = [], 0
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
                log = Path(tmp) / "log"
                extra = ["--output_dir", tmp] if "sft" in script or "grpo" in script else []
                process = _launch(script, [*script_args, *extra], log, env)
                codes.append(process.wait(timeout=900))
                aborts += "terminate called" in log.read_text()
        rows.append((name, codes, aborts))
        print(f"{name}: exit codes {codes}", flush=True)
    print("\n| run | repeats | exit 0 | printed 'terminate called' |")
    print("| --- | ---: | ---: | ---: |")
    for name, codes, aborts in rows:
        print(f"| {name} | {len(codes)} | {codes.count(0)} | {aborts} |")


def hybrid(args: argparse.Namespace) -> None:
    hybrid_args = [*SFT_FAST, "--max_steps", str(args.steps), "--odc_shard_size", "2", "--cost_model", "tokens"]
    rows = []
    for run in range(args.runs):
        busy = args.busy_every > 0 and run % args.busy_every == args.busy_every - 1
        loops = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(2 if busy else 0)
        ]
        try:
            with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
                log = Path(tmp) / "log"
                run_args = [*hybrid_args, "--odc_timeout", str(args.timeout), "--output_dir", tmp]
                started = time.monotonic()
                process = _launch("examples/sft.py", run_args, log, processes=4)
                try:
                    code = process.wait(timeout=args.limit)
                except subprocess.TimeoutExpired:
                    code = None
                seconds = time.monotonic() - started
                _end(process, [])
                errors = [line for line in log.read_text().splitlines() if "hf_odc: " in line]
        finally:
            for loop in loops:
                _end(loop, [])
        rows.append({"busy": busy, "code": code, "seconds": seconds, "error": errors[-1:]})
        label = f"hybrid run {run + 1}{' (busy)' if busy else ''}"
        print(f"{label}: exit {code} in {seconds:.1f} s {errors[-1:]}", flush=True)
    print("\n| hybrid runs (2 replicas x 2) | runs | exit 0 | hung (killed at the limit) | other exits | run time |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for label, busy in (("idle machine", False), ("beside 2 CPU-bound loops", True)):
        mine = [row for row in rows if row["busy"] == busy]
        if not mine:
            continue
        times = sorted(row["seconds"] for row in mine if row["code"] == 0)
        span = f"{times[0]:.1f}-{times[-1]:.1f} s (median {times[len(times) // 2]:.1f})" if times else "-"
        ok = sum(row["code"] == 0 for row in mine)
        hung = sum(row["code"] is None for row in mine)
        print(f"| {label} | {len(mine)} | {ok} | {hung} | {len(mine) - ok - hung} | {span} |")


CHAOS_RUNS = {  # name: (script, processes, arguments)
    "sft": ("examples/sft.py", 2, [*SFT_FAST, "--max_steps", "8"]),
    "grpo": ("examples/grpo.py", 2, ["--num_prompts", "64", "--rollouts", "synthetic", "--max_steps", "6",
                                     "--disable_tqdm", "true", "--logging_steps", "1"]),
    "dpo": ("examples/dpo.py", 2, ["--num_pairs", "128", "--max_steps", "8", "--disable_tqdm", "true",
                                   "--logging_steps", "1"]),
    "sft-hybrid": ("examples/sft.py", 4, [*SFT_FAST, "--max_steps", "8", "--odc_shard_size", "2"]),
}  # fmt: skip


def _params(output_dir: Path) -> dict | None:
    from safetensors.torch import load_file

    path = output_dir / "model.safetensors"
    return load_file(path) if path.exists() else None


def _largest_difference(ours: dict | None, reference: dict | None) -> float | None:
    if ours is None or reference is None or ours.keys() != reference.keys():
        return None
    return max(float((ours[name].double() - reference[name].double()).abs().max()) for name in reference)


def _chaos_run(name: str, output_dir: Path, timeout: float, extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    script, processes, script_args = CHAOS_RUNS[name]
    # The token cost plans the same microbatches in every run; a calibrated one refits to each run's own timings, so
    # a resumed run's summation order, hence its last bits, would differ from the uninterrupted one's.
    run_args = [*script_args, "--odc_timeout", str(timeout), "--save_strategy", "steps", "--save_steps", "2",
                "--cost_model", "tokens"]  # fmt: skip
    log = output_dir.with_suffix(".log")
    return _launch(script, [*run_args, "--output_dir", str(output_dir), *extra], log, processes=processes), log


def chaos(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    references: dict[str, tuple[float, float, dict | None]] = {}
    rows = []
    names = [n for n in ("sft", "grpo", "dpo") for _ in range(args.trials // 3)] + ["sft-hybrid"] * args.hybrid_trials
    with tempfile.TemporaryDirectory(prefix="hf_odc_trial_") as tmp:
        for name in sorted(set(names), key=names.index):  # an uninterrupted run of each: its span and its parameters
            started, wall = time.monotonic(), time.time()
            output_dir = Path(tmp) / f"reference-{name}"
            process, _ = _chaos_run(name, output_dir, args.timeout)
            process.wait(timeout=args.limit)
            # When its first checkpoint was complete (the earliest moment a fault leaves one to resume from).
            first = min(
                (m.stat().st_mtime for m in output_dir.glob("checkpoint-*/odc_checkpoint_complete")), default=wall
            )
            references[name] = (time.monotonic() - started, first - wall, _params(output_dir))
            print(
                f"reference {name}: {references[name][0]:.1f} s, first checkpoint at {first - wall:.1f} s", flush=True
            )
        for trial, name in enumerate(names):
            span, first_checkpoint, reference = references[name]
            processes = CHAOS_RUNS[name][1]
            signal_name, rank = rng.choice(("SIGKILL", "SIGSTOP")), rng.randrange(processes)
            at = rng.uniform(first_checkpoint if args.after_first_checkpoint else 0.0, span)
            shm_before = set(glob.glob("/dev/shm/hf_odc_*"))
            output_dir = Path(tmp) / f"trial-{trial}"
            started = time.monotonic()
            process, log = _chaos_run(name, output_dir, args.timeout)
            ranks: dict[int, int] = {}
            # Until the moment, and on until every rank exists (a moment before its start faults it as it starts; the
            # survivors are the other ranks' processes, so they must be known when the fault is sent).
            while (time.monotonic() - started < at or len(ranks) < processes) and process.poll() is None:
                ranks.update(_ranks(process.pid))
                time.sleep(0.02)
            row = {"name": name, "signal": signal_name, "rank": rank, "at_s": time.monotonic() - started}
            faulted = None
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # the rank may end between its last sighting and now
                    os.kill(ranks[rank], getattr(signal, signal_name))
                    faulted = time.monotonic()
            if faulted is None:
                exit_code = process.poll()
                row["outcome"] = "finished before the fault" if exit_code in (0, None) else f"exit {exit_code}"
                _end(process, list(ranks.values()))
            else:
                survivors = [pid for r, pid in ranks.items() if r != rank]
                _wait_until(lambda survivors=survivors: not any(map(_alive, survivors)), args.timeout + args.slack + 60)
                row["survivors_s"] = time.monotonic() - faulted if not any(map(_alive, survivors)) else None
                _wait_until(lambda launcher=process: launcher.poll() is not None, 30)  # the launcher's own ending
                time.sleep(10)
                # hf_odc's own words, or the launcher's report of the dead rank ("rank      : 3 (local_rank: 3)"),
                # read once the launcher has ended (its report comes last).
                said = rf"rank {rank}\b|ranks \[{rank}\]|rank\s+: {rank} \(local_rank"
                said_all = log.read_text()
                row["named"] = bool(re.search(said, said_all))
                # A rank faulted before its first beat (during its imports) is noticed only once the survivors have
                # started themselves: their own startup then counts in survivors_s. A rank faulted after the run had
                # ended (its model saved) leaves no live peer to notice: the launcher waits on a stopped one.
                row["phase"] = (
                    "startup"
                    if "has not beaten yet" in said_all
                    else "ended"
                    if "Training completed" in said_all
                    else "run"
                )
                row["left_processes"] = len(_marked(str(output_dir)))  # before anything is killed here
                row["new_shm"] = sorted(set(glob.glob("/dev/shm/hf_odc_*")) - shm_before)
                row["outcome"] = "fault"
                _end(process, list(ranks.values()))
            # The newest complete checkpoint (hf_odc writes odc_checkpoint_complete last; a save the fault cut short
            # is refused by name on resume, as resume_from_checkpoint=True would skip it).
            checkpoints = sorted(
                output_dir.glob("checkpoint-*/odc_checkpoint_complete"), key=lambda p: int(p.parent.name.split("-")[1])
            )
            checkpoints = [marker.parent for marker in checkpoints]
            if checkpoints and row["outcome"] == "fault":
                resumed = Path(tmp) / f"resumed-{trial}"
                process, _ = _chaos_run(name, resumed, args.timeout, ["--resume_from_checkpoint", str(checkpoints[-1])])
                process.wait(timeout=args.limit)
                row["resumed_from"] = checkpoints[-1].name
                row["resume_difference"] = _largest_difference(_params(resumed), reference)
            rows.append(row)
            print(f"chaos trial {trial + 1}: {row}", flush=True)
    for row in rows:  # left behind: what a trial's run created and nothing removed by the end (another job's end)
        row["left_shm"] = sum(map(os.path.exists, row.get("new_shm", ())))
    _chaos_table(rows, args)


def _chaos_table(rows: list[dict], args: argparse.Namespace) -> None:
    header = ["runs", "phase of the fault", "trials", "faults", "survivors ended within timeout + slack",
              "rank named", "processes left", "/dev/shm left", "resumed", "resumed = uninterrupted (atol 1e-6)",
              "largest difference"]  # fmt: skip
    print("\n| " + " | ".join(header) + " |")
    print("| --- | --- |" + " ---: |" * (len(header) - 2))
    for name, phase in itertools.product(CHAOS_RUNS, ("startup", "run", "ended", None)):
        mine = [row for row in rows if row["name"] == name and row.get("phase") == phase]
        faults = [row for row in mine if row["outcome"] == "fault"]
        if not mine:
            continue
        within = sum(r["survivors_s"] is not None and r["survivors_s"] <= args.timeout + args.slack for r in faults)
        resumed = [r for r in faults if "resume_difference" in r]
        differences = [r["resume_difference"] for r in resumed if r["resume_difference"] is not None]
        cells = [name, phase or "no fault", len(mine), len(faults), within, sum(r["named"] for r in faults),
                 sum(r["left_processes"] for r in faults), sum(r["left_shm"] for r in faults), len(resumed),
                 sum(d <= 1e-6 for d in differences), f"{max(differences, default=float('nan')):.2g}"]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for name, default_trials, after in (("stall", 8, 20), ("startup", 4, 5.0)):
        sub = modes.add_parser(name)
        sub.add_argument("--trials", type=int, default=default_trials)
        sub.add_argument("--timeout", type=float, default=5.0)
        sub.add_argument("--after", type=type(after), default=after, help="stall: steps; startup: seconds")
        sub.add_argument("--script", choices=["sft", "grpo"], default="sft")
    sub = modes.add_parser("launcher")
    sub.add_argument("--at", type=float, nargs="+", default=[1, 3, 5, 10])
    sub = modes.add_parser("cli")
    sub.add_argument("--trials", type=int, default=20, help="trials of each signal")
    sub.add_argument("--timeout", type=float, default=10.0, help="the runs' --odc_timeout")
    sub.add_argument("--after", type=int, default=3, help="steps before the fault")
    sub = modes.add_parser("exits")
    sub.add_argument("--repeats", type=int, default=20)
    sub.add_argument("--only", nargs="*", help="run only the runs whose name holds one of these words")
    sub = modes.add_parser("hybrid")
    sub.add_argument("--runs", type=int, default=200)
    sub.add_argument("--busy-every", type=int, default=2, help="every N-th run beside 2 CPU-bound loops (0: none)")
    sub.add_argument("--steps", type=int, default=5)
    sub.add_argument("--timeout", type=float, default=30.0, help="the runs' --odc_timeout")
    sub.add_argument("--limit", type=float, default=300.0, help="seconds after which a run counts as hung")
    sub = modes.add_parser("chaos")
    sub.add_argument("--trials", type=int, default=60, help="2-process trials, split over SFT, GRPO and DPO")
    sub.add_argument("--hybrid-trials", type=int, default=20, help="4-process trials (2 replicas x 2)")
    sub.add_argument("--timeout", type=float, default=5.0, help="the runs' --odc_timeout")
    sub.add_argument("--slack", type=float, default=10.0)
    sub.add_argument("--limit", type=float, default=600.0, help="seconds an uninterrupted or resumed run may take")
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--after-first-checkpoint", action="store_true",
                     help="fault only after the first checkpoint (where a resume can be checked)")  # fmt: skip
    args = parser.parse_args()
    modes_by_name = {"stall": stall, "startup": startup, "launcher": launcher, "exits": exits, "hybrid": hybrid}
    modes_by_name |= {"chaos": chaos, "cli": cli}
    modes_by_name[args.mode](args)


if __name__ == "__main__":
    main()
