"""One decoding step's attention over a static KV cache, per layer: hf_odc's decoding kernel
(``hf_odc.kernels.decode_attention``, the cache's whole width, unfilled blocks skipped) against SDPA over the query
heads grouped per key/value head, reading the cache up to the filled part rounded up to 256 slots (what hf_odc's
decoding loop gave SDPA before the kernel: one CUDA graph per width).

Each row (a model's attention shape, a fill of the cache) times both in CUDA graphs that replay the attention over
``--layers`` layers' caches in turn (more than the L2 holds), CUDA events around ``--replays`` replays; reported: µs
per layer, the filled keys and values read per layer, the bandwidth that makes (TB/s), kernel × SDPA, and the largest
difference between the two outputs. On a CPU the kernel needs ``TRITON_INTERPRET=1``, and the times mean nothing (a
smoke run)::

    python benchmarks/decode_attention.py --json decode_attention.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

from hf_odc.kernels import decode_attention as attention

SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}
"""Query heads, key/value heads, head size."""

SDPA_WIDTH_MULTIPLE = 256
"""What hf_odc's decoding loop rounds SDPA's width up to."""


def _time(fn, layers: int, replays: int, device: torch.device) -> float:
    """Mean µs of ``fn(layer)`` per layer, replayed from one CUDA graph of every layer (directly on a CPU)."""
    if device.type != "cuda":
        fn(0)
        return math.nan
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for layer in range(layers):
            fn(layer)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * layers)


def _kernel(query, keys, values, mask, scale, layer):
    """hf_odc's decoding kernel over the whole cache."""
    return attention.decode_attention(query, keys[layer], values[layer], mask, scale)


def _sdpa(query, keys, values, mask, scale, width, layer):
    """The grouped SDPA the loop ran before the kernel, over the first ``width`` slots."""
    attention.KERNEL = False
    try:
        k, v = keys[layer][:, :, :width], values[layer][:, :, :width]
        return attention.decode_attention(query, k, v, mask[:, :width], scale)
    finally:
        attention.KERNEL = True


def _row(query, keys, values, fill: int, args, device: torch.device) -> dict:
    """Both attentions at one fill of the caches: times, bandwidths and their outputs' largest difference."""
    batch, kv_heads, slots, head_dim = keys.shape[1:]
    mask = torch.zeros(batch, slots, dtype=torch.bool, device=device)
    mask[:, :fill] = True
    width = min(slots, math.ceil(fill / SDPA_WIDTH_MULTIPLE) * SDPA_WIDTH_MULTIPLE)
    scale = head_dim**-0.5
    kernel = functools.partial(_kernel, query, keys, values, mask, scale)
    sdpa = functools.partial(_sdpa, query, keys, values, mask, scale, width)
    kernel_us = _time(kernel, args.layers, args.replays, device)
    sdpa_us = _time(sdpa, args.layers, args.replays, device)
    read = 2 * batch * kv_heads * fill * head_dim * keys.dtype.itemsize
    return {
        "fill": fill, "sdpa_width": width, "read_mb": read / 1e6, "kernel_us": kernel_us, "sdpa_us": sdpa_us,
        "kernel_tb_s": read / kernel_us / 1e6, "sdpa_tb_s": read / sdpa_us / 1e6, "speedup": sdpa_us / kernel_us,
        "max_abs_diff": (kernel(0).float() - sdpa(0).float()).abs().max().item(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batch", type=int, default=64, help="rows (completions) decoded together")
    parser.add_argument("--slots", type=int, default=1281, help="the cache's slots (prompt + new tokens + 1)")
    parser.add_argument("--fills", default="256,512,768,1024,1280", help="filled slots per row")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in args.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[name]
        g = torch.Generator(device).manual_seed(0)
        shape = (args.layers, args.batch, kv_heads, args.slots, head_dim)
        keys, values = (torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
        query = torch.randn(args.batch, heads, head_dim, generator=g, device=device, dtype=torch.bfloat16)
        rows += [
            {"shape": name, **_row(query, keys, values, int(fill), args, device)} for fill in args.fills.split(",")
        ]
    header = ("shape", "fill", "MB", "kernel µs", "TB/s", "SDPA µs", "TB/s", "×", "diff")
    print("{:14} {:>5} {:>6} {:>9} {:>5} {:>8} {:>5} {:>5} {:>8}".format(*header))
    for r in rows:
        print(
            f"{r['shape']:14} {r['fill']:>5} {r['read_mb']:>6.1f} {r['kernel_us']:>9.1f} {r['kernel_tb_s']:>5.2f} "
            f"{r['sdpa_us']:>8.1f} {r['sdpa_tb_s']:>5.2f} {r['speedup']:>5.2f} {r['max_abs_diff']:>8.1e}"
        )
    if args.json:
        environment = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "environment": environment, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
