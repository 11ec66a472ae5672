"""Accelerate's ``parallelism_config`` taken over by hf_odc: ``sp_size`` read from a ``ParallelismConfig`` or from
what ``accelerate launch`` exports from the yaml, everything ODC cannot honour refused in one line, and the
``Accelerator`` built without it (the end-to-end run is ``tests/parity/test_sft_sequence_parallel.py``)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from accelerate import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig

from hf_odc.accelerate_plugin import (
    ODCPlugin,
    accelerate_without_parallelism,
    parallelism_config_from,
    sequence_parallel_size,
)
from hf_odc.trainer import ODCDPOConfig, ODCGRPOConfig, ODCSFTConfig

LAUNCHED = {  # what `accelerate launch` exports for a yaml with `parallelism_config: {parallelism_config_sp_size: 2}`
    "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
    "PARALLELISM_CONFIG_TP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_SIZE": "1",
    "PARALLELISM_CONFIG_CP_BACKEND": "torch",
    "PARALLELISM_CONFIG_SP_SIZE": "2",
    "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "None",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE": "True",
    "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa",
}


@pytest.fixture
def launched(monkeypatch):
    """The environment of a process that ``accelerate launch`` started with that yaml; ``launched(NAME=value)``
    changes one of its variables (``PARALLELISM_CONFIG_NAME``)."""

    def set_up(**changes: str) -> None:
        for name, value in (LAUNCHED | {f"PARALLELISM_CONFIG_{k}": v for k, v in changes.items()}).items():
            monkeypatch.setenv(name, value)

    return set_up


def test_the_size_comes_from_the_launcher_or_a_parallelism_config(monkeypatch, launched):
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert sequence_parallel_size() == 1 and ODCPlugin().sp_size == 1
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")  # without the launcher's switch, Accelerate ignores it too
    assert sequence_parallel_size() == 1
    assert sequence_parallel_size(ParallelismConfig(sp_size=4)) == 4
    launched()
    assert sequence_parallel_size() == 2 and ODCPlugin().sp_size == 2
    assert sequence_parallel_size(ParallelismConfig(sp_size=4)) == 4  # as in Accelerate, the argument wins
    assert ODCPlugin(sp_size=1).sp_size == 1


def test_the_trainer_config_takes_it_over(tmp_path, launched):
    launched()
    assert ODCSFTConfig(str(tmp_path), report_to="none").sp_size == 2
    given = ParallelismConfig(sp_size=4)
    args = ODCSFTConfig(str(tmp_path), report_to="none", parallelism_config=given)
    assert args.sp_size == 4 and args.parallelism_config is given  # kept for the record, hidden from Accelerate


@pytest.mark.parametrize("config_class", [ODCDPOConfig, ODCGRPOConfig])
def test_every_splitting_trainer_config_takes_a_parallelism_config(tmp_path, config_class):
    """``ParallelismConfig(sp_size=N)`` in Python reaches DPO's and GRPO's configs too: TRL's own ``__post_init__``
    does not see it (its GRPOConfig refuses any ``sp_size`` above 1, which hf_odc runs itself)."""
    given = ParallelismConfig(sp_size=2)
    args = config_class(str(tmp_path), report_to="none", parallelism_config=given)
    assert args.sp_size == 2 and args.parallelism_config is given


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ParallelismConfig(cp_size=4), r"cp_size=4 \(ring attention\) is not supported by hf_odc; use sp_size=4"),
        (ParallelismConfig(tp_size=2), "tp_size=2 is not supported by hf_odc"),
        (ParallelismConfig(dp_shard_size=2), "dp_shard_size=2 is not supported .* odc_shard_size"),
        (ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), "dp_replicate_size=2 is not supported"),
        (
            ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=64)),
            "sp_seq_length=64 does not apply to hf_odc",
        ),
        (
            ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")),
            None,
        ),
        (
            ParallelismConfig(
                sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="flash_attention_2")
            ),
            "sp_attn_implementation='flash_attention_2' does not apply to hf_odc",
        ),
    ],
    ids=["cp", "tp", "dp-shard", "dp-replicate", "seq-length", "sdpa", "attn"],
)
def test_what_odc_cannot_honour_is_refused_in_one_line(config, message):
    if message is None:
        assert sequence_parallel_size(config) == 2
        return
    with pytest.raises(ValueError, match=message) as refusal:
        sequence_parallel_size(config)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"CP_SIZE": "2"}, r"the Accelerate config's parallelism_config: cp_size=2 \(ring attention\) .* sp_size=2"),
        ({"SP_SIZE": "two"}, "sp_size must be a positive integer, got 'two'"),
        ({"SP_SEQ_LENGTH_IS_VARIABLE": "False"}, "sp_seq_length_is_variable=false does not apply"),
    ],
    ids=["cp", "not-a-number", "fixed-length"],
)
def test_what_the_launcher_exports_is_checked_alike(launched, changes, message):
    launched(**changes)
    with pytest.raises(ValueError, match=message) as refusal:
        ODCPlugin()
    assert "\n" not in str(refusal.value)


def test_the_accelerator_is_built_without_it(monkeypatch, launched):
    """While the ``Accelerator`` is built it gets no ``parallelism_config`` and the launcher's switch is off, so it
    builds none from the environment; both come back after, and nothing is set that was not there."""
    launched()
    given = ParallelismConfig(sp_size=2)
    args = SimpleNamespace(parallelism_config=given)
    with accelerate_without_parallelism(args):
        assert args.parallelism_config is None and os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"
    assert args.parallelism_config is given and os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG")
    with accelerate_without_parallelism(args):
        assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ


def test_a_command_line_gives_it_as_json(tmp_path):
    """``--parallelism_config '{"sp_size": 2}'`` (the examples' flag) reaches the config as text: read as a
    ``ParallelismConfig``, in the yaml's spelling too; what is not one is refused in one line."""
    args = ODCSFTConfig(str(tmp_path), report_to="none", parallelism_config='{"sp_size": 2}')
    assert isinstance(args.parallelism_config, ParallelismConfig) and args.sp_size == 2
    assert sequence_parallel_size({"parallelism_config_sp_size": 4}) == 4
    assert parallelism_config_from({"sp_size": 2, "sp_seq_length": 64}).sp_handler.sp_seq_length == 64
    for given, message in [("sp_size=2", "must be a JSON object such as"), ('{"sp_sise": 2}', "has no key sp_sise")]:
        with pytest.raises(ValueError, match=message) as refusal:
            ODCSFTConfig(str(tmp_path), report_to="none", parallelism_config=given)
        assert "\n" not in str(refusal.value)
