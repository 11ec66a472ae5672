"""ODCKTOTrainer's passes each planned on the tokens they run: the training minibatch on the examples' own
sequences, the reference's on both sequences of each example, the KL pass on the mismatched ones."""

from __future__ import annotations

from hf_odc.packing import MinibatchPlanner, TokenCost
from hf_odc.trainer.preference.kto_trainer import _plan_passes


def _documents(own: list[int], mismatched: list[int] | None) -> list[tuple]:
    def document(length: int) -> tuple[list[int], list[int]]:
        return [1] * length, [0] + [1] * (length - 1)

    if mismatched is None:
        return [(document(length),) for length in own]
    return [(document(a), document(b)) for a, b in zip(own, mismatched, strict=True)]


def _loads(plan, lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for microbatch in rank for i in microbatch) for rank in plan]


# A plan of each example's two sequences together pairs the two long own sequences (totals 500 + 500 against
# 510 + 490), which left the training minibatch with 900 own tokens on one rank and 100 on the other.
OWN = [450, 450, 60, 40]
MISMATCHED = [50, 50, 450, 450]


def test_each_pass_is_balanced_on_the_tokens_it_runs():
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost())
    plans = _plan_passes(planner, _documents(OWN, MISMATCHED), capacity=2000)
    assert plans.lengths == OWN and plans.capacity == 2000
    assert sorted(_loads(plans.training, OWN)) == [490, 510]
    assert _loads(plans.kl, MISMATCHED) == [500, 500]
    assert _loads(plans.reference, [a + b for a, b in zip(OWN, MISMATCHED, strict=True)]) == [1000, 1000]
    for plan in (plans.training, plans.reference, plans.kl):  # every example once in each pass
        assert sorted(i for rank in plan for microbatch in rank for i in microbatch) == list(range(len(OWN)))


def test_without_the_kl_estimate_the_reference_runs_the_training_plan():
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost())
    plans = _plan_passes(planner, _documents(OWN, None), capacity=2000)
    assert plans.kl is None and plans.reference == plans.training
    assert sorted(_loads(plans.training, OWN)) == [490, 510]
