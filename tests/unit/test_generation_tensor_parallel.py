"""The ``"tensor-parallel"`` generation mode (``hf_odc.trainer.generation.decoders.TensorParallelDecoder``): on 2 and 4
processes the sliced copy of the sharded policy (any head count: key/value heads replicated where the ranks outnumber
them, query heads split unevenly where the ranks do not divide them; biases on the row-parallel projections; the MLP
and the LM head whole where the ranks do not divide them) computes the whole policy's logits (fp32 tolerance),
decodes each rank's prompts greedily as the whole policy does, and samples on every rank the tokens the whole policy
samples for the group's batch from rank 0's seed; with one process it is the whole copy. Qwen2.5-1.5B's and 7B's
heads go to 2, 4 and 8 ranks, each computed once with the key/value head it reads; the chooser counts the largest
slice. Refused, naming the modes to use, for models it cannot slice over the shard group, with tools, and with vLLM.
Inside the trainer: tests/parity/test_generation_modes.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _models import VOCAB, tiny_model, tiny_qwen2_config
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_odc.accelerate_plugin import ODCRuntime
from hf_odc.trainer.generation.decoders import TensorParallelDecoder, _RankSlice, check_tensor_parallel
from hf_odc.trainer.generation.modes import TensorParallelGenerator, check_generation_mode, make_generator

SMALL = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}


# Policies of every head layout, each decoded on the ranks of one launch (see _engine_workers.tensor_parallel_decoding):
# a config's fields, its local (query heads, key/value heads, MLP rows) by rank, its LM head's local rows.
_SCALED = {"family": "qwen2", "scale": 10, "odc": False, "loop": True}  # varied tokens, plain FSDP2, hf_odc's loop
_TWO_RANKS = [
    ({}, [(2, 1, 64)] * 2, 64),  # the ODC-sharded tiny policy with LoRA (4 heads, 2 key/value), by generate
    ({**_SCALED, "config": {"num_key_value_heads": 1}}, [(2, 1, 64)] * 2, 64),  # 1 key/value head on both ranks
    (  # 3 heads: 2 and 1, unfused
        {**_SCALED, "config": {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}, "fuse": False},
        [(2, 1, 64), (1, 1, 64)],
        64,
    ),
    (  # biases on o_proj and down_proj (added once), an LM head of its own
        {
            **_SCALED,
            "family": "llama",
            "config": {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
        },
        [(2, 1, 64)] * 2,
        64,
    ),
]
_FOUR_RANKS = [
    (  # Qwen2.5-1.5B's heads (12, 2 key/value): 3 a rank, each key/value head on 2 ranks
        {**_SCALED, "config": {"num_attention_heads": 12, "head_dim": 8}},
        [(3, 1, 32)] * 4,
        32,
    ),
    (  # 3 query heads per key/value head: 2 and 1; the MLP (90 rows) and the head (130 words) whole on every rank
        {**_SCALED, "config": {"num_attention_heads": 6, "head_dim": 16, "intermediate_size": 90, "vocab_size": 130}},
        [(2, 1, 90), (1, 1, 90)] * 2,
        130,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_sliced_copy_computes_and_decodes_what_the_whole_policy_does(world_size):
    """For every policy of the launch: the sliced copy's logits equal the whole policy's (fp32 tolerance); each rank's
    prompts decode greedily as the whole policy decodes them alone, and sampled as it samples every rank's prompts
    in one batch from rank 0's seed; each rank holds its heads, MLP rows and LM head rows."""
    from _dist import launch
    from _engine_workers import Case, tensor_parallel_decoding

    policies = _TWO_RANKS if world_size == 2 else _FOUR_RANKS
    case = Case(splits=[[rank] for rank in range(world_size)], lora=True, extra={"policies": [p for p, *_ in policies]})
    results = launch(tensor_parallel_decoding, world_size, case, timeout=120 * len(policies))
    for number, (policy, local, head_rows) in enumerate(policies):
        for rank, result in enumerate(r[number] for r in results):
            where = f"policy {number}, rank {rank}"
            torch.testing.assert_close(result["logits"], result["whole_logits"], rtol=1e-5, atol=1e-5, msg=where)
            assert torch.equal(result["greedy"], result["whole_greedy"]), where
            assert torch.equal(result["sampled"], result["whole_sampled"]), where
            assert result["local"] == local[rank], where
            assert result["local_shapes"]["lm_head.weight"][0] == head_rows, where
            assert result["loop_calls"] == (2 if policy.get("loop") else 0), where
        if policy.get("scale"):  # tokens that vary: the decoding is compared, not one repeated token
            assert len(set(results[0][number]["greedy"][:, 10:].flatten().tolist())) > 3, number
    shapes = results[0][0]["local_shapes"] if world_size == 2 else None
    if shapes is not None:  # fused, half the heads (4 query, 2 key/value of 16) and MLP rows (128) per rank
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (32 + 16 + 16, 64)
        assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == (64,)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (128, 64)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
        assert shapes["model.embed_tokens.weight"] == (VOCAB, 64)  # whole; the head's half of its own


def test_with_one_process_the_copy_is_whole_and_decodes_what_the_policy_decodes():
    policy = tiny_model().eval()
    decoder = TensorParallelDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    assert torch.equal(decoder.model.generate(**prompts, **options), policy.generate(**prompts, **options))
    assert all(decoder.weight(name).shape == param.shape for name, param in policy.named_parameters())


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config)


QWEN25 = {  # the shapes of Qwen2.5-1.5B and 7B
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("shape", ["1.5b", "7b"])
def test_every_query_head_is_computed_once_with_the_key_value_head_it_reads(shape, size):
    """Qwen2.5-1.5B (12 heads, 2 key/value) and 7B (28, 4) on 2, 4 and 8 ranks: every query head on one rank, with
    the key/value head it reads there at the place the local grouping reads it from; the ranks' head counts differ
    by one at most; the MLP and the vocabulary sliced evenly."""
    config = Qwen2Config(num_hidden_layers=1, **QWEN25[shape])
    check_tensor_parallel(_meta(Qwen2ForCausalLM, config), size)
    groups = config.num_attention_heads // config.num_key_value_heads
    computed, counts = [], []
    for rank in range(size):
        part = _RankSlice(config, size, rank)
        local_groups = len(part.heads) // len(part.kv_heads)
        assert len(part.heads) == local_groups * len(part.kv_heads) > 0
        assert [part.kv_heads[i // local_groups] for i in range(len(part.heads))] == [h // groups for h in part.heads]
        computed += part.heads
        counts.append(len(part.heads))
        assert len(part.mlp_rows) == config.intermediate_size // size
        assert len(part.vocab_rows) == config.vocab_size // size
    assert computed == list(range(config.num_attention_heads)) and max(counts) - min(counts) <= 1


def test_the_largest_slice_counts_its_heads_mlp_rows_and_head_rows_and_the_whole_embeddings():
    """Qwen2.5-1.5B on 4 ranks: 3 query heads and 1 key/value head of 128, 2240 MLP rows, 37984 head rows (the
    tied embeddings whole beside them)."""
    config = Qwen2Config(num_hidden_layers=2, **QWEN25["1.5b"])
    hidden = config.hidden_size
    layer = (hidden + 1) * (3 + 1 + 1) * 128 + 3 * 128 * hidden + 3 * 2240 * hidden + 2 * hidden
    expected = 2 * layer + (151936 + 37984) * hidden + hidden
    assert TensorParallelDecoder.bytes_per_rank(_meta(Qwen2ForCausalLM, config), 4, torch.bfloat16) == 2 * expected


@pytest.mark.parametrize(
    ("model", "size", "message"),
    [
        (lambda: _meta(Qwen2ForCausalLM, tiny_qwen2_config()), 8, "at least one attention head; the policy has 4"),
        (lambda: _meta(Qwen3MoeForCausalLM, Qwen3MoeConfig(**SMALL, num_attention_heads=2, num_experts=2)), 2,
         "qwen3_moe"),
    ],
    ids=["heads", "moe"],
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
        (2.5, 2, False, "tensor-parallel"),  # its slice over 2 ranks does (0.6 of it: the embeddings whole)
        (2.5, 2, True, "gathered"),  # with tools the ranks decode different numbers of turns
        (2.5, 8, False, "gathered"),  # 4 heads do not go to 8 ranks
        (2, 2, False, "gathered"),  # not even the slice fits: an unsharded model decodes itself
        (1, 1, False, "gathered"),  # no shard group: nothing to slice over
    ],
)
def test_by_default_tensor_parallel_is_chosen_where_the_copy_does_not_fit_and_its_slice_does(
    monkeypatch, free_copies, size, tools, mode
):
    from hf_odc.trainer.generation import modes

    policy = tiny_model()
    free = int(free_copies * sum(p.numel() for p in policy.parameters()) * 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 10 * free))
    monkeypatch.setattr(modes, "shard_group", lambda model: None if size == 1 else SimpleNamespace(size=size))
    monkeypatch.setattr(modes.dist, "get_world_size", lambda group: group.size)
    chosen = modes.choose_generation_mode(
        None, policy, ODCRuntime(), torch.bfloat16, torch.device("cuda", 0), tools=tools
    )
    assert chosen == mode
