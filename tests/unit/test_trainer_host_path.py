"""What the trainers do on the host between the loader and the device, where a step's wall time can hide outside its
device-timed minibatch: the loader pins nothing, inputs are copied without waiting for the device, and cuDNN's
attention plans are built for the training data's lengths before the first step, and Python's collector runs between
steps only."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_odc.trainer.core._base_trainer as base_trainer
from hf_odc.demo import build_tokenizer, chat_dataset
from hf_odc.demo.models import MODEL_CONFIGS
from hf_odc.kernels.attention import sdpa_length
from hf_odc.trainer import ODCSFTConfig, ODCSFTTrainer
from hf_odc.trainer.core import _collector
from hf_odc.trainer.core._collector import StepCollector
from hf_odc.trainer.core.attention import warm_attention_plans


def _sft_trainer(tmp_path, length: int = 64, **config) -> ODCSFTTrainer:
    tokenizer = build_tokenizer()
    shape = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id} | MODEL_CONFIGS["tiny"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape))
    args = ODCSFTConfig(str(tmp_path), report_to="none", max_length=length, per_device_train_batch_size=4, use_cpu=True,
                        cost_model="tokens", **config)  # fmt: skip
    dataset = chat_dataset(8, length, "swe-smith", seed=0)
    return ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.mark.parametrize("warm", [True, False])
def test_the_trainer_warms_the_attention_plans_of_its_training_documents(tmp_path, monkeypatch, warm):
    """``warm_attention_plans`` (the default) hands the prepared dataset's sample lengths, SFT's documents, to the
    warm-up when ``train`` starts, for the training passes (SFT runs no forward-only pass), and the step that follows
    finds them warmed; ``False`` warms nothing."""
    calls = []
    monkeypatch.setattr(base_trainer, "warm_attention_plans", lambda *args: calls.append(args))
    trainer = _sft_trainer(tmp_path, warm_attention_plans=warm, max_steps=1, save_strategy="no")
    assert calls == []  # not at construction
    trainer.train()
    trainer.end()
    if not warm:
        assert calls == []
        return
    ((model, documents, device, dtype, backward),) = calls
    assert documents == [len(ids) for ids in trainer.train_dataset["input_ids"]] and len(documents) == 8
    assert model is trainer.model and device == torch.device("cpu") and dtype == torch.float32 and backward


def test_every_step_warms_the_minibatch_lengths_met_for_the_first_time_before_its_microbatches(tmp_path, monkeypatch):
    """Where the trainer does not know its data's lengths first, each step hands the lengths of the whole minibatch
    (the same on every rank) that no earlier step met, rounded as SDPA attends them, to the warm-up before it runs its
    microbatches: a length is warmed once per run."""
    events = []
    monkeypatch.setattr(base_trainer, "warm_attention_plans", lambda model, lengths, *_: events.append(list(lengths)))
    trainer = _sft_trainer(tmp_path, 1024, max_steps=2, save_strategy="no")
    trainer._training_documents = lambda: None
    run_minibatch = trainer._run_minibatch
    trainer._run_minibatch = lambda model, step: events.append(step.attended_lengths()) or run_minibatch(model, step)
    trainer.train()
    trainer.end()
    assert len(events) == 4  # warm-up, minibatch, warm-up, minibatch: nothing was warmed when training started
    (first_warmed, first_step, second_warmed, second_step) = events
    assert first_warmed == first_step and first_step
    met = {sdpa_length(length) for length in first_step}
    assert second_warmed == [length for length in second_step if sdpa_length(length) not in met]
    assert second_warmed and len(second_warmed) < len(second_step)  # the data meets old and new lengths


def test_warming_skips_the_cpu(tmp_path):
    """On the CPU (no per-length plans) the warm-up attends nothing."""
    trainer = _sft_trainer(tmp_path, warm_attention_plans=False)
    trainer.end()
    assert warm_attention_plans(trainer.model, [4096, 8192], torch.device("cpu"), torch.float32) == 0


def test_the_loader_pins_nothing_and_inputs_are_copied_without_waiting(tmp_path, monkeypatch):
    """The loader's items are token lists, which pinning would walk element by element (``dataloader_pin_memory``,
    asked for here, is not applied); every tensor of a microbatch, however nested, goes to the device with
    ``non_blocking=True`` (a blocking copy waits for every queued kernel)."""
    trainer = _sft_trainer(tmp_path, warm_attention_plans=False)
    trainer.end()
    trainer.args.dataloader_pin_memory = True  # a CPU config turns it off itself
    assert trainer.get_train_dataloader().pin_memory is False
    copies = []
    to = torch.Tensor.to

    def recorded(tensor, *args, **kwargs):
        copies.append(kwargs.get("non_blocking"))
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recorded)
    inputs = {"model": {"input_ids": torch.ones(1, 3)}, "pairs": [torch.zeros(2), (torch.ones(1), "label")], "n": 3}
    moved = trainer._to_device(inputs)
    assert copies == [True, True, True]
    assert isinstance(moved["pairs"][1], tuple) and moved["pairs"][1][1] == "label" and moved["n"] == 3
    torch.testing.assert_close(moved["model"]["input_ids"], inputs["model"]["input_ids"])


@pytest.mark.parametrize("manual", [True, False])
def test_the_collector_runs_before_each_minibatch_and_never_inside_one(tmp_path, monkeypatch, manual):
    """``manual_gc`` (the default): for the run of ``train`` Python's collector is off, what was alive when training
    began is frozen, and each step collects before its minibatch (every generation at the first step, then the young
    ones); afterwards the collector is on and nothing frozen. ``False``: the collector runs by itself, as before."""
    events = []
    record = lambda generation=2: events.append(("collect", generation)) or gc.collect(generation)  # noqa: E731
    functions = {
        name: getattr(gc, name) for name in ("isenabled", "freeze", "unfreeze", "enable", "disable", "get_freeze_count")
    }
    monkeypatch.setattr(_collector, "gc", SimpleNamespace(collect=record, **functions))  # its own collections only
    trainer = _sft_trainer(tmp_path, manual_gc=manual, max_steps=3, save_strategy="no")
    run_minibatch = trainer._run_minibatch

    def minibatch(model, step):
        events.append(("minibatch", gc.isenabled(), gc.get_freeze_count() > 0))
        return run_minibatch(model, step)

    trainer._run_minibatch = minibatch
    events.clear()
    trainer.train()
    trainer.end()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    steps = [event for event in events if event[0] == "minibatch" or manual]
    if manual:
        assert steps[:2] == [("collect", 2), ("collect", 2)]  # at the start, before the freeze; the first step's
        assert steps[2:] == [("minibatch", False, True), ("collect", 1), ("minibatch", False, True), ("collect", 1),
                             ("minibatch", False, True)]  # fmt: skip
    else:
        assert steps == [("minibatch", True, False)] * 3


def test_the_collector_is_restored_when_training_fails_and_left_alone_when_the_script_turned_it_off():
    collector = StepCollector(True)
    with pytest.raises(RuntimeError), collector.training():
        assert not gc.isenabled() and collector.active
        raise RuntimeError("a failed step")
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not collector.active
    gc.disable()
    try:
        with collector.training():
            assert not collector.active  # the script manages the collector: before_step collects nothing
    finally:
        gc.enable()


def test_the_collector_leaves_another_owners_freeze_frozen():
    """Objects frozen before training (vLLM's engine freezes the process at its start and unfreezes it at its
    shutdown) stay frozen after it: unfreezing them let a finished engine be collected, and its finalizer destroyed
    the default process group under the next trainer."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        collector = StepCollector(True)
        with collector.training():
            assert not gc.isenabled() and collector.active and gc.get_freeze_count() == frozen
        assert gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
