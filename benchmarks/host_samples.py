"""Where a training process's host time goes: a summary of a ``py-spy record -f raw`` profile.

The short-row trainers run at the host's pace (benchmarks/RESULTS.md), and ``torch.profiler`` sees the host's
operators but not the Python around them. py-spy samples every Python stack without touching the process; this
reads its raw output (collapsed stacks, ``frame;frame;... count`` per line, optionally gzipped) and keeps the samples
whose stack passes through ``--anchor`` (a function name, default the trainers' ``_run_minibatch``: the minibatch's
forwards as the main thread runs them; ``recompute_fn``: activation checkpointing's recomputation in the backward),
in the processes whose command line holds ``--process``. It prints, as shares of those samples, the innermost frames
(``self``) and every frame on the way (``total``), and writes both as JSON. Recorded on a GPU machine (py-spy is a
wheel to carry; the raw file, tens of MB, gzipped before it comes back)::

    py-spy record --subprocesses -r 200 -f raw -o $OUT/reward.raw -- python3 benchmarks/trainer_points.py \
        --num-processes 2 --trainers reward --schemes "ODC + LB-Mini" --steps 5 --warmup 2
    gzip -9 $OUT/reward.raw
    python benchmarks/host_samples.py reward.raw.gz --json host_reward.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def _frame(text: str) -> str:
    """``name (file:line)``, the file's path cut to its package (``.../site-packages/torch/x.py``: ``torch/x.py``;
    ``.../hf_odc/engine/odc.py``: ``hf_odc/engine/odc.py``)."""
    name, _, where = text.partition(" (")
    if "site-packages/" in where:
        where = where.partition("site-packages/")[2]
    elif "hf_odc/" in where:
        where = where[where.index("hf_odc/") :]
    return f"{name} ({where}" if where else name


def summarise(path: Path, anchor: str, process: str | None) -> dict:
    """Sample counts of the stacks through ``anchor``: in all, per innermost frame and per frame on the way."""
    opener = gzip.open if path.suffix == ".gz" else open
    own, on_the_way, processes = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    with opener(path, "rt") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            owners = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
            if process is not None and not any(process in frames[i] for i in owners):
                continue
            names = [frame.partition(" (")[0] for frame in frames]
            starts = [i for i, name in enumerate(names) if name == anchor or name.endswith("." + anchor)]
            if not starts:
                continue
            samples = int(count)
            total += samples
            processes[frames[owners[-1]].partition(":")[0] if owners else "?"] += samples
            below = [_frame(frame) for frame in frames[starts[0] :]]
            own[below[-1]] += samples
            for frame in set(below):
                on_the_way[frame] += samples
    return {"anchor": anchor, "samples": total, "processes": dict(processes), "self": dict(own.most_common()),
            "total": dict(on_the_way.most_common())}  # fmt: skip


def print_summary(summary: dict, top: int) -> None:
    total = summary["samples"]
    per_process = ", ".join(f"{process}: {samples}" for process, samples in summary["processes"].items())
    print(f"{total} samples through {summary['anchor']} ({per_process})")
    if not total:
        return
    for title in ("self", "total"):
        print(f"\n{title}:")
        for frame, samples in list(summary[title].items())[:top]:
            print(f"{samples / total:6.1%}  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="py-spy's raw output (.gz or plain)")
    parser.add_argument("--anchor", default="_run_minibatch", help="keep the stacks through this function")
    parser.add_argument("--process", default=None, help="keep the processes whose command line holds this")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    summary = summarise(args.raw, args.anchor, args.process)
    print_summary(summary, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
