"""``ODCRewardTrainer``'s scoring of a packed row, and what it refuses at construction.

The reward of a sequence is the score head's output at its last token that is not padding, as the model's own pooling
picks it in TRL's right-padded batch. On a packed row (``odc_packed`` attention, positions restarting per document)
every document must get the reward it gets alone."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_qwen2_config
from datasets import Dataset
from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

from hf_odc.demo import build_tokenizer
from hf_odc.trainer import ODCRewardConfig, ODCRewardTrainer, use_packed_attention
from hf_odc.trainer.core._step import packed_row
from hf_odc.trainer.preference.reward_trainer import _last_positions, _scoring_every_position

PAD = 0


def reward_model(**overrides) -> Qwen2ForSequenceClassification:
    torch.manual_seed(0)
    config = tiny_qwen2_config(num_labels=1, pad_token_id=PAD, vocab_size=507, **overrides)
    return Qwen2ForSequenceClassification(config).eval()


def test_each_document_of_a_packed_row_gets_its_own_reward():
    """A padding token inside a sequence (as in TRL's rows when the pad token is also the end of a turn) moves the
    scored position back to the last other token, as the model's pooling does."""
    model = reward_model()
    sequences = [[5, 6, 7, 8], [9, 10, PAD], [12, 13, 14, 15, 16, 17], [PAD, 11]]
    with torch.no_grad():
        alone = [model(torch.tensor([s])).logits.item() for s in sequences]
        use_packed_attention(model, True, "cpu")
        ids = torch.tensor([token for sequence in sequences for token in sequence])
        row = packed_row(ids, ids, list(map(len, sequences)))
        inputs = {key: value for key, value in row.items() if key != "labels"}
        last = _last_positions(inputs, PAD)
        with _scoring_every_position(model, model.score):
            scores = model(**inputs, use_cache=False).logits
    assert last.tolist() == [3, 5, 12, 14]
    torch.testing.assert_close(scores[0, last, 0], torch.tensor(alone), rtol=0, atol=1e-6)
    assert model.score._forward_hooks == {} and model._forward_hooks == {}  # the context leaves no hook behind


def test_a_model_without_a_score_head_is_refused(tmp_path):
    pairs = Dataset.from_dict({"chosen_ids": [[5, 6]], "rejected_ids": [[7]]})
    model = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=507, pad_token_id=PAD, num_labels=1))
    with pytest.raises(TypeError, match=r"`score` head, which Qwen2ForCausalLM does not have\. Use an AutoModelFor"):
        ODCRewardTrainer(model, ODCRewardConfig(str(tmp_path), report_to="none"), train_dataset=pairs,
                         processing_class=build_tokenizer())  # fmt: skip


def test_a_pair_longer_than_a_microbatch_is_refused_at_construction(tmp_path):
    pairs = Dataset.from_dict({"chosen_ids": [[5, 6, 7]], "rejected_ids": [[8, 9]]})
    args = ODCRewardConfig(str(tmp_path), report_to="none", max_tokens_per_microbatch=4)
    with pytest.raises(ValueError, match=r"longest pair has 5 tokens .* \(4 tokens\)\. Set --max_tokens_per_micro"):
        ODCRewardTrainer(reward_model(), args, train_dataset=pairs, processing_class=build_tokenizer())


def test_short_pairs_share_a_microbatch_up_to_the_floor(tmp_path):
    """Pairs far shorter than ``2 * max_length`` fill a microbatch up to ``min_tokens_per_microbatch``, which the
    trainer resolves to no floor on the CPU when unset (on a GPU, from the model's shape and the device's memory)."""
    pairs = Dataset.from_dict({"chosen_ids": [[5, 6, 7, 8]] * 8, "rejected_ids": [[9, 10]] * 8})

    def planned(**kwargs):
        args = ODCRewardConfig(
            str(tmp_path), report_to="none", max_length=8, per_device_train_batch_size=8, seed=0, **kwargs
        )
        trainer = ODCRewardTrainer(reward_model(), args, train_dataset=pairs, processing_class=build_tokenizer())
        window = [next(iter(trainer.get_train_dataloader()))]
        return trainer.args.min_tokens_per_microbatch, trainer._plan_step(window).microbatches

    floor, by_max_length = planned()
    assert floor == 0 and len(by_max_length) > 1
    floor, by_floor = planned(min_tokens_per_microbatch=1000)
    assert floor == 1000 and len(by_floor) == 1


def test_the_warm_up_covers_every_chosen_and_rejected_sequence(tmp_path):
    """The attention plans warmed when ``train`` starts are those of each pair's two sequences, whole (TRL dropped
    the pairs longer than ``max_length``)."""
    pairs = Dataset.from_dict({"chosen_ids": [[5] * 7, [6] * 90], "rejected_ids": [[8] * 3, [9] * 200]})
    args = ODCRewardConfig(str(tmp_path), report_to="none", max_length=256, use_cpu=True)
    trainer = ODCRewardTrainer(reward_model(), args, train_dataset=pairs, processing_class=build_tokenizer())
    trainer.end()
    assert trainer._training_documents() == [7, 3, 90, 200]
