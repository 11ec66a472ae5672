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

Peak memory follows the largest microbatch: a step's peak is the activations its longest microbatch keeps for the
backward (they grow with its tokens) over what every step holds. A scheme that packs fuller microbatches (LB-Mini: one
microbatch of up to the token cap where LB-Micro gives every rank two half-full ones) so peaks higher over the same few
steps, although the cap bounds every scheme and a run whose documents reach it peaks there under any plan. So the
memory table beside the main one gives each scheme's largest microbatch, its peak reserved memory, and, over the
rank-steps where it ran the very same microbatches as Collective+LB-Micro (ODC+LB-Micro shares its plans), the
difference of the peaks: the engine's own cost, the plan's taken out. ``--memory-phases`` also marks the allocated
memory and the peak so far after every forward and backward (:class:`_common.MemoryPhases`) and prints them for each
scheme's highest rank-step. On 2 GPUs, swe-smith at 4 per GPU, the steps whose plans differ most::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 torchrun --standalone \
        --nproc_per_node 2 benchmarks/sft_throughput.py --model qwen2.5-1.5b --distribution swe-smith \
        --samples-per-device 4 --warmup 0 --steps 4 --schemes Collective+LB-Micro,ODC+LB-Micro,ODC+LB-Mini \
        --predict-world-sizes 8 --memory-phases --json sft_memory.json

A Mixture-of-Experts shape counts every microbatch's active (layer, expert) pairs at its routers (forwards only, as
the trainers count them), so that the calibrated scheme's cost has the expert term the trainers' has (``hf_odc.
packing.CalibratedCost``); the summary's fit has it too. Qwen3-30B-A3B's layer, 4 of its layers, on 4 GPUs::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --standalone --nproc_per_node 4 \
        benchmarks/sft_throughput.py --model qwen3-30b-a3b-8l --num-layers 4 --distribution longalign \
        --length-scale 0.25 --samples-per-device 8 --steps 6 --warmup 4 \
        --schemes "Collective+LB-Micro,ODC+LB-Mini,ODC+LB-Mini calibrated" --predict-world-sizes 8 --json sft_moe.json

``--sp-size N`` (sequence parallelism, Ulysses, groups of ``N`` consecutive ranks): the cap becomes a rank's share,
``packing ratio x longest / N``, so that a group holds the longest document. The LB-Mini schemes run each document
over the cap as a group microbatch of one group (:mod:`hf_odc.packing.sequence_parallel`, as ``ODCSFTTrainer`` does)
and the others on single ranks; the other schemes plan the groups as ranks with ``N`` caps and split every microbatch
over its group, as Accelerate's Ulysses under FSDP2 does (Collective+LB-Micro is then FSDP2 + LB-Micro with the same
sequence parallelism). Each scheme also reports its peak memory per rank. ``--longest-document`` instead searches the
longest document the shape trains at that ``--sp-size`` (one per group, every rank busy): lengths from
``--start-length`` times ``--growth`` up to ``--max-length``, stopping at the first step out of memory, with each
probe's step time and peak memory per rank (the JSON is rewritten after every probe). On 4 H100s, the longest
documents (a launch per shape and size: ``timeout`` ends one whose out-of-memory probe left a group's peers inside an
all-to-all), then a long-tailed distribution whose tail exceeds one GPU (longalign scaled to 128K: ``--length-scale
2``)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    for sp in 1 2 4; do timeout 140 torchrun --standalone --nproc_per_node 4 benchmarks/sft_throughput.py \
        --model qwen2.5-7b --sp-size $sp --longest-document --start-length 32768 --growth 2 --max-length 262144 \
        --json longest_7b_sp$sp.json; done
    torchrun --standalone --nproc_per_node 4 benchmarks/sft_throughput.py --model qwen2.5-7b --sp-size 4 \
        --distribution longalign --length-scale 2 --samples-per-device 2 --steps 2 --warmup 1 \
        --schemes Collective+LB-Micro,ODC+LB-Mini --predict-world-sizes 8,32 --json sft_7b_sp4.json
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _common import (
    SCHEME_SYNC,
    build,
    calibrate,
    expert_counter,
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
from hf_odc.kernels import new_sequence_group
from hf_odc.packing import (
    BASELINE,
    DISTRIBUTIONS,
    Calibration,
    GroupPlan,
    MinibatchPlanner,
    microbatch_features,
    named_cost,
    plan_costs,
    split_costs,
)
from hf_odc.packing.bubble import sync_time
from hf_odc.packing.distributions import get_distribution
from hf_odc.packing.flops import mfu, peak_flops, training_flops
from hf_odc.trainer import PlannedMinibatchCollator, PlannedStep
from hf_odc.trainer.core.data import shard_row

UNBALANCED, HEADLINE = "Collective+LocalSort", "ODC+LB-Mini"
NAMES = list(SCHEME_SYNC)


@dataclass
class _SplitRows:
    """Sequence parallelism as Accelerate's Ulysses runs it: every microbatch of a group's plan (``inner``'s, planned
    with the groups as ranks) split over the group's ranks, this rank holding shard ``index`` of each."""

    inner: PlannedMinibatchCollator
    group: Any
    index: int
    size: int

    def __call__(self, examples: list[dict]) -> PlannedStep:
        step = self.inner(examples)
        rows = [shard_row(row, self.group, self.index, self.size) for row in step.microbatches]
        return replace(step, microbatches=rows)


def _collator(planner: MinibatchPlanner, rank: int, cap: int, group: Any, sp_size: int):
    """This rank's collator for ``planner``: its own (group microbatches for documents over ``cap`` where the planner
    plans groups), or, for a planner of the ``world / sp_size`` groups, every microbatch split (:class:`_SplitRows`)."""
    if planner.group_size == sp_size:
        return PlannedMinibatchCollator(rank, planner, cap, 0, group)
    return _SplitRows(
        PlannedMinibatchCollator(rank // sp_size, planner, cap * sp_size, 0), group, rank % sp_size, sp_size
    )


def _plan_record(planner: MinibatchPlanner, lengths: list[int], cap: int, sp_size: int) -> dict:
    """The plan the step ran, for its predicted time (:func:`_rank_costs`)."""
    if planner.group_size > 1:
        grouped = planner.plan_groups(lengths, cap)
        return {"plan": grouped.plan, "groups": grouped.groups}
    return {"plan": planner.plan(lengths, cap * sp_size)}


def _rank_costs(step: dict, sp_size: int, cost) -> list[list[float]]:
    """``[rank][microbatch]`` -> predicted cost of a recorded step (:func:`_plan_record`): group microbatches first;
    with every microbatch split, each group's microbatches on each of its ranks."""
    if "groups" in step:
        return GroupPlan(step["plan"], sp_size, step["groups"]).rank_costs(step["lengths"], cost)
    if sp_size == 1:
        return plan_costs(step["plan"], step["lengths"], cost)
    split = split_costs(step["lengths"], sp_size, cost)
    return [[float(split[mb].sum()) for mb in group] for group in step["plan"] for _ in range(sp_size)]


def run_config(
    args,
    model,
    optimizer,
    odc,
    collective,
    device,
    samples_per_device: int,
    packing_ratio: float,
    group: Any = None,
    experts=None,
) -> dict:
    """Every scheme on the same minibatches (``group``: this rank's sequence-parallel group, with ``--sp-size``;
    ``experts``: a MoE model's expert counter, :func:`expert_counter`, which the calibrated scheme's cost learns
    from)."""
    rank, world_size, sp_size = dist.get_rank(), dist.get_world_size(), args.sp_size
    dist_info = DISTRIBUTIONS[args.distribution]
    minibatch_size = samples_per_device * world_size
    steps = args.warmup + args.steps
    cap = int(packing_ratio * dist_info.max_length * args.length_scale / sp_size)  # a group holds sp_size caps
    cost = named_cost("attention", model.config)
    slots = experts.slots if experts is not None else 0
    planners = scheme_planners([name for name in NAMES if name in args.schemes], world_size, cost, sp_size, slots)
    collators = {name: _collator(planner, rank, cap, group, sp_size) for name, planner in planners.items()}
    records: dict[str, list[dict]] = {name: [] for name in collators}
    names = list(collators)
    for step, (chunk, examples) in enumerate(minibatches(args, model.config.vocab_size, minibatch_size, steps)):
        for name in in_turn(names, step):
            collator = collators[name]
            uses_odc = SCHEME_SYNC[name] == "minibatch"
            batch = collator(examples)
            runner = odc if uses_odc else collective
            result = run_step(
                model, optimizer, runner, batch, world_size, uses_odc, device, experts, args.memory_phases
            )
            if planners[name].calibrator is not None:
                calibrate(planners[name], batch, result["microbatch_s"][result["shared"] :], result["active_experts"])
            if step >= args.warmup:
                result |= _plan_record(planners[name], chunk, cap, sp_size)
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
        "expert_slots": slots,
        "records": gathered,
    }


def _at_peak(steps: list) -> dict:
    """The rank-step (``steps[step][rank]``) of a scheme's highest peak: where it was, its microbatches' tokens and,
    with ``--memory-phases``, where its memory went (:class:`_common.MemoryPhases`)."""
    step, rank = max(
        ((s, r) for s, ranks in enumerate(steps) for r in range(len(ranks))),
        key=lambda sr: steps[sr[0]][sr[1]]["peak_gib"],
    )
    record = steps[step][rank]
    return {"step": step, "rank": rank, "microbatch_tokens": [sum(m) for m in record["microbatch_lengths"]],
            "phases": record.get("memory_phases")}  # fmt: skip


def same_microbatch_memory(per_rank: list, name: str, reference: str) -> dict | None:
    """Peak memory of ``name`` minus ``reference``'s (GiB) over the timed rank-steps where both ran the very same
    microbatches, in the same order (e.g. ODC+LB-Micro and Collective+LB-Micro, which share their plans): the engine's
    own cost, with the plan's taken out. ``None`` where no rank-step matched."""
    differences = [
        ours["peak_gib"] - theirs["peak_gib"]
        for rank_records in per_rank
        for ours, theirs in zip(rank_records[name], rank_records[reference], strict=True)
        if ours["microbatch_lengths"] == theirs["microbatch_lengths"]
    ]
    if not differences:
        return None
    return {"rank_steps": len(differences), "min_gib": min(differences), "max_gib": max(differences)}


def summarize(config: dict, args, world_size: int) -> dict:
    """Per scheme: measured and predicted numbers over the timed steps (every rank's records, gathered)."""
    per_rank = config["records"]  # [rank][scheme] -> steps
    names = list(per_rank[0])
    features, seconds = [], []  # every microbatch of every scheme, rank and step
    for rank_records in per_rank:
        for steps in rank_records.values():
            for step in steps:
                active = step["active_experts"] or [0] * len(step["microbatch_lengths"])
                features += map(microbatch_features, step["microbatch_lengths"], active)
                seconds += step["microbatch_s"][step["shared"] :]
    calibration = Calibration.fit(features, seconds, expert_slots=config["expert_slots"])
    calibrated = calibration.cost.amortised(config["max_tokens"])
    summary: dict[str, dict] = {}
    peak = peak_flops(args.device_name)
    for name in names:
        sync = SCHEME_SYNC[name]
        steps = list(zip(*(rank_records[name] for rank_records in per_rank), strict=True))  # [step][rank]
        step_s = [max(r["busy"] + r["wait"] for r in ranks) for ranks in steps]
        busy = [sum(ranks[rank]["busy"] for ranks in steps) for rank in range(world_size)]  # per rank, all steps
        first = [ranks[0] for ranks in steps]
        predicted = sum(sync_time(_rank_costs(s, args.sp_size, calibrated), sync) for s in first)
        flops = training_flops((length for s in first for length in s["lengths"]), args.model_config)
        summary[name] = {
            **timing_summary(step_s, busy, [s["tokens"] for s in first], [s["predicted_bubble"] for s in first]),
            "peak_gib": max(r["peak_gib"] for ranks in steps for r in ranks),
            "peak_gib_per_rank": [max(ranks[rank]["peak_gib"] for ranks in steps) for rank in range(world_size)],
            "peak_reserved_gib": max(r["peak_reserved_gib"] for ranks in steps for r in ranks),
            "largest_microbatch": max(
                (sum(m) for ranks in steps for r in ranks for m in r["microbatch_lengths"]), default=0
            ),
            "at_peak": _at_peak(steps),
            "mfu": mfu(flops, sum(step_s), world_size, peak) if peak is not None else None,
            "predicted_time": predicted,
            "microbatches": [[len(r["microbatch_s"]) for r in ranks] for ranks in steps],
        }
    if BASELINE in summary:
        for name in names:
            if name != BASELINE:
                summary[name]["same_microbatches_vs_baseline"] = same_microbatch_memory(per_rank, name, BASELINE)
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
        source,
        args.predict_world_sizes,
        config["samples_per_device"],
        config["max_tokens"],
        calibrated,
        seed=args.seed,
        sp_size=args.sp_size,
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
    sp = f", sp_size {args.sp_size}" if args.sp_size > 1 else ""
    print(f"\n{args.model}, {args.distribution}, {world_size} x {args.device_name}{sp}, {args.steps} timed steps each")
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
    print_memory(results)
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
        experts = f", {fit['per_expert']:.3g} s/active expert" if fit["expert_slots"] else ""
        print(f"{label:>9}: " + ", ".join(cells) + f"   [fit: {fit['per_microbatch']:.3g} s/microbatch, "
              f"{fit['linear']:.3g} s/token, {fit['quadratic']:.3g} s/token^2{experts}]")  # fmt: skip


def print_memory(results: list[dict]) -> None:
    """Per configuration and scheme: the peak allocated and reserved memory, the largest microbatch the scheme ran
    (the activations kept for the backward grow with its tokens), the difference to Collective+LB-Micro where both
    ran the same microbatches, and with ``--memory-phases`` where the memory of the peak rank-step went."""
    print(f"\nPeak memory (GiB; the difference to {BASELINE} over the rank-steps with the same microbatches):")
    for result in results:
        label = f"{result['samples_per_device']}/dev x{result['packing_ratio']:g}"
        for name, row in result["summary"]["schemes"].items():
            same = row.get("same_microbatches_vs_baseline")
            versus = (
                f", same microbatches as {BASELINE} in {same['rank_steps']} rank-steps: "
                f"{same['min_gib']:+.2f} to {same['max_gib']:+.2f}"
                if same
                else ""
            )
            at = row["at_peak"]
            print(f"{label:>9} | {name:>22}: allocated {row['peak_gib']:.2f}, reserved {row['peak_reserved_gib']:.2f}, "
                  f"largest microbatch {row['largest_microbatch']} tokens; peak at step {at['step']} rank {at['rank']} "
                  f"(microbatches {at['microbatch_tokens']}){versus}")  # fmt: skip
            for phase, allocated, peak in at["phases"] or []:
                print(f"{'':>12}{phase:>16}: allocated {allocated:6.2f}, peak so far {peak:6.2f}")


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


def longest_document(args, model, optimizer, odc, device, group: Any, report=None) -> dict:
    """Train one document per sequence-parallel group (each rank's, without) at growing lengths, from
    ``--start-length`` by ``--growth`` up to ``--max-length``, until a step runs out of memory: the longest that
    trained, each probe's step time and peak memory per rank, and the error that stopped the search. An out-of-memory
    step aborts ODC (the peers' meeting fails at once, naming that rank), so every rank stops there. ``report`` gets
    the result so far after every probe, so that a run cut short keeps what it found."""
    rank, world_size, sp_size = dist.get_rank(), dist.get_world_size(), args.sp_size
    cost = named_cost("attention", model.config)
    pool = torch.randint(4, model.config.vocab_size, (args.max_length,), generator=torch.Generator().manual_seed(0))
    probes, length, error = [], args.start_length, None

    def found() -> dict:
        return {"sp_size": sp_size, "longest": probes[-1]["length"] if probes else None, "error": error,
                "probes": probes}  # fmt: skip

    while length <= args.max_length:
        planner = MinibatchPlanner("lb-mini", world_size, "minibatch", cost, group_size=sp_size)
        examples = [{"input_ids": pool[:length].tolist()} for _ in range(world_size // sp_size)]
        cap = -(-length // sp_size)  # each document split over a group (sp_size > 1) or one rank's microbatch
        batch = PlannedMinibatchCollator(rank, planner, cap, 0, group)(examples)
        try:
            result = run_step(model, optimizer, odc, batch, world_size, True, device)
        except (torch.OutOfMemoryError, hf_odc.PeerFailureError) as e:
            error = f"{type(e).__name__} at {length} tokens: {str(e).splitlines()[0] if str(e) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            break
        peaks: list = [None] * world_size
        dist.all_gather_object(peaks, result["peak_gib"])
        probes.append({"length": length, "step_s": result["busy"] + result["wait"], "peak_gib_per_rank": peaks})
        if rank == 0:
            print(f"  {length} tokens: step {probes[-1]['step_s']:.2f} s, peak GiB per rank {peaks}", flush=True)
        if report is not None:
            report(found())
        length = int(length * args.growth)
    return found()


def main() -> None:
    parser = workload_parser(__doc__.splitlines()[0], steps=10, warmup=1, sweep=True)
    parser.add_argument("--schemes", default=",".join(NAMES), help=f"comma list of {NAMES}")
    parser.add_argument("--predict-world-sizes", default="8,32,128")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--sp-size", type=int, default=1, help="sequence parallelism: ranks per group (see above)")
    parser.add_argument("--longest-document", action="store_true", help="search the longest trainable document")
    parser.add_argument("--start-length", type=int, default=16384, help="--longest-document's first length")
    parser.add_argument("--growth", type=float, default=1.25, help="--longest-document's factor between lengths")
    parser.add_argument("--max-length", type=int, default=1 << 20, help="--longest-document's last length")
    parser.add_argument(
        "--memory-phases", action="store_true", help="mark the memory at every forward and backward (see above)"
    )
    args = parser.parse_args()
    args.schemes = args.schemes.split(",")
    if unknown := set(args.schemes) - set(NAMES):
        parser.error(f"unknown schemes {sorted(unknown)}: choose from {NAMES}")
    if args.growth <= 1 or args.start_length < 2:
        parser.error("--growth must exceed 1 and --start-length be at least 2 tokens")
    args.predict_world_sizes = [int(w) for w in args.predict_world_sizes.split(",")]
    device = init_distributed(args)
    world_size = dist.get_world_size()
    if args.sp_size < 1 or world_size % args.sp_size:
        parser.error(f"--sp-size {args.sp_size} must divide the {world_size} processes")
    group = new_sequence_group(args.sp_size) if args.sp_size > 1 else None
    model, optimizer, model_config = build(args, device)
    args.model_config = model_config.to_dict()
    odc, collective = hf_odc.enable(model), CollectiveMinibatch(device)
    experts = expert_counter(model)
    record = {"args": vars(args), "world_size": world_size, "torch": torch.__version__,
              "model_type": model_config.model_type}  # fmt: skip
    if args.longest_document:

        def report(found: dict) -> None:
            record["longest_document"] = found
            if dist.get_rank() == 0 and args.json:
                with open(args.json, "w") as f:
                    json.dump(record, f, indent=1)

        found = longest_document(args, model, optimizer, odc, device, group, report)
        report(found)
        with contextlib.suppress(Exception):  # a probe that ran out of memory left the handle aborted
            odc.close()
        if dist.get_rank() == 0:
            stop = found["error"] or f"--max-length {args.max_length}"
            print(f"\n{args.model}, {world_size} x {args.device_name}, sp_size {args.sp_size}: longest document "
                  f"trained {found['longest']} tokens; stopped by {stop}")  # fmt: skip
        dist.destroy_process_group()
        return
    results = []
    for samples in (int(s) for s in args.samples_per_device.split(",")):
        for ratio in (float(r) for r in args.packing_ratios.split(",")):
            config = run_config(args, model, optimizer, odc, collective, device, samples, ratio, group, experts)
            if dist.get_rank() == 0:
                config["summary"] = summarize(config, args, world_size)
            results.append(config)
    odc.close()
    if dist.get_rank() == 0:
        print_table(results, args, world_size)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**record, "results": results}, f, indent=1)
        if args.plot:
            plot(results, args.plot, world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
