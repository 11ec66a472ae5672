"""Cost models (tokens, attention FLOPs, callables) and the seeded synthetic length distributions."""

from __future__ import annotations

import numpy as np
import pytest
from _models import tiny_qwen2_config

from hf_odc.packing import (
    DEFAULT_ATTENTION_SHAPE,
    DISTRIBUTIONS,
    AttentionCost,
    TokenCost,
    evaluate_costs,
    lb_micro,
    lb_mini,
    resolve_cost,
    sample_lengths,
)

# --- attention ---------------------------------------------------------------------------------------------------


def test_attention_cost_matches_its_flop_formula():
    shape = DEFAULT_ATTENTION_SHAPE
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    head_dim, kv_heads = hidden // heads, shape["num_key_value_heads"]
    # Per token: 2 FLOPs per weight of q, o (hidden x hidden), k, v (hidden x kv_heads * head_dim), the gated MLP's
    # three hidden x intermediate matrices, and the LM head once.
    weights = layers * (
        2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * shape["intermediate_size"]
    )
    linear = 2 * (weights + hidden * shape["vocab_size"])
    # Per causal pair (L^2 / 2 of them) and layer: QK^T and AV, 2 FLOPs per multiply-add over heads * head_dim.
    quadratic = layers * 2 * 2 * hidden / 2
    model = resolve_cost("attention")
    assert isinstance(model, AttentionCost)
    assert (model.linear, model.quadratic) == (linear, quadratic)
    for length in (1, 1000, 8192, 65536):
        assert model([length]) == [linear * length + quadratic * length**2]
    assert 20_000 < linear / quadratic < 26_000  # attention overtakes the matmuls at about 23K tokens, as documented


@pytest.mark.parametrize("length", [1, 512, 8192, 23_000, 65536])
def test_attention_cost_grows_faster_than_linearly(length):
    cost = resolve_cost("attention")
    single, double = cost([length, 2 * length])
    assert double > 2 * single
    assert double - 2 * single == pytest.approx(2 * cost.quadratic * length**2)  # the quadratic term, exactly


def test_attention_cost_counts_the_flops_of_a_real_forward_pass():
    """torch's FLOP counter on a tiny eager Qwen2 (which computes the full L x L score matrix, twice the causal
    half that the model charges) agrees with ``from_config`` on a transformers config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    config = tiny_qwen2_config(intermediate_size=96)
    model = transformers.Qwen2ForCausalLM(config).eval()
    cost = AttentionCost.from_config(config)
    for length in (16, 96):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, length, dtype=torch.long))
        assert counter.get_total_flops() == cost.linear * length + 2 * cost.quadratic * length**2
    assert AttentionCost.from_config(config.to_dict()) == cost  # a parsed config.json gives the same model


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_attention_cost_counts_the_routed_experts_of_a_moe(family):
    """torch's FLOP counter on a tiny eager MoE (every token through its top-k experts, and the router) agrees with
    ``from_config``: the experts a token is routed to, not the dense ``intermediate_size`` nor every expert."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from _models import tiny_moe_config
    from torch.utils.flop_counter import FlopCounterMode

    config = tiny_moe_config(family, output_router_logits=False, experts_implementation="eager")  # counted matmuls
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cost = AttentionCost.from_config(config)
    for length in (16, 96):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, length, dtype=torch.long))
        assert counter.get_total_flops() == cost.linear * length + 2 * cost.quadratic * length**2
    assert AttentionCost.from_config(config.to_dict()) == cost


def test_attention_config_checks():
    with pytest.raises(ValueError, match="the model config has no 'intermediate_size'"):
        AttentionCost.from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8})
    gqa = AttentionCost.from_config({**DEFAULT_ATTENTION_SHAPE, "num_key_value_heads": 14})
    assert gqa.linear > resolve_cost("attention").linear  # more k/v heads, more projection weights
    with pytest.raises(ValueError, match="non-negative coefficients, not both zero"):
        AttentionCost(linear=0.0, quadratic=0.0)


# --- callables and names -----------------------------------------------------------------------------------------


def test_tokens_and_callables_are_accepted_by_the_planners():
    lengths = sample_lengths("uniform", 64, seed=2)
    assert TokenCost()(lengths) == [float(length) for length in lengths]
    assert evaluate_costs(lengths, "tokens").tolist() == lengths
    calls = []

    def cubic(batch):
        calls.append(len(batch))
        return [float(length) ** 3 for length in batch]

    mini = lb_mini(lengths, 4, 32768, cubic)
    micro = lb_micro(lengths, 4, 32768, cubic)
    assert calls and all(count == 64 for count in calls)
    assert sorted(i for rank in mini for mb in rank for i in mb) == list(range(64))
    assert {len(rank) for rank in micro} == {len(micro[0])}
    assert mini != lb_mini(lengths, 4, 32768, "tokens")  # the cost actually steers the plan


@pytest.mark.parametrize("name", ["flops", "Tokens", ""])
def test_unknown_cost_names_are_rejected(name):
    with pytest.raises(ValueError, match=rf"Unknown cost model {name!r}: use one of \['attention', 'tokens'\]"):
        lb_mini([10, 20], 2, 100, name)


@pytest.mark.parametrize(
    ("cost", "error", "message"),
    [
        (42, TypeError, "cost must be a string or a callable"),
        (lambda lengths: [1.0], ValueError, "returned 1 values for 3 lengths"),
        (lambda lengths: [1.0, -1.0, 2.0], ValueError, "negative or non-finite cost"),
        (lambda lengths: [1.0, float("inf"), 2.0], ValueError, "negative or non-finite cost"),
    ],
)
def test_bad_cost_models_are_rejected(cost, error, message):
    with pytest.raises(error, match=message):
        evaluate_costs([10, 20, 30], cost)


# --- synthetic lengths -------------------------------------------------------------------------------------------

# The documented shapes: mean (and median where documented) in tokens, from the module docstring.
DOCUMENTED = {"longalign": (16_500, 13_900), "swe-smith": (34_700, None), "uniform": ((1024 + 32768) / 2, None)}


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_sample_lengths_are_seeded_in_range_and_near_the_documented_means(name):
    lengths = np.array(sample_lengths(name, 20_000, seed=123))
    assert lengths.dtype.kind == "i"
    assert sample_lengths(name, 500, seed=7) == sample_lengths(name, 500, seed=7)
    assert sample_lengths(name, 500, seed=7) != sample_lengths(name, 500, seed=8)
    distribution = DISTRIBUTIONS[name]
    assert distribution.min_length <= lengths.min() and lengths.max() <= distribution.max_length
    mean, median = DOCUMENTED[name]
    assert lengths.mean() == pytest.approx(mean, rel=0.03)
    if median is not None:
        assert np.median(lengths) == pytest.approx(median, rel=0.03)


def test_swe_smith_has_a_long_tail_and_longalign_stays_under_64k():
    swe = np.array(sample_lengths("swe-smith", 20_000, seed=1))
    assert 0.09 < (swe > 65536).mean() < 0.13  # "about 11% of samples are longer than 64K"
    assert swe.max() > 120_000
    longalign = np.array(sample_lengths("longalign", 20_000, seed=1))
    assert longalign.min() >= 8192 and longalign.max() <= 65536
    assert longalign.mean() > 1.1 * np.median(longalign)  # right-skewed (documented: mean ~16.5K, median ~13.9K)


def test_sample_lengths_checks_its_arguments():
    assert sample_lengths("uniform", 0) == []
    with pytest.raises(ValueError, match=r"Unknown length distribution 'alpaca'; choose one of"):
        sample_lengths("alpaca", 10)
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        sample_lengths("longalign", -1)


def test_training_flops_count_every_weight_a_token_multiplies_and_attention_per_document():
    """6 FLOPs per weight and token (forward and backward) plus causal attention per document; a mixture of experts
    counts its router and the experts a token is routed to, not all of them."""
    from hf_odc.packing.flops import training_flops

    shape = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip
    weights = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 64 * 100  # layers x (q, o, k, v, MLP) + LM head
    attention = 2 * 4.0 * 4 * 16  # per causal pair: layers x 2 matmuls x 2 FLOPs x heads x head_dim
    assert training_flops([10, 30], shape) == pytest.approx(3 * (2 * weights * 40 + attention * (100 + 900) / 2))
    assert training_flops([40], shape) > training_flops([10, 30], shape)  # one document of 40 attends more pairs
    moe = {**shape, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    moe_weights = weights - 2 * 3 * 64 * 128 + 2 * (64 * 8 + 2 * 3 * 64 * 32)  # router + 2 routed experts a layer
    assert training_flops([40], moe) - training_flops([40], shape) == pytest.approx(
        3 * 2 * 40 * (moe_weights - weights)
    )


def test_mfu_reads_the_peak_from_the_device_name_or_the_environment(monkeypatch):
    from hf_odc.packing.flops import mfu, peak_flops

    monkeypatch.delenv("HF_ODC_PEAK_TFLOPS", raising=False)
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("cpu") is None
    monkeypatch.setenv("HF_ODC_PEAK_TFLOPS", "2")
    assert peak_flops("cpu") == 2e12
    assert mfu(4e12, 2.0, 2, peak_flops("cpu")) == pytest.approx(0.5)
    monkeypatch.setenv("HF_ODC_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="HF_ODC_PEAK_TFLOPS must be a number of TFLOP/s"):
        peak_flops("cpu")
