"""The ODC trainer's data path: global minibatches, per-rank plans, padding-free packing, the loss normaliser."""

from __future__ import annotations

import itertools
import random
import warnings

import datasets
import numpy as np
import pytest
import torch

from hf_odc.packing import MinibatchPlanner, TokenCost
from hf_odc.trainer import GlobalMinibatchSampler, PlannedMinibatchCollator, count_target_tokens
from hf_odc.trainer.core.data import check_sft_truncation, check_truncation, require_sft_columns


def _examples(n: int, seed: int = 0) -> list[dict]:
    """Tokenized samples with long-tailed lengths; the first third of each sample is masked (a prompt)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = min(64, int(rng.paretovariate(1.2) * 4))
        ids = [rng.randrange(10, 100) for _ in range(max(length, 2))]
        prompt = len(ids) // 3
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _collator(rank: int, world_size: int, balance: str = "lb-mini", max_tokens: int = 64) -> PlannedMinibatchCollator:
    sync = "minibatch" if balance == "lb-mini" else "layer"
    planner = MinibatchPlanner(balance, world_size, sync, TokenCost())
    return PlannedMinibatchCollator(rank, planner, max_tokens, pad_token_id=0)


def test_sampler_is_identical_across_ranks_and_reshuffles_per_epoch():
    a, b = GlobalMinibatchSampler(50, 8, seed=3), GlobalMinibatchSampler(50, 8, seed=3)
    first = list(a)
    assert first == list(b)  # every rank draws the same global minibatches
    assert len(first) == len(a) == 6 and all(len(mb) == 8 for mb in first)  # the incomplete 7th is dropped
    assert len({i for mb in first for i in mb}) == 48
    a.set_epoch(1)
    assert list(a) != first
    a.set_epoch(0)
    assert list(a) == first
    assert list(GlobalMinibatchSampler(16, 8, seed=3, shuffle=False)) == [list(range(8)), list(range(8, 16))]


def test_sampler_rejects_a_dataset_smaller_than_one_minibatch():
    with pytest.raises(ValueError, match="fewer than one global minibatch"):
        GlobalMinibatchSampler(5, 8, seed=0)


def test_count_target_tokens_skips_the_first_label_and_masked_ones():
    assert count_target_tokens({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}) == 2
    assert count_target_tokens({"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}) == 3
    assert count_target_tokens({"input_ids": [5, 6, 7]}) == 2


@pytest.mark.parametrize("balance", ["lb-mini", "lb-micro", "local-sort"])
def test_every_sample_is_packed_once_across_ranks(balance):
    examples, world_size = _examples(24), 4
    items = [_collator(rank, world_size, balance)(examples) for rank in range(world_size)]
    seen = []
    for item in items:
        assert item.num_loss_tokens == sum(count_target_tokens(e) for e in examples)
        assert item.num_tokens == sum(len(e["input_ids"]) for e in examples)
        for mb in item.microbatches:
            assert mb["input_ids"].shape[0] == 1 and mb["input_ids"].shape[1] <= 64
            starts = [*(mb["position_ids"][0] == 0).nonzero().flatten().tolist(), mb["input_ids"].shape[1]]
            for begin, end in itertools.pairwise(starts):
                seen.append(tuple(mb["input_ids"][0, begin:end].tolist()))
                assert mb["position_ids"][0, begin:end].tolist() == list(range(end - begin))
                assert mb["labels"][0, begin] == -100  # no target across the boundary with the previous sample
            assert mb["cu_seq_lens_q"].tolist() == starts
    assert sorted(seen) == sorted(tuple(e["input_ids"]) for e in examples)
    for rank, item in enumerate(items):  # every rank knows every rank's microbatch lengths (what times calibrate)
        assert item.microbatch_lengths == items[0].microbatch_lengths
        packed = [mb["cu_seq_lens_q"].diff().tolist() for mb in item.microbatches]
        assert [sorted(lengths) for lengths in item.microbatch_lengths[rank]] == [sorted(p) for p in packed]
    counts = [len(item.microbatches) for item in items]
    if balance != "lb-mini":  # collective FSDP needs the same number of microbatches on every rank
        assert len(set(counts)) == 1


def test_samples_read_as_numpy_pack_as_lists_do():
    """SFT's loader reads samples as numpy arrays (``with_format("numpy")``): every rank's microbatches and the
    normaliser are the same as from Python lists."""
    examples = _examples(24, seed=3)
    arrays = datasets.Dataset.from_list(examples).with_format("numpy")
    read = arrays.__getitems__(list(range(len(examples))))
    assert isinstance(read[0]["input_ids"], np.ndarray)
    for rank in range(3):
        expected, got = _collator(rank, 3)(examples), _collator(rank, 3)(read)
        assert got.num_loss_tokens == expected.num_loss_tokens and got.microbatch_lengths == expected.microbatch_lengths
        assert len(got.microbatches) == len(expected.microbatches)
        for ours, theirs in zip(got.microbatches, expected.microbatches, strict=True):
            assert ours.keys() == theirs.keys()
            for key, value in theirs.items():
                assert torch.equal(ours[key], value) if torch.is_tensor(value) else ours[key] == value, key


def test_packed_targets_add_up_to_the_normaliser():
    """The loss normaliser every rank computes alone equals the targets the fused LM head will see."""
    examples, world_size = _examples(16, seed=1), 2
    items = [_collator(rank, world_size)(examples) for rank in range(world_size)]
    packed_targets = sum(int((mb["labels"][0, 1:] != -100).sum()) for item in items for mb in item.microbatches)
    assert packed_targets == items[0].num_loss_tokens


def test_lb_mini_balances_the_ranks_better_than_local_sort():
    examples, world_size = _examples(32, seed=2), 4
    mini = _collator(0, world_size, "lb-mini")(examples).predicted_bubble_rate
    local = _collator(0, world_size, "local-sort")(examples).predicted_bubble_rate
    assert 0.0 <= mini < local


def test_a_rank_with_no_sample_gets_no_microbatch():
    examples = _examples(2)
    assert _collator(3, 4)(examples).microbatches == []


def test_unknown_balance_is_refused():
    with pytest.raises(ValueError, match="Unknown planner 'greedy'"):
        _collator(0, 2, "greedy")


def test_packed_microbatch_has_position_ids_and_no_attention_mask():
    mb = _collator(0, 1)(_examples(4)).microbatches[0]
    assert mb["input_ids"].dtype == torch.long and mb["position_ids"].dtype == torch.long
    assert "attention_mask" not in mb  # a mask would make the model ignore the packed boundaries


@pytest.mark.parametrize(
    ("columns", "says"),
    [
        ({"messages": []}, r"The training dataset is empty \(its columns: \['messages'\]\)"),
        ({"conversation": [[]]}, r"it needs 'messages' or 'body' or .*; its columns are \['conversation'\]"),
        ({"body": ["w1"]}, None),  # the text field, as configured
        ({"prompt": ["w1"], "completion": ["w2"]}, None),
    ],
)
def test_a_dataset_sft_cannot_train_on_is_refused_naming_its_columns(columns, says):
    """Said before TRL reads a row, which would fail on one rank only (an ``IndexError`` on an empty dataset, a
    ``KeyError`` for a missing column) while the others wait in a collective."""
    dataset = datasets.Dataset.from_dict(columns)
    if says is None:
        require_sft_columns(dataset, text_field="body")
        return
    with pytest.raises(ValueError, match=says):
        require_sft_columns(dataset, text_field="body")


def test_truncation_that_leaves_nothing_or_damages_most_is_refused_unless_allowed(recwarn):
    """Nothing left to train on: refused, allowed or not; most of the samples damaged: refused, naming the flag that
    allows it, or with it one warning from the process told to warn; a few: nothing."""
    for allowed in (False, True):
        with pytest.raises(ValueError, match=r"cut\. Nothing is left to train on, so the run is refused"):
            check_truncation(4, 4, "cut.", warn=False, nothing_left=True, allowed=allowed)
    with pytest.raises(ValueError, match=r"cut\. Or pass --allow_truncated_data true to train on what is left anyway"):
        check_truncation(3, 4, "cut.", warn=True, nothing_left=False, allowed=False)
    check_truncation(3, 4, "cut.", warn=False, nothing_left=False, allowed=True)
    check_truncation(2, 4, "cut.", warn=True, nothing_left=False, allowed=False)
    assert not recwarn.list
    check_truncation(4, 4, "cut.", warn=True, nothing_left=False, allowed=True)
    assert [str(w.message) for w in recwarn.list] == ["cut."]


def test_sft_truncation_counts_the_samples_cut_and_the_samples_dropped_and_says_each_once():
    """Tokenized by TRL, a kept sample of ``max_length`` tokens was cut and a dropped one lost its completion; given
    tokenized, a sample was cut when it was longer than ``max_length`` (one exactly that long was not). The message
    names each group once, and no group that is empty."""
    chats = datasets.Dataset.from_dict({"messages": [[]] * 4})
    cut = datasets.Dataset.from_dict({"input_ids": [[1] * 4, [1] * 4, [1] * 2]})
    with pytest.warns(UserWarning, match=r"^max_length=4 cuts 3 of the 4 training samples: 1 lose every token "
                                         r"carrying a loss \(their completion\) and TRL drops them; 2 train on their "
                                         r"first 4 tokens only\. Raise --max_length"):  # fmt: skip
        check_sft_truncation(chats, cut, 4, True, allowed=True)
    with pytest.raises(ValueError, match=r"cuts 3 of the 4 .* Or pass --allow_truncated_data true"):
        check_sft_truncation(chats, cut, 4, True, allowed=False)
    with pytest.raises(ValueError) as refused:
        check_sft_truncation(chats, datasets.Dataset.from_dict({"input_ids": []}), 4, False, allowed=True)
    assert str(refused.value) == (
        "max_length=4 cuts 4 of the 4 training samples: 4 lose every token carrying a loss (their completion) and TRL "
        "drops them. Raise --max_length to fit most samples whole. Nothing is left to train on, so the run is refused."
    )
    tokenized = datasets.Dataset.from_dict({"input_ids": [[1] * 4, [1] * 4, [1] * 5]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_sft_truncation(tokenized, tokenized, 4, True, allowed=False)  # one of three cut
        check_sft_truncation(tokenized, tokenized, None, True, allowed=False)  # no truncation
