"""The headline: SFT throughput of Collective+LocalSort, Collective+LB-Micro, ODC+LB-Micro and ODC+LB-Mini (planned
with the attention cost, and with the trainers' default, the calibrated cost), one launch.

One process per GPU builds the model once (random weights from a Qwen2.5 shape, or a Qwen3-MoE one whose 3-D expert
weights are sharded like the rest, trained without the router's load-balancing loss; bf16 compute with fp32 master
weights and reductions, activation checkpointing keeping the attention (``--recompute-attention``: recomputing it),
hf_odc's packed attention and fused RMSNorm/MLP kernels (``--unfused``: transformers' forwards), TRL's fused LM head:
what ``ODCSFTTrainer`` runs) and trains it on the same global minibatches under every scheme, interleaved minibatch by
minibatch so that drift hits them alike, the schemes taking turns at going first. Plain FSDP2 is the ODC model
outside ``odc.minibatch()``, between the same two meeting points (:class:`hf_odc.engine.CollectiveMinibatch`), with
its reduce-scatter deferred to the last microbatch as the trainer does. Timings are device-timed
(:mod:`hf_odc.engine.timing`)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 torchrun --standalone \\
        --nproc_per_node 2 \\
        benchmarks/sft_throughput.py --model qwen2.5-1.5b --distribution longalign --samples-per-device 8 \\
        --json sft.json --plot sft.png

Per configuration (samples per device x packing ratio) and scheme it prints the median step time, tokens/s over the
timed steps, the measured bubble ``1 - sum(busy) / (W * step)`` and the plan's predicted one, the peak memory, MFU
(:mod:`hf_odc.packing.flops`: the documents' training FLOPs over the summed step times, the GPUs and their peak), the
microbatches all ranks ran, and the time ratios to Collective+LB-Micro and Collective+LocalSort. "ODC+LB-Mini
calibrated" plans as the trainers do by default (``cost_model="calibrated"``): a ``MinibatchPlanner`` whose
``Calibrator`` is fed every step's gathered microbatch times (give it ``--warmup 3``: its first fit follows the third
step). It then fits a ``Calibration`` to the measured
microbatch times and prints the speedups that model predicts for the same minibatches beside the measured ones, and
for 8, 32 and 128 GPUs (``hf_odc.cli.plan.simulate``). ``--plot`` draws tokens/s per configuration and
the first timed step's per-rank device timeline of Collective+LB-Micro against ODC+LB-Mini.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist
from _common import (
    SCHEME_SYNC,
    build,
    calibrate,
    in_turn,
    init_distributed,
    minibatches,
    run_step,
    scaled_lengths,
    scheme_planners,
    timing_summary,
    workload_parser,
)

import hf_odc
from hf_odc.cli.plan import LengthPool, simulate
from hf_odc.engine import CollectiveMinibatch
from hf_odc.packing import (
    BASELINE,
    DISTRIBUTIONS,
    Calibration,
    microbatch_features,
    named_cost,
    plan_costs,
)
from hf_odc.packing.bubble import sync_time
from hf_odc.packing.distributions import get_distribution
from hf_odc.packing.flops import mfu, peak_flops, training_flops
from hf_odc.trainer import PlannedMinibatchCollator

UNBALANCED, HEADLINE = "Collective+LocalSort", "ODC+LB-Mini"
NAMES = list(SCHEME_SYNC)


def run_config(args, model, optimizer, odc, collective, device, samples_per_device: int, packing_ratio: float) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist_info = DISTRIBUTIONS[args.distribution]
    minibatch_size = samples_per_device * world_size
    steps = args.warmup + args.steps
    cap = int(packing_ratio * dist_info.max_length * args.length_scale)
    cost = named_cost("attention", model.config)
    planners = scheme_planners([name for name in NAMES if name in args.schemes], world_size, cost)
    collators = {name: PlannedMinibatchCollator(rank, planner, cap, 0) for name, planner in planners.items()}
    records: dict[str, list[dict]] = {name: [] for name in collators}
    names = list(collators)
    for step, (chunk, examples) in enumerate(minibatches(args, model.config.vocab_size, minibatch_size, steps)):
        for name in in_turn(names, step):
            collator = collators[name]
            uses_odc = SCHEME_SYNC[name] == "minibatch"
            batch = collator(examples)
            result = run_step(model, optimizer, odc if uses_odc else collective, batch, world_size, uses_odc, device)
            if planners[name].calibrator is not None:
                calibrate(planners[name], batch, result["microbatch_s"])
            if step >= args.warmup:
                result["plan"] = collator.plan(chunk)
                result["lengths"] = chunk
                result["predicted_bubble"] = batch.predicted_bubble_rate
                result["tokens"] = sum(chunk)
                records[name].append(result)
        if rank == 0:
            print(f"  [{samples_per_device}/dev x{packing_ratio:g}] minibatch {step + 1}/{steps} done", flush=True)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, records)
    return {
        "samples_per_device": samples_per_device,
        "packing_ratio": packing_ratio,
        "max_tokens": cap,
        "records": gathered,
    }


def summarize(config: dict, args, world_size: int) -> dict:
    """Per scheme: measured and predicted numbers over the timed steps (every rank's records, gathered)."""
    per_rank = config["records"]  # [rank][scheme] -> steps
    names = list(per_rank[0])
    features, seconds = [], []  # every microbatch of every scheme, rank and step
    for rank_records in per_rank:
        for steps in rank_records.values():
            for step in steps:
                features += map(microbatch_features, step["microbatch_lengths"])
                seconds += step["microbatch_s"]
    calibration = Calibration.fit(features, seconds)
    calibrated = calibration.cost.amortised(config["max_tokens"])
    summary: dict[str, dict] = {}
    peak = peak_flops(args.device_name)
    for name in names:
        sync = SCHEME_SYNC[name]
        steps = list(zip(*(rank_records[name] for rank_records in per_rank), strict=True))  # [step][rank]
        step_s = [max(r["busy"] + r["wait"] for r in ranks) for ranks in steps]
        busy = [sum(ranks[rank]["busy"] for ranks in steps) for rank in range(world_size)]  # per rank, all steps
        first = [ranks[0] for ranks in steps]
        predicted = sum(sync_time(plan_costs(s["plan"], s["lengths"], calibrated), sync) for s in first)
        flops = training_flops((length for s in first for length in s["lengths"]), args.model_config)
        summary[name] = {
            **timing_summary(step_s, busy, [s["tokens"] for s in first], [s["predicted_bubble"] for s in first]),
            "peak_gib": max(r["peak_gib"] for ranks in steps for r in ranks),
            "mfu": mfu(flops, sum(step_s), world_size, peak) if peak is not None else None,
            "predicted_time": predicted,
            "microbatches": [[len(r["microbatch_s"]) for r in ranks] for ranks in steps],
        }
    for row in summary.values():
        for ref in (BASELINE, UNBALANCED):
            if ref in summary:
                row[f"speedup_vs_{ref}"] = summary[ref]["time_s"] / row["time_s"]
                row[f"predicted_speedup_vs_{ref}"] = summary[ref]["predicted_time"] / row["predicted_time"]
    source = get_distribution(args.distribution)
    if args.length_scale != 1:
        source = LengthPool(
            f"{args.distribution}x{args.length_scale:g}", tuple(scaled_lengths(args, 4096, seed=[args.seed, 99]))
        )
    simulation = simulate(
        source, args.predict_world_sizes, config["samples_per_device"], config["max_tokens"], calibrated, seed=args.seed
    )
    predictions = {
        f"{r.world_size}:{r.scheme}": r.speedup for r in simulation.results
    }  # speedup over Collective+LB-Micro
    return {
        "calibration": calibration.to_dict(),
        "schemes": summary,
        "predicted_speedups_vs_lb_micro": predictions,
    }


def print_table(results: list[dict], args, world_size: int) -> None:
    print(f"\n{args.model}, {args.distribution}, {world_size} x {args.device_name}, {args.steps} timed steps each")
    head = (
        f"{'config':>9} | {'scheme':>20} | {'step s':>7} | {'tok/s':>8} | {'bubble':>6} | {'pred':>5} | {'GiB':>5} | "
    )
    head += f"{'MFU':>5} | {'mbs':>4} | {'x LB-Micro':>10} | {'x LocalSort':>11} | {'pred x LBMicro':>14}"
    print(head)
    for result in results:
        label = f"{result['samples_per_device']}/dev x{result['packing_ratio']:g}"
        for name, row in result["summary"]["schemes"].items():
            print(
                f"{label:>9} | {name:>20} | {row['step_s_median']:7.3f} | {row['tokens_per_second']:8.0f} | "
                f"{row['bubble_measured']:6.1%} | {row['bubble_predicted']:5.1%} | {row['peak_gib']:5.1f} | "
                f"{row['mfu'] if row['mfu'] is not None else float('nan'):5.1%} | "
                f"{sum(map(sum, row['microbatches'])):4d} | "
                f"{row.get(f'speedup_vs_{BASELINE}', float('nan')):10.3f} | "
                f"{row.get(f'speedup_vs_{UNBALANCED}', float('nan')):11.3f} | "
                f"{row.get(f'predicted_speedup_vs_{BASELINE}', float('nan')):14.3f}"
            )
    print("\nCalibrated model's predicted speedup of ODC+LB-Mini over Collective+LB-Micro (and over LocalSort):")
    for result in results:
        predictions = result["summary"]["predicted_speedups_vs_lb_micro"]
        cells = []
        for w in args.predict_world_sizes:
            mini, local = predictions.get(f"{w}:{HEADLINE}"), predictions.get(f"{w}:{UNBALANCED}")
            cells.append(f"{w} GPUs {mini:.3f}x ({mini / local:.3f}x)")
        label = f"{result['samples_per_device']}/dev x{result['packing_ratio']:g}"
        calibration = result["summary"]["calibration"]
        fit = calibration["cost"]
        print(f"{label:>9}: " + ", ".join(cells) + f"   [fit: {fit['per_microbatch']:.3g} s/microbatch, "
              f"{fit['linear']:.3g} s/token, {fit['quadratic']:.3g} s/token^2]")  # fmt: skip


def plot(results: list[dict], path: str, world_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, timeline) = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{r['samples_per_device']}/dev x{r['packing_ratio']:g}" for r in results]
    names = list(results[0]["summary"]["schemes"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [r["summary"]["schemes"][name]["tokens_per_second"] for r in results]
        bars.bar(np.arange(len(results)) + i * width, values, width, label=name)
    bars.set_xticks(np.arange(len(results)) + 0.4 - width / 2, labels)
    bars.set_ylabel("tokens / s")
    bars.legend(fontsize=8)
    bars.set_title("Throughput per configuration")
    first = results[-1]
    y = 0
    for name, color in ((BASELINE, "tab:orange"), (HEADLINE, "tab:green")):
        if name not in first["records"][0]:
            continue
        for rank in range(world_size):
            step = first["records"][rank][name][0]
            starts = np.cumsum([0.0, *step["microbatch_s"][:-1]])
            timeline.broken_barh(
                list(zip(starts, step["microbatch_s"], strict=True)),
                (y, 0.8), facecolors=color, edgecolors="black", linewidth=0.5,
            )  # fmt: skip
            timeline.broken_barh([(step["busy"], step["wait"])], (y, 0.8), facecolors="lightgrey")
            timeline.text(0, y + 0.4, f"{name} r{rank}", va="center", fontsize=7)
            y += 1
        y += 0.5
    timeline.set_xlabel("seconds (device time; grey: waiting for peers)")
    timeline.set_yticks([])
    timeline.set_title(f"First timed step, {labels[-1]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = workload_parser(__doc__.splitlines()[0], steps=10, warmup=1, sweep=True)
    parser.add_argument("--schemes", default=",".join(NAMES), help=f"comma list of {NAMES}")
    parser.add_argument("--predict-world-sizes", default="8,32,128")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    args.schemes = args.schemes.split(",")
    if unknown := set(args.schemes) - set(NAMES):
        parser.error(f"unknown schemes {sorted(unknown)}: choose from {NAMES}")
    args.predict_world_sizes = [int(w) for w in args.predict_world_sizes.split(",")]
    device = init_distributed(args)
    world_size = dist.get_world_size()
    model, optimizer, model_config = build(args, device)
    args.model_config = model_config.to_dict()
    odc, collective = hf_odc.enable(model), CollectiveMinibatch(device)
    results = []
    for samples in (int(s) for s in args.samples_per_device.split(",")):
        for ratio in (float(r) for r in args.packing_ratios.split(",")):
            config = run_config(args, model, optimizer, odc, collective, device, samples, ratio)
            if dist.get_rank() == 0:
                config["summary"] = summarize(config, args, world_size)
            results.append(config)
    odc.close()
    if dist.get_rank() == 0:
        print_table(results, args, world_size)
        if args.json:
            with open(args.json, "w") as f:
                record = {"args": vars(args), "world_size": world_size, "torch": torch.__version__,
                          "model_type": model_config.model_type}  # fmt: skip
                json.dump({**record, "results": results}, f, indent=1)
        if args.plot:
            plot(results, args.plot, world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
