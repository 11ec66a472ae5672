"""Sequence parallelism on 4 ranks: ODCSFTTrainer on 4 CPU processes, with groups of 2 and of 4 ranks (Accelerate's
``ParallelismConfig(sp_size=N)`` given as the config's ``parallelism_config``, so that one launch runs both), trains
documents of up to ``sp_size`` times its microbatch's tokens as group microbatches beside short documents on one rank
each, exactly as stock TRL ``SFTTrainer`` does on one process without a token budget: loss, gradient norm, TRL's
metrics and the parameters, and with LoRA and gradient accumulation together."""

from __future__ import annotations

import pytest
from _parity import assert_same_case, parity_fixture
from _sft_parity import FOUR_RANK_CASES

from hf_odc.demo import build_tokenizer

pytestmark = pytest.mark.slow  # every test starts processes

_TOKENIZER = build_tokenizer()
runs = parity_fixture(
    "_sft_parity.py",
    FOUR_RANK_CASES,
    processes=4,
    vocab_size=len(_TOKENIZER),
    pad_token_id=_TOKENIZER.pad_token_id,
    eos_token_id=_TOKENIZER.eos_token_id,
    bos_token_id=_TOKENIZER.bos_token_id,
)
SETTINGS = {
    name: {"gradient_accumulation_steps": accumulation} for name, (_, accumulation, _, _) in FOUR_RANK_CASES.items()
}


@pytest.mark.parametrize("case", list(FOUR_RANK_CASES))
def test_long_documents_train_on_four_ranks_as_on_one_process(runs, case):
    _, ours = assert_same_case(runs, SETTINGS, case, per_slice=("entropy", "mean_token_accuracy"))
    # every step split documents over groups, and some rank ran a different number of microbatches than another
    assert all(entry["group_microbatches"] >= 1 for entry in ours["logs"]), ours["logs"]
    counts = [[entry[f"microbatches/rank_{rank}"] for rank in range(4)] for entry in ours["logs"]]
    assert any(len(set(step)) > 1 for step in counts), counts
