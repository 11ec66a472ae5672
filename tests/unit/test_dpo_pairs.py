"""The DPO trainer's data path (:mod:`hf_odc.trainer.preference.pairs`): pairs truncated as TRL truncates them, packed
as two documents each, never split across ranks or microbatches, and every rank planning the same minibatch alike."""

from __future__ import annotations

import random

import pytest
import torch

from hf_odc.packing import MinibatchPlanner, named_cost
from hf_odc.trainer.preference.pairs import (
    PairPacker,
    check_pair_capacity,
    document_sums,
    indistinct_pairs,
    pack_pairs,
    pair_documents,
)

PAIRS = [
    {"prompt_ids": [10, 11], "chosen_ids": [20, 21, 22], "rejected_ids": [30]},
    {"prompt_ids": [12], "chosen_ids": [23], "rejected_ids": [31, 32]},
]


def test_truncation_keeps_the_start_or_the_end_as_trl_does():
    example = {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]}
    (chosen, chosen_mask), (rejected, rejected_mask) = pair_documents(example, max_length=4)
    assert (chosen, chosen_mask, rejected, rejected_mask) == ([1, 2, 3, 4], [0, 0, 0, 1], [1, 2, 3, 6], [0, 0, 0, 1])
    (chosen, chosen_mask), _ = pair_documents(example, max_length=4, truncation_mode="keep_end")
    assert (chosen, chosen_mask) == ([2, 3, 4, 5], [0, 0, 1, 1])
    assert pair_documents(example, max_length=None)[0][0] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="truncation_mode"):
        pair_documents(example, 4, "middle")


def test_pairs_that_truncation_makes_identical_are_counted():
    """A prompt that fills ``max_length`` (keep_start), or replies that agree up to it, leave nothing to prefer."""
    pairs = {
        "prompt_ids": [[1, 2, 3], [1, 2], [1]],
        "chosen_ids": [[4], [4, 5, 6], [4]],
        "rejected_ids": [[5], [4, 5, 7], [5]],
    }
    assert [indistinct_pairs(pairs, max_length) for max_length in (None, 5, 4, 3)] == [0, 0, 1, 2]
    assert indistinct_pairs(pairs, 3, truncation_mode="keep_end") == 0


def test_a_packed_microbatch_holds_each_pair_as_two_documents():
    packed = pack_pairs([pair_documents(p, None) for p in PAIRS], references=[(-1.0, -2.0), (-3.0, -4.0)], ld_alpha=0.5)
    model, pairs = packed["model"], packed["pairs"]
    assert model["input_ids"].tolist() == [[10, 11, 20, 21, 22, 10, 11, 30, 12, 23, 12, 31, 32]]
    assert model["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1, 2]]
    # completions scored; prompts and every document's first token not
    assert model["labels"].tolist() == [[-100, -100, 20, 21, 22, -100, -100, 30, -100, 23, -100, 31, 32]]
    assert model["cu_seq_lens_q"].tolist() == [0, 5, 8, 10, 13] and model["max_length_q"] == 5
    # per scored position (label t + 1): its document (chosen 2j, rejected 2j + 1) and LD-DPO's weight past the
    # pair's shared completion length (pair 0: 3 and 1 scored tokens, pair 1: 1 and 2)
    assert pairs["document"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert pairs["weight"].tolist() == [0, 1, 0.5, 0.5, 0, 0, 1, 0, 1, 0, 1, 0.5]
    assert pairs["completion_tokens"].tolist() == [[3, 1], [1, 2]]
    assert pairs["ref_logps"].tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    # without LD-DPO every scored position weighs 1, exactly where a label is
    plain = pack_pairs([pair_documents(p, None) for p in PAIRS])
    assert plain["pairs"]["weight"].tolist() == (model["labels"][0, 1:] != -100).float().tolist()
    assert "ref_logps" not in plain["pairs"]


def test_document_sums_are_differentiable_per_document():
    values = torch.arange(1.0, 6.0, requires_grad=True)
    sums = document_sums(values, torch.tensor([0, 0, 1, 3, 3]), 4)
    assert sums.tolist() == [3.0, 3.0, 0.0, 9.0]
    (sums * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 2.0, 4.0, 4.0]


def test_every_rank_plans_alike_and_no_pair_is_split():
    rng = random.Random(0)
    examples = [
        {
            "prompt_ids": [1] * rng.randint(1, 8),
            "chosen_ids": [2] * rng.randint(1, 40),
            "rejected_ids": [3] * rng.randint(1, 40),
            "ref_chosen_logps": -float(i),
            "ref_rejected_logps": -float(i) - 0.5,
        }
        for i in range(24)
    ]
    planner = MinibatchPlanner("lb-mini", 3, "minibatch", named_cost("tokens", None), None)
    steps = [PairPacker(rank, planner, lambda longest: 64, max_length=32)(examples) for rank in range(3)]
    assert all(step.microbatch_lengths == steps[0].microbatch_lengths for step in steps)
    indices = sorted(i for step in steps for microbatch in step.pair_indices for i in microbatch)
    assert indices == list(range(24))  # each pair once, on one rank, in one microbatch
    for step in steps:
        for microbatch, pairs in zip(step.microbatches, step.pair_indices, strict=True):
            assert microbatch["model"]["input_ids"].shape[1] <= 64
            assert microbatch["pairs"]["ref_logps"][:, 0].tolist() == [-float(i) for i in pairs]
    step = steps[0]
    documents = [pair_documents(example, 32) for example in examples]
    assert step.num_samples == 24 and step.num_tokens == sum(len(c[0]) + len(r[0]) for c, r in documents)
    # the pair is planned as one item, attended (and its attention planned) as two sequences
    assert step.attended_lengths() == [len(sequence[0]) for pair in documents for sequence in pair]
    assert step.num_chosen_tokens == sum(sum(c[1][1:]) for c, _ in documents)
    assert step.num_loss_tokens == step.num_chosen_tokens + sum(sum(r[1][1:]) for _, r in documents)


def test_a_pair_longer_than_a_microbatch_is_cut_over_its_group_in_row_order():
    """Sequence parallelism (group size 2 on 2 ranks): the long pair is both ranks' first microbatch, each holding a
    contiguous slice of its row; put back together, the slices are the whole row, its next-token labels and its scored
    positions, and both name the pair's two documents."""
    long = {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5, 6, 7, 8, 13], "rejected_ids": [9, 10, 11, 12]}  # 9 + 7
    examples = [long, *PAIRS]
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", named_cost("tokens", None), None, group_size=2)
    steps = [PairPacker(rank, planner, lambda longest: 8, max_length=None)(examples) for rank in range(2)]
    whole = pack_pairs([pair_documents(long, None)])
    row, pairs = whole["model"], whole["pairs"]
    shards = [step.microbatches[0] for step in steps]
    assert [step.pair_indices[0] for step in steps] == [[0], [0]]
    assert steps[0].shared_lengths == [[16], [16]] and steps[0].metrics == {"group_microbatches": 1.0}
    assert sorted(i for step in steps for microbatch in step.pair_indices[1:] for i in microbatch) == [1, 2]
    assert [shard["model"]["input_ids"].shape[1] for shard in shards] == [8, 8]
    assert torch.cat([s["model"]["input_ids"] for s in shards], 1).tolist() == row["input_ids"].tolist()
    assert torch.cat([s["model"]["position_ids"] for s in shards], 1).tolist() == row["position_ids"].tolist()
    assert torch.cat([s["model"]["shift_labels"] for s in shards], 1)[0].tolist() == [*row["labels"][0, 1:], -100]
    assert torch.cat([s["pairs"]["weight"] for s in shards]).tolist() == [*pairs["weight"], 0.0]
    assert torch.cat([s["pairs"]["document"] for s in shards]).tolist() == [*pairs["document"], 1]
    assert all(s["model"]["sequence_shard"].lengths == (9, 7) for s in shards)  # the documents
    assert all(s["model"]["sequence_shard"].sizes == (8, 8) for s in shards)  # the slices


def test_a_pair_may_fill_sp_size_microbatches_and_no_more():
    check_pair_capacity([90, 112], lambda longest: 56, sp_size=2)  # 112 = 2 x 56 tokens: a group microbatch
    with pytest.raises(ValueError, match=r"longest pair has 113 tokens, more than sp_size=2 ranks hold \(2 x 56"):
        check_pair_capacity([113], lambda longest: 56, sp_size=2)
    with pytest.raises(ValueError, match="more than one microbatch holds"):
        check_pair_capacity([57], lambda longest: 56)
