"""The ``"tensor-parallel"`` generation mode (``hf_odc.trainer.generation.decoders.TensorParallelDecoder``): on 2
processes the sliced copy of the ODC-sharded policy computes the whole policy's logits (fp32 tolerance), decodes each
rank's prompts greedily as the whole policy does, and samples on every rank the tokens the whole policy samples for the
group's batch from rank 0's seed; with one process it is the whole copy. Refused, naming the modes to use, for models it
cannot slice over the shard group, with tools, and with vLLM. Inside the trainer: tests/parity/test_generation_modes.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _models import VOCAB, tiny_model, tiny_qwen2_config
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_odc.accelerate_plugin import ODCRuntime
from hf_odc.trainer.generation.decoders import TensorParallelDecoder, check_tensor_parallel
from hf_odc.trainer.generation.modes import TensorParallelGenerator, check_generation_mode, make_generator

SMALL = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}


@pytest.mark.slow
def test_the_sliced_copy_on_two_ranks_computes_what_the_whole_policy_does():
    from _dist import launch
    from _engine_workers import Case, tensor_parallel_decoding

    results = launch(tensor_parallel_decoding, 2, Case(splits=[[0], [1]], lora=True), timeout=180)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], result["whole_logits"], rtol=1e-5, atol=1e-5, msg=str(rank))
        assert torch.equal(result["greedy"], result["whole_greedy"]), rank
        assert torch.equal(result["sampled"], result["whole_sampled"]), rank
        shapes = result["local_shapes"]  # half the heads (4 query, 2 key/value of 16) and MLP rows (128) per rank
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
        assert shapes["model.layers.0.self_attn.k_proj.bias"] == (16,)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
        assert shapes["model.embed_tokens.weight"] == (VOCAB, 64)  # whole


def test_with_one_process_the_copy_is_whole_and_decodes_what_the_policy_decodes():
    policy = tiny_model().eval()
    decoder = TensorParallelDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    assert torch.equal(decoder.model.generate(**prompts, **options), policy.generate(**prompts, **options))
    assert all(a.shape == b.shape for a, b in zip(decoder.model.parameters(), policy.parameters(), strict=True))


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def test_a_model_sliceable_over_the_group_is_allowed():
    check_tensor_parallel(_meta(Qwen2ForCausalLM, tiny_qwen2_config()), 2)  # 4 heads, 2 key/value, 128 rows


@pytest.mark.parametrize(
    ("model", "size", "message"),
    [
        (lambda: _meta(Qwen2ForCausalLM, tiny_qwen2_config()), 4, "num_key_value_heads"),
        (lambda: _meta(Qwen2ForCausalLM, tiny_qwen2_config(num_attention_heads=2, num_key_value_heads=2)), 4,
         "num_attention_heads"),
        (lambda: _meta(Qwen2ForCausalLM, tiny_qwen2_config(intermediate_size=100)), 8, "intermediate_size"),
        (lambda: _meta(LlamaForCausalLM, LlamaConfig(**SMALL, num_attention_heads=2, attention_bias=True)), 2,
         "o_proj"),
        (lambda: _meta(LlamaForCausalLM, LlamaConfig(**SMALL, num_attention_heads=2, mlp_bias=True)), 2, "down_proj"),
        (lambda: _meta(Qwen3MoeForCausalLM, Qwen3MoeConfig(**SMALL, num_attention_heads=2, num_experts=2)), 2,
         "qwen3_moe"),
    ],
    ids=["key-value-heads", "heads", "intermediate", "o_proj-bias", "down_proj-bias", "moe"],
)  # fmt: skip
def test_what_cannot_be_sliced_over_the_group_is_refused_naming_the_modes_to_use(model, size, message):
    with pytest.raises(ValueError, match=message) as refusal:
        check_tensor_parallel(model(), size)
    assert "Use odc_generation='static', 'gathered' or 'sharded'" in str(refusal.value)


def _trainer(**attributes) -> SimpleNamespace:
    args = SimpleNamespace(odc_generation="tensor-parallel", use_vllm=False, bf16=False, fp16=False)
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    return SimpleNamespace(args=args, model=tiny_model(), odc=ODCRuntime(), accelerator=accelerator, **attributes)


def test_the_mode_has_its_owner_and_is_refused_with_tools_and_with_vllm():
    generator = make_generator(_trainer())
    assert type(generator) is TensorParallelGenerator and generator.mode == "tensor-parallel"
    with pytest.raises(ValueError, match="with tools"):
        make_generator(_trainer(tools=[print]))
    with pytest.raises(ValueError, match="use_vllm=False"):
        check_generation_mode("tensor-parallel", use_vllm=True)


@pytest.mark.parametrize(
    ("free_copies", "size", "tools", "mode"),
    [
        (4, 2, False, "static"),  # the copy fits its quarter
        (2, 2, False, "tensor-parallel"),  # only a half does: the slice over 2 ranks
        (2, 2, True, "gathered"),  # with tools the ranks decode different numbers of turns
        (2, 3, False, "gathered"),  # 4 heads do not split over 3 ranks
        (1, 2, False, "gathered"),  # not even the slice fits: an unsharded model decodes itself
        (1, 1, False, "gathered"),  # no shard group: nothing to slice over
    ],
)
def test_by_default_tensor_parallel_is_chosen_where_the_copy_does_not_fit_and_its_slice_does(
    monkeypatch, free_copies, size, tools, mode
):
    from hf_odc.trainer.generation import modes

    policy = tiny_model()
    free = free_copies * sum(p.numel() for p in policy.parameters()) * 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 10 * free))
    monkeypatch.setattr(modes, "shard_group", lambda model: None if size == 1 else SimpleNamespace(size=size))
    monkeypatch.setattr(modes.dist, "get_world_size", lambda group: group.size)
    chosen = modes.choose_generation_mode(
        None, policy, ODCRuntime(), torch.bfloat16, torch.device("cuda", 0), tools=tools
    )
    assert chosen == mode
