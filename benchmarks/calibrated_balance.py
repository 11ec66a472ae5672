"""LB-Mini with the calibrated cost model (and per-rank speeds) against the attention-cost default, in one launch.

The model and training step are ``sft_throughput.py``'s (Qwen2.5 shape, bf16, activation checkpointing, packed
attention, fused LM head). Three schemes train on the same global minibatches, interleaved minibatch by minibatch:
Collective+LB-Micro and ODC+LB-Mini with the attention cost (the trainers' default), and ODC+LB-Mini planned by a
``MinibatchPlanner`` whose ``Calibrator`` is fed every step's gathered microbatch times, exactly as the trainers do
with ``cost_model="calibrated"``::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 torchrun --standalone \\
        --nproc_per_node 2 \\
        benchmarks/calibrated_balance.py --model qwen2.5-1.5b --distribution longalign --json calibrated.json \\
        [--straggler]

``--straggler`` slows one GPU (``--slow-rank``) with a noisy neighbour: a thread of the same process keeps a side
stream busy with bf16 matmuls for the whole run, so that GPU's kernels share its SMs. The ideal is then the
minibatch's work at the ranks' combined measured speed: each rank's speed is the calibrated work it ran over its busy
time in the calibrated scheme. Printed per scheme: median step time, tokens/s, measured bubble, the gap between the
ranks' busy times (``1 - min / max`` per step, averaged) and, with ``--straggler``, the time of the ideal over each
scheme's.
"""

from __future__ import annotations

import json
import statistics
import threading

import torch
import torch.distributed as dist
from _common import build, init_distributed, minibatches, run_step, timing_summary, workload_parser

import hf_odc
from hf_odc.engine import CollectiveMinibatch
from hf_odc.packing import DISTRIBUTIONS, Calibrator, MinibatchPlanner, named_cost
from hf_odc.trainer import PlannedMinibatchCollator

# (name, sync, balance, cost model)
SCHEMES = (
    ("Collective+LB-Micro", "layer", "lb-micro", "attention"),
    ("ODC+LB-Mini", "minibatch", "lb-mini", "attention"),
    ("ODC+LB-Mini calibrated", "minibatch", "lb-mini", "calibrated"),
)
CALIBRATED = SCHEMES[-1][0]


class NoisyNeighbour:
    """Keeps ``device`` busy on a side stream (bf16 matmuls of ``size``) until :meth:`stop`: the GPU's kernels
    share its SMs with it, as with a co-tenant. On a CPU, the same matmuls in float32 compete for the cores."""

    def __init__(self, device: torch.device, size: int):
        self.device, self._stop = device, threading.Event()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self._a = torch.randn(size, size, device=device, dtype=dtype)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> NoisyNeighbour:
        self._thread.start()
        return self

    def _run(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        out = torch.empty_like(self._a)
        while not self._stop.is_set():
            if cuda:
                with torch.cuda.stream(stream):
                    for _ in range(4):
                        torch.mm(self._a, self._a, out=out)
                stream.synchronize()  # a bounded queue: a device-wide synchronize elsewhere waits for a few ms at most
            else:
                torch.mm(self._a, self._a, out=out)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(args, model, optimizer, device) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    minibatch_size = args.samples_per_device * world_size
    cap = int(args.packing_ratio * DISTRIBUTIONS[args.distribution].max_length * args.length_scale)
    attention = named_cost("attention", model.config)
    planners = {
        name: MinibatchPlanner(balance, world_size, sync, attention, Calibrator(world_size) if cost != "attention"
                               else None)
        for name, sync, balance, cost in SCHEMES
    }  # fmt: skip
    collators = {name: PlannedMinibatchCollator(rank, planner, cap, 0) for name, planner in planners.items()}
    odc, collective = hf_odc.enable(model), CollectiveMinibatch(device)
    slowed = args.straggler and rank == args.slow_rank
    neighbour = NoisyNeighbour(device, args.neighbour_size).start() if slowed else None
    steps = args.warmup + args.steps
    records: dict[str, list[dict]] = {name: [] for name, *_ in SCHEMES}
    for step, (lengths, examples) in enumerate(minibatches(args, model.config.vocab_size, minibatch_size, steps)):
        for name, sync, _, _ in SCHEMES:
            batch = collators[name](examples)
            result = run_step(model, optimizer, odc if sync == "minibatch" else collective, batch, world_size,
                              sync == "minibatch", device)  # fmt: skip
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, (result["busy"], result["wait"], result["microbatch_s"]))
            planners[name].record(batch.microbatch_lengths, [times for *_, times in gathered])
            calibration = planners[name].calibration
            if step >= args.warmup:
                records[name].append({
                    "busy": [b for b, _, _ in gathered], "wait": [w for _, w, _ in gathered],
                    "microbatch_s": [t for *_, t in gathered], "microbatch_lengths": batch.microbatch_lengths,
                    "tokens": sum(lengths), "predicted_bubble": batch.predicted_bubble_rate,
                    "calibration": calibration.to_dict() if calibration is not None else None,
                })  # fmt: skip
        if rank == 0:
            print(f"  minibatch {step + 1}/{steps} done", flush=True)
    if neighbour is not None:
        neighbour.stop()
    odc.close()
    return records


def summarise(records: dict[str, list[dict]], straggler: bool, calibration: dict | None) -> dict:
    summary = {}
    for name, steps in records.items():
        step_s = [max(b + w for b, w in zip(s["busy"], s["wait"], strict=True)) for s in steps]
        ranks = range(len(steps[0]["busy"]))
        busy = [sum(s["busy"][rank] for s in steps) for rank in ranks]
        summary[name] = {
            **timing_summary(step_s, busy, [s["tokens"] for s in steps], [s["predicted_bubble"] for s in steps]),
            "busy_gap": statistics.mean(1 - min(s["busy"]) / max(s["busy"]) for s in steps),
            "busy_per_rank_s": busy,
            "tokens_per_rank": [sum(sum(map(sum, s["microbatch_lengths"][r])) for s in steps) for r in ranks],
        }
    if straggler and calibration is not None:
        ideal = _ideal_time(records[CALIBRATED], calibration)
        for row in summary.values():
            row["ideal_over_time"] = ideal / row["time_s"]
        summary["ideal_time_s"] = ideal
    return summary


def _ideal_time(steps: list[dict], calibration: dict) -> float:
    """The timed minibatches' work (calibrated seconds at speed 1) at the ranks' combined measured speed, each rank's
    speed being the work it ran over its busy time."""
    cost = calibration["cost"]

    def work(microbatch: list[int]) -> float:
        return (cost["per_microbatch"] + sum(cost["per_sequence"] + cost["linear"] * n + cost["quadratic"] * n * n
                                             for n in microbatch))  # fmt: skip

    world_size = len(steps[0]["busy"])
    done = [sum(work(mb) for s in steps for mb in s["microbatch_lengths"][r]) for r in range(world_size)]
    busy = [sum(s["busy"][r] for s in steps) for r in range(world_size)]
    return sum(done) / sum(d / b for d, b in zip(done, busy, strict=True))


def print_table(summary: dict, args) -> None:
    setting = "one GPU slowed by a noisy neighbour" if args.straggler else "equal GPUs"
    print(f"\n{args.model}, {args.distribution}, {args.samples_per_device}/device, {args.device_name}, {setting}, "
          f"{args.steps} timed steps each")  # fmt: skip
    print(f"{'scheme':>24} | {'step s':>7} | {'tok/s':>8} | {'bubble':>6} | {'pred':>5} | {'busy gap':>8} | "
          f"{'tokens/rank':>18} | {'x LB-Mini':>9} | {'ideal/time':>10}")  # fmt: skip
    reference = summary["ODC+LB-Mini"]["time_s"]
    for name, *_ in SCHEMES:
        row = summary[name]
        print(f"{name:>24} | {row['step_s_median']:7.3f} | {row['tokens_per_second']:8.0f} | "
              f"{row['bubble_measured']:6.1%} | {row['bubble_predicted']:5.1%} | {row['busy_gap']:8.1%} | "
              f"{'/'.join(str(t) for t in row['tokens_per_rank']):>18} | {reference / row['time_s']:9.3f} | "
              f"{row.get('ideal_over_time', float('nan')):10.3f}")  # fmt: skip


def main() -> None:
    parser = workload_parser(__doc__.splitlines()[0], 8, 3, "untimed first steps (the calibration's first fits)")
    parser.add_argument("--straggler", action="store_true", help="slow one GPU with a noisy neighbour")
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--neighbour-size", type=int, default=8192, help="the neighbour's square matmul size")
    args = parser.parse_args()
    device = init_distributed(args)
    model, optimizer, _ = build(args, device)
    records = run(args, model, optimizer, device)
    if dist.get_rank() == 0:
        final = records[CALIBRATED][-1]["calibration"]
        summary = summarise(records, args.straggler, final)
        print_table(summary, args)
        if final is not None:
            speeds = ", ".join(f"{s:.3f}" for s in final["speeds"])
            fit = final["cost"]
            print(f"\ncalibration: {fit['per_microbatch'] * 1e3:.2f} ms/microbatch, "
                  f"{fit['per_sequence'] * 1e3:.3f} ms/sequence, {fit['linear'] * 1e6:.3f} us/token, "
                  f"{fit['quadratic'] * 1e9:.4f} ns/token^2; speeds {speeds}; median error {final['error']:.1%} "
                  f"over {final['samples']} microbatches")  # fmt: skip
        if args.straggler:
            print(f"ideal (combined measured speed): {summary['ideal_time_s']:.2f} s over the timed steps")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "torch": torch.__version__, "summary": summary, "records": records},
                          f, indent=1)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
