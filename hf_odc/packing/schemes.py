"""The four training setups every comparison names: how ranks synchronise, and which planner plans the minibatch.

One vocabulary for the simulator, ``hf-odc plan``, the benchmarks and the tests: a scheme's ``balance`` is a name of
:data:`~hf_odc.packing.PLANNERS` (what the trainers' ``balance`` takes) and its ``sync`` says whether it runs on
collectives (``"layer"``) or ODC (``"minibatch"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .bubble import Sync
from .planners import PLANNERS, Planner

__all__ = ["BASELINE", "SCHEMES", "Scheme"]


@dataclass(frozen=True)
class Scheme:
    """A training setup: how ranks synchronise, and which planner (a name of ``PLANNERS``) plans the minibatch."""

    name: str
    sync: Sync
    balance: str

    @property
    def odc(self) -> bool:
        return self.sync == "minibatch"

    @property
    def planner(self) -> Planner:
        return PLANNERS[self.balance]


SCHEMES: tuple[Scheme, ...] = (
    Scheme("Collective+LocalSort", "layer", "local-sort"),
    Scheme("Collective+LB-Micro", "layer", "lb-micro"),
    Scheme("ODC+LB-Micro", "minibatch", "lb-micro"),
    Scheme("ODC+LB-Mini", "minibatch", "lb-mini"),
)
BASELINE = "Collective+LB-Micro"
"""Speedups are relative to the best that collective FSDP can do."""
