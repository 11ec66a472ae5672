"""``benchmarks/sft_throughput.py``'s memory report: where a step's memory went (``--memory-phases``: a mark after every
forward and backward of :func:`_common.run_step`), the rank-step of each scheme's peak, and the engine's own cost,
compared only where two schemes ran the very same microbatches (so that a plan's fuller microbatches are not taken
for the engine's memory). The numbers themselves are a GPU's; here the marks and the matching are checked on one CPU
process with stand-ins (the 2-process run: tests/distributed/test_benchmarks.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sft_throughput
from _common import run_step

from hf_odc.engine import CollectiveMinibatch


class _Model(nn.Module):
    """Stands in for the benchmark model: log-probabilities of the inputs, and FSDP2's gradient-sync switch."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.syncs: list[bool] = []

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.syncs.append(sync)

    def forward(self, input_ids, cu_seq_lens_q, use_cache, fused_lm_head):
        return SimpleNamespace(log_probs=-self.weight * input_ids.float())


def _microbatch(tokens: int) -> dict:
    return {"input_ids": torch.ones(1, tokens), "cu_seq_lens_q": torch.tensor([0, tokens])}


def test_a_step_marks_its_memory_after_every_forward_and_backward():
    model = _Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = SimpleNamespace(microbatches=[_microbatch(3), _microbatch(2)], num_loss_tokens=5)
    runner = CollectiveMinibatch(torch.device("cpu"))
    result = run_step(model, optimizer, runner, batch, 1, False, torch.device("cpu"), memory_phases=True)
    phases = [phase for phase, _, _ in result["memory_phases"]]
    assert phases == [
        "start", "entered", "forward 0", "backward 0", "forward 1", "backward 1", "exit", "optimizer step"
    ]  # fmt: skip
    assert result["peak_gib"] == result["peak_reserved_gib"] == 0.0  # no device memory on a CPU
    assert "memory_phases" not in run_step(model, optimizer, runner, batch, 1, False, torch.device("cpu"))


def _record(peak: float, microbatches: list[int]) -> dict:
    return {"peak_gib": peak, "microbatch_lengths": [[tokens] for tokens in microbatches]}


def test_the_engines_memory_is_compared_over_the_same_microbatches_only():
    # [rank][scheme] -> timed steps; rank 1's second step ran other microbatches under ODC (an LB-Mini-like plan)
    fsdp2 = [[_record(30.0, [100, 50]), _record(20.0, [60])], [_record(28.0, [90, 40]), _record(21.0, [70])]]
    odc = [[_record(24.5, [100, 50]), _record(20.2, [60])], [_record(22.0, [90, 40]), _record(35.0, [130])]]
    per_rank = [{"FSDP2": fsdp2[rank], "ODC": odc[rank]} for rank in range(2)]
    same = sft_throughput.same_microbatch_memory(per_rank, "ODC", "FSDP2")
    assert same["rank_steps"] == 3
    assert same["min_gib"] == -6.0 and abs(same["max_gib"] - 0.2) < 1e-9  # not +14.0: the 130-token step is the plan's
    per_rank[0]["ODC"][0] = _record(24.5, [50, 100])  # the same microbatches in another order are another step
    assert sft_throughput.same_microbatch_memory(per_rank, "ODC", "FSDP2")["rank_steps"] == 2
    assert (
        sft_throughput.same_microbatch_memory([{"A": [_record(1.0, [5])], "B": [_record(1.0, [6])]}], "A", "B") is None
    )


def test_the_peak_names_its_rank_step_and_microbatches():
    steps = [  # [step][rank]
        [_record(20.0, [60, 50]), _record(21.0, [70])],
        [_record(26.0, [120]) | {"memory_phases": [["start", 8.0, 8.0]]}, _record(25.0, [110, 10])],
    ]
    assert sft_throughput._at_peak(steps) == {
        "step": 1, "rank": 0, "microbatch_tokens": [120], "phases": [["start", 8.0, 8.0]]
    }  # fmt: skip
