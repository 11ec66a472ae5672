"""``hf_odc.trainer.generation.StaticDecoder`` on one process: its copy decodes as the policy does (greedy, token for
token; a PEFT policy's adapters merged), follows the policy's weights in place on each refresh, and keeps one static
KV cache for every generation batch it fits. Each mode gets its owner (``make_generator``), whose turns are held
until released. Across sharded ranks, inside the trainer: tests/parity/test_grpo_generation.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from _models import VOCAB, tiny_model
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_odc.accelerate_plugin import ODCRuntime
from hf_odc.trainer import generation
from hf_odc.trainer.generation import (
    DECODING_ATTENTION,
    StaticDecoder,
    choose_generation_mode,
    grouped_decoding_attention,
    make_generator,
)

NEW_TOKENS = 12


def _prompts(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, as TRL passes them: row ``i`` holds ``length - i`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : min(row, length - 1)] = 0
        ids[row, : min(row, length - 1)] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _greedy(model: nn.Module, prompts: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.generate(**prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize(
    ("lora", "attention"), [(False, "eager"), (True, "eager"), (False, "sdpa")], ids=["plain", "lora", "sdpa"]
)
def test_the_copy_decodes_what_the_policy_decodes(lora, attention):
    policy = tiny_model(lora=lora).eval()
    policy.set_attn_implementation(attention)
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    assert decoder.model.config._attn_implementation == ("eager" if attention == "eager" else DECODING_ATTENTION)
    prompts = _prompts(3, 10)
    expected = _greedy(policy, prompts)
    assert torch.equal(_greedy(decoder.model, prompts), expected)
    assert type(decoder.model) is type(policy.get_base_model() if lora else policy)
    assert not any("lora" in name for name, _ in decoder.model.named_parameters())  # adapters merged, not copied


def test_refresh_copies_the_policys_new_weights_in_place():
    policy = tiny_model()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    addresses = {name: p.data_ptr() for name, p in decoder.model.named_parameters()}
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param))
    decoder.refresh()
    copied = dict(decoder.model.named_parameters())
    assert all(torch.equal(copied[name], param) for name, param in policy.named_parameters())
    assert {name: p.data_ptr() for name, p in copied.items()} == addresses


def test_a_policy_holding_its_tied_weights_apart_gets_a_copy_that_does_too():
    """Accelerate's FSDP2 on one process holds the LM head apart from the embeddings its config ties."""
    policy = tiny_model().eval()
    with torch.no_grad():
        policy.lm_head.weight = nn.Parameter(policy.lm_head.weight + torch.randn_like(policy.lm_head.weight))
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    copied = decoder.model
    assert torch.equal(copied.lm_head.weight, policy.lm_head.weight)
    assert torch.equal(copied.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    prompts = _prompts(3, 10)
    assert torch.equal(_greedy(copied, prompts), _greedy(policy, prompts))


def test_tied_weights_given_under_either_name_fill_the_copy(monkeypatch):
    """Accelerate's FSDP2 on one process gives the tied embeddings under the LM head's name (its own FSDP group)."""
    import hf_odc.trainer.generation as generation

    def named_weights(model, runtime):
        for name, tensor in model.named_parameters():
            yield ("lm_head.weight" if name == "model.embed_tokens.weight" else name), tensor.detach()

    monkeypatch.setattr(generation, "full_named_weights", named_weights)
    policy = tiny_model().eval()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    copied = decoder.model
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert torch.equal(copied.lm_head.weight, policy.model.embed_tokens.weight)


def test_the_cache_is_kept_for_every_batch_it_fits():
    policy = tiny_model().eval()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    caches = []
    for batch, length in [(3, 10), (3, 6), (3, 30), (2, 6), (2, 8)]:
        prompts = _prompts(batch, length, seed=length)
        assert torch.equal(_greedy(decoder.model, prompts), _greedy(policy, prompts)), (batch, length)
        caches.append(decoder._cache)
    assert caches[0] is caches[1] is caches[2]  # a longer prompt within the rounded length too
    assert caches[3] is not caches[2] and caches[4] is caches[3]  # another batch size


def test_without_a_gpu_the_default_mode_is_gathered_and_static_is_allowed():
    policy = tiny_model()
    runtime, cpu = ODCRuntime(), torch.device("cpu")
    assert choose_generation_mode(None, policy, runtime, torch.float32, cpu) == "gathered"
    assert choose_generation_mode("static", policy, runtime, torch.float32, cpu) == "static"
    with pytest.raises(ValueError, match="odc_generation must be one of"):
        choose_generation_mode("compiled", policy, runtime, torch.float32, cpu)


def _trainer(odc_generation=None, use_vllm=False) -> SimpleNamespace:
    args = SimpleNamespace(odc_generation=odc_generation, use_vllm=use_vllm, bf16=False, fp16=False)
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    return SimpleNamespace(args=args, model=tiny_model(), odc=ODCRuntime(), accelerator=accelerator)


@pytest.mark.parametrize(
    ("requested", "owner"),
    [(None, "GatheredGenerator"), ("gathered", "GatheredGenerator"), ("sharded", "ShardedGenerator"),
     ("static", "StaticGenerator"), ("lockstep", "Generator")],
)  # fmt: skip
def test_each_mode_has_its_owner(requested, owner):
    generator = make_generator(_trainer(requested))
    assert type(generator).__name__ == owner
    assert generator.mode == (requested or "gathered")


def test_use_vllm_is_the_vllm_owner_which_installs_the_sync_and_shuts_the_engine_down(monkeypatch):
    events = []
    monkeypatch.setattr(generation.ODCWeightSync, "install", lambda *args: events.append("install"))
    monkeypatch.setattr(generation, "shut_down_engine", lambda vllm_generation: events.append("shut down"))
    trainer = _trainer(use_vllm=True)
    trainer.vllm_generation = object()
    generator = make_generator(trainer)
    assert (generator.mode, events) == ("vllm", ["install"])
    generator.end()
    assert events == ["install", "shut down"]


def test_the_turns_are_entered_once_and_held_until_released(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def turns():
        entered.append("enter")
        yield
        entered.append("exit")

    generator = make_generator(_trainer("sharded"))
    monkeypatch.setattr(generator, "turns", turns)
    generator.hold_turns()
    generator.hold_turns()  # a tool loop's next turn
    assert entered == ["enter"]
    generator.release_turns()
    generator.release_turns()
    assert entered == ["enter", "exit"]


@pytest.mark.parametrize(("free_copies", "mode"), [(4, "static"), (2, "gathered"), (1, "gathered")])
def test_on_a_gpu_the_default_mode_is_chosen_by_free_memory_before_the_model_is_placed(monkeypatch, free_copies, mode):
    """With one process the Trainer places the model on its GPU only when training starts: the device trained on
    decides, not where the parameters are when the trainer is built. An unsharded model that does not fit a copy
    decodes itself ("gathered" gathers nothing)."""
    policy = tiny_model()
    free = free_copies * sum(p.numel() for p in policy.parameters()) * 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 10 * free))
    assert choose_generation_mode(None, policy, ODCRuntime(), torch.bfloat16, torch.device("cuda", 0)) == mode


class _Layer(nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("query_length", [1, 5])
def test_grouped_decoding_attention_equals_sdpa(query_length):
    """Equal to transformers' SDPA (keys and values repeated per query head) for one query token, with a padding mask,
    and for a longer query (which it hands to transformers' SDPA)."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, query_length, 8, generator=g)
    key, value = torch.randn(2, 2, 2, 11, 8, generator=g).unbind(0)
    mask = torch.ones(2, 1, query_length, 11, dtype=torch.bool).tril(diagonal=11 - query_length)
    mask[1, ..., :4] = False  # a left-padded row
    expected, _ = sdpa_attention_forward(_Layer(), query, key, value, mask, scaling=0.3)
    out, _ = grouped_decoding_attention(_Layer(), query, key, value, mask, scaling=0.3)
    assert out.shape == expected.shape == (2, query_length, 6, 8)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_grouped_decoding_attention_compiles_as_one_graph():
    """The decoding step transformers compiles must not break at the attention (``fullgraph``)."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 1, 8, generator=g)
    key, value = torch.randn(2, 1, 2, 9, 8, generator=g).unbind(0)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    compiled = torch.compile(grouped_decoding_attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(
        compiled(_Layer(), query, key, value, mask)[0], grouped_decoding_attention(_Layer(), query, key, value, mask)[0]
    )
