"""A vision-language model in DPO: ``ODCDPOTrainer`` on 2 CPU processes trains the built-in tiny Qwen2.5-VL on image
preference pairs, against a reference model, exactly as stock TRL ``DPOTrainer`` does on one process (loss, gradient
norm, TRL's metrics, final parameters), with the ranks running different numbers of microbatches, and one rank a
step (and its reference pass) with no image at all (``tests/support/_dpo_vision_parity.py``)."""

from __future__ import annotations

import pytest
from _parity import assert_same_training, assert_unequal_microbatches, parity_runs

from hf_odc.demo import build_vision_model, build_vision_processor

pytestmark = pytest.mark.slow  # every test starts processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = build_vision_model(build_vision_processor(), seed=0)
    trl, odc = parity_runs(tmp_path_factory.mktemp("dpo_vision"), "_dpo_vision_parity.py", ["vision"], model=model)
    return trl["vision"], odc["vision"]


def test_odc_dpo_on_images_matches_stock_trl_on_one_process(runs):
    reference, ours = runs
    assert [entry["step"] for entry in ours["logs"]] == [1, 2]
    assert_same_training(reference, ours)
    assert_unequal_microbatches([ours])


def test_a_rank_with_no_image_runs_no_vision_tower(runs):
    """The second step holds one pair with images: both ranks train microbatches, only one of them has images."""
    first, second = runs[1]["logs"]
    assert 0 < second["image_patches"] < first["image_patches"]
    assert second["microbatches/rank_0"] >= 1 and second["microbatches/rank_1"] >= 1
