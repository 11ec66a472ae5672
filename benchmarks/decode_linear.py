"""The decoding step's linear layers: ``torch.nn.functional.linear`` (cuBLAS) against hf_odc's Triton kernel
(``hf_odc.kernels.decoding.decode_linear``, the tiling of ``DECODE_LINEAR_CONFIGS``), on one GPU, with a table and JSON.

Each shape is a projection of a decoder's decoding copy (fused q/k/v, ``o_proj``, fused gate/up, ``down_proj``, the LM
head; Qwen2.5-1.5B's by default) at 32, 64 and 128 rows (one token per sequence), bf16. Each call reads another copy
of the weight, the copies together larger than the L2 cache, as a decoding step reads each layer's weights once. Both
are timed with CUDA events, over ``--calls`` calls run eagerly and over the same calls recorded in one CUDA graph
and replayed (as the decoding loop runs them). Reported per shape and row count: microseconds a call, the effective
bandwidth (weight, input and output bytes over the time), and F.linear's time over the kernel's; the kernel's largest
difference from F.linear (fp32 reference) is checked. ``--sweep`` also times, at 64 rows in CUDA graphs, the tilings
around the table's for each shape (nearest first), and prints the best, within ``--sweep-budget`` seconds shared
evenly by the shapes (30 s by default, so that a run with it stays near a minute; more tries more tilings).

    python benchmarks/decode_linear.py --json decode_linear.json
    python benchmarks/decode_linear.py --rows 64 --sweep --json decode_linear_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F

from hf_odc.kernels.decoding import DecodeLinearConfig, decode_linear_config

SHAPES = {
    "qwen2.5-1.5b": {
        "qkv_proj": (2048, 1536),
        "o_proj": (1536, 1536),
        "gate_up_proj": (17920, 1536),
        "down_proj": (1536, 8960),
        "lm_head": (151936, 1536),
    },
    "qwen2.5-7b": {
        "qkv_proj": (4608, 3584),
        "o_proj": (3584, 3584),
        "gate_up_proj": (37888, 3584),
        "down_proj": (3584, 18944),
        "lm_head": (152064, 3584),
    },
}
"""Each model's decoding-copy projections, ``name: (out_features, in_features)``."""

_ROTATED_BYTES = 256 * 2**20
"""The weight copies a timing cycles through take at least this much (an H200's L2 holds 50 MiB)."""


def _time(fn, calls: int, graph: bool) -> float:
    """Microseconds per call of ``fn(i)`` for ``i`` in ``range(calls)``, eagerly or replayed from one CUDA graph."""
    for i in range(min(calls, 8)):  # compile, warm the allocator
        fn(i)
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(calls):  # every copy touched once before the recording
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        recorded = torch.cuda.CUDAGraph()
        with torch.cuda.graph(recorded):
            for i in range(calls):
                fn(i)
        run = recorded.replay
    else:

        def run():
            for i in range(calls):
                fn(i)

    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    repeats = 5
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * calls)


def _operands(rows: int, n: int, k: int, bias: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    copies = max(1, math.ceil(_ROTATED_BYTES / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    return x, weights, b


def _rotating(fn, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None):
    """``fn`` on call ``i`` with the weight copy ``i`` comes to."""
    return lambda i: fn(x, weights[i % len(weights)], bias)


def _kernel(config: DecodeLinearConfig):
    from hf_odc.kernels import _triton_decoding

    def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _triton_decoding.decode_linear_forward(
            x, weight, bias, config.block_n, config.block_k, config.split_k, config.num_warps, config.num_stages
        )

    return call


def _measure(name: str, rows: int, n: int, k: int, calls: int) -> dict:
    x, weights, bias = _operands(rows, n, k, bias=name == "qkv_proj")  # Qwen2's q/k/v have a bias
    moved = n * k * 2 + rows * (k + n) * 2
    expected = F.linear(x.float(), weights[0].float(), None if bias is None else bias.float())
    got = torch.ops.hf_odc.decode_linear(x, weights[0], bias)
    error = (got.float() - expected).abs().max().item() / expected.abs().max().item()
    row = {"shape": name, "rows": rows, "out_features": n, "in_features": k, "bytes": moved, "max_rel_error": error}
    row["config"] = vars(decode_linear_config(n, k)).copy()
    for label, fn in (("linear", F.linear), ("kernel", torch.ops.hf_odc.decode_linear)):
        for graph in (False, True):
            us = _time(_rotating(fn, x, weights, bias), calls, graph)
            key = f"{label}_{'graph' if graph else 'eager'}"
            row[f"{key}_us"], row[f"{key}_tbs"] = us, moved / us / 1e6
    row["speedup_graph"] = row["linear_graph_us"] / row["kernel_graph_us"]
    row["speedup_eager"] = row["linear_eager_us"] / row["kernel_eager_us"]
    return row


def _candidates(n: int, k: int, rows: int, sms: int, table: DecodeLinearConfig) -> list[DecodeLinearConfig]:
    """Tilings around ``table``'s: block sizes, splits that give between a third of a wave and 16 waves of programs,
    and warps; nearest the table's first."""
    found = []
    for block_n, block_k, split_k, num_warps in itertools.product(
        (16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (4, 8)
    ):
        programs = math.ceil(n / block_n) * split_k
        if not sms / 3 <= programs <= 16 * sms or split_k * block_k > k:
            continue
        if num_warps == 8 and block_n * max(rows, 16) < 64 * 128:
            continue  # too small a tile for 8 warps
        found.append(DecodeLinearConfig(block_n, block_k, split_k, num_warps))  # stages: as many as fit, up to 4
    # The tilings nearest the table's first: fewest blocks and splits changed.
    return sorted(found, key=lambda c: (c.block_n != table.block_n) + (c.block_k != table.block_k)
                  + (c.split_k != table.split_k) + (c.num_warps != table.num_warps))  # fmt: skip


def _sweep(shapes: dict, rows: int, calls: int, budget: float) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, (n, k) in shapes.items():
        start = time.monotonic()
        x, weights, bias = _operands(rows, n, k, bias=name == "qkv_proj")
        moved = n * k * 2 + rows * (k + n) * 2
        table = decode_linear_config(n, k)
        candidates = [table] + [c for c in _candidates(n, k, rows, sms, table) if c != table]
        timed = []
        for config in candidates:
            if time.monotonic() - start > budget / len(shapes):
                break
            try:  # a tiling Triton cannot compile is reported, not fatal
                us = _time(_rotating(_kernel(config), x, weights, bias), calls, graph=True)
            except Exception as error:
                timed.append({"config": vars(config).copy(), "error": f"{type(error).__name__}: {error}"[:200]})
                continue
            timed.append({"config": vars(config).copy(), "us": us, "tbs": moved / us / 1e6})
        ok = sorted((t for t in timed if "us" in t), key=lambda t: t["us"])
        results.append({"shape": name, "rows": rows, "tried": len(timed), "of": len(candidates), "timed": ok,
                        "table": timed[0] if timed else None})  # fmt: skip
        if ok:
            best, ours = ok[0], timed[0]
            table_us = ours.get("us", float("nan"))
            print(f"{name:>13} best {best['us']:7.1f} us {best['tbs']:5.2f} TB/s {best['config']}; "
                  f"table's {table_us:7.1f} us ({len(timed)} of {len(candidates)} tried)")  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--rows", default="32,64,128", help="comma-separated row counts (tokens a step)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timing (each on another weight copy)")
    parser.add_argument("--sweep", action="store_true", help="also time the tilings around the table's, at 64 rows")
    parser.add_argument(
        "--sweep-budget", type=float, default=30.0, help="seconds the sweep may take, shared by the shapes"
    )
    parser.add_argument("--json", default=None, help="write the rows (and the sweep) here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_linear.py times CUDA kernels: run it on a machine with a GPU.")
    shapes = SHAPES[args.model_config]
    results = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.model_config}")
    print(f"{'shape':>13} {'rows':>4} | {'linear us':>9} {'TB/s':>5} | {'kernel us':>9} {'TB/s':>5} | "
          f"{'× graph':>7} {'× eager':>7} | rel err")  # fmt: skip
    for name, (n, k) in shapes.items():
        for rows in (int(r) for r in args.rows.split(",")):
            row = _measure(name, rows, n, k, args.calls)
            results.append(row)
            print(f"{name:>13} {rows:>4} | {row['linear_graph_us']:9.1f} {row['linear_graph_tbs']:5.2f} | "
                  f"{row['kernel_graph_us']:9.1f} {row['kernel_graph_tbs']:5.2f} | {row['speedup_graph']:7.2f} "
                  f"{row['speedup_eager']:7.2f} | {row['max_rel_error']:.1e}")  # fmt: skip
            torch.cuda.empty_cache()
    for rows in sorted({r["rows"] for r in results}):
        per = [r for r in results if r["rows"] == rows]
        linear, kernel = sum(r["linear_graph_us"] for r in per), sum(r["kernel_graph_us"] for r in per)
        print(f"{'one of each':>13} {rows:>4} | {linear:9.1f}       | {kernel:9.1f}       | {linear / kernel:7.2f}")
    sweep = _sweep(shapes, 64, args.calls, args.sweep_budget) if args.sweep else None
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model_config,
                  "rows": results, "sweep": sweep}  # fmt: skip
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
