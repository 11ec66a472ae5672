"""``hf_odc.trainer.generation.vllm_sync`` without vLLM: what a sync hands a (stand-in) engine or server, in which
order, under which names, and PEFT's adapters merged as PEFT merges them. The real engine and server:
tests/distributed/test_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _models import tiny_qwen2_config
from transformers import Qwen2ForCausalLM

from hf_odc.accelerate_plugin import ODCRuntime
from hf_odc.trainer.generation.full_weights import full_named_weights
from hf_odc.trainer.generation.vllm_sync import ODCWeightSync


class _Worker:
    """A vLLM worker as ``LLM.collective_rpc`` reaches it; its model runner reloads from an iterator when ``reloads``
    (vLLM's ``reload_weights``), else only the model's ``load_weights`` takes new weights."""

    def __init__(self, events: list, reloads: bool):
        self.events = events
        self.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load))
        if reloads:
            self.model_runner.reload_weights = self._reload

    def reload_weights(self, *args, **kwargs):
        return self.model_runner.reload_weights(*args, **kwargs)

    def _reload(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        assert is_checkpoint_format
        self._load(weights_iterator, "reload")

    def _load(self, weights, how="load_weights"):
        self.events.append((how, [(name, tensor.clone()) for name, tensor in weights]))


class _LLM:
    def __init__(self, events: list, reloads: bool):
        self.events, self.worker = events, _Worker(events, reloads)

    def collective_rpc(self, method, args=(), kwargs=None):
        function = (
            getattr(self.worker, method) if isinstance(method, str) else lambda *a, **k: method(self.worker, *a, **k)
        )
        return [function(*args, **(kwargs or {}))]

    def wake_up(self, tags):
        self.events.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))


def _colocated(reloads: bool, sleep: bool = False) -> SimpleNamespace:
    events = []
    return SimpleNamespace(
        mode="colocate", llm=_LLM(events, reloads), enable_sleep_mode=sleep, _llm_weights_sleeping=sleep, events=events
    )


@pytest.fixture
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=False))


def _pushed(events: list) -> dict[str, torch.Tensor]:
    loads = [event for event in events if event[0] in ("reload", "load_weights")]
    assert len(loads) == 1
    return dict(loads[0][1])


@pytest.mark.parametrize("reloads", [True, False], ids=["reload_weights", "load_weights"])
def test_colocated_sync_loads_every_weight_then_resets_the_prefix_cache(model, reloads):
    generation = _colocated(reloads)
    sync = ODCWeightSync.install(generation, model, ODCRuntime())
    assert generation.sync_weights is sync
    sync()
    assert [event[0] for event in generation.events] == ["reload" if reloads else "load_weights", "reset_prefix_cache"]
    pushed = _pushed(generation.events)
    assert list(pushed) == [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        assert torch.equal(pushed[name], param.detach())


def test_sleep_mode_wakes_the_weights_before_loading(model):
    generation = _colocated(reloads=True, sleep=True)
    ODCWeightSync.install(generation, model, ODCRuntime())()
    assert generation.events[0] == ("wake_up", ["weights"])
    assert generation.events[1][0] == "reload"
    assert generation._llm_weights_sleeping is False  # TRL's generate() would otherwise push again


def test_server_sync_announces_what_it_streams_from_rank_0(model):
    calls = []

    class Client:
        def update_named_params(self, metadata, named_params):
            calls.append(("update", metadata, [(n, t.dtype, list(t.shape)) for n, t in named_params]))

        def reset_prefix_cache(self):
            calls.append(("reset",))

    generation = SimpleNamespace(mode="server", vllm_client=Client(), accelerator=SimpleNamespace(is_main_process=True))
    ODCWeightSync.install(generation, model, ODCRuntime())()
    assert [call[0] for call in calls] == ["update", "reset"]
    _, metadata, streamed = calls[0]
    assert [(n, d, s) for n, d, s in metadata] == [(n, str(d).removeprefix("torch."), s) for n, d, s in streamed]
    assert sorted(n for n, *_ in metadata) == sorted(name for name, _ in model.named_parameters())


def _lora(model, **options):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **options)
    lora = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    for name, param in lora.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: a merge would change nothing
            torch.nn.init.normal_(param)
    return lora


def test_lora_adapters_are_merged_as_peft_merges_them(model):
    lora = _lora(model)
    weights = {name: tensor.clone() for name, tensor in full_named_weights(lora, ODCRuntime())}
    merged = lora.merge_and_unload()
    assert sorted(weights) == sorted(name for name, _ in merged.named_parameters())
    for name, param in merged.named_parameters():
        torch.testing.assert_close(weights[name], param.detach(), rtol=0, atol=0, msg=name)


def test_a_lora_variant_is_refused_when_the_sync_is_built(model):
    lora = _lora(model, use_dora=True)
    with pytest.raises(NotImplementedError, match="DoRA"):
        ODCWeightSync(SimpleNamespace(mode="server"), lora, ODCRuntime())


@pytest.mark.slow
def test_the_sharded_policy_reaches_vllm_without_a_collective():
    """2 processes, a LoRA policy sharded with ODC: every rank loads the merged full weights into its engine, rank 0
    alone streams them to the server (twice: the first sync also reads what to announce), and no collective runs."""
    from _dist import launch
    from _engine_workers import Case, vllm_sync

    results = launch(vllm_sync, 2, Case(splits=[[0], [1]], lora=True), timeout=180)
    reference = results[0]["reference"]
    for rank, result in enumerate(results):
        assert result["collectives"] == [], f"rank {rank}"
        loaded = dict(result["loaded"])
        assert sorted(loaded) == sorted(reference), f"rank {rank}"
        for name, tensor in reference.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=f"rank {rank}: {name}")
    assert results[1]["streamed"] == []
    assert len(results[0]["streamed"]) == 2
    for metadata, tensors in results[0]["streamed"]:
        assert metadata == [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]
        for name, tensor in tensors:
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
