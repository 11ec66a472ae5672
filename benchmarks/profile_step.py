"""Where an SFT step's device time goes, per scheme and rank: kernels by kind (GEMMs, attention, ODC's gradient
pushes, NCCL, the optimizer, the rest), ODC's one-sided reads (copies), the span in which any kernel ran, and the
same per microbatch, so that the same documents can be compared under two plans.

It answers two questions of issue #37 with measurements instead of guesses: what keeps MFU where it is (the share
of the step in GEMMs and attention against everything else, and the device's idle time), and why ODC+LB-Mini's
microbatches run slower than ODC+LB-Micro's (slower kernels, more of them, or gaps between them). The model, data
and schemes are ``sft_throughput.py``'s (one build, the schemes taking turns, the calibrated planner fed every
step's times); warm-up steps run unprofiled, then each scheme's next ``--steps`` steps are profiled
(``torch.profiler``, CUDA activity only)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 torchrun --standalone \\
        --nproc_per_node 2 benchmarks/profile_step.py --distribution longalign --samples-per-device 8 --json p.json

Per scheme and rank it prints the step, the device's busy time and each kind's seconds; then, for every microbatch
that two schemes both ran (the same documents), its device time and GEMM / attention seconds under each. GPU only.
"""

from __future__ import annotations

import contextlib
import json

import torch.distributed as dist
from _common import (
    CALIBRATED,
    SCHEME_SYNC,
    build,
    calibrate,
    device_time,
    in_turn,
    init_distributed,
    minibatches,
    run_step,
    scheme_planners,
    workload_parser,
)

import hf_odc
from hf_odc.engine import CollectiveMinibatch
from hf_odc.packing import named_cost
from hf_odc.packing.distributions import DISTRIBUTIONS
from hf_odc.trainer import PlannedMinibatchCollator

KINDS = ("gemm", "attention", "elementwise", "other", "odc push", "copy", "nccl", "optimizer")


def main() -> None:
    parser = workload_parser(__doc__.splitlines()[0], steps=1, warmup=3)
    parser.add_argument("--schemes", default="Collective+LB-Micro,ODC+LB-Micro," + CALIBRATED)
    args = parser.parse_args()
    args.schemes = args.schemes.split(",")
    if unknown := set(args.schemes) - set(SCHEME_SYNC):
        parser.error(f"unknown schemes {sorted(unknown)}: choose from {list(SCHEME_SYNC)}")
    device = init_distributed(args)
    if device.type != "cuda":
        raise SystemExit("profile_step.py profiles CUDA kernels: run it on GPUs.")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, config = build(args, device)
    odc, collective = hf_odc.enable(model), CollectiveMinibatch(device)
    planners = scheme_planners(args.schemes, world_size, named_cost("attention", config))
    cap = int(args.packing_ratio * DISTRIBUTIONS[args.distribution].max_length * args.length_scale)
    collators = {name: PlannedMinibatchCollator(rank, planner, cap, 0) for name, planner in planners.items()}
    names, records = list(collators), {name: [] for name in collators}
    steps = args.warmup + args.steps
    for step, (_, examples) in enumerate(
        minibatches(args, config.vocab_size, args.samples_per_device * world_size, steps)
    ):
        for name in in_turn(names, step):
            odc_sync = SCHEME_SYNC[name] == "minibatch"
            batch = collators[name](examples)
            profiled: dict = {}
            with device_time(profiled, spans="microbatch") if step >= args.warmup else contextlib.nullcontext():
                result = run_step(
                    model, optimizer, odc if odc_sync else collective, batch, world_size, odc_sync, device
                )
            if planners[name].calibrator is not None:
                calibrate(planners[name], batch, result["microbatch_s"])
            if step >= args.warmup:
                records[name].append({**result, "device": profiled})
        if rank == 0:
            print(f"  minibatch {step + 1}/{steps} done", flush=True)
    odc.close()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, records)
    if rank == 0:
        report(gathered, args)
    dist.destroy_process_group()


def report(per_rank: list[dict], args) -> None:
    print(f"\n{args.model}, {args.distribution}, {len(per_rank)} GPUs, {args.samples_per_device}/GPU, "
          f"{args.steps} profiled step(s) per scheme; seconds summed over them")  # fmt: skip
    head = f"{'scheme':>22} | rank | {'step':>6} | {'busy':>6} | {'kernels':>7} | " + " | ".join(
        f"{k:>9}" for k in KINDS
    )
    print(head)
    for name in per_rank[0]:
        for rank, records in enumerate(per_rank):
            steps = records[name]
            step_s = sum(r["busy"] + r["wait"] for r in steps)
            dev = [r["device"] for r in steps]
            cells = [sum(d.get(k, 0.0) for d in dev) for k in KINDS]
            print(f"{name:>22} | {rank:>4} | {step_s:6.3f} | {sum(d['kernels busy'] for d in dev):6.3f} | "
                  f"{sum(d['kernels'] for d in dev):7d} | " + " | ".join(f"{c:9.3f}" for c in cells))  # fmt: skip
    print(
        "\nPer rank and scheme: host waits for the device, the longest gaps with no kernel running (s, kernel "
        "before -> after), the kernels taking the most time"
    )
    for name in per_rank[0]:
        for rank, records in enumerate(per_rank):
            for r in records[name]:
                dev = r["device"]
                print(f"  {name} r{rank}: host waits {dev['host waits']:.3f} s")
                for seconds, before, after in dev["gaps"][:5]:
                    print(f"      gap {seconds:.4f}: {before} -> {after}")
                for kernel, seconds, _ in dev["top kernels"][:8]:
                    print(f"      {seconds:7.3f} {kernel}")
                spans = [(round(s["span"], 3), round(s["span"] - s["kernels busy"], 3)) for s in dev["spans"]]
                print(f"      microbatches (span s, idle s): {spans}; documents: "
                      f"{[len(lengths) for lengths in r['microbatch_lengths']]}")  # fmt: skip
    # The same documents under two schemes: microbatches keyed by their sorted lengths.
    seen: dict[tuple, dict[str, list]] = {}
    for name in per_rank[0]:
        for rank, records in enumerate(per_rank):
            for r in records[name]:
                for lengths, seconds, span in zip(r["microbatch_lengths"], r["microbatch_s"], r["device"]["spans"],
                                                  strict=False):  # fmt: skip
                    cell = (rank, seconds, span.get("gemm", 0.0), span.get("attention", 0.0), span["span"])
                    seen.setdefault(tuple(sorted(lengths)), {}).setdefault(name, []).append(cell)
    shared = {k: v for k, v in seen.items() if len(v) > 1}
    print(f"\nMicrobatches run by more than one scheme ({len(shared)}): (rank, device s, gemm s, attention s, span s)")
    for lengths, by_scheme in sorted(shared.items(), key=lambda kv: -sum(kv[0]))[:12]:
        print(f"  {sum(lengths):>6} tokens, {len(lengths)} docs:")
        for name, cells in by_scheme.items():
            print(
                f"    {name:>22}: " + "; ".join(f"r{c[0]} {c[1]:.3f} {c[2]:.3f} {c[3]:.3f} {c[4]:.3f}" for c in cells)
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "per_rank": per_rank}, f)


if __name__ == "__main__":
    main()
