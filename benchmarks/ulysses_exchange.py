"""What Ulysses sequence parallelism's all-to-alls cost, measured: the cost model's ``EXCHANGE``, fitted.

The planner prices a document split over a group of ``N`` ranks at ``1/N`` of its cost plus its all-to-alls
(:func:`hf_odc.packing.split_costs`): each rank sends ``L (N - 1) / N**2`` tokens, each costed at ``EXCHANGE`` times
a token's per-token work (the cost model's step from one token to two). This benchmark measures that share on
``N`` ranks (every rank of the job in one group): for each row of one document of ``L`` tokens, per attention layer,
forward and backward,

* ``ulysses``: :func:`hf_odc.kernels.ulysses.sharded_causal_attention` on this rank's ``L / N`` tokens: the head
  exchange in, attention over the whole row for ``1/N`` of the heads, the exchange back;
* ``local``: the same attention without the exchanges (this rank's heads over the whole row, already in place);
* ``linear``: the layer's token-wise matmuls (q/k/v/o projections and the gated MLP) on this rank's tokens, which
  give the seconds per forward FLOP of a token's work.

The exchange is ``ulysses - local`` (the slowest rank's); over the model's layers against the cost model's per-token
FLOPs (:class:`hf_odc.packing.AttentionCost` of the shape) at the measured seconds per FLOP, it gives each length's
share; the fitted ``EXCHANGE`` is the least-squares share over all lengths (weighted by the tokens sent). Pass it to
the planner as ``exchange=`` (``lb_mini_groups``, ``split_costs``) where it differs from the default.

On 4 GPUs (one group of 4; the 1.5B and 7B shapes, bf16)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    for model in qwen2.5-1.5b qwen2.5-7b; do torchrun --standalone --nproc_per_node 4 benchmarks/ulysses_exchange.py \
        --model $model --lengths 8192,16384,32768,65536,131072 --json ulysses_exchange_$model.json; done

``--model tiny --lengths 64,128`` on 2 CPU processes (gloo, fp32) is the smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _common import MODELS, init_distributed

from hf_odc.kernels.attention import packed_causal_attention
from hf_odc.kernels.ulysses import SequenceShard, sharded_causal_attention
from hf_odc.packing import EXCHANGE, AttentionCost, evaluate_costs, shard_sizes


def _median_ms(fn, warmup: int, reps: int, device: torch.device) -> float:
    """The slowest rank's median milliseconds of ``fn`` (every rank runs it in step: it may exchange)."""
    for _ in range(warmup):
        fn()
    times = []
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    for _ in range(reps):
        dist.barrier()
        synchronize(device)
        began = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - began))
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _linear_layer(shape: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.ModuleList, int]:
    """A decoder layer's token-wise matmuls (Qwen2's: biased q/k/v, o, gate/up/down) and their forward FLOPs per
    token (2 per weight)."""
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    inter = shape["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    sizes = [(hidden, q, True), (hidden, kv, True), (hidden, kv, True), (q, hidden, False), (hidden, inter, False),
             (hidden, inter, False), (inter, hidden, False)]  # fmt: skip
    layers = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=b, device=device, dtype=dtype) for i, o, b in sizes)
    return layers, 2 * sum(i * o for i, o, _ in sizes)


def _run_linear(layers: torch.nn.ModuleList, x: torch.Tensor) -> None:
    q, k, v, o, gate, up, down = layers
    queries, keys, values = q(x), k(x), v(x)
    y = x + o(queries)
    out = y + down(torch.nn.functional.silu(gate(y)) * up(y))
    (out.sum() + keys.sum() + values.sum()).backward()


def measure(length: int, shape: dict, args, device: torch.device, dtype: torch.dtype) -> dict:
    """One row of ``length`` tokens split over every rank: the three timings (ms) and the exchange's share."""
    world, rank = dist.get_world_size(), dist.get_rank()
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", shape["hidden_size"] // heads)
    sizes = shard_sizes(length, world)
    shard = SequenceShard(group=dist.group.WORLD, sizes=sizes, lengths=(length,))
    generator = torch.Generator(device=device).manual_seed(rank)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype, generator=generator).requires_grad_()

    mine = sizes[rank]
    q, k, v = randn(mine, heads, head_dim), randn(mine, kv_heads, head_dim), randn(mine, kv_heads, head_dim)
    grad = torch.randn(mine, heads, head_dim, device=device, dtype=dtype, generator=generator)
    local_kv = kv_heads // world if kv_heads % world == 0 else heads // world  # repeated as the kernel repeats them
    lq = randn(length, heads // world, head_dim)
    lk, lv = randn(length, local_kv, head_dim), randn(length, local_kv, head_dim)
    local_grad = torch.randn(length, heads // world, head_dim, device=device, dtype=dtype, generator=generator)

    def ulysses() -> None:
        torch.autograd.grad(sharded_causal_attention(q, k, v, shard), (q, k, v), grad)

    def local() -> None:
        torch.autograd.grad(packed_causal_attention(lq, lk, lv, [length]), (lq, lk, lv), local_grad)

    layers, flops = _linear_layer(shape, device, dtype)
    x = randn(mine, shape["hidden_size"])
    ms = {
        "ulysses": _median_ms(ulysses, args.warmup, args.reps, device),
        "local": _median_ms(local, args.warmup, args.reps, device),
        "linear": _median_ms(lambda: _run_linear(layers, x), args.warmup, args.reps, device),
    }
    exchange = max(ms["ulysses"] - ms["local"], 0.0)
    seconds_per_flop = ms["linear"] / (mine * flops)  # ms per forward FLOP of a token's layer work, fwd + bwd
    one, two = evaluate_costs([1, 2], AttentionCost.from_config(shape))
    sent = length * (world - 1) / world**2
    token_ms = (two - one) * seconds_per_flop  # the cost model's per-token work, in ms
    return {"ms": ms, "exchange_ms": exchange, "model_exchange_ms": shape["num_hidden_layers"] * exchange,
            "sent": sent, "token_ms": token_ms,
            "share": shape["num_hidden_layers"] * exchange / (token_ms * sent)}  # fmt: skip


def fitted_share(rows: list[dict]) -> float:
    """The least-squares ``EXCHANGE`` through the origin: the model's exchange time against ``token_ms x sent``."""
    x = [row["token_ms"] * row["sent"] for row in rows]
    return sum(row["model_exchange_ms"] * xi for row, xi in zip(rows, x, strict=True)) / sum(xi * xi for xi in x)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[name for name, shape in MODELS.items() if "model_type" not in shape],
                        default="qwen2.5-1.5b")  # fmt: skip
    parser.add_argument("--lengths", default="8192,16384,32768,65536", help="comma list of row lengths (tokens)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = init_distributed(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(MODELS[args.model])
    world = dist.get_world_size()
    if shape["num_attention_heads"] % world:
        raise SystemExit(
            f"{args.model} has {shape['num_attention_heads']} query heads, which {world} ranks do not split."
        )
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        rows.append({"length": length, **measure(length, shape, args, device, dtype)})
        if dist.get_rank() == 0:
            row = rows[-1]
            print(f"L={length}: ulysses {row['ms']['ulysses']:.3f} ms, local {row['ms']['local']:.3f} ms, "
                  f"linear {row['ms']['linear']:.3f} ms per layer; share {row['share']:.3f}", flush=True)  # fmt: skip
    record = {"device": args.device_name, "world_size": world, "torch": torch.__version__, "args": vars(args),
              "rows": rows, "exchange": fitted_share(rows), "default_exchange": EXCHANGE}  # fmt: skip
    if dist.get_rank() == 0:
        print(f"{args.device_name} x{world}, {args.model}: fitted EXCHANGE = {record['exchange']:.3f} "
              f"(the default: {EXCHANGE})")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
    dist.destroy_process_group()
    return record


if __name__ == "__main__":
    main()
