"""``examples/sft.py`` with one slow rank: after each forward on rank ``HF_ODC_TEST_SLOW_RANK``, the process sleeps
``HF_ODC_TEST_SLOWDOWN`` times as long as the forward took, so that rank runs every microbatch at a fraction of the
others' speed (as a throttled GPU would). Launched like the example: ``accelerate launch ...
tests/support/_straggler_sft.py <sft.py arguments>``."""

from __future__ import annotations

import os
import runpy
import time
from pathlib import Path

import hf_odc.demo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft.py"


def _slowed(build_model):
    def build(*args, **kwargs):
        model = build_model(*args, **kwargs)
        if int(os.environ["RANK"]) == int(os.environ["HF_ODC_TEST_SLOW_RANK"]):
            factor = float(os.environ["HF_ODC_TEST_SLOWDOWN"])
            started = []
            model.register_forward_pre_hook(lambda module, args: started.append(time.perf_counter()))
            model.register_forward_hook(
                lambda module, args, out: time.sleep(factor * (time.perf_counter() - started.pop()))
            )
        return model

    return build


if __name__ == "__main__":
    hf_odc.demo.build_model = _slowed(hf_odc.demo.build_model)  # before the example imports it
    runpy.run_path(str(EXAMPLE), run_name="__main__")
