"""Hybrid ODC against ODC on one host and against Collective HSDP: the SFT benchmark's step time, one launch.

The job's N GPUs are laid out two ways, each a model of its own built the same way as ``sft_throughput.py``'s (bf16
compute, fp32 masters and reductions, activation checkpointing, packed attention, TRL's fused LM head):

* ``1 host x N``: one shard group over every GPU (1-D mesh), ODC+LB-Mini;
* ``N/G hosts x G`` (``--gpus-per-host`` G, by default N/2: 2 hosts x 1 on 2 GPUs, 2 x 2 on 4): shard groups of G GPUs,
  replicated (HSDP's 2-D mesh, ``shard_size=G``, what a job over N/G hosts of G GPUs gets), run as hybrid ODC+LB-Mini
  (one all-reduce across replicas per minibatch) and as Collective HSDP+LB-Micro (FSDP2's collectives, reduce-scatter
  and all-reduce deferred to the last microbatch).

The schemes run the same global minibatches, interleaved minibatch by minibatch; timings are device-timed. The GPUs
sit on one NVLink switch here, so the "cross-host" all-reduce runs at NVLink speed: this measures hybrid ODC's
mechanics and overheads, not an InfiniBand fabric (``hf-odc plan --gpus-per-host`` models that)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 torchrun --standalone \\
        --nproc_per_node 2 \\
        benchmarks/hybrid_step.py --model qwen2.5-1.5b --distribution longalign --samples-per-device 8 --json h.json
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from _common import build, init_distributed, minibatches, run_step, timing_summary, workload_parser

import hf_odc
from hf_odc.engine import CollectiveMinibatch
from hf_odc.packing import DISTRIBUTIONS, MinibatchPlanner, named_cost
from hf_odc.trainer import PlannedMinibatchCollator


def schemes(world_size: int, gpus_per_host: int) -> dict[str, tuple[str, bool, str]]:
    """Each row's name, which names its layout, -> (layout, odc, balance); the first row is the one-host reference."""
    hosts = f"{world_size // gpus_per_host} hosts x {gpus_per_host}"
    return {
        f"ODC+LB-Mini (1 host x {world_size})": ("flat", True, "lb-mini"),
        f"Hybrid ODC+LB-Mini ({hosts})": ("hybrid", True, "lb-mini"),
        f"HSDP+LB-Micro ({hosts})": ("hybrid", False, "lb-micro"),
    }


def run(args, device: torch.device) -> dict[str, list[dict]]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gpus_per_host = args.gpus_per_host or max(1, world_size // 2)
    if world_size % gpus_per_host or world_size // gpus_per_host < 2:
        raise SystemExit(f"--gpus-per-host {gpus_per_host} must divide the {world_size} GPUs into at least 2 hosts.")
    rows = schemes(world_size, gpus_per_host)
    layouts = {"flat": build(args, device), "hybrid": build(args, device, shard_size=gpus_per_host)}
    runners = {name: (hf_odc.enable(model), CollectiveMinibatch(device)) for name, (model, _, _) in layouts.items()}
    cap = int(args.packing_ratio * DISTRIBUTIONS[args.distribution].max_length * args.length_scale)
    cost = named_cost("attention", layouts["flat"][2])
    collators = {
        name: PlannedMinibatchCollator(rank, MinibatchPlanner(balance, world_size, "minibatch" if odc else "layer",
                                                              cost), cap, 0)
        for name, (_, odc, balance) in rows.items()
    }  # fmt: skip
    records: dict[str, list[dict]] = {name: [] for name in rows}
    steps = args.warmup + args.steps
    vocab = layouts["flat"][2].vocab_size
    for step, (lengths, examples) in enumerate(minibatches(args, vocab, args.samples_per_device * world_size, steps)):
        for name, (layout, odc, _) in rows.items():
            model, optimizer, _ = layouts[layout]
            odc_runner, collective = runners[layout]
            runner = odc_runner if odc else collective
            batch = collators[name](examples)
            result = run_step(model, optimizer, runner, batch, world_size, odc, device)
            gathered: list = [None] * world_size
            mine = (result["busy"], result["wait"], runner.last.all_reduce, result["peak_gib"])
            dist.all_gather_object(gathered, mine)
            if step >= args.warmup:
                records[name].append({
                    "busy": [g[0] for g in gathered], "wait": [g[1] for g in gathered],
                    "all_reduce": [g[2] for g in gathered], "peak_gib": max(g[3] for g in gathered),
                    "tokens": sum(lengths), "predicted_bubble": batch.predicted_bubble_rate,
                    "microbatches": [len(r) for r in batch.microbatch_lengths],
                })  # fmt: skip
        if rank == 0:
            print(f"  minibatch {step + 1}/{steps} done", flush=True)
    for odc_runner, _ in runners.values():
        odc_runner.close()
    return records


def summarise(records: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for name, steps in records.items():
        step_s = [max(b + w for b, w in zip(s["busy"], s["wait"], strict=True)) for s in steps]
        busy = [sum(s["busy"][rank] for s in steps) for rank in range(len(steps[0]["busy"]))]
        summary[name] = {
            **timing_summary(step_s, busy, [s["tokens"] for s in steps], [s["predicted_bubble"] for s in steps]),
            "all_reduce_s_median": sorted(max(s["all_reduce"]) for s in steps)[len(steps) // 2],
            "peak_gib": max(s["peak_gib"] for s in steps),
        }
    reference = next(iter(summary.values()))["time_s"]  # the one-host row
    for row in summary.values():
        row["time_over_one_host"] = row["time_s"] / reference
    return summary


def main() -> None:
    parser = workload_parser(__doc__.splitlines()[0], 5, 1)
    parser.add_argument("--gpus-per-host", type=int, default=None, help="the hybrid layout's host size (default: N/2)")
    args = parser.parse_args()
    device = init_distributed(args)
    records = run(args, device)
    if dist.get_rank() == 0:
        summary = summarise(records)
        print(f"\n{args.model}, {args.distribution}, {args.samples_per_device}/device, {args.device_name}, "
              f"{args.steps} timed steps each")  # fmt: skip
        print(f"{'scheme':>34} | {'step s':>7} | {'tok/s':>8} | {'bubble':>6} | {'all-reduce s':>12} | "
              f"{'peak GiB':>8} | {'time / 1 host':>13}")  # fmt: skip
        for name, row in summary.items():
            print(f"{name:>34} | {row['step_s_median']:7.3f} | {row['tokens_per_second']:8.0f} | "
                  f"{row['bubble_measured']:6.1%} | {row['all_reduce_s_median']:12.4f} | {row['peak_gib']:8.1f} | "
                  f"{row['time_over_one_host']:13.3f}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "torch": torch.__version__, "summary": summary, "records": records}, f,
                          indent=1)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
