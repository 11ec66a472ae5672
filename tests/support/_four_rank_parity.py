"""The four-rank sequence-parallel cases of SFT, DPO and GRPO (each parity script's ``FOUR_RANK_CASES``) in one launch
per side, so that 4 processes start once: ``python tests/support/_four_rank_parity.py trl MODEL_DIR OUT CASE...`` on
one process, ``accelerate launch --num_processes 4 ... odc MODEL_DIR OUT CASE...`` on four, a case named
``FAMILY/NAME`` (``sft/four-ranks-sp2``) trained by that family's ``train_case``."""

from __future__ import annotations

import _dpo_parity
import _grpo_parity
import _sft_parity
from _parity import run_cases

FAMILIES = {"sft": _sft_parity, "dpo": _dpo_parity, "grpo": _grpo_parity}
CASES = {f"{family}/{name}": module.FOUR_RANK_CASES[name] for family, module in FAMILIES.items()
         for name in module.FOUR_RANK_CASES}  # fmt: skip
QUIET = _dpo_parity.QUIET | _grpo_parity.QUIET


def train_case(kind: str, model_dir: str, name: str, output_dir: str) -> dict | None:
    family, case = name.split("/")
    return FAMILIES[family].train_case(kind, model_dir, case, output_dir)


if __name__ == "__main__":
    run_cases(train_case)
