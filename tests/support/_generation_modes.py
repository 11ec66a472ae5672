"""ODCGRPOTrainer's generation modes, traced: one optimizer step per mode, greedy decoding of real prompts.

``accelerate launch ... tests/support/_generation_modes.py MODEL_DIR OUT MODE...`` (a mode of ``odc_generation``, or
``<mode>-fsdp2`` for the plain FSDP2 baseline) records, per mode and rank, the completions TRL's generation returned,
the all-gathers (:data:`GATHERS`), the all-reduces and the policy's forwards (of the decoding copy in ``"static"`` and
``"tensor-parallel"``) while decoding, and saves every rank's record on rank 0. With a decoding copy it also records
how far the copy is from (its slice of) the policy's full weights once the step's update has run (``stale``) and after
the trainer generates again (``refreshed``).
Generation stops at any token of a large stop set, so that prompts stop at different lengths and the ranks' longest
completions differ.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from _parity import finish
from torch.nn.modules.module import register_module_forward_pre_hook
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from hf_odc.demo import build_tokenizer, length_reward, prompt_dataset

MAX_COMPLETION = 24


GATHERS = [name for name in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, name)]
"""FSDP2's all-gather (``all_gather_single`` from torch 2.13, ``all_gather_into_tensor`` before) and ODC's outside a
minibatch."""


@contextlib.contextmanager
def traced(trainer, record: dict):
    """Count all-gathers, all-reduces and policy forwards inside ``_generate_single_turn`` and keep what ``_generate``
    returned."""
    originals = {name: getattr(dist, name) for name in (*GATHERS, "all_reduce")}
    generate_single, generate = trainer._generate_single_turn, trainer._generate
    inside = [False]

    def counting(collective, key):
        def counted(*args, **kwargs):
            record[key] += inside[0]
            return collective(*args, **kwargs)

        return counted

    def single(*args, **kwargs):
        inside[0] = True
        try:
            return generate_single(*args, **kwargs)
        finally:
            inside[0] = False

    def whole(prompts):
        result = generate(prompts)
        record.setdefault("completions", [list(ids) for ids in result[1]])  # the training step's
        record.setdefault("prompts", prompts)
        return result

    def count_forward(module, args):
        record["forwards"] += inside[0] and isinstance(module, Qwen2ForCausalLM)  # the policy, or its static copy

    handle = register_module_forward_pre_hook(count_forward)
    for name, collective in originals.items():
        setattr(dist, name, counting(collective, "all_reduces" if name == "all_reduce" else "all_gathers"))
    trainer._generate_single_turn, trainer._generate = single, whole
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
        handle.remove()


def run(model_dir: str, mode: str, out: str) -> dict:
    """One step with ``odc_generation=mode``; ``"<mode>-fsdp2"`` runs it on the plain FSDP2 baseline (odc=False),
    ``"<mode>-generate"`` decodes with transformers' ``generate`` (``odc_decoding_loop=False``), else with the
    mode's default."""
    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    tokenizer = build_tokenizer()
    stop = list(
        range(len(tokenizer) // 3, len(tokenizer) // 3 + len(tokenizer) // 30)
    )  # a third of the vocabulary ends a completion
    args = ODCGRPOConfig(
        f"{out}.{mode}", per_device_train_batch_size=4, num_generations=4, max_completion_length=MAX_COMPLETION,
        max_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=3,
        disable_tqdm=True, odc_generation=mode.removesuffix("-fsdp2").removesuffix("-generate"),
        **({"odc_decoding_loop": False} if mode.endswith("-generate") else {}),
        max_tokens_per_microbatch=128,
        cost_model="tokens", odc=not mode.endswith("-fsdp2"), learning_rate=1e-2, entropy_coef=0.1,
        generation_kwargs={"do_sample": False, "eos_token_id": stop},
    )  # fmt: skip
    trainer = ODCGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=[length_reward], args=args,
        train_dataset=prompt_dataset(16, MAX_COMPLETION, "swe-smith", seed=0), processing_class=tokenizer,
    )  # fmt: skip
    record = {"all_gathers": 0, "all_reduces": 0, "forwards": 0}
    with traced(trainer, record):
        trainer.train()
    if getattr(trainer._generator, "decoder", None) is not None:
        record["loop"] = getattr(trainer._generator.decoder, "_loop", None) is not None  # hf_odc's loop decoded
        record["stale"] = copy_distance(trainer)
        trainer._generate(record["prompts"])
        record["refreshed"] = copy_distance(trainer)
    del record["prompts"]
    trainer.close_odc()
    return record


def copy_distance(trainer) -> float:
    """The largest difference between what the decoding copy holds of each of the policy's weights (its rows of a
    fused projection) and the weight (assembled as vLLM's are; in ``"tensor-parallel"`` the rank's slice)."""
    from hf_odc.trainer.generation.full_weights import full_named_weights

    decoder = trainer._generator.decoder
    weights = full_named_weights(trainer.model, trainer.odc)
    return max((decoder.weight(name) - decoder._local(name, tensor)).abs().max().item() for name, tensor in weights)


def main() -> None:
    model_dir, out, *modes = sys.argv[1:]
    records = {mode: run(model_dir, mode, out) for mode in modes}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        torch.save({mode: [rank[mode] for rank in gathered] for mode in modes}, out)
    finish()


if __name__ == "__main__":
    main()
