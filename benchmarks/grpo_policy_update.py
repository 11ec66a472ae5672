"""GRPO policy-update time of ODCGRPOTrainer's schemes on the same rollouts, with a table and JSON (``--script
rloo.py`` or ``distill.py``: ODCRLOOTrainer's or ODCDistillationTrainer's, with ``--num-generations 0`` for the
latter, which has no groups).

Each scheme is one ``accelerate launch`` of ``examples/grpo.py`` with the same seed, prompts and injected rollouts
(``--rollouts synthetic``: long-tailed completions drawn reproducibly, so every scheme trains on the same minibatches
and generation takes no time). Per scheme it reports the device-timed policy update (``step_s``, the minibatch between
its two meeting points), the measured and predicted bubble, and the predicted bubble of TRL's split (each rank trains on
the rollouts it generated). The speed-up over the first scheme is set against the planner's prediction,
``(1 - predicted bubble of this scheme) / (1 - predicted bubble of the first)``: equal work, so time is inversely
proportional to the busy fraction. ``--generate-steps N`` adds a run that generates with transformers (the same model,
``--generate-length`` new tokens per completion) and reports generation's share of a step.

    python benchmarks/grpo_policy_update.py --num-processes 2 --json out/grpo.json
    python benchmarks/grpo_policy_update.py --num-processes 2 --model-config tiny --max-completion-length 256 \
        --accelerate-config examples/odc_cpu.yaml          # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import TRAINER_SCHEMES as SCHEMES

ROOT = Path(__file__).resolve().parents[1]


def launch(args: argparse.Namespace, extra: list[str], output_dir: str, log: Path) -> list[dict]:
    """Run the example script; return its per-step log entries."""
    accelerate = Path(sys.executable).with_name("accelerate")
    launcher = [str(accelerate) if accelerate.exists() else shutil.which("accelerate") or "accelerate", "launch"]
    command = [
        *launcher, "--config_file", args.accelerate_config, "--num_processes", str(args.num_processes),
        str(ROOT / "examples" / args.script), "--model_config", args.model_config,
        "--max_completion_length", str(args.max_completion_length),
        *(["--num_generations", str(args.num_generations)] if args.num_generations else []),
        "--per_device_train_batch_size", str(args.per_device_train_batch_size), "--max_steps", str(args.steps),
        "--length_distribution", args.distribution, "--logging_steps", "1", "--save_strategy", "no",
        "--report_to", "none", "--disable_tqdm", "true", "--output_dir", output_dir, "--seed", str(args.seed),
        *args.extra.split(), *extra,
    ]  # fmt: skip
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed; see {log}:\n{log.read_text()[-3000:]}")
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return [entry for entry in history if "loss" in entry and "train_runtime" not in entry]


def summarise(entries: list[dict], warmup: int, world_size: int) -> dict:
    timed = entries[warmup:] or entries
    mean = lambda key: statistics.fmean(e[key] for e in timed if key in e)  # noqa: E731
    return {
        "steps": len(timed),
        "step_s": mean("step_s"),
        "tokens_per_second": mean("tokens_per_second"),
        "bubble_rate": mean("bubble_rate"),
        "predicted_bubble_rate": mean("predicted_bubble_rate"),
        "predicted_bubble_rate_unbalanced": mean("predicted_bubble_rate_unbalanced"),
        "scoring_s": mean("scoring_s") if any("scoring_s" in e for e in timed) else 0.0,
        "microbatches_per_rank": [mean(f"microbatches/rank_{r}") for r in range(world_size)],
        "peak_memory_gib": max((e.get("peak_memory_gib", 0.0) for e in timed), default=0.0),
        "per_step_s": [e["step_s"] for e in timed],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", default="grpo.py", choices=["grpo.py", "rloo.py", "distill.py"])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--accelerate-config", default=str(ROOT / "examples" / "odc.yaml"))
    parser.add_argument("--model-config", default="qwen2.5-1.5b")
    parser.add_argument("--distribution", default="swe-smith", help="completion-length shape (hf_odc DISTRIBUTIONS)")
    parser.add_argument("--max-completion-length", type=int, default=16384)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--per-device-train-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma list of scheme names")
    parser.add_argument("--extra", default="--gradient_checkpointing true", help="more examples/grpo.py arguments")
    parser.add_argument("--generate-steps", type=int, default=0, help="also time transformers generation")
    parser.add_argument("--generate-length", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--logs", default=None, help="directory for the runs' logs (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="grpo_bench_"))
    logs.mkdir(parents=True, exist_ok=True)

    results = {}
    for index, name in enumerate(args.schemes.split(",")):
        with tempfile.TemporaryDirectory() as out:
            entries = launch(args, [*SCHEMES[name], "--rollouts", "synthetic"], out, logs / f"scheme{index}.log")
        results[name] = summarise(entries, args.warmup, args.num_processes)
        print(f"{name}: {results[name]['step_s']:.2f} s/step", flush=True)
    generation = None
    if args.generate_steps:
        generate_args = argparse.Namespace(**{**vars(args), "steps": args.generate_steps})
        generate_args.max_completion_length = args.generate_length
        with tempfile.TemporaryDirectory() as out:
            entries = launch(generate_args, ["--rollouts", "generate"], out, logs / "generate.log")
        timed = entries[1:] or entries
        generation = {
            "new_tokens_per_completion": args.generate_length,
            "generation_s": statistics.fmean(e["generation_s"] for e in timed if "generation_s" in e),
            "policy_update_s": statistics.fmean(e["step_s"] for e in timed),
            "step_time_s": statistics.fmean(e["step_time"] for e in timed),
        }

    base_name = next(iter(results))
    base = results[base_name]
    print(f"\n{'scheme':36s} {'update s':>9s} {'tok/s':>9s} {'speed-up':>9s} {'predicted':>9s} {'bubble':>7s} "
          f"{'pred.':>7s} {'TRL split':>9s}  microbatches/rank")  # fmt: skip
    for name, r in results.items():
        r["speedup"] = base["step_s"] / r["step_s"]
        r["predicted_speedup"] = (1 - r["predicted_bubble_rate"]) / (1 - base["predicted_bubble_rate"])
        mbs = "/".join(f"{m:.1f}" for m in r["microbatches_per_rank"])
        print(f"{name:36s} {r['step_s']:9.2f} {r['tokens_per_second']:9.0f} {r['speedup']:8.3f}x "
              f"{r['predicted_speedup']:8.3f}x {r['bubble_rate']:7.1%} {r['predicted_bubble_rate']:7.1%} "
              f"{r['predicted_bubble_rate_unbalanced']:9.1%}  {mbs}")  # fmt: skip
    if generation is not None:
        share = generation["generation_s"] / generation["step_time_s"]
        print(f"\ngeneration ({args.generate_length} new tokens per completion, transformers generate): "
              f"{generation['generation_s']:.1f} s of a {generation['step_time_s']:.1f} s step ({share:.0%}); "
              f"policy update {generation['policy_update_s']:.2f} s")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"config": vars(args), "schemes": results, "generation": generation}, indent=2)
        )


if __name__ == "__main__":
    main()
