"""ODC's one-sided gather / scatter-accumulate against NCCL's all-gather / reduce-scatter on the same bytes.

Run on one host with one process per GPU::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc_per_node 2 benchmarks/comm.py --json comm.json

``size`` is the bytes of the full (gathered / pre-reduction) tensor. Gather moves bf16 (what ODC gathers under bf16
mixed precision), reduce moves fp32 (FSDP's ``reduce_dtype``). Bus bandwidth = size * (W - 1) / W / time, NCCL's
convention, for both. Every ODC result is checked against the exact answer before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from hf_odc.kernels import make_transport
from hf_odc.liveness.host_barrier import HostBarrier

MB = 1 << 20
SAMPLE_BYTES = 64 * MB  # each timed sample moves at least this much (several calls back to back at small sizes)


def _time_ms(fn, iters: int, reps: int = 1, warmup: int = 5) -> float:
    """Median over ``iters`` samples of the time per call (CUDA events) after ``warmup`` untimed calls.

    Each sample runs ``reps`` calls back to back, as a training step issues them: at small sizes one call alone
    measures the host's launch latency rather than the transfer. Ranks start each sample together.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    return times[len(times) // 2]


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_size(transport, host: HostBarrier, size: int, iters: int) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()

    def meet() -> None:  # every rank's writes so far are visible to all after it
        transport.fence()
        host.meet()

    reps = max(1, SAMPLE_BYTES // size)
    # --- gather (bf16) ---
    shard = size // 2 // ws  # bf16 elements per rank
    mirror = transport.allocate(shard, torch.bfloat16)
    mirror.local.copy_(torch.arange(shard, device="cuda").remainder(251).to(torch.bfloat16) + rank)
    meet()
    out = torch.empty(ws * shard, dtype=torch.bfloat16, device="cuda")
    out_nccl = torch.empty_like(out)
    out.fill_(-1)
    transport.gather(mirror, 0, shard, out)
    torch.cuda.synchronize()
    expected = torch.cat([torch.arange(shard, device="cuda").remainder(251).to(torch.bfloat16) + r for r in range(ws)])
    assert torch.equal(out, expected), "gather returned wrong data"
    own = out.view(ws, shard)[rank]  # FSDP has already copied the local shard into the output: a peer-only gather
    t_gather = _time_ms(lambda: transport.gather(mirror, 0, shard, out, include_self=False), iters, reps)
    own_nccl = out_nccl.view(ws, shard)[rank]  # in place, as FSDP calls it
    own_nccl.copy_(own)
    t_ag = _time_ms(lambda: dist.all_gather_into_tensor(out_nccl, own_nccl), iters, reps)
    # --- scatter-accumulate (fp32) ---
    numel = size // 4 // ws  # fp32 elements per rank
    acc = transport.allocate(numel, torch.float32)
    src = torch.full((ws, numel), float(rank + 1), device="cuda")
    meet()
    transport.scatter_accumulate(acc, 0, numel, src)
    meet()
    expected_sum = float(ws * (ws + 1) // 2)
    assert torch.equal(acc.local, torch.full_like(acc.local, expected_sum)), (
        f"accumulate lost updates: expected {expected_sum} everywhere, found {acc.local.unique()[:8].tolist()}"
    )
    meet()  # every rank has checked its sums before any rank pushes again (the timing's warm-up)
    rs_out = torch.empty(numel, device="cuda")
    t_scatter = _time_ms(lambda: transport.scatter_accumulate(acc, 0, numel, src), iters, reps)
    t_rs = _time_ms(lambda: dist.reduce_scatter_tensor(rs_out, src.view(-1)), iters, reps)
    bus = size * (ws - 1) / ws / 1e9  # GB moved over the bus per call
    row = {
        "size_mb": size / MB,
        "calls_per_sample": reps,
        "gather_ms": _max_over_ranks(t_gather),
        "all_gather_ms": _max_over_ranks(t_ag),
        "scatter_accumulate_ms": _max_over_ranks(t_scatter),
        "reduce_scatter_ms": _max_over_ranks(t_rs),
    }
    row["gather_busbw"] = bus / (row["gather_ms"] / 1e3)
    row["all_gather_busbw"] = bus / (row["all_gather_ms"] / 1e3)
    row["scatter_busbw"] = bus / (row["scatter_accumulate_ms"] / 1e3)
    row["reduce_scatter_busbw"] = bus / (row["reduce_scatter_ms"] / 1e3)
    row["gather_speedup"] = row["all_gather_ms"] / row["gather_ms"]
    row["scatter_speedup"] = row["reduce_scatter_ms"] / row["scatter_accumulate_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="4,16,64,256,512")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    parser.add_argument("--label", default="", help="a name for this configuration in the table and the JSON")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    transport = make_transport(torch.device("cuda", local_rank))
    host = HostBarrier.create(None, timeout=600.0)
    rows = [bench_size(transport, host, int(mb) * MB, args.iters) for mb in args.sizes_mb.split(",")]
    if dist.get_rank() == 0:
        knobs = {k: v for k, v in os.environ.items() if k.startswith("HF_ODC_SCATTER_")}
        print(f"configuration {args.label or 'default'} {knobs}")
        print(
            f"{'size MB':>8} | {'gather GB/s':>11} {'NCCL AG GB/s':>12} {'x':>5} | {'scatter GB/s':>12} "
            f"{'NCCL RS GB/s':>12} {'x':>5}"
        )
        for r in rows:
            print(
                f"{r['size_mb']:8.0f} | {r['gather_busbw']:11.1f} {r['all_gather_busbw']:12.1f} "
                f"{r['gather_speedup']:5.2f} | {r['scatter_busbw']:12.1f} {r['reduce_scatter_busbw']:12.1f} "
                f"{r['scatter_speedup']:5.2f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "label": args.label,
                        "env": knobs,
                        "device": torch.cuda.get_device_name(),
                        "world_size": dist.get_world_size(),
                        "rows": rows,
                    },
                    f,
                    indent=2,
                )
    transport.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
