"""Minibatch planning for ODC: balance variable-length work across ranks, then pack it into microbatches.

Collective FSDP synchronises every layer, so every microbatch step waits for its slowest rank; ODC synchronises once
per minibatch, so only each rank's total must be balanced (LB-Mini). This package holds the planners, the cost
models they balance, the bubble model that predicts idle time, the four schemes every comparison names, the
built-in length distributions, and the calibration that fits the cost model (and each rank's speed) to measured
microbatch times while training (:class:`MinibatchPlanner` plans with it), and the plans that split documents
longer than a microbatch over groups of ranks (:func:`lb_mini_groups`, sequence parallelism). The simulator and the
rest of ``hf-odc plan``'s back end are in :mod:`hf_odc.cli.plan`.
"""

from .bubble import bubble_of_costs, bubble_rate, idle_fraction, plan_costs, predicted_time, sync_time
from .calibration import Calibration, Calibrator, microbatch_features
from .cost import (
    COSTS,
    DEFAULT_ATTENTION_SHAPE,
    AttentionCost,
    CalibratedCost,
    CostLike,
    CostModel,
    QuadraticCost,
    TokenCost,
    evaluate_costs,
    named_cost,
    resolve_cost,
)
from .distributions import DISTRIBUTIONS, LengthDistribution, sample_lengths
from .online import MinibatchPlanner
from .partition import karmarkar_karp
from .planners import PLANNERS, CapacityError, Plan, Planner, get_planner, lb_micro, lb_mini, local_sort, max_tokens_for
from .schemes import BASELINE, SCHEMES, Scheme
from .sequence_parallel import EXCHANGE, GroupPlan, lb_mini_groups, shard_sizes, split_costs

__all__ = [
    "BASELINE",
    "COSTS",
    "DEFAULT_ATTENTION_SHAPE",
    "DISTRIBUTIONS",
    "EXCHANGE",
    "PLANNERS",
    "SCHEMES",
    "AttentionCost",
    "CalibratedCost",
    "Calibration",
    "Calibrator",
    "CapacityError",
    "CostLike",
    "CostModel",
    "GroupPlan",
    "LengthDistribution",
    "MinibatchPlanner",
    "Plan",
    "Planner",
    "QuadraticCost",
    "Scheme",
    "TokenCost",
    "bubble_of_costs",
    "bubble_rate",
    "evaluate_costs",
    "get_planner",
    "idle_fraction",
    "karmarkar_karp",
    "lb_micro",
    "lb_mini",
    "lb_mini_groups",
    "local_sort",
    "max_tokens_for",
    "microbatch_features",
    "named_cost",
    "plan_costs",
    "predicted_time",
    "resolve_cost",
    "sample_lengths",
    "shard_sizes",
    "split_costs",
    "sync_time",
]
