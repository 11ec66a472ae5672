"""Mixture-of-Experts models in the three ODC trainers: the router's load-balancing loss over the whole global
minibatch (:mod:`hf_odc.trainer.core._moe`), and the experts' 3-D weights sharded and read through ODC.

The fast tests check the loss's definition on packed rows and unequal splits against transformers' own
``load_balancing_loss_func`` over the whole batch (padded, with its attention mask). The slow ones train a tiny
Qwen3-MoE (SFT, GRPO) and a tiny Mixtral (DPO) on 2 CPU processes whose ranks run different numbers of microbatches,
with the loss on and off, against stock TRL on one process with the whole minibatch in one forward (where TRL's
per-forward loss is the minibatch's): loss, gradient norm, TRL's metrics (``aux_loss`` among them) and parameters.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from _dpo_parity import MOE_CASES as DPO_CASES
from _grpo_parity import MOE_CASES as GRPO_CASES
from _models import tiny_model, tiny_moe_config
from _parity import assert_same_training, parity_runs
from _sft_parity import MOE_CASES as SFT_CASES
from _trainer_launch import logged_steps, run
from transformers import AutoModelForCausalLM

from hf_odc import _compat
from hf_odc.demo import build_tokenizer
from hf_odc.packing import Calibration
from hf_odc.trainer.core._base_trainer import _ODCTrainer
from hf_odc.trainer.core._checkpoint_hooks import CALIBRATION_FILE
from hf_odc.trainer.core._moe import ExpertActivity, ExpertLoad
from hf_odc.trainer.core._step import packed_row
from hf_odc.trainer.core.attention import use_packed_attention

QUIET = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def moe_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny MoE whose routers are confident (their weights scaled up from the initialisation), so that the experts'
    load is uneven and differs between a minibatch and its microbatches."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family, hidden_size=32, **overrides))
    for module, _ in _compat.router_modules(model):
        module.weight.data.mul_(25)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_routers_are_found_in_each_layer(family):
    model = moe_model(family)
    assert len(_compat.router_modules(model)) == model.config.num_hidden_layers
    assert _compat.router_modules(tiny_model()) == []


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_loss_over_packed_unequal_microbatches_is_the_whole_batchs(family):
    """Documents packed into microbatches of 1, 2 and 3 documents (ODC's rows: no padding, no attention mask): the
    microbatches' terms add up to ``coef`` times transformers' loss of the whole batch in one padded forward, in value
    and in gradient (every parameter's); a split's own per-microbatch losses would not."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model, coef = moe_model(family), 0.3
    config = model.config
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(4, config.vocab_size, (n,), generator=generator) for n in (5, 17, 9, 30, 2, 12)]

    width = max(len(d) for d in documents)
    ids = torch.stack([torch.cat([d, d.new_zeros(width - len(d))]) for d in documents])
    mask = torch.stack([torch.arange(width) < len(d) for d in documents]).long()
    model.zero_grad()
    outputs = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    expected = load_balancing_loss_func(outputs.router_logits, config.num_experts, config.num_experts_per_tok, mask)
    (coef * expected).backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    use_packed_attention(model, True, "cpu")  # as the trainers do: each packed document attended on its own
    load = ExpertLoad(model, config.num_experts, config.num_experts_per_tok, coef)
    split = [[0], [1, 2], [3, 4, 5]]
    rows = [packed_row(torch.cat([documents[i] for i in m]), torch.cat([documents[i] for i in m]), [
        len(documents[i]) for i in m]) for m in split]  # fmt: skip
    inputs = [{key: value for key, value in row.items() if key != "labels"} for row in rows]
    totals, own = torch.zeros(2 * config.num_experts + 1, dtype=torch.float64), []
    with torch.no_grad():
        for row in inputs:
            with load.recording():
                model(**row)
                counted = load.count()
            totals += counted
            own.append(counted)
    assert load.start_step(totals) == pytest.approx(expected.item(), rel=1e-5)
    model.zero_grad()
    terms = []
    for row in inputs:
        with load.recording():
            model(**row)
            term = load.loss()
        term.backward()
        terms.append(term.item())
    assert sum(terms) == pytest.approx(coef * expected.item(), rel=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-7, msg=name)
    per_microbatch = [load.start_step(counted) for counted in own]  # each microbatch's own loss, as TRL's
    assert sum(per_microbatch) / len(per_microbatch) != pytest.approx(expected.item(), rel=1e-3)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_expert_counter_counts_each_microbatchs_active_experts(family):
    """The calibrated cost's expert feature: per recorded forward, the distinct top-k experts of every layer, summed
    over the layers, as the router logits transformers returns give them; forwards outside :meth:`recording` (a
    recomputation, a scoring pass) are not counted."""
    model = moe_model(family)
    config = model.config
    use_packed_attention(model, True, "cpu")
    activity = ExpertActivity(model, config.num_experts, config.num_experts_per_tok)
    assert activity.slots == config.num_hidden_layers * config.num_experts
    generator = torch.Generator().manual_seed(3)
    expected = []
    for lengths in ([1], [2, 3], [7], [1, 1], [30, 12, 5]):
        ids = torch.randint(4, config.vocab_size, (sum(lengths),), generator=generator)
        row = {key: value for key, value in packed_row(ids, ids, lengths).items() if key != "labels"}
        with torch.no_grad(), activity.recording():
            logits = model(**row, output_router_logits=True).router_logits
        chosen = [layer.topk(config.num_experts_per_tok, dim=-1).indices.unique().numel() for layer in logits]
        expected.append(sum(chosen))
        with torch.no_grad():
            model(**row)  # not recorded
    counted = [int(count) for count in activity.take()]
    assert counted == expected
    assert len(set(counted)) > 1 and min(counted) < activity.slots, "a discriminating case: counts differ"
    assert activity.take() == []


def test_the_calibrated_cost_counts_experts_for_moe_models_only():
    """The trainers build the expert counter (and so the cost's expert term) for a MoE model planned with the
    calibrated cost, and for nothing else: a dense model's planning is unchanged."""
    args = SimpleNamespace(cost_model="calibrated")
    model = moe_model("qwen3_moe")
    counter = _ODCTrainer._expert_counter(SimpleNamespace(model=model, args=args))
    assert isinstance(counter, ExpertActivity) and counter.slots == 2 * 4
    assert _ODCTrainer._expert_counter(SimpleNamespace(model=tiny_model(), args=args)) is None
    attention = SimpleNamespace(cost_model="attention")
    assert _ODCTrainer._expert_counter(SimpleNamespace(model=model, args=attention)) is None


def test_a_moe_model_without_recorded_routers_is_refused():
    with pytest.raises(ValueError, match="set router_aux_loss_coef=0"):
        ExpertLoad(tiny_model(), num_experts=4, top_k=2, coef=0.1)


# -- stock TRL parity on 2 processes --------------------------------------------------------------------------------


def _assert_parity(runs: tuple[dict, dict], case: str, skip: tuple[str, ...] = (), **kwargs) -> None:
    reference, ours = runs[0][case], runs[1][case]
    assert_same_training(reference, ours, skip=("step_time", *skip), **kwargs)
    on = case == "moe-aux"
    assert all(("aux_loss" in entry) == on for entry in reference["logs"] + ours["logs"])
    assert any(entry["microbatches/rank_0"] != entry["microbatches/rank_1"] for entry in ours["logs"])


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    tokenizer = build_tokenizer()
    model = moe_model("qwen3_moe", vocab_size=len(tokenizer), max_position_embeddings=512,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    return parity_runs(tmp_path_factory.mktemp("moe_sft"), "_sft_parity.py", SFT_CASES, model=model, env=QUIET)


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
    model = moe_model("mixtral", vocab_size=507, max_position_embeddings=512, pad_token_id=0, eos_token_id=3)
    return parity_runs(tmp_path_factory.mktemp("moe_dpo"), "_dpo_parity.py", DPO_CASES, model=model, env=QUIET)


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    model = moe_model("qwen3_moe", vocab_size=507, max_position_embeddings=512, pad_token_id=0, eos_token_id=3)
    return parity_runs(tmp_path_factory.mktemp("moe_grpo"), "_grpo_parity.py", GRPO_CASES, model=model, env=QUIET)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SFT_CASES))
def test_odc_sft_on_a_moe_matches_stock_trl(sft_runs, case):
    accumulating = SFT_CASES[case][1] > 1  # then TRL's token means are per accumulation slice, ODC's per minibatch
    _assert_parity(sft_runs, case, skip=("entropy", "mean_token_accuracy") if accumulating else ())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DPO_CASES))
def test_odc_dpo_on_a_moe_matches_stock_trl(dpo_runs, case):
    _assert_parity(
        dpo_runs, case, absolute=dict.fromkeys(("rewards/chosen", "rewards/rejected", "rewards/margins"), 2e-5)
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_odc_grpo_on_a_moe_matches_stock_trl(grpo_runs, case):
    skip = ("step_s", "generation_s", "scoring_s", "tokens_per_second", "bubble_rate")
    _assert_parity(grpo_runs, case, skip=skip)


@pytest.mark.slow
def test_the_sft_example_trains_the_tiny_moe_on_two_processes(tmp_path):
    """``examples/sft.py --model_config tiny-moe``: a Qwen3-MoE built from a config, trained with the router's
    load-balancing loss (its config's coefficient) on 2 processes; the saved model loads with the Auto class. The
    default calibrated cost learns the experts' term from the counted active (layer, expert) pairs, once it fits
    (from the third step), and saves it with the model."""
    run("sft.py", "--model_config", "tiny-moe", "--max_steps", "4", "--num_samples", "32", "--global_batch_size", "8",
        "--disable_tqdm", "true", "--output_dir", str(tmp_path), processes=2)  # fmt: skip
    logs = logged_steps(tmp_path)
    assert sorted(logs) == [1, 2, 3, 4]
    assert all(math.isfinite(entry["aux_loss"]) and entry["aux_loss"] > 0 for entry in logs.values()), logs
    assert all(entry["busy_s/rank_1"] > 0 for entry in logs.values())
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "Qwen3MoeForCausalLM"
    assert "calibration/per_expert" not in logs[2] and logs[4]["calibration/per_expert"] >= 0
    saved = Calibration.load(tmp_path / CALIBRATION_FILE).cost
    assert saved.expert_slots == 2 * 4 and saved.per_expert == logs[4]["calibration/per_expert"]
