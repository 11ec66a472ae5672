"""Vision-language models end to end: ``ODCSFTTrainer``, ``ODCDPOTrainer`` (with a reference model),
``ODCGRPOTrainer`` and ``ODCRLOOTrainer`` on 2 CPU processes train the built-in tiny Qwen2.5-VL (SFT also the tiny
LLaVA-style model: whole images, the processor's image tokens, 1-D positions) on image data exactly
as stock TRL does on one process (loss, gradient norm, TRL's metrics, final parameters), with the ranks running
different numbers of microbatches, and a step with no image on one rank (SFT, DPO) or on every rank (GRPO, RLOO:
stock TRL cannot score prompts with and without images together) (``tests/support/_vision_parity.py``: one launch of
each side for every trainer); and ``examples/sft_vlm.py`` runs as a user runs it."""

from __future__ import annotations

import pytest
from _grpo_parity import TIMINGS
from _parity import assert_same_training, assert_unequal_microbatches, example_steps, parity_runs

from hf_odc.demo import build_llava_model, build_llava_processor, build_vision_model, build_vision_processor

pytestmark = pytest.mark.slow  # every test starts processes
PARITY = ["sft", "dpo", "grpo", "rloo", "sft-llava"]
CASES = [*PARITY, "grpo-generate"]
ONLINE = ["grpo", "rloo"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vision")
    build_llava_model(build_llava_processor(), seed=0).save_pretrained(directory / "model" / "llava")
    model = build_vision_model(build_vision_processor(), seed=0)
    return parity_runs(directory, "_vision_parity.py", CASES, model=model)


@pytest.mark.parametrize("case", PARITY)
def test_odc_on_images_matches_stock_trl_on_one_process(runs, case):
    reference, ours = runs[0][case], runs[1][case]
    assert [entry["step"] for entry in ours["logs"]] == [1, 2]
    assert_same_training(reference, ours, skip=TIMINGS if case in ONLINE else ())
    assert_unequal_microbatches([ours])


@pytest.mark.parametrize("case", ["sft", "dpo", "sft-llava"])
def test_a_rank_with_no_image_still_trains(runs, case):
    """The second step holds one sample (pair) with images: both ranks train microbatches, so one of them has none
    (its microbatches carry no pixels: ``tests/unit/test_trainer_vision.py``), and the step's image patches are that
    sample's."""
    first, second = runs[1][case]["logs"]
    assert 0 < second["image_patches"] < first["image_patches"]
    assert second["microbatches/rank_0"] >= 1 and second["microbatches/rank_1"] >= 1


def test_the_vision_example_runs_on_two_processes(tmp_path):
    """``examples/sft_vlm.py`` as a user runs it (``accelerate launch`` with ``examples/odc_cpu.yaml``), shortened."""
    logs = example_steps("sft_vlm.py", tmp_path, "--num_samples", "16", "--global_batch_size", "8")
    assert all(entry["image_patches"] > 0 and entry["loss"] > 0 for entry in logs.values())


@pytest.mark.parametrize("case", ONLINE)
def test_a_vision_policy_trains_a_step_without_images(runs, case):
    """The first step's rollouts carry their images, re-planned with them (weighed with their patches); the second's
    have none: the vision-language policy's update runs no vision tower on any rank, with its 3-D positions still."""
    first, second = runs[1][case]["logs"]
    assert first["image_patches"] > 0 and second["image_patches"] == 0
    assert second["microbatches/rank_0"] >= 1 and second["microbatches/rank_1"] >= 1


def test_a_vision_policy_decodes_its_images(runs):
    """``ODCGRPOTrainer`` decodes the image prompts with transformers' ``generate`` (the ``"gathered"`` mode, FSDP2's
    lazy initialisation run from the root: the vision blocks run first) and trains on the rollouts, as stock TRL
    does."""
    for result in runs:
        (entry,) = result["grpo-generate"]["logs"]
        assert entry["completions/mean_length"] > 0 and entry["num_tokens"] > 0
    assert runs[1]["grpo-generate"]["logs"][0]["image_patches"] > 0
