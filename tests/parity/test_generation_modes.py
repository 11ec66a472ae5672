"""ODCGRPOTrainer decodes on each rank alone: greedy rollouts of the ``"static"``, ``"gathered"`` and ``"sharded"``
modes equal TRL's lockstep decoding token for token, with no all-gather while decoding (ODC reads one-sidedly; the
plain FSDP2 baseline gathers once per group per generation batch), the rank whose completions end first stops decoding
then, instead of running dummy forwards until the longest completion anywhere ends, and the static copy holds the
policy's weights each time the trainer generates. The ``"tensor-parallel"`` mode's ranks decode together on their
slices of the copy: the same tokens, no weight all-gather, two all-reduces of activations per layer per forward."""

from __future__ import annotations

import math

import pytest
import torch
from _models import tiny_qwen2_config
from _parity import run_checked
from transformers import Qwen2ForCausalLM

from hf_odc.demo import build_tokenizer
from hf_odc.trainer.generation import _static_decoding

pytestmark = pytest.mark.slow  # every test starts processes
MODES = (
    "lockstep", "static", "static-generate", "gathered", "sharded", "gathered-fsdp2", "tensor-parallel",
    "tensor-parallel-generate",
)  # fmt: skip
FSDP_GROUPS = 3  # two decoder layers and the root


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generation_modes")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = tiny_qwen2_config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    Qwen2ForCausalLM(config).save_pretrained(directory / "model")
    out = directory / "traces.pt"
    run_checked("_generation_modes.py", str(directory / "model"), str(out), *MODES, processes=2,
                env={"TRL_EXPERIMENTAL_SILENCE": "1"})  # fmt: skip
    return torch.load(out)


def test_every_mode_decodes_the_same_tokens(traces):
    for rank in (0, 1):
        expected = traces["lockstep"][rank]["completions"]
        assert expected and all(traces[mode][rank]["completions"] == expected for mode in MODES), rank


def test_no_all_gather_while_decoding_with_odc_and_one_per_group_without(traces):
    longest = [max(map(len, traces["lockstep"][rank]["completions"])) for rank in (0, 1)]
    assert all(traces["lockstep"][rank]["all_gathers"] >= FSDP_GROUPS * max(longest) for rank in (0, 1))  # traced
    odc = ("static", "static-generate", "gathered", "sharded", "tensor-parallel", "tensor-parallel-generate")
    # (tensor-parallel's LM head stays whole: the 2 ranks do not divide the tokenizer's 507 words; no logits gathered)
    assert all(traces[mode][rank]["all_gathers"] == 0 for mode in odc for rank in (0, 1))
    assert all(traces["gathered-fsdp2"][rank]["all_gathers"] == FSDP_GROUPS for rank in (0, 1))


def test_a_rank_stops_decoding_when_its_own_completions_end(traces):
    """Every mode but lockstep stops when the rank's own completions end; hf_odc's static decoding loop asks whether
    its rows have ended every ``_CHECK_EVERY`` steps, and stops at the first check after that."""
    longest = [max(map(len, traces["lockstep"][rank]["completions"])) for rank in (0, 1)]
    assert longest[0] < longest[1]  # the prompts make the ranks' completions end at different lengths
    assert traces["lockstep"][0]["forwards"] == traces["lockstep"][1]["forwards"] >= longest[1]  # lockstep
    for mode in ("static", "static-generate", "gathered", "sharded", "gathered-fsdp2"):
        forwards = [traces[mode][rank]["forwards"] for rank in (0, 1)]
        every = _static_decoding._CHECK_EVERY if mode == "static" else 1  # the loop is static's default
        bound = math.ceil((longest[0] + 1) / every) * every
        assert forwards[0] < forwards[1] and forwards[0] <= bound, (mode, forwards, longest)
    # Tensor-parallel: the ranks decode the group's prompts together, until the longest completion of either ends.
    for mode in ("tensor-parallel", "tensor-parallel-generate"):
        forwards = [traces[mode][rank]["forwards"] for rank in (0, 1)]
        every = 1 if mode.endswith("-generate") else _static_decoding._CHECK_EVERY  # the loop is its default
        assert forwards[0] == forwards[1] <= math.ceil((longest[1] + 1) / every) * every, (mode, forwards, longest)


def test_tensor_parallel_decoding_sums_the_row_parallel_outputs_over_the_ranks(traces):
    """Two all-reduces (after ``o_proj`` and ``down_proj``) per decoder layer per forward, on every rank."""
    for rank in (0, 1):
        for mode in ("tensor-parallel", "tensor-parallel-generate"):
            record = traces[mode][rank]
            assert record["forwards"] and record["all_reduces"] == 2 * 2 * record["forwards"], (mode, rank)


@pytest.mark.parametrize("mode", ["static", "static-generate", "tensor-parallel", "tensor-parallel-generate"])
def test_the_decoding_copy_is_refreshed_each_time_the_trainer_generates(traces, mode):
    for rank in (0, 1):
        record = traces[mode][rank]
        # odc_decoding_loop chooses hf_odc's loop (the default of both modes) or transformers' generate
        assert record["loop"] == (not mode.endswith("-generate")), mode
        assert record["stale"] > 1e-4  # the step's update moved the policy away from the copy it decoded with
        assert record["refreshed"] == 0.0, rank
