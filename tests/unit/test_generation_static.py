"""``hf_odc.trainer.generation.decoders.StaticDecoder`` on one process: its copy decodes as the policy does (greedy,
token for token; a PEFT policy's adapters merged), follows the policy's weights in place on each refresh, and keeps one
static KV cache for every generation batch it fits. hf_odc's decoding loop (``_static_decoding``) decodes on the copy
what transformers' ``generate`` decodes (greedy and sampled, token for token), reads only the filled part of the cache
with the grouped decoding attention, and leaves what it does not decode exactly so to ``generate``. Each mode gets its
owner (``make_generator``), whose turns are held until released. Across sharded ranks, inside the trainer:
tests/parity/test_generation_modes.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from _interpreted import KERNEL_DEVICES
from _models import VOCAB, tiny_model
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_odc import _compat
from hf_odc.accelerate_plugin import ODCRuntime
from hf_odc.trainer.generation import _static_decoding, decoders, modes
from hf_odc.trainer.generation._static_decoding import processed_scores
from hf_odc.trainer.generation.decoders import DECODING_ATTENTION, StaticDecoder, grouped_decoding_attention
from hf_odc.trainer.generation.modes import choose_generation_mode, make_generator
from hf_odc.trainer.online import _overlap

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


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_refresh_copies_the_policys_new_weights_in_place(fuse):
    """Each refresh writes the policy's current weights where the copy holds them (fused: rows of its fused
    projections), in place, and the copy then decodes what the changed policy decodes."""
    policy = tiny_model().eval()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32, fuse=fuse)
    decoder.refresh()
    addresses = {name: p.data_ptr() for name, p in decoder.model.named_parameters()}
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param))
    decoder.refresh()
    assert all(torch.equal(decoder.weight(name), param) for name, param in policy.named_parameters())
    assert {name: p.data_ptr() for name, p in decoder.model.named_parameters()} == addresses
    prompts = _prompts(3, 10)
    assert torch.equal(_greedy(decoder.model, prompts), _greedy(policy, prompts))
    attention = decoder.model.model.layers[0].self_attn
    assert hasattr(attention, "qkv_proj") == fuse and isinstance(attention.q_proj, nn.Linear) != fuse


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

    def named_weights(model, runtime):
        for name, tensor in model.named_parameters():
            yield ("lm_head.weight" if name == "model.embed_tokens.weight" else name), tensor.detach()

    monkeypatch.setattr(decoders, "full_named_weights", named_weights)
    policy = tiny_model().eval()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    copied = decoder.model
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert torch.equal(copied.lm_head.weight, policy.model.embed_tokens.weight)


def test_the_cache_is_kept_for_every_batch_it_fits():
    policy = tiny_model().eval()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32, loop=True)
    decoder.refresh()
    caches, loops = [], []
    for batch, length in [(3, 10), (3, 6), (3, 30), (2, 6), (2, 8)]:
        prompts = _prompts(batch, length, seed=length)
        assert torch.equal(_greedy(decoder.model, prompts), _greedy(policy, prompts)), (batch, length)
        caches.append(decoder._cache)
        loops.append(decoder._loop)  # the decoding loop (its CUDA graphs on a GPU) kept with its cache
    assert caches[0] is caches[1] is caches[2]  # a longer prompt within the rounded length too
    assert caches[3] is not caches[2] and caches[4] is caches[3]  # another batch size
    assert loops[0] is loops[1] is loops[2] and loops[3] is not loops[2] and loops[4] is loops[3]
    assert loops[4].cache is caches[4]


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
    monkeypatch.setattr(modes.ODCWeightSync, "install", lambda *args: events.append("install"))
    monkeypatch.setattr(modes, "shut_down_engine", lambda vllm_generation: events.append("shut down"))
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


# -- hf_odc's decoding loop (hf_odc.trainer.generation._static_decoding) ----------------------------------------------


def _copy(attention: str = "eager", fuse: bool = True, device: str = "cpu") -> StaticDecoder:
    """A static decoder (its projections fused, or not) of a tiny policy on ``device`` whose weight matrices are scaled
    up: the tiny model as initialised repeats one token per row, this one varies them (so that EOS ids can end rows at
    different steps)."""
    policy = tiny_model(device=device).eval()
    policy.set_attn_implementation(attention)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.mul_(10 if parameter.ndim == 2 else 1)
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32, loop=True, fuse=fuse)
    decoder.refresh()
    return decoder


def _generate(decoder: StaticDecoder, monkeypatch, loop: bool, seed: int = 0, **kwargs) -> torch.Tensor:
    """The copy's ``generate``, by hf_odc's loop (``loop``, checked to run) or by transformers' (the loop's plan
    refused), from the same generator state."""
    decoded = []
    with monkeypatch.context() as patch:
        if loop:
            decode = _static_decoding.Loop.decode
            patch.setattr(_static_decoding.Loop, "decode", lambda self, plan: decoded.append(1) or decode(self, plan))
        else:
            patch.setattr(_static_decoding, "decoding_plan", lambda *args: None)
        torch.manual_seed(seed)
        out = decoder.model.generate(**kwargs)
    assert decoded == ([1] if loop else [])
    return out


def _ending_at_different_steps(decoder: StaticDecoder, monkeypatch, prompts: dict, new_tokens: int) -> list[int]:
    """EOS ids that end each row of ``prompts`` greedily at its own step (row ``i`` near step ``2 + 3 i``)."""
    free = _generate(decoder, monkeypatch, False, **prompts, max_new_tokens=new_tokens, do_sample=False,
                     eos_token_id=None, pad_token_id=0)  # fmt: skip
    completions = free[:, prompts["input_ids"].shape[1] :]
    return sorted({int(completions[row, 2 + 3 * row]) for row in range(completions.shape[0])})


@pytest.mark.parametrize(
    ("attention", "width"),
    [("eager", None), (DECODING_ATTENTION, None), (DECODING_ATTENTION, 8), ("sdpa", 8)],
    ids=["eager", "grouped", "grouped-narrow", "sdpa"],
)
def test_the_loop_decodes_greedily_what_generate_decodes(monkeypatch, attention, width):
    """Left-padded prompts of different lengths, rows ending at EOS at different steps (then padded), all ended
    before ``max_new_tokens`` (the steps run past that cut), or cut at ``max_new_tokens``; with the grouped decoding
    attention reading only the filled part of the cache (``width``), transformers' SDPA all of it."""
    if width is not None:
        monkeypatch.setattr(_static_decoding, "_WIDTH_MULTIPLE", width)
        monkeypatch.setattr(_static_decoding, "_MAX_WIDTHS", 256 // width)  # each multiple of 8 up to the cache's 256
    decoder = _copy("eager" if attention == "eager" else "sdpa")
    decoder.model.set_attn_implementation(attention)
    prompts = _prompts(4, 9, seed=3)
    eos = _ending_at_different_steps(decoder, monkeypatch, prompts, 40)
    outputs = {}
    for new_tokens in (40, 5):
        options = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=1)
        outputs[new_tokens] = _generate(decoder, monkeypatch, False, **prompts, **options)
        assert torch.equal(_generate(decoder, monkeypatch, True, **prompts, **options), outputs[new_tokens])
    completions = outputs[40][:, 9:]
    ends = [int(torch.isin(row, torch.tensor(eos)).nonzero()[0]) for row in completions]
    assert len(set(ends)) > 1 and completions.shape[1] == max(ends) + 1  # all ended, at different steps
    assert completions.shape[1] < 40 - _static_decoding._CHECK_EVERY  # steps the loop ran past the end were cut
    assert all((row[end + 1 :] == 1).all() for row, end in zip(completions, ends, strict=True))  # then padded
    assert outputs[5].shape[1] == 9 + 5
    if width is not None:  # the decoding steps' attention reads the cache up to the filled part rounded up, or all
        read, sdpa = [], F.scaled_dot_product_attention
        spy = lambda q, k, v, **kwargs: read.append(k.shape[-2]) or sdpa(q, k, v, **kwargs)  # noqa: E731
        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        _generate(decoder, monkeypatch, True, **prompts, max_new_tokens=5, eos_token_id=eos, pad_token_id=1)
        filled = 16 if attention == DECODING_ATTENTION else 257  # slots 9 to 12 rounded up to 8, or all 257
        assert read[2:] == [filled] * 8  # 4 steps of 2 layers, after the prefill's


@pytest.mark.parametrize("device", KERNEL_DEVICES[:1])  # (test_kernels_decode_attention.py runs it interpreted)
def test_the_loop_reads_the_whole_cache_through_the_decoding_kernel(monkeypatch, device):
    """Where hf_odc's decoding kernel runs, the loop gives the attention the cache's whole width at every step (one
    width: one CUDA graph on a GPU; the kernel reads only what is filled) and decodes, greedily and ending rows at
    EOS, what ``generate`` decodes with SDPA instead of the kernel."""
    from hf_odc.kernels import _triton_decode
    from hf_odc.kernels import decode_attention as attention

    monkeypatch.setattr(_static_decoding, "_WIDTH_MULTIPLE", 8)  # SDPA would be given widths of 16, 24, ... here
    monkeypatch.setattr(_static_decoding, "_MAX_WIDTHS", 256 // 8)
    decoder = _copy("sdpa")
    decoder.model.set_attn_implementation(DECODING_ATTENTION)
    prompts = _prompts(4, 9, seed=3)
    eos = _ending_at_different_steps(decoder, monkeypatch, prompts, 24)
    widths, kernel = [], _triton_decode.decode_attention
    spy = lambda q, k, v, mask, scale: widths.append(k.shape[2]) or kernel(q, k, v, mask, scale)  # noqa: E731
    monkeypatch.setattr(_triton_decode, "decode_attention", spy)
    options = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=1)
    decoded = _generate(decoder, monkeypatch, True, **prompts, **options)
    assert len(widths) > 2 * 9 and set(widths) == {widths[0]} and widths[0] > 9 + 24  # beyond all ever filled
    monkeypatch.setattr(attention, "KERNEL", False)
    assert torch.equal(decoded, _generate(decoder, monkeypatch, False, **prompts, **options))


@pytest.mark.parametrize("device", KERNEL_DEVICES[1:])
def test_on_a_gpu_the_compiled_recorded_loop_decodes_what_generate_decodes(monkeypatch, device):
    """The loop as the trainers run it on a GPU: compiled by layer (one graph for both layers, one each for the final
    norm and the rotary embedding, on this image's torch), each step replayed from one CUDA graph, the attention the
    decoding kernel. Two batches (the second replays the first's graph) decode, greedily and ending rows at EOS, what
    transformers' ``generate`` decodes eagerly."""
    monkeypatch.setattr(StaticDecoder, "_COMPILE", False)  # generate's reference, eager
    decoder = _copy("sdpa", device=device)
    decoder.model.set_attn_implementation(DECODING_ATTENTION)
    batches = [{k: v.to(device) for k, v in _prompts(4, 9, seed=seed).items()} for seed in (3, 6)]
    eos = _ending_at_different_steps(decoder, monkeypatch, batches[0], 24)
    options = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=1)
    expected = [_generate(decoder, monkeypatch, False, **prompts, **options) for prompts in batches]
    monkeypatch.setattr(StaticDecoder, "_COMPILE", True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for prompts, tokens in zip(batches, expected, strict=True):
        assert torch.equal(_generate(decoder, monkeypatch, True, **prompts, **options), tokens)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    assert len(decoder._loop._graphs) == 1


def test_a_row_that_has_ended_attends_only_to_its_newest_slot(monkeypatch):
    """Once a row has chosen its EOS, the masks the decoding attention is given hold only the row's newest slot (the
    kernel then skips its cache), while the rows still decoding hold their prompt and everything decoded; what the
    loop decodes is what ``generate`` decodes."""
    decoder = _copy("sdpa")
    decoder.model.set_attn_implementation(DECODING_ATTENTION)
    prompts = _prompts(4, 9, seed=3)
    eos = _ending_at_different_steps(decoder, monkeypatch, prompts, 24)
    held, attend = [], decoders.decode_attention
    spy = lambda q, k, v, mask, scale: held.append(mask.sum(-1).tolist()) or attend(q, k, v, mask, scale)  # noqa: E731
    monkeypatch.setattr(decoders, "decode_attention", spy)
    options = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=1)
    decoded = _generate(decoder, monkeypatch, True, **prompts, **options)
    monkeypatch.setattr(decoders, "decode_attention", attend)
    assert torch.equal(decoded, _generate(decoder, monkeypatch, False, **prompts, **options))
    completions = decoded[:, 9:]
    ends = [int(torch.isin(row, torch.tensor(eos)).nonzero()[0]) for row in completions]
    prompt_tokens = prompts["attention_mask"].sum(-1).tolist()
    steps = held[::2]  # 2 layers a step; step j forwards the token chosen j - 1 steps after the prefill's
    assert len(steps) >= max(ends) + 1 and len(set(ends)) > 1
    for step, counts in enumerate(steps, start=1):
        expected = [1 if step > end else tokens + step for end, tokens in zip(ends, prompt_tokens, strict=True)]
        assert counts == expected, step


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "generate"])
def test_the_fused_copy_decodes_what_the_unfused_one_does_with_fewer_projections(monkeypatch, loop):
    """q/k/v and gate/up fused into one projection each: the same logits (fp32 tolerance) and greedy tokens as the
    copy with the layers' own projections, from 4 linear layers a layer instead of 7."""
    fused, unfused = _copy("sdpa"), _copy("sdpa", fuse=False)
    prompts = _prompts(4, 9, seed=3)
    counts = []
    with monkeypatch.context() as patch, torch.no_grad():
        linear = F.linear
        patch.setattr(F, "linear", lambda *args: counts.append(1) or linear(*args))
        logits = [decoder.model(**prompts).logits for decoder in (fused, unfused)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert len(counts) == (4 + 7) * 2 + 2  # 2 layers each, and the head
    options = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=1)
    expected = _generate(unfused, monkeypatch, loop, **prompts, **options)
    assert torch.equal(_generate(fused, monkeypatch, loop, **prompts, **options), expected)
    assert len(set(expected[:, 9:].flatten().tolist())) > 4  # tokens that vary


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_every_fused_family_computes_the_policys_logits(family):
    """Each family of ``FUSED_ATTENTION_CLASSES`` (and its dense MLP where it has one) fused: the policy's logits."""
    from _models import tiny_moe_config
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attn_implementation="eager")  # fmt: skip
    configs = {"llama": lambda: LlamaConfig(**shape), "qwen3": lambda: Qwen3Config(**shape, head_dim=16)}
    config = configs[family]() if family in configs else tiny_moe_config(family)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).eval()
    decoder = StaticDecoder(policy, ODCRuntime(), torch.float32)
    decoder.refresh()
    assert hasattr(decoder.model.model.layers[0].self_attn, "qkv_proj")
    ids = _prompts(2, 7)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(decoder.model(input_ids=ids).logits, policy(input_ids=ids).logits)


@pytest.mark.parametrize("by_layer", [True, False], ids=["layers", "whole"])
def test_the_compiled_loop_decodes_what_generate_decodes_reading_at_most_max_widths_once(monkeypatch, by_layer):
    """The loop's forward compiled (as on a GPU, here by inductor for the CPU), by layer (the default) or whole: the
    same greedy tokens as transformers' ``generate``; a long cache read at no more than ``_MAX_WIDTHS`` widths (the
    multiple raised from 8 to 64 for a 256-slot cache), every one of them by one compiled graph, the last, up to the
    longest sequence the cache is for, too (the cache's spare slot is never read: read whole, its keys would be
    contiguous, a second graph)."""
    monkeypatch.setattr(_static_decoding, "_WIDTH_MULTIPLE", 8)
    monkeypatch.setattr(_static_decoding, "_MAX_WIDTHS", 4)
    decoder = _copy("sdpa")
    decoder.model.set_attn_implementation(DECODING_ATTENTION)
    decoder.compile_layers = by_layer
    prompts = _prompts(3, 9, seed=4)
    options = [dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=1) for n in (140, 240)]
    expected = [_generate(decoder, monkeypatch, False, **prompts, **o) for o in options]
    widths, make = [], _static_decoding.Loop.__init__

    def compiled(self, *args, **kwargs):
        make(self, *args, **{**kwargs, "compile": True})
        forward = self._forward
        self._forward = lambda mask: widths.append(mask.shape[-1]) or forward(mask)

    monkeypatch.setattr(_static_decoding.Loop, "__init__", compiled)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert torch.equal(_generate(decoder, monkeypatch, True, **prompts, **options[0]), expected[0])
    assert sorted(set(widths)) == [64, 128, 192]  # slots 9 to 148: three widths of 64, not 18 of 8
    # One compiled graph for the three (by layer, one for each body: the layers', the final norm's, the rotary's).
    graphs = 3 if by_layer else 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(_generate(decoder, monkeypatch, True, **prompts, **options[1]), expected[1])
    assert sorted(set(widths)) == [64, 128, 192, 256]  # slots 9 to 248, the same cache
    assert decoder._loop.cache.layers[0].keys.shape[2] == 257
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_loop_compiled_by_layer_compiles_one_body_for_every_layer_and_decodes_what_generate_decodes(monkeypatch):
    """``compile_layers`` (the default): inside the decoding step every decoder layer runs one compiled body, compiled
    once for both layers (each is given its own part of the cache, so the body does not specialise on the layer's
    index), the final norm and the rotary embedding each their own, the prefill runs eagerly (its prompt lengths
    compile nothing), and the loop (inductor for the CPU) decodes the tokens ``generate`` does, for two prompt
    lengths."""
    decoder = _copy("sdpa")
    decoder.model.set_attn_implementation(DECODING_ATTENTION)
    options = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=1)
    batches = [_prompts(3, 9, seed=4), _prompts(3, 6, seed=5)]
    expected = [_generate(decoder, monkeypatch, False, **prompts, **options) for prompts in batches]
    graphs, calls, make, compile = [], [], _static_decoding.Loop.__init__, torch.compile

    def recording(graph, inputs):
        graphs.append(graph)
        compiled = torch._dynamo.lookup_backend("inductor")(graph, inputs)
        return lambda *args: calls.append(1) or compiled(*args)

    monkeypatch.setattr(
        _static_decoding.Loop, "__init__", lambda self, *a, **k: make(self, *a, **{**k, "compile": True})
    )
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile(fn, backend=recording, **kwargs))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for prompts, tokens in zip(batches, expected, strict=True):
        assert torch.equal(_generate(decoder, monkeypatch, True, **prompts, **options), tokens)
    # One graph for both layers, one for the final norm, one for the rotary embedding; none for the prefill.
    assert len(graphs) == 3
    layers = decoder.model.config.num_hidden_layers
    assert layers == 2 and len(calls) == 2 * (layers + 2) * (options["max_new_tokens"] - 1)  # at every step


def test_closing_releases_the_loop_and_the_cache_and_a_later_call_decodes_anew(monkeypatch):
    """``close`` (the generator's ``end``, before the process groups go) releases the loop's graphs and drops the
    cache; a later ``generate`` makes both again and decodes the same tokens."""
    decoder = _copy()
    prompts = _prompts(2, 6)
    options = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    first = _generate(decoder, monkeypatch, True, **prompts, **options)
    loop, released = decoder._loop, []
    monkeypatch.setattr(loop, "release", lambda: released.append(loop))
    generator = modes.StaticGenerator(SimpleNamespace(), torch.float32)
    generator.decoder = decoder
    generator.end()
    assert released == [loop] and decoder._loop is None and decoder._cache is None
    assert torch.equal(_generate(decoder, monkeypatch, True, **prompts, **options), first)
    assert decoder._loop is not None and decoder._loop is not loop


def test_a_decoder_is_closed_when_python_exits(monkeypatch):
    """A script that never calls the trainer's ``end()``: the decoder closes at exit (before the process groups are
    torn down), and a decoder already gone leaves nothing to do."""
    hooks = []
    monkeypatch.setattr(decoders.atexit, "register", lambda hook, *args: hooks.append((hook, args)))
    decoder, closed = StaticDecoder(tiny_model(), ODCRuntime(), torch.float32), []
    monkeypatch.setattr(decoder, "close", lambda: closed.append(decoder))
    StaticDecoder(tiny_model(), ODCRuntime(), torch.float32)  # dropped at once
    for hook, args in hooks:
        hook(*args)
    assert len(hooks) == 2 and closed == [decoder]


def test_the_loop_samples_what_generate_samples(monkeypatch):
    """Sampling with temperature, top-k, top-p, min-p and a repetition penalty: from the same generator state the
    loop draws the tokens transformers' generate draws (one exponential race per step, as ``torch.multinomial``);
    top-k 1 is greedy."""
    decoder = _copy("sdpa")
    prompts = _prompts(4, 9, seed=5)
    eos = _ending_at_different_steps(decoder, monkeypatch, prompts, 24)
    cases = [
        dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
        dict(temperature=1.3, repetition_penalty=1.4),
        dict(top_p=0.5, repetition_penalty=0.8),
    ]
    for seed, sampling in enumerate(cases):
        options = dict(max_new_tokens=24, do_sample=True, eos_token_id=eos, pad_token_id=1, **sampling)
        expected = _generate(decoder, monkeypatch, False, seed, **prompts, **options)
        assert torch.equal(_generate(decoder, monkeypatch, True, seed, **prompts, **options), expected), sampling
    greedy = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(
        _generate(decoder, monkeypatch, True, **prompts, do_sample=True, top_k=1, **greedy),
        _generate(decoder, monkeypatch, True, **prompts, do_sample=False, **greedy),
    )


def test_the_loop_records_the_chosen_tokens_log_probabilities(monkeypatch):
    """With ``log_prob_temperature`` set, each sampled token's log-probability under the logits divided by it, taken
    from the logits the loop chose it from, equals the copy's forward over prompt and completion scoring it again
    (what ``max_rollout_staleness=1`` would otherwise run; left-padded prompts, rows ending at different steps)."""
    decoder = _copy("sdpa")
    prompts = _prompts(4, 9, seed=5)
    eos = _ending_at_different_steps(decoder, monkeypatch, prompts, 24)
    options = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_k=20, eos_token_id=eos, pad_token_id=1)
    with _overlap.recording_log_probs(decoder, 0.7):
        out = _generate(decoder, monkeypatch, True, 3, **prompts, **options)
    completions = [
        [int(t) for t in row[: int(torch.isin(row, torch.tensor(eos)).nonzero()[0]) + 1]] for row in out[:, 9:]
    ]
    prompt_ids = [
        [int(t) for t, m in zip(ids, mask, strict=True) if m]
        for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
    ]
    recorded = _overlap.behaviour_log_probs(decoder, prompt_ids, completions, 0.7)
    scored = _overlap._scored(decoder.model, prompt_ids, completions, 0.7)
    assert decoder.log_prob_temperature is None and decoder.last_log_probs.shape == (4, out.shape[1] - 9)
    assert [len(r) for r in recorded] == [len(c) for c in completions] and len({len(c) for c in completions}) > 1
    for mine, theirs in zip(recorded, scored, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    _generate(decoder, monkeypatch, True, 3, **prompts, **options)  # not recording: nothing kept
    assert decoder.last_log_probs is None


@pytest.mark.parametrize(
    ("options", "steps"),
    [
        ({"temperature": 0.5, "top_k": 3}, ["Temperature", "TopK"]),
        ({"top_p": 0.6, "top_k": 0}, ["TopP"]),
        ({"top_p": 0.999}, ["TopK", "TopP"]),  # transformers' default top_k (50) too
        ({"min_p": 0.2, "top_k": 0}, ["MinP"]),
        (
            {"temperature": 2.0, "top_k": 5, "top_p": 0.7, "min_p": 0.1, "repetition_penalty": 1.5},
            ["RepetitionPenalty", "Temperature", "TopK", "TopP", "MinP"],
        ),
        ({"do_sample": False, "repetition_penalty": 0.5}, ["RepetitionPenalty"]),
    ],
    ids=["temperature-top-k", "top-p", "top-p-near-1", "min-p", "all", "greedy-penalty"],
)
def test_the_loops_processing_equals_transformers_processors(options, steps):
    """On hand-made logits (ties, a dominant token, negative and positive logits) the loop's processing, read from the
    processors transformers' ``generate`` builds for the options, gives what those processors give."""
    from transformers import GenerationConfig

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, VOCAB, generator=g) * 3
    scores[1, :10] = 2.0  # ties at the top
    scores[2, 7] = 40.0  # one token with almost all the mass
    input_ids = torch.randint(0, VOCAB, (4, 6), generator=g)
    mask = torch.ones_like(input_ids)
    mask[3, :2] = 0  # a left-padded row: its padding is not penalised
    config = GenerationConfig(**{"do_sample": True, **options})
    setup = _compat.generation_setup(tiny_model(), config, {"input_ids": input_ids, "attention_mask": mask})
    assert [
        type(p).__name__.removesuffix("LogitsWarper").removesuffix("LogitsProcessor") for p in setup.processors
    ] == (steps)
    sampling = _static_decoding._sampling(setup.processors, config.do_sample)
    counted = torch.arange(6)[None, :] >= mask.argmax(dim=1)[:, None]
    seen = torch.zeros(4, VOCAB + 1, dtype=torch.bool).scatter_(1, input_ids.masked_fill(~counted, VOCAB), True)
    expected = setup.processors(input_ids, scores.clone())
    assert torch.equal(processed_scores(scores.clone(), sampling, seen[:, :VOCAB]), expected)


@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 2},
        {"num_return_sequences": 2, "do_sample": True},
        {"return_dict_in_generate": True},
        {"no_repeat_ngram_size": 2},
        {"typical_p": 0.5, "do_sample": True},
        {"logits_processor": "list"},
        {"stopping_criteria": "list"},
        {"attention_mask": None},
        {"wrapped": "generate"},
    ],
    ids=lambda options: next(iter(options)),
)
def test_what_the_loop_does_not_decode_goes_through_transformers_generate(monkeypatch, options):
    """Beam search, several sequences, a dict output, processors the loop lacks, the caller's own processors or
    criteria, no attention mask, a ``generate`` wrapped around transformers' (as the tool tests' scripted policy)."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    decoder = _copy()
    prompts = _prompts(2, 6)
    if options.get("logits_processor") == "list":
        options = {"logits_processor": LogitsProcessorList([lambda input_ids, scores: scores])}
    if options.get("stopping_criteria") == "list":
        options = {"stopping_criteria": StoppingCriteriaList([lambda input_ids, scores: False])}
    if "attention_mask" in options:
        prompts, options = {"input_ids": prompts["input_ids"]}, {}
    if "wrapped" in options:  # as hf_odc.demo.tools.scripted_generation wraps it to force tokens
        from transformers import GenerationMixin

        wrapped = GenerationMixin.generate
        monkeypatch.setattr(GenerationMixin, "generate", lambda *args, **kwargs: wrapped(*args, **kwargs))
        options = {}
    plan, plans = _static_decoding.decoding_plan, []
    monkeypatch.setattr(_static_decoding, "decoding_plan", lambda *args: plans.append(plan(*args)) or plans[-1])
    monkeypatch.setattr(_static_decoding.Loop, "decode", lambda *args: pytest.fail("the loop decoded"))
    out = decoder.model.generate(**prompts, max_new_tokens=4, pad_token_id=0, **options)
    assert plans == [None] and out is not None  # refused by the loop, decoded by transformers


@pytest.mark.parametrize(
    ("tools", "odc", "mode"), [(False, True, "lockstep"), (True, True, "sharded"), (True, False, "lockstep")]
)
def test_where_no_copy_fits_a_sharded_policy_decodes_in_lockstep_unless_odc_runs_tools(monkeypatch, tools, odc, mode):
    """The last resort, by measured speed: ``"sharded"`` is slower per step than lockstep and the slowest rank steps
    to the longest completion in both, so it is chosen only where lockstep cannot run: tools under ODC (each rank
    decodes its own number of turns)."""
    policy = tiny_model()
    free = sum(p.numel() for p in policy.parameters())  # half a bf16 copy: neither static nor gathered fits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 10 * free))
    monkeypatch.setattr(modes, "FSDPModule", nn.Module)  # the policy counts as sharded
    monkeypatch.setattr(modes, "_tensor_parallel_size", lambda model: 1)  # nothing to slice over
    runtime = SimpleNamespace(active=odc)
    chosen = choose_generation_mode(None, policy, runtime, torch.bfloat16, torch.device("cuda", 0), tools=tools)
    assert chosen == mode
