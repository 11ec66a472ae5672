"""The vision data path (``hf_odc.trainer.core.vision``) on the built-in tiny Qwen2.5-VL, in one process: a packed row
scores every sample as the sample alone does (its pixels and its 3-D rope positions kept with its text), a microbatch
without an image carries no pixels, the planner weighs images' patches, and what the path cannot train is refused in
one line (GRPO's too: the generation modes that cannot decode images, a model without 3-D rope positions)."""

from __future__ import annotations

import pytest
import torch
from _models import tiny_qwen2_config
from transformers import Qwen2ForCausalLM
from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from hf_odc.demo import build_vision_model, build_vision_processor, vision_dataset, vision_preference_dataset
from hf_odc.packing import MinibatchPlanner, named_cost
from hf_odc.trainer import PACKED_ATTENTION, ODCSFTConfig, ODCSFTTrainer
from hf_odc.trainer.core.vision import VisionMinibatchCollator, check_vision_model, pack_vision
from hf_odc.trainer.preference.vision_pairs import VisionPairPacker


@pytest.fixture(scope="module")
def parts():
    processor = build_vision_processor()
    model = build_vision_model(processor, seed=0, attn_implementation=PACKED_ATTENTION).eval()
    return processor, model, vision_dataset(9, seed=1)


def collator(parts, max_tokens: int = 512, world_size: int = 2, max_length: int | None = 96, rank: int = 0):
    processor, model, _ = parts
    planner = MinibatchPlanner("lb-mini", world_size, "minibatch", named_cost("tokens", model.config.get_text_config()))
    process = DataCollatorForVisionLanguageModeling(processor, max_length=max_length)
    return VisionMinibatchCollator(rank, planner, max_tokens, process, model.model.get_rope_index, max_length)


def token_log_probs(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits.log_softmax(-1)[0]


def test_a_packed_row_scores_each_sample_as_the_sample_alone(parts):
    processor, model, dataset = parts
    vision = collator(parts)
    samples = [vision.sample(dataset[i]) for i in range(len(dataset))]
    assert sum(sample.pixel_values is None for sample in samples) == 3  # every third sample has no image
    row = pack_vision(samples)
    assert row["position_ids"].shape == (4, 1, sum(sample.input_ids.numel() for sample in samples))
    packed, start = token_log_probs(model, row), 0
    for index, sample in enumerate(samples):
        # The sample alone, processed as TRL's collator does and positioned by the model itself.
        alone = DataCollatorForVisionLanguageModeling(processor, max_length=96)([dict(dataset[index])])
        alone.pop("labels")
        expected = token_log_probs(model, alone)
        length = sample.input_ids.numel()
        torch.testing.assert_close(packed[start : start + length], expected, rtol=1e-5, atol=1e-5)
        assert row["labels"][0, start] == -100  # nothing predicts a sample's first token across the boundary
        start += length


def test_a_microbatch_without_an_image_carries_no_pixels(parts):
    _, _, dataset = parts
    vision = collator(parts)
    row = pack_vision([vision.sample(dataset[2]), vision.sample(dataset[5])])  # the demo's image-less samples
    assert "pixel_values" not in row and "image_grid_thw" not in row


def test_the_planner_weighs_image_patches(parts):
    """A sample weighs its tokens plus its patches, so the rank given more patches trains fewer tokens."""
    _, _, dataset = parts
    sample = collator(parts).sample(dataset[0])
    assert sample.patches == sample.pixel_values.shape[0] > 0
    assert sample.weight == sample.input_ids.numel() + sample.patches
    shares = []
    for rank in (0, 1):
        step = collator(parts, rank=rank)(list(dataset))
        tokens = sum(row["input_ids"].numel() for row in step.microbatches)
        patches = sum(row["pixel_values"].shape[0] for row in step.microbatches if "pixel_values" in row)
        assert step.rank_tokens(rank) == tokens + patches
        shares.append((patches, tokens))
    (fewer_patches, their_tokens), (more_patches, our_tokens) = sorted(shares)
    assert more_patches > fewer_patches and our_tokens < their_tokens


def test_an_image_column_is_a_sample_of_one_image(parts):
    """TRL's other format, an ``image`` column of one image: the same sample as an ``images`` list of it."""
    _, _, dataset = parts
    vision, example = collator(parts), dataset[0]
    one = {"image": example["images"][0], "messages": example["messages"]}
    listed = vision.sample({"images": example["images"][:1], "messages": example["messages"]})
    single = vision.sample(one)
    assert "image" in one  # the dataset's row is left as it is
    torch.testing.assert_close(single.pixel_values, listed.pixel_values)
    assert torch.equal(single.input_ids, listed.input_ids) and torch.equal(single.positions, listed.positions)


def test_a_sample_heavier_than_a_microbatch_is_refused(parts):
    _, _, dataset = parts
    with pytest.raises(ValueError, match="image patches\\), more than one microbatch holds \\(16\\)"):
        collator(parts, max_tokens=16)([dataset[0], dataset[1]])


def test_truncation_inside_an_image_is_refused(parts):
    _, _, dataset = parts
    with pytest.raises(ValueError, match="max_length=8 cuts a sample inside an image's tokens") as refusal:
        collator(parts, max_length=8).sample(dataset[0])
    assert "\n" not in str(refusal.value)


def test_unsupported_vision_models_and_options_are_refused(parts, tmp_path):
    processor, model, dataset = parts
    with pytest.raises(ValueError, match="sp_size to 1 for a vision dataset"):
        check_vision_model(model, "ODCSFTTrainer", sp_size=2)
    other = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=len(processor.tokenizer)))  # a text model
    args = ODCSFTConfig(str(tmp_path), report_to="none", max_length=96)
    with pytest.raises(ValueError, match=r"trains vision datasets with \['llava', 'qwen2_5_vl'\] models, not 'qwen2'"):
        ODCSFTTrainer(model=other, args=args, train_dataset=dataset, processing_class=processor)


def pair_packer(parts, max_length: int | None = 64) -> VisionPairPacker:
    processor, model, _ = parts
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", named_cost("tokens", model.config.get_text_config()))
    process = DataCollatorForVisionPreference(processor, max_length=max_length)
    rope_index = model.model.get_rope_index
    return VisionPairPacker(0, planner, lambda longest: 512, max_length, process=process, rope_index=rope_index)


def test_a_packed_vision_pair_scores_each_sequence_as_trl_does(parts):
    """DPO: each sequence of a packed pair carries the pair's images and scores as TRL's padded batch of the pair."""
    processor, model, _ = parts
    pairs = vision_preference_dataset(3, seed=1)  # images, images, none
    packer = pair_packer(parts)
    documents = [packer.documents(pair) for pair in pairs]
    chosen, rejected = documents[0]
    torch.testing.assert_close(chosen.images.pixel_values, rejected.images.pixel_values)
    assert packer.weight(documents[0]) == len(chosen[0]) + len(rejected[0]) + 2 * chosen.images.patches
    row = packer.pack(documents, None)["model"]
    packed, start = token_log_probs(model, row), 0
    for pair in pairs:
        batch = DataCollatorForVisionPreference(processor, max_length=64)([dict(pair)])
        batch.pop("completion_mask")
        with torch.no_grad():
            expected = model(**batch, use_cache=False).logits.log_softmax(-1)
        for side in (0, 1):
            length = int(batch["attention_mask"][side].sum())
            torch.testing.assert_close(packed[start : start + length], expected[side, :length], rtol=1e-5, atol=1e-5)
            start += length
    assert start == row["input_ids"].shape[1]


def test_a_vision_pair_cut_inside_an_image_is_refused(parts):
    pair = vision_preference_dataset(1, seed=1)[0]
    with pytest.raises(ValueError, match="max_length=6 cuts a preference pair inside an image's tokens"):
        pair_packer(parts, max_length=6).documents(pair)  # the prompt's 3 tokens, then 6 of its image's


@pytest.mark.parametrize("setting", [dict(odc_generation="static"), dict(odc_generation="lockstep")])
def test_a_vision_policy_refuses_the_generation_modes_that_cannot_decode_images(parts, tmp_path, setting):
    from hf_odc.demo import length_reward, vision_prompt_dataset
    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    processor, model, _ = parts
    args = ODCGRPOConfig(
        str(tmp_path), report_to="none", use_cpu=True, num_generations=2, per_device_train_batch_size=2, **setting
    )
    with pytest.raises(ValueError, match="cannot decode a vision-language policy's images; leave odc_generation unset"):
        ODCGRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=vision_prompt_dataset(4, 0),
                       processing_class=processor)  # fmt: skip


def test_a_llava_model_is_refused_where_only_rope_models_train(tmp_path):
    from hf_odc.demo import build_llava_model, build_llava_processor, length_reward, vision_prompt_dataset
    from hf_odc.trainer import ODCGRPOConfig, ODCGRPOTrainer

    processor = build_llava_processor()
    args = ODCGRPOConfig(
        str(tmp_path), report_to="none", use_cpu=True, num_generations=2, per_device_train_batch_size=2
    )
    with pytest.raises(ValueError, match=r"trains vision datasets with \['qwen2_5_vl'\] models, not 'llava'"):
        ODCGRPOTrainer(model=build_llava_model(processor, 0), reward_funcs=length_reward, args=args,
                       train_dataset=vision_prompt_dataset(4, 0), processing_class=processor)  # fmt: skip
