"""``ODCPlugin``: validated fields with ``HF_ODC_*`` fallbacks; ``ODCRuntime`` runs a plain Accelerate loop with ODC."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from _dist import launch
from _trainer_launch import run
from _trainer_workers import shard_under_an_accelerate_fsdp_config
from torch.distributed.fsdp import MixedPrecisionPolicy

from hf_odc.accelerate_plugin import ODCPlugin, ODCRuntime, mixed_precision_policy, remap_optimizer
from hf_odc.liveness import DEFAULT_TIMEOUT_S, heartbeat


def test_fields_fall_back_to_the_environment(monkeypatch):
    for name in ("ENABLED", "TIMEOUT", "RESHARD_AFTER_FORWARD"):
        monkeypatch.delenv(f"HF_ODC_{name}", raising=False)
    default = ODCPlugin()
    assert (default.enabled, default.timeout, default.reshard_after_forward) == (True, DEFAULT_TIMEOUT_S, None)
    monkeypatch.setenv("HF_ODC_ENABLED", "0")
    monkeypatch.setenv("HF_ODC_TIMEOUT", "30")
    monkeypatch.setenv("HF_ODC_RESHARD_AFTER_FORWARD", "false")
    from_env = ODCPlugin()
    assert (from_env.enabled, from_env.timeout, from_env.reshard_after_forward) == (False, 30.0, False)
    explicit = ODCPlugin(enabled=True, timeout=5)  # explicit fields win over the environment
    assert (explicit.enabled, explicit.timeout) == (True, 5.0)


def test_the_odc_timeout_is_the_process_s_from_the_plugin_built_last(monkeypatch, tmp_path):
    """The process's ODC timeout (the heartbeat's bound, what ``hf_odc.enable`` runs on by default) is resolved in one
    place: unset, ``HF_ODC_TIMEOUT``; then what an ``ODCPlugin`` is built with, a trainer's config's ``odc_timeout``
    included (its plugin is built before the process group exists)."""
    from hf_odc.trainer import ODCSFTConfig

    monkeypatch.setattr(heartbeat, "_timeout", None)  # as in a fresh process; restored after the test
    monkeypatch.setenv("HF_ODC_TIMEOUT", "30")
    assert heartbeat.current_timeout() == 30.0
    assert ODCPlugin(timeout=7).timeout == heartbeat.current_timeout() == 7.0
    config = ODCSFTConfig(str(tmp_path), odc_timeout=9, report_to="none")
    assert config.odc_timeout == heartbeat.current_timeout() == 9.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enabled": "maybe"}, "must be a boolean"),
        ({"timeout": -1}, "positive and finite"),
        ({"timeout": float("inf")}, "positive and finite"),
        ({"timeout": "soon"}, "number of seconds"),
        ({"reshard_after_forward": "2"}, "must be a boolean"),
        ({"transport": "nvshmem"}, "must be one of"),
    ],
)
def test_invalid_fields_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ODCPlugin(**kwargs)


def test_invalid_environment_is_refused(monkeypatch):
    monkeypatch.setenv("HF_ODC_ENABLED", "yes please")
    with pytest.raises(ValueError, match="HF_ODC_ENABLED"):
        ODCPlugin()


@pytest.mark.parametrize("old", ["ODC_ENABLED", "ODC_TIMEOUT", "ODC_RESHARD_AFTER_FORWARD"])
def test_the_old_variable_names_are_refused_with_the_new_one(monkeypatch, old):
    monkeypatch.setenv(old, "1")
    with pytest.raises(ValueError, match=f"{old} is now HF_{old}"):
        ODCPlugin()


def test_disabled_runtime_has_no_handle_and_times_the_plain_model():
    runtime = ODCRuntime(ODCPlugin(enabled=False))
    with runtime.minibatch():  # before enable(): nothing to time
        pass
    assert runtime.odc is None and runtime.last is None and not runtime.active
    runtime.enable(torch.nn.Linear(2, 2))  # one process, not sharded: the model runs as it is
    with runtime.minibatch():
        time.sleep(0.05)
    assert runtime.odc is None and not runtime.active
    assert runtime.last.busy >= 0.05 and runtime.last.step == pytest.approx(runtime.last.busy, abs=0.02)


def test_mixed_precision_policy_follows_the_accelerator():
    assert mixed_precision_policy(SimpleNamespace(mixed_precision="no")) == MixedPrecisionPolicy()
    bf16 = mixed_precision_policy(SimpleNamespace(mixed_precision="bf16"))
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    own = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fsdp = SimpleNamespace(
        mixed_precision="bf16", state=SimpleNamespace(fsdp_plugin=SimpleNamespace(mixed_precision_policy=own))
    )
    assert mixed_precision_policy(fsdp) is own
    with pytest.raises(ValueError, match="fp16"):
        mixed_precision_policy(SimpleNamespace(mixed_precision="fp16"))


def test_remap_optimizer_points_at_the_new_parameters_and_refuses_a_stepped_one():
    old, new = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(old.parameters(), lr=0.1)
    remap_optimizer(optimizer, {id(p): n for n, p in old.named_parameters()}, new)
    assert optimizer.param_groups[0]["params"] == list(new.parameters())
    stepped = torch.optim.Adam(old.parameters())
    old(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already taken a step"):
        remap_optimizer(stepped, {id(p): n for n, p in old.named_parameters()}, new)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "single.json"
    run("accelerate_odc.py", "--output", str(path))
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("enabled", ["1", "0"], ids=["odc-lb-mini", "fsdp2-lb-micro"])
def test_plain_accelerate_loop_matches_a_single_process(single_process, tmp_path, enabled):
    """examples/accelerate_odc.py on 2 processes (ODC + LB-Mini, or plain FSDP2 + LB-Micro) vs 1 process."""
    path = tmp_path / "run.json"
    run("accelerate_odc.py", "--output", str(path), processes=2, env={"HF_ODC_ENABLED": enabled})
    distributed = json.loads(path.read_text())
    assert len(distributed) == len(single_process) == 5
    for ours, reference in zip(distributed, single_process, strict=True):
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-4)
        assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_sharding_under_an_accelerate_fsdp_config():
    """One FSDP group per decoder layer plus the root, fp32 master weights under a bf16 policy, and Accelerate's
    later ``prepare`` still finds nothing to re-wrap."""
    results = launch(shard_under_an_accelerate_fsdp_config, 2, timeout=120)
    assert results[0] == results[1]
    assert results[0]["groups"] == ["", "model.layers.0", "model.layers.1"]
    assert results[0]["dtypes"] == ["torch.float32"] and results[0]["param_dtype"] == "torch.bfloat16"
