"""``gradient_accumulation_steps`` means what it means in TRL: an optimizer step takes ``per_device_train_batch_size x
gradient_accumulation_steps`` samples per process. ODCSFTTrainer on 2 CPU processes, planning those 32 samples as one
ODC minibatch, must update the model exactly as stock TRL ``SFTTrainer`` does on one process accumulating 4 batches of
8 (loss, gradient norm, parameters). GRPO's accumulation cases are in ``test_grpo_parity.py``."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_qwen2_config
from _parity import run_checked
from transformers import Qwen2ForCausalLM

from hf_odc.demo import build_tokenizer

pytestmark = pytest.mark.slow  # every test starts processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sft_accumulation")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = tiny_qwen2_config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                               max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory / "model")
    model = str(directory / "model")
    run_checked("_sft_parity.py", "trl", model, str(directory / "trl.pt"), "accumulation")
    run_checked("_sft_parity.py", "odc", model, str(directory / "odc.pt"), "accumulation", processes=2)
    return torch.load(directory / "trl.pt")["accumulation"], torch.load(directory / "odc.pt")["accumulation"]


def test_odc_sft_with_accumulation_matches_stock_trl_on_one_process(runs):
    reference, ours = runs
    assert [entry["step"] for entry in ours["logs"]] == [entry["step"] for entry in reference["logs"]] == [1, 2]
    for expected, entry in zip(reference["logs"], ours["logs"], strict=True):
        step = expected["step"]
        assert entry["loss"] == pytest.approx(expected["loss"], rel=1e-4), f"loss at step {step}"
        assert entry["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), f"grad norm at step {step}"
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(ours["params"][name], tensor, rtol=0, atol=5e-5, msg=name)
