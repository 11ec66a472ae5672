"""``gradient_accumulation_steps`` means what it means in TRL: an optimizer step takes ``per_device_train_batch_size x
gradient_accumulation_steps`` samples per process. ODCSFTTrainer on 2 CPU processes, planning those 32 samples as one
ODC minibatch, must update the model exactly as stock TRL ``SFTTrainer`` does on one process accumulating 4 batches of
8 (loss, gradient norm, parameters). GRPO's accumulation cases are in ``test_grpo_parity.py``."""

from __future__ import annotations

import pytest
import torch
from _parity import parity_runs

from hf_odc.demo import build_tokenizer

pytestmark = pytest.mark.slow  # every test starts processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tokenizer = build_tokenizer()
    trl, odc = parity_runs(tmp_path_factory.mktemp("sft_accumulation"), "_sft_parity.py", ["accumulation"],
                           vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    return trl["accumulation"], odc["accumulation"]


def test_odc_sft_with_accumulation_matches_stock_trl_on_one_process(runs):
    reference, ours = runs
    assert [entry["step"] for entry in ours["logs"]] == [entry["step"] for entry in reference["logs"]] == [1, 2]
    for expected, entry in zip(reference["logs"], ours["logs"], strict=True):
        step = expected["step"]
        assert entry["loss"] == pytest.approx(expected["loss"], rel=1e-4), f"loss at step {step}"
        assert entry["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), f"grad norm at step {step}"
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(ours["params"][name], tensor, rtol=0, atol=5e-5, msg=name)
