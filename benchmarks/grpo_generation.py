"""GRPO rollout generation on a sharded policy: each of ``hf_odc.trainer.generation.modes``'s modes, per rank, with a
table and JSON.

Every rank decodes its own prompts greedily with transformers' ``generate`` on the FSDP2-sharded policy (ODC installed),
in each mode: ``lockstep`` (TRL's path: an all-gather per layer group per token, ranks in lockstep), ``static`` (a kept
copy refreshed one-sidedly, static KV cache, compiled forward on a GPU), ``tensor-parallel`` (each rank's slice of a
kept copy, the shard group's ranks decoding their prompts together), ``gathered`` (full weights assembled once,
one-sided, dynamic cache) and ``sharded`` (one-sided reads per forward, no copy). ``static`` and ``tensor-parallel`` run
twice on the same prompts: the first batch pays the compile and the CUDA graphs' recording (reported as ``compile_s``,
with the refresh's time), the second is the one timed, as every later generation batch of a run. ``--static-attention
sdpa`` decodes the copy with transformers' SDPA instead of hf_odc's grouped decoding attention, and ``grouped-sdpa``
with that attention's SDPA path instead of its kernel (``hf_odc.kernels.decode_attention``), for comparison; ``static``
decodes with hf_odc's decoding loop (CUDA graphs on a GPU), every completion to the longest length, or with
``--static-decoding generate`` with transformers' ``generate`` and its compiled forward, the lengths forced as in the
other modes; so does ``tensor-parallel`` (its copy's forward not compiled), every completion to the group's longest.
With ``--static-ends eos``, ``static``'s loop ends each completion at its length instead, by an EOS the copy's LM head
gives from inside the recorded step (:class:`EndInGraph`), as a trained policy's completions end: the loop then decodes
as many steps, but an ended row's attention reads one slot. The copies fuse each layer's q/k/v and gate/up projections
(``--unfused-decoding`` keeps them apart, for an A/B); the JSON records which (``fused``) and each rank's
tensor-parallel slice (``local``: its heads, key/value heads, MLP rows and LM head rows). ``--static-compile`` chooses
how ``static``'s loop compiles the copy's forward: ``layers`` (one compiled body for every decoder layer, a shorter
compile: the trainers' default) or ``whole`` (one graph of every layer); ``whole,layers`` runs ``static`` once with
each, as rows ``static[whole]`` and ``static[layers]``, each compiled anew. Completion lengths are long-tailed and
differ between ranks: a logits processor ends each completion at a length drawn from ``--distribution``, scaled to
``--max-new-tokens``. Reported per rank: decode seconds (after a synchronize), decoding steps (forwards), ms per step,
generated tokens per second, the completions ended (by an EOS) at their length; then one policy update on the generated
sequences (packed rows, forward and backward inside one ODC minibatch), and generation's share of generation + update.
``lockstep`` is timed on at most ``--lockstep-tokens`` steps (it is slow); its full-length time is the measured ms per
step times the longest completion, marked as an estimate.

    torchrun --nproc_per_node 2 benchmarks/grpo_generation.py --json out/grpo_generation.json
    torchrun --nproc_per_node 4 benchmarks/grpo_generation.py --modes tensor-parallel,static,lockstep \
        --model-config qwen2.5-7b --max-new-tokens 128 --json out/grpo_generation_7b.json
    torchrun --nproc_per_node 2 benchmarks/grpo_generation.py --model-config tiny --prompts 4 --max-new-tokens 32 \
        --prompt-length 16 --row-tokens 256          # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from _common import MODELS, EndAt, compile_phases, device_time
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList

from hf_odc.accelerate_plugin import ODCPlugin, ODCRuntime
from hf_odc.demo.models import MODEL_CONFIGS
from hf_odc.kernels import decode_attention
from hf_odc.packing import sample_lengths
from hf_odc.trainer import PACKED_ATTENTION
from hf_odc.trainer.generation.decoders import StaticDecoder, TensorParallelDecoder, shard_group
from hf_odc.trainer.generation.modes import GENERATION_MODES, decoding

EOS = 2

SHAPES = MODEL_CONFIGS | {"qwen2.5-7b": {"model_type": "qwen2", **MODELS["qwen2.5-7b"]}}
"""The models ``--model-config`` names: hf_odc.demo's, and Qwen2.5-7B's shape (28 heads on 4 key/value heads)."""


def build(args: argparse.Namespace, accelerator: Accelerator) -> tuple[torch.nn.Module, ODCRuntime]:
    raw = {"vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True}
    raw |= SHAPES[args.model_config] | {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": EOS}
    if args.num_layers:
        raw["num_hidden_layers"] = args.num_layers
    config = AutoConfig.for_model(**raw)
    config._attn_implementation = PACKED_ATTENTION  # private: transformers.PretrainedConfig._attn_implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_enable()
    runtime = ODCRuntime(ODCPlugin(), accelerator)
    model = runtime.shard(model.to(accelerator.device))
    if accelerator.num_processes == 1 and accelerator.device.type == "cuda":
        model = model.to(torch.bfloat16)  # unsharded: compute in bf16 as FSDP2's policy does when sharded
    runtime.enable(model)
    return model, runtime


class EndInGraph:
    """A forward hook on the decoding copy's LM head that ends completion ``i`` after exactly ``lengths[i]`` tokens (EOS
    last, never before), as :class:`_common.EndAt` does, but inside the step hf_odc's loop records (which leaves a
    caller's logits processor to ``generate``): the forwards are counted in a device tensor the step advances."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.last = torch.tensor(lengths, device=device) - 1
        self.forwards = torch.zeros((), dtype=torch.long, device=device)

    def __call__(self, module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        done = self.last == self.forwards  # the prefill's forward chooses token 0
        self.forwards.add_(1)
        limits = torch.finfo(logits.dtype)
        logits[:, -1, EOS] = torch.where(done, limits.max, limits.min)
        return logits


def meet(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def generate(
    model,
    runtime,
    mode: str,
    prompts: torch.Tensor,
    lengths: list[int],
    decoder: StaticDecoder | TensorParallelDecoder | None = None,
    forced: bool = True,
    group_lengths: list[int] | None = None,
    ends: EndInGraph | None = None,
) -> tuple[float, int, torch.Tensor]:
    """Decode ``prompts`` in ``mode`` (``"static"``, ``"tensor-parallel"``: on ``decoder``'s copy), each completion
    ended at its length by :class:`EndAt` (``forced``), or every one decoded to the longest length (hf_odc's static
    decoding loop leaves a call with a logits processor of the caller's to transformers' ``generate``; its fixed batch
    steps at the same cost whether rows ended or not); returns (seconds, decoding steps, prompt + completion ids).
    ``group_lengths``: every completion's length in the batch ``generate`` decodes (tensor-parallel: the shard
    group's, rank by rank), where not ``lengths``. ``ends``: the copy's LM head ends the completions instead."""
    out = []
    target = decoder.model if mode in ("static", "tensor-parallel") else model
    end_at = EndAt(group_lengths or lengths, prompts.shape[1], EOS)
    ending = {"logits_processor": LogitsProcessorList([end_at]), "eos_token_id": EOS}
    if ends is not None:
        ends.forwards.zero_()
        ending, forced = {"eos_token_id": EOS}, True

    def run() -> None:
        with decoding(model, runtime, mode), torch.no_grad():
            out.append(
                target.generate(
                    input_ids=prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=max(group_lengths or lengths),
                    do_sample=False,
                    pad_token_id=0,
                    **(ending if forced else {"eos_token_id": None}),
                )
            )

    model.gradient_checkpointing_disable()  # as TRL does for generation: checkpointing would turn the KV cache off
    seconds = timed(prompts.device, run)
    model.gradient_checkpointing_enable()
    # The forwards after the prefill: one per token decoded after the prefill's. (Not counted by a forward hook: the
    # compiled forward would guard on the hook's counter and recompile every step until dynamo's limit.)
    return seconds, out[0].shape[1] - prompts.shape[1] - 1, out[0]


def update(model, runtime, sequences: list[torch.Tensor], row_tokens: int) -> float:
    """One forward and backward of ``sequences`` packed into rows of at most ``row_tokens``, in one ODC minibatch."""
    rows, row = [], []
    for sequence in sorted(sequences, key=len, reverse=True):
        if row and sum(map(len, row)) + len(sequence) > row_tokens:
            rows.append(row)
            row = []
        row.append(sequence)
    rows.append(row)
    device = sequences[0].device

    def run() -> None:
        with runtime.minibatch():
            for parts in rows:
                ids = torch.cat(parts)[None]
                positions = torch.cat([torch.arange(len(p), device=device) for p in parts])[None]
                with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                    loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
                loss.backward()

    seconds = timed(device, run)
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="qwen2.5-1.5b", choices=list(SHAPES))
    parser.add_argument("--num-layers", type=int, default=None, help="the model's layers (default: its shape's)")
    parser.add_argument("--prompts", type=int, default=64, help="completions per rank")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--lockstep-tokens", type=int, default=128, help="at most this many lockstep steps are timed")
    parser.add_argument("--distribution", default="swe-smith")
    parser.add_argument("--row-tokens", type=int, default=16384)
    parser.add_argument("--modes", default=",".join(GENERATION_MODES))
    parser.add_argument("--static-attention", choices=["grouped", "grouped-sdpa", "sdpa"], default="grouped")
    parser.add_argument(
        "--static-decoding",
        choices=["loop", "generate"],
        default="loop",
        help="static: hf_odc's decoding loop (every completion decoded to the longest length), or transformers' "
        "generate (the lengths forced by a logits processor, which the loop leaves to generate)",
    )
    parser.add_argument(
        "--unfused-decoding",
        action="store_true",
        help="the decoding copies (static, tensor-parallel) keep each layer's q/k/v and gate/up projections apart "
        "instead of fusing them (their default), for an A/B",
    )
    parser.add_argument(
        "--static-compile",
        default="layers",
        help="static's loop compiles the copy's forward by 'layers' (one body for every layer, the default) or "
        "'whole'; 'whole,layers' runs static with each",
    )
    parser.add_argument(
        "--static-ends",
        choices=["longest", "eos"],
        default="longest",
        help="static's loop decodes every completion to the longest length, or ends each at its own by an EOS from the "
        "copy's LM head (as a trained policy's end)",
    )
    parser.add_argument("--profile", action="store_true", help="also profile each mode's device time (GPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    decode_attention.KERNEL = args.static_attention != "grouped-sdpa"
    strategies = args.static_compile.split(",")
    if not strategies or not set(strategies) <= {"whole", "layers"}:
        parser.error(f"--static-compile takes 'whole', 'layers' or both, comma-separated; got {args.static_compile!r}")

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), mixed_precision="bf16" if torch.cuda.is_available() else "no"
    )
    rank, world_size, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    model, runtime = build(args, accelerator)
    draws = sample_lengths(args.distribution, args.prompts * world_size, seed=1)
    scale = args.max_new_tokens / max(draws)
    # Rank-major and sorted, so the ranks' longest completions differ (as when one rank draws the long tail).
    all_lengths = sorted(max(1, round(n * scale)) for n in draws)
    lengths = all_lengths[rank * args.prompts : (rank + 1) * args.prompts]
    g = torch.Generator().manual_seed(rank)
    prompts = torch.randint(3, 1000, (args.prompts, args.prompt_length), generator=g).to(device)
    generate(model, runtime, "gathered", prompts[:2, :8], [4, 4])  # warm-up: kernels, the first unshard
    rows, sequences, decoder = {}, None, None
    runs = [(m, s) for m in args.modes.split(",") for s in (strategies if m == "static" else [None])]
    for mode, strategy in runs:
        name = f"{mode}[{strategy}]" if strategy is not None and len(strategies) > 1 else mode
        meet(world_size)  # each mode's times start together: a rank's wait for a slower one is not counted
        capped = [min(n, args.lockstep_tokens) for n in lengths] if mode == "lockstep" else lengths
        # The loop (static, tensor-parallel) leaves a call with the caller's logits processor to generate: its rows
        # are decoded to the longest length, at the cost of a fixed batch.
        first, forced = {}, mode not in ("static", "tensor-parallel") or args.static_decoding == "generate"
        group_lengths, ends = None, None
        if mode in ("static", "tensor-parallel"):  # the copy made and refreshed (the first batch compiles, records)
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            if decoder is not None:
                decoder.close()
            copy = {"loop": args.static_decoding == "loop", "fuse": not args.unfused_decoding}
            if mode == "static":
                decoder = StaticDecoder(model, runtime, dtype, **copy)
                decoder.compile_layers = strategy == "layers"
                torch.compiler.reset()  # each strategy's first batch compiles anew
            else:
                decoder = TensorParallelDecoder(model, runtime, dtype, **copy)
                group = shard_group(model)
                ranks = dist.get_process_group_ranks(group) if group is not None else [rank]
                group_lengths = [n for r in ranks for n in all_lengths[r * args.prompts : (r + 1) * args.prompts]]
            first["first_refresh_s"] = timed(device, decoder.refresh)
            first["fused"] = decoder.fuse
            local = decoder.model.config  # tensor-parallel: this rank's part of the heads and MLP rows
            first["local"] = {"heads": local.num_attention_heads, "kv_heads": local.num_key_value_heads,
                              "mlp_rows": local.intermediate_size,
                              "head_rows": decoder.model.get_output_embeddings().out_features}  # fmt: skip
            if mode == "static" and args.static_attention == "sdpa":
                decoder.model.set_attn_implementation("sdpa")
            if mode == "static" and args.static_decoding == "loop" and args.static_ends == "eos":
                ends = EndInGraph(lengths, device)
                decoder.model.get_output_embeddings().register_forward_hook(ends)
            batch = generate(model, runtime, mode, prompts, capped, decoder, forced, group_lengths, ends)
            first["first_batch_s"] = batch[0]
            first["compile_phases_s"] = compile_phases()
            meet(world_size)  # (a rank whose first batch ended first would count its wait in the refresh)
            first["refresh_s"] = timed(device, decoder.refresh)
        seconds, steps, out = generate(model, runtime, mode, prompts, capped, decoder, forced, group_lengths, ends)
        if args.profile and device.type == "cuda":  # once more, profiled: is decoding kernel- or launch-bound?
            profiled: dict = {}
            with device_time(profiled, top=48):  # (every kernel of a step, by name)
                run = generate(model, runtime, mode, prompts, capped, decoder, forced, group_lengths, ends)
                first["profiled_s"] = run[0]
            first["device"] = profiled
        tokens = sum(capped)
        completions = out[:, args.prompt_length :]
        ended = [
            bool(row[: n - 1].ne(EOS).all() and row[n - 1] == EOS) for row, n in zip(completions, capped, strict=True)
        ]
        rows[name] = {"decode_s": seconds, "steps": steps, "ms_per_step": 1e3 * seconds / max(steps, 1),
                      "tokens": tokens, "tokens_per_s": tokens / seconds, "longest": max(lengths),
                      "ended_at_length": sum(ended), **first}  # fmt: skip
        if "first_batch_s" in first:
            rows[name]["compile_s"] = first["first_batch_s"] - seconds
        if mode == "lockstep":  # the full-length time, at the measured rate (every rank steps to the global longest)
            rows[name]["decode_s_estimated"] = rows[name]["ms_per_step"] * max(all_lengths) / 1e3
        if mode != "lockstep" and sequences is None:
            sequences = [o[: args.prompt_length + n] for o, n in zip(out, lengths, strict=True)]
    if sequences is not None:
        meet(world_size)
        rows["update"] = {"update_s": update(model, runtime, sequences, args.row_tokens)}
    if decoder is not None:
        decoder.close()  # before the process groups go: its CUDA graphs may hold tensor-parallel's communicator
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rows) if world_size > 1 else gathered.__setitem__(0, rows)
    runtime.close()
    if rank == 0:
        report(gathered, args)
    accelerator.end_training()


def report(per_rank: list[dict], args: argparse.Namespace) -> None:
    update_s = max(r["update"]["update_s"] for r in per_rank) if "update" in per_rank[0] else None
    print(
        f"\n{len(per_rank)} rank(s), {args.model_config}, {args.prompts} completions/rank, up to "
        f"{args.max_new_tokens} new tokens; static decodes with {args.static_attention} attention by "
        f"{args.static_decoding} (compiled {args.static_compile}), the copies' projections "
        f"{'unfused' if args.unfused_decoding else 'fused'}; "
        "policy update "
        f"{update_s and round(update_s, 2)} s"
    )
    print("| mode | rank | decode s | steps | ms/step | tokens/s | generation's share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    summary = {}
    for mode in [m for m in per_rank[0] if m != "update"]:
        # a generation batch's time: decoding, and with a decoding copy its refresh before it
        slowest = max(
            r[mode].get("decode_s_estimated", r[mode]["decode_s"]) + r[mode].get("refresh_s", 0.0) for r in per_rank
        )
        share = slowest / (slowest + update_s) if update_s else float("nan")
        summary[mode] = {"generation_s": slowest, "share_of_step": share}
        for rank, r in enumerate(per_rank):
            row = r[mode]
            estimate = f" (est. {row['decode_s_estimated']:.1f} full)" if "decode_s_estimated" in row else ""
            if "compile_s" in row:
                estimate += f" (first batch +{row['compile_s']:.1f} compile; refresh {row['refresh_s']:.2f})"
            if mode == "tensor-parallel":  # this rank's slice
                local = row["local"]
                estimate += (f" (heads {local['heads']}, key/value {local['kv_heads']}, MLP rows {local['mlp_rows']}, "
                             f"head rows {local['head_rows']})")  # fmt: skip
            print(f"| {mode} | {rank} | {row['decode_s']:.2f}{estimate} | {row['steps']} | {row['ms_per_step']:.1f} | "
                  f"{row['tokens_per_s']:.0f} | {share:.0%} |")  # fmt: skip
            if "device" in row:  # the profiled run: kernels' busy time against the run's, per decoding step
                dev, steps = row["device"], max(row["steps"], 1)
                kinds = ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in dev.items() if isinstance(v, float))
                print(f"|   profiled | {rank} | {row['profiled_s']:.2f} | {dev['kernels'] / steps:.0f} kernels/step "
                      f"| ms/step: {kinds} | | |")  # fmt: skip
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "per_rank": per_rank, "summary": summary, "update_s": update_s}, f, indent=1)


if __name__ == "__main__":
    main()
