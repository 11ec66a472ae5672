"""How long planning one minibatch takes on the CPU: the spec's budget is 50 ms for 4096 samples over 64 ranks.

Every rank plans every minibatch itself (no communication), so this is per-step overhead on each rank. Run::

    python benchmarks/plan_speed.py --json benchmarks/results/plan_speed.json

Lengths come from the built-in ``longalign`` and ``swe-smith`` distributions; the token cap is the one ``hf-odc plan``
uses by default (``--packing-ratio 1``: the distribution's longest possible sample, 64K and 128K tokens). Planners are
timed end to end (cost evaluation included); ``karmarkar_karp`` is timed alone on the precomputed per-sample costs,
split ``world_size`` ways as LB-Mini does. Each time is the median of ``--runs`` calls after one warm-up call.

On a shared virtual machine a core's speed can change by more than 1.5x from one second to the next (the host's
other tenants): the minimum is the steadier number to compare, the median says what a busy host gives. The JSON
records the CPUs the process was allowed to use (pin with ``taskset -c N`` to compare cores).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hf_odc.packing import DISTRIBUTIONS, evaluate_costs, karmarkar_karp, lb_micro, lb_mini, local_sort, sample_lengths

BUDGET_MS = 50.0


def _time_ms(fn: Callable[[], object], runs: int) -> dict[str, float]:
    fn()  # warm-up: first-call imports and allocations
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _shape(plan) -> str:
    counts = sorted({len(rank) for rank in plan})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def bench(distribution: str, samples: int, world_size: int, cost: str, runs: int, seed: int) -> list[dict]:
    lengths = sample_lengths(distribution, samples, seed=seed)
    cap = DISTRIBUTIONS[distribution].max_length
    costs = evaluate_costs(lengths, cost)
    cases = {
        "lb_mini": lambda: lb_mini(lengths, world_size, cap, cost),
        "lb_micro": lambda: lb_micro(lengths, world_size, cap, cost),
        "local_sort": lambda: local_sort(lengths, world_size),
        "karmarkar_karp": lambda: karmarkar_karp(costs, world_size),
    }
    rows = []
    for name, fn in cases.items():
        result = fn()
        microbatches = _shape(result) if name != "karmarkar_karp" else "-"
        rows.append(
            {
                "distribution": distribution,
                "function": name,
                "samples": samples,
                "world_size": world_size,
                "max_tokens": cap,
                "cost": cost,
                "microbatches_per_rank": microbatches,
                **_time_ms(fn, runs),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--distributions", default="longalign,swe-smith")
    parser.add_argument("--cost", default="attention", choices=["attention", "tokens"], help="default: the CLI's")
    parser.add_argument("--runs", type=int, default=21, help="timed calls per case; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/plan_speed.json", help="where to write the results")
    args = parser.parse_args()

    rows = []
    for distribution in args.distributions.split(","):
        rows += bench(distribution, args.samples, args.world_size, args.cost, args.runs, args.seed)

    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "device": {
            "cpu": _cpu_model(),
            "cpus_allowed": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "budget_ms": BUDGET_MS,
        "runs": args.runs,
        "results": rows,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"{report['device']['cpu']} (CPUs {report['device']['cpus_allowed']}); {args.samples} samples, "
        f"{args.world_size} ranks, cost={args.cost}, median of {args.runs} runs; written to {path}"
    )
    print()
    print("| lengths | function | max_tokens | microbatches/rank | median ms | min ms | max ms | < 50 ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |")
    for row in rows:
        ok = "yes" if row["median_ms"] < BUDGET_MS else "**no**"
        print(
            f"| {row['distribution']} | `{row['function']}` | {row['max_tokens']} | {row['microbatches_per_rank']} "
            f"| {row['median_ms']:.1f} | {row['min_ms']:.1f} | {row['max_ms']:.1f} | {ok} |"
        )


if __name__ == "__main__":
    main()
