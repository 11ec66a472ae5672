"""Forward+backward of one packed row's attention against the same documents run unpacked, on one GPU.

For each split of a row into documents, per attention layer of a model shape (default: Qwen2.5-1.5B's 12 query heads,
2 key/value heads, 128 dims, bf16), CUDA-event medians of:

* ``unpacked``: the documents one by one through transformers' ``sdpa`` (each its own causal batch of one), summed:
  what an unpacked LocalSort microbatch costs, the target's denominator;
* ``odc-sdpa`` / ``odc-varlen``: hf_odc's packed attention on the whole row with each backend (``sdpa`` is the
  default; ``varlen`` where this torch's ``varlen_attn`` runs these heads);
* ``dense-mask``: transformers' ``sdpa`` on the packed row with its block-diagonal ``T x T`` mask (``--dense``), what
  packing cost before.

Target: every ``odc-sdpa`` row at most 1.1x ``unpacked``::

    python benchmarks/packed_attention.py --json packed_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_odc.kernels.attention import packed_causal_attention, varlen_available

SPLITS = {
    "40K+16K+8K": [40960, 16384, 8192],
    "4x16K": [16384] * 4,
    "8x8K": [8192] * 8,
    "32x2K": [2048] * 32,
}
TARGET = 1.1


class _Module(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def _qkv(tokens: int, heads: int, kv_heads: int, dim: int, generator: torch.Generator):
    """Laid out as transformers' projections make them: (1, T, H, D) storage, viewed as (1, H, T, D)."""
    return [
        torch.randn(1, tokens, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        .transpose(1, 2)
        .requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]


def _time(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` (forward + backward), CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(attention, tensors, grad):
    def run():
        torch.autograd.grad(attention(*tensors), tensors, grad)  # gradients returned, not accumulated into .grad

    return run


def measure(lengths: list[int], heads: int, kv_heads: int, dim: int, args) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(lengths)
    q, k, v = _qkv(tokens, heads, kv_heads, dim, g)
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    module = _Module(heads, kv_heads)
    thd = [t.detach().transpose(1, 2)[0].requires_grad_() for t in (q, k, v)]  # (T, H, D) views, as hf_odc gets
    results: dict[str, float] = {}

    docs = [[t.detach()[:, :, s : s + n].requires_grad_() for t in (q, k, v)] for s, n in _starts(lengths)]

    def unpacked():
        for doc, (s, n) in zip(docs, _starts(lengths), strict=True):
            out, _ = sdpa_attention_forward(module, *doc, None)
            torch.autograd.grad(out, doc, grad[s : s + n][None])

    results["unpacked"] = _time(unpacked, args.warmup, args.reps)
    backends = ["sdpa", *(["varlen"] if varlen_available(thd[0], thd[1]) else [])]
    for backend in backends:
        attention = lambda *x, b=backend: packed_causal_attention(*x, lengths, backend=b)  # noqa: E731
        results[f"odc-{backend}"] = _time(_fwd_bwd(attention, thd, grad), args.warmup, args.reps)
    if args.dense:
        ids = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(lengths)])
        causal = torch.ones(tokens, tokens, device="cuda", dtype=torch.bool).tril()
        mask = (causal & (ids[:, None] == ids[None, :]))[None, None]
        del causal

        def dense():
            out, _ = sdpa_attention_forward(module, q, k, v, mask)
            torch.autograd.grad(out, (q, k, v), grad[None])

        results["dense-mask"] = _time(dense, 1, max(2, args.reps // 4))
        del mask
    return results


def _starts(lengths: list[int]):
    start = 0
    for n in lengths:
        yield start, n
        start += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--splits", default=",".join(SPLITS), help=f"comma list of {list(SPLITS)}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dense", action="store_true", help="also time the dense block-diagonal mask")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = {
        name: measure(SPLITS[name], args.heads, args.kv_heads, args.head_dim, args) for name in args.splits.split(",")
    }
    columns = [c for c in ("unpacked", "odc-sdpa", "odc-varlen", "dense-mask") if c in next(iter(rows.values()))]
    shape = f"{args.heads}/{args.kv_heads} heads x {args.head_dim}"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {shape}")
    print("fwd+bwd ms per layer (ratio to unpacked)")
    print(f"{'split':>12} | " + " | ".join(f"{c:>16}" for c in columns) + " | target")
    for name, r in rows.items():
        cells = [f"{r[c]:8.2f} ({r[c] / r['unpacked']:4.2f}x)" for c in columns]
        ok = "met" if r["odc-sdpa"] <= TARGET * r["unpacked"] else "MISSED"
        print(f"{name:>12} | " + " | ".join(f"{c:>16}" for c in cells) + f" | {ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "ms": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
