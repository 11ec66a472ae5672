"""The GRPO data path (:mod:`hf_odc.trainer.online.rollouts`) and ODCGRPOConfig's refusals."""

from __future__ import annotations

import pytest
import torch

from hf_odc.packing import MinibatchPlanner, TokenCost
from hf_odc.trainer import ODCGRPOConfig
from hf_odc.trainer.online.rollouts import Rollouts, pack_rollouts, plan_generation_batch, shard_rollouts


def rollouts(prompt_lengths, completion_lengths) -> Rollouts:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(10, 500, (n,), generator=g)  # noqa: E731
    return Rollouts(
        prompt_ids=[ids(p) for p in prompt_lengths],
        completion_ids=[ids(c) for c in completion_lengths],
        loss_mask=[torch.ones(c) for c in completion_lengths],
        advantages=torch.linspace(-1, 1, len(prompt_lengths)),
    )


def test_pack_points_every_completion_token_at_the_log_prob_that_scores_it():
    batch = rollouts([3, 1, 5], [4, 2, 6])
    batch.loss_mask[1] = torch.tensor([1.0, 0.0])  # e.g. a tool token
    packed = pack_rollouts(batch, [2, 0, 1])
    model, loss = packed["model"], packed["loss"]
    assert model["input_ids"].shape == (1, 21) and model["cu_seq_lens_q"].tolist() == [0, 11, 18, 21]
    assert model["position_ids"][0].tolist() == list(range(11)) + list(range(7)) + list(range(3))
    # log_probs[t] scores labels[t + 1]: each completion token, in order, and nothing else.
    shifted = model["labels"][0, 1:]
    for row, i in enumerate([2, 0, 1]):
        n = len(batch.completion_ids[i])
        positions = loss["token_index"][row, :n]
        assert torch.equal(shifted[positions], batch.completion_ids[i])
        assert torch.equal(loss["mask"][row, :n], batch.loss_mask[i]) and not loss["mask"][row, n:].any()
    assert int((shifted != -100).sum()) == 12
    assert torch.equal(loss["advantages"], batch.advantages[[2, 0, 1]])


def test_a_rollout_split_over_a_group_scores_each_completion_token_on_one_rank():
    """Sequence parallelism: each rank's slice of a long rollout's row scores the completion tokens whose scoring
    position it holds, at its own ``log_probs`` positions (``shift_labels``); over the group, every trained token once,
    and each rank keeps the whole rollout's token count."""
    batch = rollouts([7], [12])
    batch.loss_mask[0][3] = 0.0  # e.g. a tool token
    whole = pack_rollouts(batch, [0])
    shards = [shard_rollouts(whole, None, index, 3) for index in range(3)]
    scored = []
    for shard in shards:
        labels, loss = shard["model"]["shift_labels"][0], shard["loss"]
        trained = loss["mask"][0].bool()
        scored += labels[loss["token_index"][0][trained]].tolist()
        assert loss["sequence_tokens"].tolist() == [11.0]
    assert [shard["model"]["input_ids"].shape[1] for shard in shards] == [7, 6, 6]
    assert [int(shard["loss"]["mask"].sum()) for shard in shards] == [1, 5, 5]  # token 3 untrained
    completion = batch.completion_ids[0].tolist()
    assert scored == completion[:3] + completion[4:]


def test_a_rollout_longer_than_a_microbatch_is_every_group_rank_s_first():
    batch = rollouts([5] * 8, [60, 4, 3, 2, 5, 6, 7, 8])
    planner = MinibatchPlanner("lb-mini", 2, "minibatch", TokenCost(), group_size=2)
    steps = [
        plan_generation_batch(batch, steps=1, rank=rank, seed=3, planner=planner, max_tokens_for=lambda n: 40)[0]
        for rank in (0, 1)
    ]
    assert [step.rollout_indices[0] for step in steps] == [[0], [0]]
    assert steps[0].shared_lengths == [[65], [65]] and steps[0].metrics["group_microbatches"] == 1.0
    assert "predicted_bubble_rate_unbalanced" not in steps[0].metrics  # TRL's split cannot hold the long rollout
    assert sorted(i for step in steps for mb in step.rollout_indices[1:] for i in mb) == list(range(1, 8))
    assert [step.microbatches[0]["model"]["input_ids"].shape[1] for step in steps] == [33, 32]


def plan(batch, rank, world_size=2, steps=2, balance="lb-mini", sync="minibatch"):
    planner = MinibatchPlanner(balance, world_size, sync, TokenCost())
    return plan_generation_batch(batch, steps=steps, rank=rank, seed=3, planner=planner, max_tokens_for=lambda n: 2 * n)


def test_every_rank_plans_the_same_minibatches_and_each_rollout_runs_once():
    batch = rollouts([5] * 16, [3, 90, 4, 80, 2, 70, 6, 60, 5, 50, 7, 40, 8, 30, 9, 20])
    shares = [plan(batch, rank) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 2
    seen = []
    for step in range(2):
        mine = [[i for mb in shares[rank][step].rollout_indices for i in mb] for rank in (0, 1)]
        assert len(mine[0]) + len(mine[1]) == 8 == shares[0][step].num_samples
        seen += mine[0] + mine[1]
        assert shares[0][step].num_tokens == shares[1][step].num_tokens
    assert sorted(seen) == list(range(16))


def test_the_unbalanced_prediction_packs_each_rank_with_the_run_planner():
    """TRL's split (each rank keeps the rollouts it generated) is packed by the run's planner: with local-sort, one
    rollout per microbatch (which LB-Mini would pack two or more to a microbatch)."""
    batch = rollouts([4] * 8, [100, 10, 95, 8, 50, 60, 40, 70])
    (step,) = plan(batch, 0, steps=1, balance="local-sort", sync="layer")
    lengths = batch.lengths
    own = [[[i] for i in sorted(range(r * 4, r * 4 + 4), key=lambda i: -lengths[i])] for r in (0, 1)]
    planner = MinibatchPlanner("local-sort", 2, "layer", TokenCost())
    expected = planner.predicted_bubble(own, lengths, 2 * max(lengths))
    assert step.metrics["predicted_bubble_rate_unbalanced"] == pytest.approx(expected)


def test_skewed_rollouts_are_rebalanced():
    """Rank 0 generated the long completions (the first half, rank-major): TRL's split leaves rank 1 idle."""
    batch = rollouts([4] * 8, [100, 90, 95, 85, 5, 6, 4, 7])
    (step,) = plan(batch, 0, steps=1)
    assert step.metrics["predicted_bubble_rate_unbalanced"] > 0.3 and step.predicted_bubble_rate < 0.05
    generated = [step.metrics[f"tokens_generated/rank_{rank}"] for rank in (0, 1)]
    assert generated == [104 + 94 + 99 + 89, 9 + 10 + 8 + 11]  # each rank's own rollouts, whatever the plan
    trained = [step.rank_tokens(rank) for rank in (0, 1)]
    assert sum(trained) == sum(generated) == step.num_tokens and max(trained) < 300


def test_a_generation_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="do not split into 3 minibatches"):
        plan(rollouts([2] * 8, [2] * 8), 0, steps=3)


def test_vllm_generation_is_accepted_in_both_modes(tmp_path):
    for mode in ("colocate", "server"):
        args = ODCGRPOConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_vllm=True,
                             vllm_mode=mode)  # fmt: skip
        assert args.use_vllm and args.vllm_mode == mode


def test_models_are_loaded_whole_for_sharding(tmp_path):
    args = ODCGRPOConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4, model_init_kwargs={})
    assert args.model_init_kwargs["device_map"] is None and args.steps_per_generation == 1


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
@pytest.mark.parametrize(
    "peft, message",
    [
        ("adapter", "Pass the base model with peft_config"),  # TRL would copy the adapter as the reference
        ("prompt-tuning", "does not support prompt-learning PEFT"),
    ],
)
def test_peft_setups_without_a_packed_reference_are_refused_in_one_line(tmp_path, trainer, peft, message):
    """A LoRA policy with ``beta > 0`` given as the base model and ``peft_config`` trains
    (``tests/parity/test_grpo_parity``, ``tests/parity/test_rloo_parity``); a PeftModel whose adapter TRL would keep a
    copy of as the reference, and prompt-learning PEFT, are refused."""
    from _models import tiny_model
    from peft import PromptTuningConfig

    from hf_odc import trainer as odc
    from hf_odc.demo import build_tokenizer, length_reward, prompt_dataset

    model, peft_config = tiny_model(lora=True), None
    if peft == "prompt-tuning":
        model, peft_config = tiny_model(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    config_class, trainer_class = getattr(odc, f"ODC{trainer}Config"), getattr(odc, f"ODC{trainer}Trainer")
    args = config_class(str(tmp_path), per_device_train_batch_size=4, num_generations=4, beta=0.04, use_cpu=True,
                        report_to="none")  # fmt: skip
    with pytest.raises(NotImplementedError, match=message) as refusal:
        trainer_class(model=model, reward_funcs=length_reward, args=args, processing_class=build_tokenizer(),
                      train_dataset=prompt_dataset(8, 16, "swe-smith", seed=0), peft_config=peft_config)  # fmt: skip
    assert "\n" not in str(refusal.value)
