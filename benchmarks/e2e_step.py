"""Step time and peak memory of ODC vs plain FSDP2 on a balanced workload, side by side in one run.

A Qwen2-shaped model (random weights, built from a config) is trained with bf16 mixed precision; every rank runs the
same number of equal-length microbatches, so FSDP2 loses nothing to imbalance and ODC's own overhead shows::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc_per_node 2 benchmarks/e2e_step.py --json e2e.json

The defaults (Qwen2-1.5B shape, 4 x 8192 tokens per rank) keep the GPUs busy. Smaller steps are bound by the host
launching kernels (Qwen2-0.5B, 4 x 4096 tokens: the GPU computes about a third of the step on an H200), and then the
step time measures the host's CPU and its noise more than the communication.

The modes alternate (FSDP2, ODC, FSDP2, ODC, ...) over ``--rounds`` so that clock or thermal drift hits all of them.
``--odc-variants`` adds ODC rows with other caps on the GPU accumulate kernel's programs: ``p64`` is 64 programs,
``p0`` uncapped, the engine's default (``HF_ODC_SCATTER_PROGRAMS``). ``--profile-dir`` then profiles one more step of
each mode (torch.profiler, rank 0's Chrome trace, gzipped) to show where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import statistics
import time

import _common
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hf_odc

MODELS = {  # the shapes of Qwen2-0.5B and Qwen2-1.5B (tied embeddings)
    "qwen2-0.5b": _common.MODELS["qwen2.5-0.5b"],
    "qwen2-1.5b": _common.MODELS["qwen2.5-1.5b"],
}


def build(name: str, odc: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **{"tie_word_embeddings": True, **MODELS[name]}, max_position_embeddings=32768, attn_implementation="sdpa"
    )
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    handle = hf_odc.enable(model) if odc else None
    return model, opt, handle


def step(model, opt, handle, batches, sync: bool = False) -> None:
    """One optimizer step over ``batches``; ``sync`` adds ODC's two synchronisation points to plain FSDP2 (a device
    sync and a barrier before and after the microbatches), to tell their cost apart from the comms'."""
    if sync:
        _sync_all()
    with handle.minibatch() if handle is not None else contextlib.nullcontext():
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.div(len(batches)).backward()
    if sync:
        _sync_all()
    opt.step()
    opt.zero_grad()


def _sync_all() -> None:
    torch.cuda.synchronize()
    dist.barrier()


def _variant_env(variant: str) -> dict[str, str]:
    """``"p64"`` -> at most 64 programs in the accumulate kernel; ``"p0"`` -> uncapped."""
    return {"HF_ODC_SCATTER_PROGRAMS": variant[1:]}


def _mode_setup(mode: str) -> bool:
    """Set the environment a mode runs under; True if it uses ODC."""
    if mode.startswith("odc-"):
        os.environ.update(_variant_env(mode.split("-", 1)[1]))
        return True
    return False


def _warm(name: str, mode: str, batches, warmup: int):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, opt, handle = build(name, _mode_setup(mode))
    for _ in range(warmup):
        step(model, opt, handle, batches, sync=mode == "fsdp2-sync")
    torch.cuda.synchronize()
    dist.barrier()
    return model, opt, handle


def measure(name: str, mode: str, batches, warmup: int, steps: int) -> dict:
    model, opt, handle = _warm(name, mode, batches, warmup)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(model, opt, handle, batches, sync=mode == "fsdp2-sync")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    if handle is not None:
        handle.close()
    return {"step_s": statistics.median(times), "peak_gib": peak}


def profile(name: str, mode: str, batches, warmup: int, path: str) -> None:
    """One step of ``mode`` under torch.profiler after ``warmup`` steps; rank 0 writes a gzipped Chrome trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, opt, handle = _warm(name, mode, batches, warmup)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, opt, handle, batches, sync=mode == "fsdp2-sync")
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        raw = path.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        os.remove(raw)
    if handle is not None:
        handle.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-1.5b", choices=sorted(MODELS))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--odc-variants", default="p0", help="comma list, e.g. p0,p32 (see the docstring)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--fsdp-sync", action="store_true", help="add FSDP2 with ODC's sync points (fsdp2-sync)")
    parser.add_argument("--profile-dir", default=None, help="also profile one step per mode, traces written here")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
    g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    vocab = MODELS[args.model]["vocab_size"]
    batches = [torch.randint(0, vocab, (1, args.seq_len), device="cuda", generator=g) for _ in range(args.microbatches)]
    modes = ["fsdp2", *(["fsdp2-sync"] if args.fsdp_sync else []), *(f"odc-{v}" for v in args.odc_variants.split(","))]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            results[mode].append(measure(args.model, mode, batches, args.warmup, args.steps))
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        for mode in modes:
            profile(args.model, mode, batches, args.warmup, f"{args.profile_dir}/trace_{mode}.json.gz")
    summary = {
        mode: {
            "step_s": statistics.median(r["step_s"] for r in rows),
            "peak_gib": max(r["peak_gib"] for r in rows),
        }
        for mode, rows in results.items()
    }
    for key in ("step_s", "peak_gib"):  # the slowest rank's step, the largest rank's peak
        values = torch.tensor([summary[m][key] for m in modes], device="cuda")
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        for m, v in zip(modes, values.tolist(), strict=True):
            summary[m][key] = v
    if dist.get_rank() == 0:
        f = summary["fsdp2"]
        print(f"model {args.model}, {dist.get_world_size()} GPUs, {args.microbatches} x {args.seq_len} tokens per rank")
        print(f"{'mode':>10} | {'step s':>8} | {'peak GiB':>8} | {'time x':>6} | {'mem x':>6}")
        for m in modes:
            s = summary[m]
            print(
                f"{m:>10} | {s['step_s']:8.4f} | {s['peak_gib']:8.2f} | {s['step_s'] / f['step_s']:6.3f} | "
                f"{s['peak_gib'] / f['peak_gib']:6.3f}"
            )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(
                    {"args": vars(args), "device": torch.cuda.get_device_name(), "summary": summary, "rounds": results},
                    fh,
                    indent=2,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
