"""One profiled trainer step, per rank, read from ``torch.profiler``'s trace into a compact summary
(:func:`step_summary`) and printed side by side for every rank (:func:`print_profile`): what
``trainer_points.py --profile`` reports, to say why ranks with the same tokens are busy for different times.

The "device" is the GPU's kernels, copies and memsets on CUDA; on a CPU it is the host's innermost operators (each
``cpu_op`` with no other nested in it), so that the same reading runs in the CPU tests. Everything else is the same
on both: each device event belongs to the microbatch whose ``record_function`` range (``microbatch N``, which the
trainers open around each microbatch) was open on the host when it was launched (a kernel's launch is its runtime
call, found by the trace's correlation id; a CPU operator launches itself); the minibatch is the union of those
events. Device time is split by kind (``_common.kernel_kind``) so that the kinds add up to the busy time: where
events overlap (several streams), each instant is shared equally among those running, and the overlapped time is
reported apart."""

from __future__ import annotations

import bisect
import re
from collections import defaultdict

from _common import kernel_kind

KINDS = ("gemm", "attention", "odc push", "copy", "nccl", "elementwise", "optimizer", "memset", "other")
"""Every kind a device event is put in, in the table's order (``copy`` and ``memset``: the trace's own categories)."""

MICROBATCH = re.compile(r"microbatch (\d+)$")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME = ("cuda_runtime", "cuda_driver")
_WATCHED = re.compile(
    r"_local_scalar_dense|item|cudnn|triton|nccl|gloo|c10d|barrier|record_param_comms|Optimizer\.step|synchron",
    re.IGNORECASE,
)
"""Host operators reported by name besides every CUDA runtime and driver call: the host's syncs (``.item()``),
cuDNN's plan building, Triton, the collectives and the optimizer step."""


def device_events(events: list[dict], cuda: bool) -> list[dict]:
    """The trace's device work, each event with ``"kind"`` and ``"launch"`` (the host time its launch began, in the
    trace's microseconds) added, sorted by start."""
    if cuda:
        launches = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") in _RUNTIME and "correlation" in e.get("args", {})}  # fmt: skip
        work = [e for e in events if e.get("cat") in _DEVICE and "dur" in e]
        for event in work:
            event["launch"] = launches.get(event.get("args", {}).get("correlation"), event["ts"])
            event["kind"] = {"gpu_memcpy": "copy", "gpu_memset": "memset"}.get(event["cat"]) or kernel_kind(
                event["name"]
            )
    else:
        work = _innermost([e for e in events if e.get("cat") == "cpu_op" and "dur" in e])
        for event in work:
            event["launch"] = event["ts"]
            event["kind"] = kernel_kind(event["name"])
    return sorted(work, key=lambda e: e["ts"])


def _innermost(ops: list[dict]) -> list[dict]:
    """Of a host's operators, those in which no other (of the same thread) starts: on each thread they nest."""
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for op in ops:
        threads[op.get("pid"), op.get("tid")].append(op)
    leaves = []
    for own in threads.values():
        own.sort(key=lambda e: (e["ts"], -e["dur"]))
        leaves += [op for op, after in zip(own, [*own[1:], None], strict=True) if after is None
                   or after["ts"] >= op["ts"] + op["dur"]]  # fmt: skip
    return leaves


def shared_time(work: list[dict]) -> dict[str, float]:
    """Seconds of ``work`` by kind, each instant shared equally among the events running then, so that the kinds add
    up to ``"busy"`` (the time in which any ran); ``"overlapped"``: the time in which more than one ran."""
    edges = sorted([(e["ts"], 1, e["kind"]) for e in work] + [(e["ts"] + e["dur"], -1, e["kind"]) for e in work])
    seconds: dict[str, float] = defaultdict(float)
    running: dict[str, int] = defaultdict(int)
    count, last = 0, None
    for time, step, kind in edges:
        if count and time > last:
            span = (time - last) / 1e6
            for name, n in running.items():
                seconds[name] += span * n / count
            seconds["busy"] += span
            seconds["overlapped"] += span if count > 1 else 0.0
        running[kind] += step
        if not running[kind]:
            del running[kind]
        count, last = count + step, time
    return {name: seconds.get(name, 0.0) for name in (*KINDS, "busy", "overlapped")}


def _gaps(work: list[dict]) -> list[tuple[float, float, str, str]]:
    """The intervals inside ``work``'s span in which no event ran: ``(start, end, event before, event after)``."""
    gaps, end, last = [], None, None
    for event in work:
        if end is not None and event["ts"] > end:
            gaps.append((end, event["ts"], last["name"], event["name"]))
        if end is None or event["ts"] + event["dur"] > end:
            end, last = event["ts"] + event["dur"], event
    return gaps


def _host_op_during(host: list[dict], start: float, end: float) -> str:
    """The innermost host event covering at least half of ``[start, end)`` (what the host was doing while the device
    idled), else the one covering most of it; "" when none overlaps."""
    best, best_key = "", None
    for event in host:
        overlap = min(end, event["ts"] + event["dur"]) - max(start, event["ts"])
        if overlap <= 0:
            continue
        key = (overlap < 0.5 * (end - start), event["dur"] if overlap >= 0.5 * (end - start) else -overlap)
        if best_key is None or key < best_key:
            best, best_key = event["name"], key
    return best


def _by_name(events: list[dict], top: int) -> list[tuple[str, float, int]]:
    """``top`` names of ``events`` by summed seconds: ``(name, seconds, count)``."""
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        seconds[event["name"][:70]] += event["dur"] / 1e6
        counts[event["name"][:70]] += 1
    return [(name, s, counts[name]) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]]


def step_summary(events: list[dict], cuda: bool, top: int = 8) -> dict:
    """One rank's profiled step (``events``: the chrome trace's ``traceEvents``) as a small dict: the minibatch's
    device ``busy`` seconds, its span from first start to last end and the ``idle`` seconds inside it, the seconds by
    kind (:func:`shared_time`), its number of device events, per microbatch its device seconds, span and events, the
    longest device gaps inside the minibatch with the events either side and the host event the host was in
    meanwhile, the host's biggest operators (CUDA runtime and driver calls, and the watched operators) over the whole
    step and inside the minibatch's host range, and the device's busy time over the whole step."""
    work = device_events(events, cuda)
    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and MICROBATCH.match(e.get("name", ""))),
        key=lambda e: e["ts"],
    )
    starts = [r["ts"] for r in ranges]
    per_microbatch: list[list[dict]] = [[] for _ in ranges]
    for event in work:
        index = bisect.bisect_right(starts, event["launch"]) - 1
        if index >= 0 and event["launch"] < ranges[index]["ts"] + ranges[index]["dur"]:
            per_microbatch[index].append(event)
    minibatch = sorted((e for own in per_microbatch for e in own), key=lambda e: e["ts"])
    kinds = shared_time(minibatch)
    span = (max(e["ts"] + e["dur"] for e in minibatch) - minibatch[0]["ts"]) / 1e6 if minibatch else 0.0
    host = [e for e in events if e.get("cat") in (*_RUNTIME, "cpu_op", "user_annotation") and "dur" in e
            and not MICROBATCH.match(e.get("name", ""))]  # fmt: skip
    watched = [e for e in host if e["cat"] in _RUNTIME or _WATCHED.search(e["name"])]
    first, last = (ranges[0]["ts"], ranges[-1]["ts"] + ranges[-1]["dur"]) if ranges else (0.0, 0.0)
    gaps = sorted(_gaps(minibatch), key=lambda g: g[0] - g[1])[:top]
    return {
        "busy_s": kinds["busy"],
        "span_s": span,
        "idle_s": span - kinds["busy"],
        "overlapped_s": kinds["overlapped"],
        "kinds_s": {kind: kinds[kind] for kind in KINDS},
        "events": len(minibatch),
        "microbatches": [_microbatch(r, own) for r, own in zip(ranges, per_microbatch, strict=True)],
        "minibatch_host_s": (last - first) / 1e6,
        "gaps": [_gap(host, *gap) for gap in gaps],
        "host_ops_step": _by_name(watched, 2 * top),
        "host_ops_minibatch": _by_name([e for e in watched if first <= e["ts"] < last], top),
        "step_device_busy_s": shared_time(work)["busy"],
        "step_device_events": len(work),
        "top_device": _by_name(minibatch, top),
    }


def _microbatch(annotation: dict, own: list[dict]) -> dict:
    """One microbatch's entry: its host range's seconds, its device events' busy seconds, span and number."""
    span = (max(e["ts"] + e["dur"] for e in own) - own[0]["ts"]) / 1e6 if own else 0.0
    return {"name": annotation["name"], "host_s": annotation["dur"] / 1e6, "device_s": shared_time(own)["busy"],
            "events": len(own), "span_s": span}  # fmt: skip


def _gap(host: list[dict], start: float, end: float, before: str, after: str) -> dict:
    """One device gap's entry: its seconds, the events either side and the host event meanwhile."""
    return {"s": (end - start) / 1e6, "before": before[:60], "after": after[:60],
            "host": _host_op_during(host, start, end)[:60]}  # fmt: skip


def print_profile(title: str, ranks: list[dict]) -> None:
    """Every rank's :func:`step_summary` (with ``"wall_s"``, ``"tokens"``, ``"rank"`` and the engine's ``busy_s`` and
    ``wait_s`` added) as a table, then per rank its microbatches, device gaps and biggest host operators."""
    short = {"attention": "attn", "odc push": "push", "elementwise": "elem", "optimizer": "optim"}
    print(f"\nprofile: {title} (one step after the timed ones; seconds; kinds share overlapped time)")
    print(f"{'rank':>4} {'wall':>6} {'eng.busy':>8} {'eng.wait':>8} {'busy':>6} {'idle':>6} {'overlap':>7} "
          f"{'events':>7} {'tokens':>7} " + " ".join(f"{short.get(k, k):>6}" for k in KINDS))  # fmt: skip
    for r in ranks:
        print(f"{r['rank']:>4} {r['wall_s']:6.3f} {r['engine_busy_s']:8.3f} {r['engine_wait_s']:8.3f} "
              f"{r['busy_s']:6.3f} {r['idle_s']:6.3f} {r['overlapped_s']:7.3f} {r['events']:7d} {r['tokens']:7d} "
              + " ".join(f"{r['kinds_s'][k]:6.3f}" for k in KINDS))  # fmt: skip
    for r in ranks:
        print(
            f"  rank {r['rank']}: minibatch enqueued by the host in {r['minibatch_host_s']:.3f} s; "
            f"device busy {r['step_device_busy_s']:.3f} s over the whole step ({r['step_device_events']} events)"
        )
        for mb, tokens in zip(r["microbatches"], r["microbatch_tokens"], strict=False):
            print(f"    {mb['name']}: {tokens} tokens, device {mb['device_s']:.3f} s (span {mb['span_s']:.3f}, "
                  f"{mb['events']} events), host {mb['host_s']:.3f} s")  # fmt: skip
        for gap in r["gaps"][:4]:
            print(f"    gap {gap['s']:.4f} s: {gap['before']} -> {gap['after']}; host in {gap['host'] or '?'}")
        ops = ", ".join(f"{name} {s:.3f}/{n}" for name, s, n in r["host_ops_minibatch"][:6])
        print(f"    host ops in the minibatch (s/calls): {ops}")
        ops = ", ".join(f"{name} {s:.3f}/{n}" for name, s, n in r["host_ops_step"][:8])
        print(f"    host ops in the step (s/calls): {ops}")
