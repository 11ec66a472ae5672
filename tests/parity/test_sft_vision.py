"""A vision-language model end to end: ``ODCSFTTrainer`` on 2 CPU processes trains the built-in tiny Qwen2.5-VL on
image conversations exactly as stock TRL ``SFTTrainer`` does on one process (loss, gradient norm, TRL's metrics, final
parameters), with the ranks running different numbers of microbatches, and one rank a step with no image at all
(``tests/support/_sft_vision_parity.py``)."""

from __future__ import annotations

import pytest
from _parity import assert_same_training, assert_unequal_microbatches, example_steps, parity_runs

from hf_odc.demo import build_vision_model, build_vision_processor

pytestmark = pytest.mark.slow  # every test starts processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = build_vision_model(build_vision_processor(), seed=0)
    trl, odc = parity_runs(tmp_path_factory.mktemp("sft_vision"), "_sft_vision_parity.py", ["vision"], model=model)
    return trl["vision"], odc["vision"]


def test_odc_sft_on_images_matches_stock_trl_on_one_process(runs):
    reference, ours = runs
    assert [entry["step"] for entry in ours["logs"]] == [1, 2]
    assert_same_training(reference, ours)
    assert_unequal_microbatches([ours])


def test_a_rank_with_no_image_runs_no_vision_tower(runs):
    """The second step holds one sample with images: the rank without it still trains its microbatches (tokens on
    both ranks), and the step's image patches are that one sample's."""
    first, second = runs[1]["logs"]
    assert second["image_patches"] > 0 and second["image_patches"] < first["image_patches"]
    assert second["microbatches/rank_0"] >= 1 and second["microbatches/rank_1"] >= 1


def test_the_vision_example_runs_on_two_processes(tmp_path):
    """``examples/sft_vlm.py`` as a user runs it (``accelerate launch`` with ``examples/odc_cpu.yaml``), shortened."""
    logs = example_steps("sft_vlm.py", tmp_path, "--num_samples", "16", "--global_batch_size", "8")
    assert all(entry["image_patches"] > 0 and entry["loss"] > 0 for entry in logs.values())
