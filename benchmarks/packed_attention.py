"""Packed attention on one GPU: per attention layer, over a whole model's packed row, and for the reference pass.

Three modes, CUDA-event medians (wall-clock medians on CPU, for the smoke test):

* ``--mode layer``: one attention layer of a model shape (default: Qwen2.5-1.5B's 12 query heads, 2 key/value heads,
  128 dims, bf16), forward + backward of a packed row against its documents run unpacked:

  - ``unpacked``: the documents one by one through transformers' ``sdpa`` (each its own causal batch of one),
    summed: what an unpacked LocalSort microbatch costs;
  - ``odc-sdpa`` / ``odc-varlen`` / ``odc-auto``: hf_odc's packed attention on the whole row with each backend
    (``varlen`` where this torch's ``varlen_attn`` runs);
  - ``dense-mask``: transformers' ``sdpa`` with the row's block-diagonal ``T x T`` mask (``--dense``).

  Target: ``odc-auto`` at most 1.1x ``unpacked``.
* ``--mode model``: a Qwen2.5-1.5B-shaped model (random weights from a ``Qwen2Config``, bf16, activation
  checkpointing, TRL's fused LM head as the trainers use it), forward + backward of one packed row per split, with
  ``odc_packed`` pinned to each backend (``sdpa`` is what ``odc_packed`` did before ``auto``). Targets: ``auto``
  within 1.1x of the faster backend and never slower than ``sdpa``; the 64x256 row at most 1.1x the 16x1024 row.
* ``--mode forward``: the same model's forward alone on the same rows: the policy's (training mode, gradients,
  activation checkpointing), a reference pass as ``ODCGRPOTrainer`` runs it (no gradients, ``odc_packed``) and the
  reference pass before (``sdpa`` with its dense mask). Target: the reference pass no dearer than the policy's.

Rows (``--rows``): ``NxL`` (N documents of L tokens), ``A+B+...`` (such parts in order), ``grpo`` (300-token
prompts with long-tailed completions, the ``swe-smith`` shape rescaled to at most 3072 tokens) and ``longtail-rR``
(documents of that shape rescaled to at most ``tokens / R``, the longest sample a row holds at packing ratio R), each
filling one row of ``--tokens``::

    python benchmarks/packed_attention.py --mode model --json packed_attention_model.json
    python benchmarks/packed_attention.py --mode forward --json packed_attention_forward.json
    python benchmarks/packed_attention.py --mode layer --dense --json packed_attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_odc.kernels.attention as kernels
from hf_odc.kernels.attention import attention_pieces, packed_causal_attention, varlen_available
from hf_odc.packing import sample_lengths
from hf_odc.trainer.core.attention import PACKED_ATTENTION, register_packed_attention

LAYER_ROWS = "40960+16384+8192,4x16384,8x8192,32x2048"
MODEL_ROWS = "1x16384,4x4096,8x2048,16x1024,32x512,64x256,128x128,grpo,longtail-r1,longtail-r2"
TARGET = 1.1
PROMPT, GRPO_COMPLETION = 300, 3072


# -- rows ------------------------------------------------------------------------------------------------------------


def row_lengths(name: str, tokens: int, seed: int = 0) -> list[int]:
    """The documents' lengths of the row ``name`` (see the module docstring)."""
    if "+" in name:
        return [n for part in name.split("+") for n in row_lengths(part, tokens, seed)]
    if name.isdigit():
        return [int(name)]
    if "x" in name:
        count, length = (int(n) for n in name.split("x"))
        return [length] * count
    if name == "grpo":
        draw = lambda n: [PROMPT + c for c in _longtail(n, GRPO_COMPLETION, seed)]  # noqa: E731
    elif name.startswith("longtail-r"):
        draw = lambda n: _longtail(n, int(tokens / float(name.removeprefix("longtail-r"))), seed)  # noqa: E731
    else:
        raise ValueError(f"Unknown row {name!r}: use NxL, A+B+..., grpo or longtail-rR.")
    lengths, candidates = [], iter(draw(tokens // 8 + 1))  # documents have at least 8 tokens
    while sum(lengths) < tokens:
        lengths.append(min(next(candidates), tokens - sum(lengths)))
    return lengths


def _longtail(n: int, longest: int, seed: int) -> list[int]:
    """``swe-smith``-shaped lengths rescaled so that the longest possible one is ``longest``."""
    return [max(8, round(length * longest / 131072)) for length in sample_lengths("swe-smith", n, seed)]


def _describe(lengths: list[int]) -> str:
    """What ``auto`` launches for the row, e.g. ``3 sdpa + 2 varlen (40 docs)``."""
    pieces = attention_pieces(lengths, "auto")
    varlen = [p for p in pieces if p.varlen]
    alone = len(pieces) - len(varlen)
    parts = [f"{alone} sdpa"] * bool(alone) + [
        f"{len(varlen)} varlen ({sum(len(p.lengths) for p in varlen)} docs)"
    ] * bool(varlen)
    return " + ".join(parts)


# -- timing ----------------------------------------------------------------------------------------------------------


def _time(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn``: CUDA events around each call on a GPU, the wall clock otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


# -- one attention layer ---------------------------------------------------------------------------------------------


class _Module(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def measure_layer(lengths: list[int], args) -> dict[str, float]:
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(lengths)
    # Laid out as transformers' projections make them: (1, T, H, D) storage, viewed as (1, H, T, D).
    q, k, v = [
        torch.randn(1, tokens, h, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        .transpose(1, 2)
        .requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    module = _Module(heads, kv_heads)
    thd = [t.detach().transpose(1, 2)[0].requires_grad_() for t in (q, k, v)]  # (T, H, D) views, as hf_odc gets
    docs = [[t.detach()[:, :, s : s + n].requires_grad_() for t in (q, k, v)] for s, n in _starts(lengths)]

    def unpacked():
        for doc, (s, n) in zip(docs, _starts(lengths), strict=True):
            out, _ = sdpa_attention_forward(module, *doc, None)
            torch.autograd.grad(out, doc, grad[s : s + n][None])

    results = {"unpacked": _time(unpacked, args.warmup, args.reps)}
    for backend in _backends(args, varlen_available(thd[0], thd[1])):

        def packed(backend=backend):
            out = packed_causal_attention(*thd, lengths, backend=backend)
            torch.autograd.grad(out, thd, grad)  # gradients returned, not accumulated into .grad

        results[f"odc-{backend}"] = _time(packed, args.warmup, args.reps)
    if args.dense:
        ids = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(lengths)])
        causal = torch.ones(tokens, tokens, device="cuda", dtype=torch.bool).tril()
        mask = (causal & (ids[:, None] == ids[None, :]))[None, None]
        del causal

        def dense():
            out, _ = sdpa_attention_forward(module, q, k, v, mask)
            torch.autograd.grad(out, (q, k, v), grad[None])

        results["dense-mask"] = _time(dense, 1, max(2, args.reps // 4))
        del mask
    return results


def _backends(args, varlen: bool) -> list[str]:
    return [b for b in args.backends.split(",") if varlen or b != "varlen"]


def _starts(lengths: list[int]):
    start = 0
    for n in lengths:
        yield start, n
        start += n


# -- a whole model ---------------------------------------------------------------------------------------------------


def build_model(args):
    """A Qwen2.5-1.5B-shaped causal LM with random weights (``--tiny``: a 2-layer one), TRL's fused LM head added."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    if args.tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)  # fmt: skip
    else:
        shape = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936)  # fmt: skip
    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    add_fused_lm_head(model, outputs=("log_probs",))
    for backend in ("sdpa", "varlen"):
        register_packed_attention(f"{PACKED_ATTENTION}_{backend}", backend)
    return model


def _inputs(lengths: list[int], vocab: int, device) -> dict:
    """One packed row as hf_odc's packing makes it (position_ids restarting per document, cu_seq_lens, labels)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    cu_seq_lens = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    row = {
        "input_ids": ids,
        "labels": ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in row.items()}


def _implementation(backend: str) -> str:
    return PACKED_ATTENTION if backend == "auto" else f"{PACKED_ATTENTION}_{backend}"


def measure_model(model, lengths: list[int], args) -> dict[str, float]:
    """Forward + backward of one row with ``odc_packed`` pinned to each backend (``auto`` per ``--alone-from``)."""
    row = _inputs(lengths, model.config.vocab_size, model.device)
    model.train()

    def step():
        model(**row, use_cache=False, fused_lm_head=True).log_probs.float().sum().backward()

    results = {}
    for backend in _backends(args, model.device.type == "cuda"):
        model.set_attn_implementation(_implementation(backend))
        thresholds = args.alone_from if backend == "auto" else [kernels.ALONE_FROM]
        for threshold in thresholds:
            with _alone_from(threshold):
                name = backend if backend != "auto" or len(thresholds) == 1 else f"auto@{threshold}"
                results[name] = _time(step, args.warmup, args.reps)
        model.zero_grad(set_to_none=True)
    return results


def measure_forward(model, lengths: list[int], args) -> dict[str, float]:
    """The policy's forward (training) against the reference pass's (no gradients), after and before."""
    row = _inputs(lengths, model.config.vocab_size, model.device)

    def forward():
        return model(**row, use_cache=False, fused_lm_head=True).log_probs

    results = {}
    model.set_attn_implementation(PACKED_ATTENTION)
    model.train()
    results["policy"] = _time(forward, args.warmup, args.reps)
    model.eval()
    with torch.no_grad():
        results["reference"] = _time(forward, args.warmup, args.reps)
        model.set_attn_implementation("sdpa")
        results["reference-dense"] = _time(forward, 1, max(2, args.reps // 2))
    return results


@contextlib.contextmanager
def _alone_from(threshold: int):
    saved, kernels.ALONE_FROM = kernels.ALONE_FROM, threshold
    try:
        yield
    finally:
        kernels.ALONE_FROM = saved


# -- the command -----------------------------------------------------------------------------------------------------


def _table(mode: str, rows: dict) -> None:
    columns = list(next(iter(rows.values()))["ms"])
    print(f"{'row':>18} | {'docs':>4} | " + " | ".join(f"{c:>15}" for c in columns) + " | auto launches | target")
    for name, entry in rows.items():
        ms = entry["ms"]
        cells = [f"{ms[c]:9.2f}" for c in columns]
        print(f"{name:>18} | {len(entry['lengths']):>4} | " + " | ".join(f"{c:>15}" for c in cells)
              + f" | {entry['auto']} | {_verdict(mode, ms)}")  # fmt: skip


def _verdict(mode: str, ms: dict[str, float]) -> str:
    if mode == "layer":
        if "odc-auto" not in ms:
            return "-"
        return "met" if ms["odc-auto"] <= TARGET * ms["unpacked"] else "MISSED"
    if mode == "forward":
        return "met" if ms["reference"] <= ms["policy"] else "MISSED"
    auto = [v for k, v in ms.items() if k.startswith("auto")]
    if "varlen" not in ms or len(auto) != 1:
        return "-"
    ok = auto[0] <= TARGET * min(ms["sdpa"], ms["varlen"]) and auto[0] <= TARGET * ms["sdpa"]
    return f"{auto[0] / min(ms['sdpa'], ms['varlen']):.2f}x best, {auto[0] / ms['sdpa']:.2f}x sdpa: " + (
        "met" if ok else "MISSED"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["layer", "model", "forward"], default="model")
    parser.add_argument("--rows", default=None, help=f"comma list; default {LAYER_ROWS} (layer), {MODEL_ROWS}")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of a grpo / longtail-rR row")
    parser.add_argument("--heads", type=int, default=12, help="layer mode")
    parser.add_argument("--kv-heads", type=int, default=2, help="layer mode")
    parser.add_argument("--head-dim", type=int, default=128, help="layer mode")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (the CPU smoke test)")
    parser.add_argument("--alone-from", type=lambda s: [int(n) for n in s.split(",")], default=[kernels.ALONE_FROM],
                        help="auto's thresholds to compare (model mode); default the library's")  # fmt: skip
    parser.add_argument("--backends", default="sdpa,varlen,auto", help="odc_packed's backends to time")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dense", action="store_true", help="layer mode: also the dense block-diagonal mask")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = (args.rows or (LAYER_ROWS if args.mode == "layer" else MODEL_ROWS)).split(",")
    model = build_model(args) if args.mode != "layer" else None
    measure = {"layer": measure_layer, "model": measure_model, "forward": measure_forward}[args.mode]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record = {"device": device, "torch": torch.__version__, "args": vars(args), "rows": {}}
    for name in names:
        lengths = row_lengths(name, args.tokens)
        ms = measure(lengths, args) if model is None else measure(model, lengths, args)
        record["rows"][name] = {"lengths": lengths, "auto": _describe(lengths), "ms": ms}
        print(f"{name}: {json.dumps(ms)}", flush=True)
        if args.json:  # after every row, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
    print(f"{device}, torch {torch.__version__}, mode {args.mode}, ms per row (medians of {args.reps})")
    _table(args.mode, record["rows"])
    return record


if __name__ == "__main__":
    main()
