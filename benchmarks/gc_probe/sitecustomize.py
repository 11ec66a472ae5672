"""Python's garbage collections in every process of a run, timed: put this folder first on ``PYTHONPATH`` and every
Python process started with it (the launcher's ranks included) writes, at exit, ``gc_<rank>_<pid>.json`` into
``$GC_PROBE_DIR`` (default: the working directory): its tracked objects, the count and seconds of collections per
generation, and each full (generation 2) collection's wall time, duration and objects collected. Used to see whether
collections land inside the trainers' steps (``manual_gc``)::

    GC_PROBE_DIR=/tmp/gc PYTHONPATH=benchmarks/gc_probe:. python benchmarks/trainer_points.py --model-config tiny \\
        --max-length 64 --global-batch-size 8 --steps 8 --warmup 1 --extra "" \\
        --accelerate-config examples/odc_cpu.yaml --trainers kto --schemes "ODC + LB-Mini" --json /tmp/gc/points.json
"""

import atexit
import gc
import json
import os
import time

_started: list[float] = []
_totals = {generation: [0, 0.0] for generation in range(3)}
_full: list[dict] = []


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
        return
    seconds = time.perf_counter() - _started[0] if _started else 0.0
    generation = info["generation"]
    _totals[generation][0] += 1
    _totals[generation][1] += seconds
    if generation == 2:
        _full.append({"at": time.time(), "s": seconds, "collected": info["collected"]})


def _write() -> None:
    name = f"gc_{os.environ.get('RANK', 'main')}_{os.getpid()}.json"
    with open(os.path.join(os.environ.get("GC_PROBE_DIR", "."), name), "w") as f:
        json.dump({"objects": len(gc.get_objects()), "per_generation": _totals, "full": _full}, f)


gc.callbacks.append(_timed)
atexit.register(_write)
