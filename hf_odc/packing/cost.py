"""Per-sample cost models: how long one sample keeps a rank busy, in arbitrary but consistent units.

Balancing only needs *relative* costs, so every model here is a per-sample function ``list[int] -> list[float]``
whose sum over a microbatch predicts that microbatch's compute time. Token count is the classic proxy; it is wrong
for long sequences, where attention's quadratic term dominates, so two quadratic models are provided: one derived
from a model's shape (FLOP counting) and one fitted to measured microbatch times (:mod:`hf_odc.packing.calibration`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "COSTS",
    "DEFAULT_ATTENTION_SHAPE",
    "AttentionCost",
    "CalibratedCost",
    "CostLike",
    "CostModel",
    "QuadraticCost",
    "TokenCost",
    "evaluate_costs",
    "named_cost",
    "resolve_cost",
]


@runtime_checkable
class CostModel(Protocol):
    """Anything that maps sample lengths to per-sample costs (one non-negative float per length)."""

    def __call__(self, lengths: Sequence[int]) -> list[float]: ...


CostLike = str | CostModel | Callable[[Sequence[int]], Sequence[float]]
"""What planners accept as ``cost``: ``"tokens"``, ``"attention"``, a cost model, or any such callable."""


@dataclass(frozen=True)
class TokenCost:
    """Cost = number of tokens. Right when per-token work (the matmuls) dominates, i.e. for short sequences."""

    def __call__(self, lengths: Sequence[int]) -> list[float]:
        return [float(length) for length in lengths]


@dataclass(frozen=True)
class QuadraticCost:
    """Cost = ``linear * L + quadratic * L**2`` for a sample of ``L`` tokens.

    The linear term is the per-token work (projections, MLP, LM head); the quadratic term is causal attention,
    whose work grows with the number of token pairs. Both subclasses below only differ in where the two
    coefficients come from.
    """

    linear: float
    quadratic: float

    def __post_init__(self) -> None:
        if not (self.linear >= 0 and self.quadratic >= 0 and self.linear + self.quadratic > 0):
            raise ValueError(
                f"{type(self).__name__} needs non-negative coefficients, not both zero; got "
                f"linear={self.linear}, quadratic={self.quadratic}."
            )

    def __call__(self, lengths: Sequence[int]) -> list[float]:
        return [self.linear * length + self.quadratic * length * length for length in lengths]


# A Qwen2-0.5B-like shape: small enough that attention overtakes the matmuls at about 23K tokens, which is the
# regime (8K-64K samples) where cost-aware balancing matters. Pass your own config for another model.
DEFAULT_ATTENTION_SHAPE: dict[str, int] = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
}


class AttentionCost(QuadraticCost):
    """Forward FLOPs of a decoder-only transformer (the backward is a constant multiple, which balancing ignores)."""

    @classmethod
    def from_config(cls, config: Any) -> AttentionCost:
        """Derive the coefficients from a model shape.

        ``config`` is a ``transformers.PretrainedConfig`` or a plain mapping (e.g. a parsed ``config.json``) with
        ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``, ``num_attention_heads``, ``vocab_size`` and
        optionally ``num_key_value_heads`` (GQA) and ``head_dim``.

        Per token and layer, the q/k/v/o projections and the gated MLP (three ``hidden x intermediate`` matrices)
        cost 2 FLOPs per weight; the LM head adds ``2 * hidden * vocab`` once. Per causal token pair (``L**2 / 2``
        of them) and layer, ``QK^T`` and ``AV`` cost ``2 * 2 * heads * head_dim`` FLOPs.

        A Mixture-of-Experts config (``num_experts_per_tok`` and ``num_experts`` or ``num_local_experts``: Qwen3-MoE,
        Mixtral...) replaces each sparse layer's MLP by the experts a token is routed to (``num_experts_per_tok``
        gated MLPs of width ``moe_intermediate_size``, else ``intermediate_size``) and the router (``hidden x
        experts``), plus a shared expert of width ``shared_expert_intermediate_size`` where the config has one; the
        layers of ``mlp_only_layers`` stay dense. The count is the same whatever the routing: how evenly the experts
        are loaded is not a FLOP count.
        """
        hidden = _config_int(config, "hidden_size")
        layers = _config_int(config, "num_hidden_layers")
        heads = _config_int(config, "num_attention_heads")
        vocab = _config_int(config, "vocab_size")
        kv_heads = _config_int(config, "num_key_value_heads", default=heads)
        head_dim = _config_int(config, "head_dim", default=hidden // heads)
        projection_weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        top_k = _config_int(config, "num_experts_per_tok", default=0)
        experts = _config_int(config, "num_experts", default=0) or _config_int(config, "num_local_experts", default=0)
        if top_k and experts:
            width = _config_int(config, "moe_intermediate_size", default=0) or _config_int(config, "intermediate_size")
            shared = _config_int(config, "shared_expert_intermediate_size", default=0)
            sparse_mlp = top_k * 3 * hidden * width + hidden * experts + (3 * hidden * shared + hidden if shared else 0)
            dense = len(_config_value(config, "mlp_only_layers") or [])
            dense_mlp = 3 * hidden * _config_int(config, "intermediate_size") if dense else 0
            mlp_weights = dense * dense_mlp + (layers - dense) * sparse_mlp  # over every layer
        else:
            mlp_weights = layers * 3 * hidden * _config_int(config, "intermediate_size")
        linear = 2.0 * (layers * projection_weights + mlp_weights + hidden * vocab)
        quadratic = 0.5 * layers * 4.0 * heads * head_dim
        return cls(linear=linear, quadratic=quadratic)


@dataclass(frozen=True)
class CalibratedCost(QuadraticCost):
    """A cost in seconds, fitted to measured microbatch times (:class:`hf_odc.packing.Calibration`).

    Besides the linear and quadratic terms it carries what a FLOP count cannot see: a fixed cost per sequence
    (``per_sequence``, e.g. per-document kernel launches of varlen attention) and per microbatch (``per_microbatch``:
    the parameter reads, gradient pushes and launches every microbatch pays whatever it holds). A sample's cost
    includes its sequence term; the microbatch term belongs to no sample, so a planner sees it spread over the tokens
    of a full microbatch (:meth:`amortised`).

    A Mixture-of-Experts model adds the *expert term*: an expert's weights are read and its kernels launched once per
    layer for each microbatch whose tokens the router sends to it, so a microbatch pays ``per_expert`` for each
    (layer, expert) pair it activates. How many it activates is known only after its forward, so the cost predicts
    it from the router statistics of earlier microbatches: of the ``expert_slots`` pairs (MoE layers x experts), a
    microbatch of ``T`` tokens activates ``expert_slots * (1 - exp(-T / expert_scale))``
    (:meth:`active_experts`; uniform top-k routing over ``E`` experts gives ``expert_scale = E / k``, routing that
    concentrates tokens on fewer experts a larger one). The term is concave in ``T``: two microbatches of ``T / 2``
    tokens activate more pairs than one of ``T``. With ``expert_slots=0`` (a dense model) it is off.
    """

    per_sequence: float = 0.0
    per_microbatch: float = 0.0
    per_expert: float = 0.0
    expert_slots: int = 0
    expert_scale: float = 0.0

    def __post_init__(self) -> None:
        # Any one term may carry the whole cost: measured times can be flat in the length (short samples, a
        # launch-bound device), so that only the fixed costs are fitted.
        terms = (self.linear, self.quadratic, self.per_sequence, self.per_microbatch, self.per_expert)
        if not (all(term >= 0 for term in terms) and sum(terms) > 0):
            raise ValueError(
                f"CalibratedCost needs non-negative coefficients, not all zero; got linear={self.linear}, "
                f"quadratic={self.quadratic}, per_sequence={self.per_sequence}, per_microbatch={self.per_microbatch}, "
                f"per_expert={self.per_expert}."
            )
        if not (self.expert_slots >= 0 and self.expert_scale >= 0):
            raise ValueError(
                f"CalibratedCost needs expert_slots >= 0 and expert_scale >= 0; got expert_slots={self.expert_slots}, "
                f"expert_scale={self.expert_scale}."
            )

    def __call__(self, lengths: Sequence[int]) -> list[float]:
        return [self.per_sequence + self.linear * length + self.quadratic * length * length for length in lengths]

    @property
    def has_expert_term(self) -> bool:
        """Whether a microbatch's fixed cost depends on its tokens (a MoE model's fitted expert term)."""
        return self.per_expert > 0 and self.expert_slots > 0

    def active_experts(self, tokens: int) -> float:
        """The expected (layer, expert) pairs a microbatch of ``tokens`` tokens activates (0 for a dense model)."""
        if self.expert_slots == 0 or tokens <= 0:
            return 0.0
        if self.expert_scale == 0:  # every microbatch seen so far activated every pair
            return float(self.expert_slots)
        return self.expert_slots * -math.expm1(-tokens / self.expert_scale)

    def microbatch(self, tokens: int) -> float:
        """The fixed cost of a microbatch of ``tokens`` tokens: ``per_microbatch`` plus its expert term."""
        if not self.has_expert_term:
            return self.per_microbatch
        return self.per_microbatch + self.per_expert * self.active_experts(tokens)

    def amortised(self, max_tokens: int) -> CalibratedCost:
        """The per-sample cost a planner balances when microbatches hold up to ``max_tokens``: the fixed cost of a
        full microbatch (:meth:`microbatch`) spread over that many tokens. Planners fill microbatches close to the
        cap, so a rank's share of ``N`` tokens runs about ``N / max_tokens`` of them."""
        if not max_tokens >= 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
        return CalibratedCost(
            linear=self.linear + self.microbatch(max_tokens) / max_tokens,
            quadratic=self.quadratic,
            per_sequence=self.per_sequence,
        )


def _config_value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _config_int(config: Any, key: str, default: int | None = None) -> int:
    value = _config_value(config, key)
    if value is None:
        if default is None:
            raise ValueError(
                f"AttentionCost.from_config: the model config has no {key!r}; pass a transformers config or a "
                f"dict with the keys of DEFAULT_ATTENTION_SHAPE."
            )
        return default
    return int(value)


COSTS: dict[str, Callable[[Any], CostModel]] = {
    "tokens": lambda config: TokenCost(),
    "attention": lambda config: AttentionCost.from_config(config if config is not None else DEFAULT_ATTENTION_SHAPE),
}
"""The cost models by name, each built from a model config (``None``: :data:`DEFAULT_ATTENTION_SHAPE`)."""


def named_cost(name: str, config: Any = None) -> CostModel:
    """The cost model called ``name`` (see :data:`COSTS`) for a model ``config`` (a dict or a transformers config)."""
    if name not in COSTS:
        raise ValueError(
            f"Unknown cost model {name!r}: use one of {sorted(COSTS)}, a CostModel such as "
            "AttentionCost.from_config(config) or Calibration.fit(...).cost, or a callable list[int] -> list[float]."
        )
    return COSTS[name](config)


def resolve_cost(cost: CostLike) -> Callable[[Sequence[int]], Sequence[float]]:
    """Turn a cost argument into a callable: a name of :data:`COSTS` (default shape), or a callable as is."""
    if isinstance(cost, str):
        return named_cost(cost)
    if not callable(cost):
        raise TypeError(f"cost must be a string or a callable list[int] -> list[float], got {type(cost).__name__}.")
    return cost


def evaluate_costs(lengths: Sequence[int], cost: CostLike) -> np.ndarray:
    """Per-sample costs as a float64 array, checked: one finite, non-negative value per sample."""
    values = np.asarray(list(resolve_cost(cost)(list(lengths))), dtype=np.float64)
    if values.shape != (len(lengths),):
        raise ValueError(
            f"The cost model returned {values.size} values for {len(lengths)} lengths; it must return one each."
        )
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("The cost model returned a negative or non-finite cost; costs must be finite and >= 0.")
    return values
