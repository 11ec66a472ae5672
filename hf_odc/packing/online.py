"""``MinibatchPlanner``: how a training run plans each minibatch, with a fixed cost model or one it calibrates.

A trainer plans every minibatch on every rank, the same way, from what every rank knows: the lengths, the planner
and the cost model. With a calibrated cost (``cost_model="calibrated"``) the model also changes during the run, from
microbatch times that every rank receives in the step's one metric gather, so every rank still holds the same model
at every step (:class:`~hf_odc.packing.Calibrator`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .bubble import bubble_of_costs, bubble_rate
from .calibration import Calibration, Calibrator
from .cost import CostModel
from .planners import MicrobatchCost, Plan, get_planner, lb_mini
from .sequence_parallel import GroupPlan, check_group_size, lb_mini_groups

__all__ = ["MinibatchPlanner"]


class MinibatchPlanner:
    """Plans minibatches with the planner ``balance`` for ``world_size`` ranks synchronised per ``sync``
    (``"minibatch"`` with ODC, ``"layer"`` with collective FSDP).

    Args:
        cost: the cost model; with a ``calibrator``, the one used until its first fit (e.g. the analytical
            :class:`~hf_odc.packing.AttentionCost`).
        calibrator: learns the cost and each rank's speed from :meth:`record`. Speeds are used only by LB-Mini under
            ODC: with per-layer collectives every microbatch step runs at the slowest rank's pace whatever the plan.
        group_size: the sequence-parallel size: documents longer than the token cap run as group microbatches of
            that many ranks (:meth:`plan_groups`, LB-Mini under ODC only); 1: none.
    """

    def __init__(
        self,
        balance: str,
        world_size: int,
        sync: str,
        cost: CostModel,
        calibrator: Calibrator | None = None,
        group_size: int = 1,
    ):
        self.balance, self.world_size, self.sync = balance, world_size, sync
        check_group_size(world_size, group_size)
        if group_size > 1 and (balance != "lb-mini" or sync != "minibatch"):
            raise ValueError(
                f"Sequence parallelism (sp_size={group_size}) runs with ODC and balance='lb-mini' (group microbatches "
                f"beside unequal microbatch counts), not with balance={balance!r} and {sync}-level synchronisation."
            )
        self.group_size = group_size
        self._planner = get_planner(balance)
        self._cost = cost
        self.calibrator = calibrator

    @property
    def calibration(self) -> Calibration | None:
        """The calibration plans are made with now (``None``: the fixed cost model)."""
        return self.calibrator.calibration if self.calibrator is not None else None

    @property
    def speeds(self) -> tuple[float, ...] | None:
        """Per-rank speeds LB-Mini balances for, or ``None`` (equal)."""
        calibration = self.calibration
        if calibration is None or self.balance != "lb-mini" or self.sync != "minibatch":
            return None
        return calibration.speeds

    def cost_for(self, max_tokens: int) -> CostModel:
        """The per-sample cost under a token cap of ``max_tokens`` (a calibrated per-microbatch cost is spread over a
        full microbatch's tokens)."""
        calibration = self.calibration
        return calibration.cost.amortised(max_tokens) if calibration is not None else self._cost

    def plan(self, lengths: Sequence[int], max_tokens: int) -> Plan:
        """The plan of a minibatch of ``lengths`` under the token cap ``max_tokens``. LB-Mini under ODC is given the
        calibrated per-microbatch cost as such (it weighs each rank's microbatch count, see
        :func:`~hf_odc.packing.lb_mini`); the other planners see it spread over the tokens."""
        cost, speeds, per_microbatch = self._balanced(max_tokens)
        if speeds is None:
            return self._planner(lengths, self.world_size, max_tokens, cost)
        return lb_mini(lengths, self.world_size, max_tokens, cost, speeds=speeds, per_microbatch=per_microbatch)

    def plan_groups(self, lengths: Sequence[int], max_tokens: int) -> GroupPlan:
        """The plan of a minibatch of ``lengths`` with documents longer than ``max_tokens`` split over groups of
        :attr:`group_size` ranks (:func:`~hf_odc.packing.lb_mini_groups`, given what :meth:`plan` gives LB-Mini);
        with a group size of 1, :meth:`plan`'s plan and no group microbatch."""
        if self.group_size == 1:
            return GroupPlan(self.plan(lengths, max_tokens), 1, [[] for _ in range(self.world_size)])
        cost, speeds, per_microbatch = self._balanced(max_tokens)
        return lb_mini_groups(
            lengths, self.world_size, max_tokens, cost, group_size=self.group_size, speeds=speeds,
            per_microbatch=per_microbatch,
        )  # fmt: skip

    def _balanced(self, max_tokens: int) -> tuple[CostModel, tuple[float, ...] | None, MicrobatchCost]:
        """The cost, speeds and per-microbatch cost to plan with: once calibrated, LB-Mini under ODC balances the
        ranks' speeds and weighs their microbatch counts (with a MoE model's expert term, each microbatch's fixed cost
        by its tokens); otherwise the cost under the cap, equal speeds."""
        speeds = self.speeds
        if speeds is None:
            return self.cost_for(max_tokens), None, 0.0
        cost = self.calibration.cost
        return cost, speeds, cost.microbatch if cost.has_expert_term else cost.per_microbatch

    def pack_alone(self, lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
        """The microbatches (indices into ``lengths``) this planner packs ``lengths`` into for one rank alone, under
        the token cap ``max_tokens``: what a rank would train on if it kept its own samples."""
        return self._planner(lengths, 1, max_tokens, self.cost_for(max_tokens))[0]

    def predicted_bubble(self, plan: Plan | GroupPlan, lengths: Sequence[int], max_tokens: int) -> float:
        """The idle fraction the cost model (and speeds) predict for ``plan``."""
        cost = self.cost_for(max_tokens)
        if isinstance(plan, GroupPlan):
            return bubble_of_costs(plan.rank_costs(lengths, cost), self.sync, self.speeds)
        return bubble_rate(plan, lengths, cost, sync=self.sync, speeds=self.speeds)

    def record(
        self,
        microbatch_lengths: Sequence[Sequence[Sequence[int]]],
        seconds: Sequence[Sequence[float]],
        active_experts: Sequence[Sequence[float]] | None = None,
    ) -> bool:
        """Feed one step's measured microbatches (every rank's; a MoE model's with their routers' active (layer,
        expert) pairs) to the calibrator; whether the calibration changed."""
        if self.calibrator is None:
            return False
        return self.calibrator.record(microbatch_lengths, seconds, active_experts)
