"""Documents longer than a microbatch, with Accelerate's sequence parallelism taken over by hf_odc: ODCSFTTrainer on 2
CPU processes launched with ``parallelism_config: {parallelism_config_sp_size: 2}`` in the Accelerate yaml trains
documents of up to twice its microbatch's tokens as group microbatches of both ranks (Ulysses attention), beside
short documents on one rank each, exactly as stock TRL ``SFTTrainer`` does on one process without a token budget:
loss, gradient norm, TRL's metrics and the parameters, with and without gradient accumulation, and with LoRA (TRL's
default activation checkpointing on throughout: the recomputation exchanges heads again)."""

from __future__ import annotations

import pytest
from _parity import SEQUENCE_PARALLEL, assert_same_case, parity_fixture
from _sft_parity import LONG_DOCUMENT_CASES, demo_token_fields

pytestmark = pytest.mark.slow  # every test starts processes

runs = parity_fixture(
    "_sft_parity.py",
    LONG_DOCUMENT_CASES,
    accelerate=SEQUENCE_PARALLEL,
    **demo_token_fields(),
)
SETTINGS = {
    name: {"gradient_accumulation_steps": accumulation} for name, (_, accumulation, _, _) in LONG_DOCUMENT_CASES.items()
}


@pytest.mark.parametrize("case", list(LONG_DOCUMENT_CASES))
def test_long_documents_train_as_on_one_process(runs, case):
    _, ours = assert_same_case(runs, SETTINGS, case, per_slice=("entropy", "mean_token_accuracy"))
    # every step split documents over both ranks (its documents are up to twice the 32-token microbatch)
    assert all(entry["group_microbatches"] >= 1 for entry in ours["logs"]), ours["logs"]
