"""Worker functions for the engine tests (run in spawned processes by ``_dist.launch``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from _models import VOCAB, tiny_model
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def minibatch(step: int, n_micro: int, device: str = "cpu") -> list[torch.Tensor]:
    """``n_micro`` microbatches of token ids with different shapes (variable-length workload)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(n_micro):
        rows = int(torch.randint(1, 3, (1,), generator=g))
        length = int(torch.randint(5, 24, (1,), generator=g))
        out.append(torch.randint(0, VOCAB, (rows, length), generator=g).to(device))
    return out


def target_tokens(ids: torch.Tensor) -> int:
    return ids.shape[0] * (ids.shape[1] - 1)


def loss_sum(model, ids: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the next-token losses of one microbatch."""
    logits = model(input_ids=ids).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class Case:
    """One parity scenario: per-step splits of each step's microbatches across ranks."""

    splits: list[list[int]]  # rank -> microbatch indices (same for every step)
    steps: int = 1
    odc: bool = True
    mixed_precision: bool = False
    checkpointing: bool | float = False  # a float: activation checkpointing on that share of the layers
    lora: bool = False
    reshard_after_forward: bool = True
    lr: float = 1e-2
    device: str = "cpu"  # "cuda": rank r on GPU r, NCCL
    sleep_rank: int | None = None  # this rank sleeps `sleep_s` in every microbatch
    sleep_s: float = 0.0
    hosts: int | None = None  # present the ranks as this many hosts (HF_ODC_HOST_ID): hybrid ODC / HSDP
    extra: dict = field(default_factory=dict)

    @property
    def n_micro(self) -> int:
        return sum(len(s) for s in self.splits)


def reference_grads(case: Case, step: int) -> dict[str, torch.Tensor]:
    """Single process: the gradients of step ``step``'s whole minibatch on the freshly built model."""
    model = tiny_model(lora=case.lora, checkpointing=case.checkpointing, device=case.device)
    mbs = minibatch(step, case.n_micro, case.device)
    n = sum(target_tokens(m) for m in mbs)
    for ids in mbs:
        (loss_sum(model, ids) / n).backward()
    return {k: p.grad.cpu() for k, p in trainable(model).items()}


def reference(case: Case) -> dict:
    """Single process, whole minibatch: gradients of step 0 and parameters after ``case.steps`` AdamW steps."""
    model = tiny_model(lora=case.lora, checkpointing=case.checkpointing, device=case.device)
    params = trainable(model)
    opt = torch.optim.AdamW(params.values(), lr=case.lr)
    grads0 = None
    for step in range(case.steps):
        mbs = minibatch(step, case.n_micro, case.device)
        n = sum(target_tokens(m) for m in mbs)
        for ids in mbs:
            (loss_sum(model, ids) / n).backward()
        if grads0 is None:
            grads0 = {k: p.grad.detach().cpu() for k, p in params.items()}
        opt.step()
        opt.zero_grad()
    return {"grads": grads0, "params": {k: p.detach().cpu() for k, p in params.items()}}


def present_hosts(rank: int, world_size: int, case: Case) -> None:
    """Ranks ``[h * W/H, (h + 1) * W/H)`` claim host ``h`` (the test-only override of host identity)."""
    if case.hosts is not None:
        os.environ["HF_ODC_HOST_ID"] = str(rank * case.hosts // world_size)


def shard(model, case: Case):
    """FSDP2 on every layer and the root: 1-D over all ranks, or HSDP's 2-D mesh (one shard group per presented
    host, the mesh hf_odc's own sharding picks) when ``case.hosts`` is set."""
    from hf_odc.accelerate_plugin import device_mesh

    mesh = device_mesh(case.device) if case.hosts is not None else None
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if case.mixed_precision
        else MixedPrecisionPolicy()
    )
    layers = model.base_model.model.model.layers if case.lora else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=case.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=case.reshard_after_forward)
    return model


def distributed(rank: int, world_size: int, case: Case) -> dict:
    """Sharded training on ``world_size`` ranks (ODC or plain FSDP2); returns full gradients/params on rank 0."""
    import hf_odc

    present_hosts(rank, world_size, case)
    model = shard(tiny_model(lora=case.lora, checkpointing=case.checkpointing, device=case.device), case)
    params = trainable(model)
    opt = torch.optim.AdamW(params.values(), lr=case.lr)
    odc = hf_odc.enable(model, timeout=float(case.extra.get("timeout", 60))) if case.odc else None
    grads0 = None
    times = []
    for step in range(case.steps):
        mbs = minibatch(step, case.n_micro, case.device)
        n = sum(target_tokens(m) for m in mbs)
        mine = [mbs[i] for i in case.splits[rank]]
        with odc.minibatch() if odc is not None else contextlib.nullcontext():
            for ids in mine:
                if case.sleep_rank == rank:
                    time.sleep(case.sleep_s)
                (loss_sum(model, ids) * world_size / n).backward()
                if case.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.monotonic())
        if grads0 is None:
            grads0 = {k: p.grad.full_tensor().float().cpu().clone() for k, p in params.items()}
        opt.step()
        opt.zero_grad()
    final = {k: p.detach().full_tensor().float().cpu() for k, p in params.items()}
    prefix = None
    if odc is not None:
        prefix = shm_prefixes(odc)
        odc.close()
    return {"grads": grads0, "params": final, "times": times, "prefix": prefix}


def shm_prefixes(odc) -> list[str]:
    """The prefixes of every shared-memory name ``odc`` made: its host barrier's, and on CPUs its transport's."""
    return [odc.host.segment_prefix, *filter(None, [getattr(odc.transport, "segment_prefix", None)])]


def in_turn(rank: int, world_size: int, calls: list[tuple[Callable[[int, int, Case], Any], Case]]) -> list:
    """Each ``fn(rank, world_size, case)`` of ``calls`` in turn, in one launch of the processes: each case shards a
    model of its own (ODC closed before the next), and the processes start once, which is most of a small case's
    time."""
    return [fn(rank, world_size, case) for fn, case in calls]


def faulty(rank: int, world_size: int, case: Case) -> dict:
    """Rank ``case.extra["culprit"]`` (default 1) misbehaves inside the first minibatch (``case.extra["fault"]``);
    the others report what they saw.

    ``kill``: SIGKILL itself; ``raise``: raise an exception out of ``minibatch()``; ``stall``: sleep past the timeout.
    """
    import signal

    import hf_odc

    present_hosts(rank, world_size, case)
    culprit = case.extra.get("culprit", 1)
    model = shard(tiny_model(device=case.device), case)
    odc = hf_odc.enable(model, timeout=float(case.extra.get("timeout", 60)))
    prefix = shm_prefixes(odc)
    mbs = minibatch(0, case.n_micro, case.device)
    n = sum(target_tokens(m) for m in mbs)
    start = time.monotonic()
    fault = case.extra["fault"]
    try:
        with odc.minibatch():
            for i in case.splits[rank]:
                (loss_sum(model, mbs[i]) * world_size / n).backward()
            if rank == culprit and fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == culprit and fault == "raise":
                raise ValueError("bad batch on purpose")
            if rank == culprit and fault == "stall":
                time.sleep(float(case.extra["stall_s"]))
    except (hf_odc.PeerFailureError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    odc.close()
    return {"error": error, "elapsed": time.monotonic() - start, "prefix": prefix}


def meetings(rank: int, world_size: int, case: Case) -> dict:
    """``hf_odc.ODC.meet`` between minibatches, as the trainers meet before each collective of a step.

    ``case.extra["path"]``: ``"same"``: every rank meets ``case.extra["meetings"]`` times, alternating two names, each
    rank sleeping a random 0-3 ms before each (the hurried replicas of a loaded machine: a replica that passed a
    meeting must not take away what a slower one still reads); ``"other-replica"``: host 1's ranks meet ``"B"`` where
    host 0's meet ``"A"``; ``"other-host-peer"``: rank 1 alone meets ``"B"``. Returns the meetings passed, the error
    (if any) and the seconds until it."""
    import random

    import hf_odc

    present_hosts(rank, world_size, case)
    model = shard(tiny_model(device=case.device), case)
    odc = hf_odc.enable(model, timeout=float(case.extra.get("timeout", 60)))
    path = case.extra["path"]
    jitter = random.Random(rank)
    passed, error, start = 0, None, time.monotonic()
    try:
        for n in range(case.extra.get("meetings", 1)):
            if path == "same":
                time.sleep(jitter.uniform(0, 3e-3))
                odc.meet("gradient clipping" if n % 2 == 0 else "logging, evaluation and checkpointing")
            else:
                other = rank >= world_size // 2 if path == "other-replica" else rank == 1
                odc.meet("B" if other else "A")
            passed += 1
    except hf_odc.PeerFailureError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    odc.close()
    return {"passed": passed, "error": error, "elapsed": elapsed}


def accumulation_and_divide_factor(rank: int, world_size: int, case: Case) -> dict:
    """Two minibatches without ``zero_grad`` accumulate (as FSDP does); ``set_gradient_divide_factor(1)`` sums."""
    import hf_odc

    model = shard(tiny_model(device=case.device), case)
    params = trainable(model)
    odc = hf_odc.enable(model)
    out = {}
    for label in ("first", "both"):
        step = 0 if label == "first" else 1
        mbs = minibatch(step, case.n_micro, case.device)
        n = sum(target_tokens(m) for m in mbs)
        with odc.minibatch():
            for i in case.splits[rank]:
                (loss_sum(model, mbs[i]) * world_size / n).backward()
        out[label] = {k: p.grad.full_tensor().cpu() for k, p in params.items()}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    for p in params.values():
        p.grad = None
    mbs = minibatch(0, case.n_micro, case.device)
    n = sum(target_tokens(m) for m in mbs)
    with odc.minibatch():
        for i in case.splits[rank]:
            (loss_sum(model, mbs[i]) * world_size / n).backward()
    out["sum"] = {k: p.grad.full_tensor().cpu() for k, p in params.items()}
    odc.close()
    return out


def forward_only(rank: int, world_size: int, case: Case) -> dict:
    """A forward-only minibatch (uneven split) before a training one: its losses, and ``.grad`` right after it."""
    import hf_odc

    model = shard(tiny_model(device=case.device), case)
    params = trainable(model)
    odc = hf_odc.enable(model, timeout=60.0)
    mbs = minibatch(0, case.n_micro, case.device)
    n = sum(target_tokens(m) for m in mbs)
    mine = case.splits[rank]
    with odc.minibatch(backward=False):
        losses = {i: float(loss_sum(model, mbs[i])) for i in mine}
        inside_no_grad = not torch.is_grad_enabled()
    grads_after_forward = [p.grad for p in params.values()]
    with odc.minibatch():
        for i in mine:
            (loss_sum(model, mbs[i]) * world_size / n).backward()
    grads = {k: p.grad.full_tensor().float().cpu().clone() for k, p in params.items()}
    odc.close()
    return {"losses": losses, "no_grad": inside_no_grad, "grads_after_forward": grads_after_forward, "grads": grads}


def mesh_error(rank: int, world_size: int, hosts: list[int], shard_size: int | None) -> str:
    """Rank ``r`` claims host ``hosts[r]``; the error hf_odc's mesh gives (empty if it builds one)."""
    from hf_odc.accelerate_plugin import device_mesh

    os.environ["HF_ODC_HOST_ID"] = str(hosts[rank])
    try:
        device_mesh("cpu", shard_size)
    except ValueError as e:
        return str(e)
    return ""


def vllm_sync(rank: int, world_size: int, case: Case) -> dict:
    """What :class:`~hf_odc.trainer.generation.vllm_sync.ODCWeightSync` hands vLLM from the ODC-sharded policy (LoRA
    merged with ``case.lora``): colocated (every rank loads), then twice to a server (rank 0 streams, the other ranks
    only publish); the collectives dispatched meanwhile, and the weights a single process holds, to compare."""
    import copy
    from types import SimpleNamespace

    from _vllm_workers import Collectives

    from hf_odc.accelerate_plugin import ODCRuntime
    from hf_odc.trainer.generation.vllm_sync import ODCWeightSync

    model = tiny_model(lora=case.lora)
    reference = copy.deepcopy(model)
    reference = reference.merge_and_unload() if case.lora else reference
    runtime = ODCRuntime()
    runtime.enable(shard(model, case))
    loaded, streamed = [], []

    class Engine:  # LLM.collective_rpc reaching a worker without reload_weights: the model's load_weights
        def collective_rpc(self, method, args=()):
            model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda w: loaded.extend(
                (n, t.clone()) for n, t in w)))  # fmt: skip
            return [method(SimpleNamespace(model_runner=model_runner), *args)]

        def reset_prefix_cache(self):
            pass

    class Client:
        def update_named_params(self, metadata, named_params):
            streamed.append((metadata, [(n, t.clone()) for n, t in named_params]))

        def reset_prefix_cache(self):
            pass

    accelerator = SimpleNamespace(is_main_process=rank == 0)
    colocated = SimpleNamespace(mode="colocate", llm=Engine(), enable_sleep_mode=False)
    served = SimpleNamespace(mode="server", vllm_client=Client(), accelerator=accelerator)
    with Collectives() as collectives:
        ODCWeightSync.install(colocated, model, runtime)()
        server_sync = ODCWeightSync.install(served, model, runtime)
        server_sync()
        server_sync()
    runtime.close()
    return {
        "collectives": collectives.ops,
        "loaded": loaded,
        "streamed": streamed,
        "reference": {name: param.detach().clone() for name, param in reference.named_parameters()},
    }


def tensor_parallel_decoding(rank: int, world_size: int, case: Case) -> list[dict]:
    """:class:`~hf_odc.trainer.generation.decoders.TensorParallelDecoder` on each of ``case.extra["policies"]`` (dicts
    of :func:`_tensor_parallel_policy`'s ``family``, ``config`` and ``scale``; ``odc``: sharded with ODC, else plain
    FSDP2; the decoder's ``loop`` and ``fuse``), by default the ODC-sharded tiny policy (LoRA merged with
    ``case.lora``), decoded by ``generate``, fused: the logits of one forward of the sliced copy on prompts every rank
    shares, and each rank's own prompts (a different number and width per rank) decoded together, greedily and sampled
    (each rank's generator seeded apart); with what the whole policy gives for each: the same forward, greedy decoding
    of the rank's prompts alone, and sampling of every rank's prompts in one batch from the seed rank 0 draws. Also the
    copy's local parameter shapes and config, and how many calls hf_odc's decoding loop decoded."""
    import copy

    import torch.distributed as dist

    from hf_odc.accelerate_plugin import ODCRuntime
    from hf_odc.trainer.generation import _static_decoding
    from hf_odc.trainer.generation.decoders import TensorParallelDecoder

    def prompts(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        for row in range(1, batch):
            mask[row, :row], ids[row, :row] = 0, 0
        return {"input_ids": ids, "attention_mask": mask}

    def decode(model, inputs: dict, sample: bool) -> torch.Tensor:
        return model.generate(**inputs, max_new_tokens=8, do_sample=sample, pad_token_id=0, eos_token_id=None)

    loop_calls, decode_with_loop = [0], _static_decoding.Loop.decode

    def counted(self, plan):
        loop_calls[0] += 1
        return decode_with_loop(self, plan)

    _static_decoding.Loop.decode = counted
    results = []
    for policy in case.extra.get("policies", [{}]):
        lora = case.lora and "family" not in policy
        model = _tensor_parallel_policy(policy.get("family"), policy.get("config", {}), policy.get("scale", 1), lora)
        whole = copy.deepcopy(model)
        whole = whole.merge_and_unload() if lora else whole
        runtime = ODCRuntime()
        model = shard(model, Case(splits=case.splits, lora=lora))
        if policy.get("odc", True):
            runtime.enable(model)
        decoder = TensorParallelDecoder(
            model, runtime, torch.float32, loop=policy.get("loop", False), fuse=policy.get("fuse", True)
        )
        decoder.refresh()
        loop_calls[0] = 0
        shared, own = prompts(2, 9, seed=7), prompts(3 - rank % 3, 10 - 3 * (rank % 3), seed=rank)
        with torch.no_grad():
            result = {"logits": decoder.model(**shared).logits, "whole_logits": whole(**shared).logits}
        result["greedy"], result["whole_greedy"] = decode(decoder.model, own, False), decode(whole, own, False)
        torch.manual_seed(100 + rank)
        result["sampled"] = decode(decoder.model, own, True)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, own)
        width = max(p["input_ids"].shape[1] for p in everyone)
        batch = {key: torch.cat([F.pad(p[key], (width - p[key].shape[1], 0)) for p in everyone]) for key in own}
        torch.manual_seed(100)
        seed = int(torch.randint(2**62, (1,)))  # rank 0's draw
        torch.manual_seed(seed)
        start = sum(p["input_ids"].shape[0] for p in everyone[:rank])
        rows = decode(whole, batch, True)[start : start + own["input_ids"].shape[0]]
        result["whole_sampled"] = rows[:, width - own["input_ids"].shape[1] :]
        result["local_shapes"] = {
            name: tuple(p.shape) for name, p in decoder.model.named_parameters(remove_duplicate=False)
        }
        config = decoder.model.config
        result["local"] = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
        result["loop_calls"] = loop_calls[0]
        decoder.close()
        runtime.close()
        results.append(result)
    return results


def _tensor_parallel_policy(family: str | None, config: dict, scale: float, lora: bool) -> torch.nn.Module:
    """:func:`~_models.tiny_model` (LoRA with ``lora``), or (``family``: ``"qwen2"``, ``"llama"``) a model of the
    same tiny shape with ``config``'s fields, its biases drawn at random, its weight matrices multiplied by ``scale``
    (which varies the tokens it decodes)."""
    if family is None:
        return tiny_model(lora=lora).eval()
    from _models import tiny_qwen2_config
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = {"max_position_embeddings": 256, "tie_word_embeddings": True, **config}
    if family == "llama":
        tiny = tiny_qwen2_config()
        fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        shape = {key: getattr(tiny, key) for key in (*fields, "num_key_value_heads")} | shape
        shape["attn_implementation"] = "eager"
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        model = Qwen2ForCausalLM(tiny_qwen2_config(**shape))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):  # (transformers initialises them to zero)
                parameter.normal_()
            parameter.mul_(scale if parameter.ndim == 2 else 1)
    return model.eval()
