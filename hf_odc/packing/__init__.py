"""Minibatch planning for ODC: balance variable-length work across ranks, then pack it into microbatches.

Collective FSDP synchronises every layer, so every microbatch step waits for its slowest rank; ODC synchronises once
per minibatch, so only each rank's total must be balanced (LB-Mini). This package holds the planners, the cost
models they balance, the bubble model that predicts idle time, and the simulator behind ``hf-odc plan``.
"""

from .bubble import bubble_rate, plan_costs, predicted_time, sync_time
from .cost import (
    DEFAULT_ATTENTION_SHAPE,
    AttentionCost,
    CalibratedCost,
    CostLike,
    CostModel,
    QuadraticCost,
    TokenCost,
    evaluate_costs,
    resolve_cost,
)
from .distributions import DISTRIBUTIONS, LengthDistribution, sample_lengths
from .partition import karmarkar_karp
from .planners import Plan, lb_micro, lb_mini, local_sort
from .simulate import SCHEMES, Simulation, simulate
from .sources import LengthPool, choose_cost, choose_source

__all__ = [
    "DEFAULT_ATTENTION_SHAPE",
    "DISTRIBUTIONS",
    "SCHEMES",
    "AttentionCost",
    "CalibratedCost",
    "CostLike",
    "CostModel",
    "LengthDistribution",
    "LengthPool",
    "Plan",
    "QuadraticCost",
    "Simulation",
    "TokenCost",
    "bubble_rate",
    "choose_cost",
    "choose_source",
    "evaluate_costs",
    "karmarkar_karp",
    "lb_micro",
    "lb_mini",
    "local_sort",
    "plan_costs",
    "predicted_time",
    "resolve_cost",
    "sample_lengths",
    "simulate",
    "sync_time",
]
