"""The back end of ``hf-odc plan``: where lengths and cost models come from, the simulator, the table and the plot.

Nothing in training imports this: the trainers need only the planning core, :mod:`hf_odc.packing`.
"""

from .simulate import HYBRID_SCHEMES, CrossHost, GroupPlacement, SchemeResult, Simulation, simulate
from .sources import LengthPool, LengthSource, choose_cost, choose_source, load_calibration

__all__ = [
    "HYBRID_SCHEMES",
    "CrossHost",
    "GroupPlacement",
    "LengthPool",
    "LengthSource",
    "SchemeResult",
    "Simulation",
    "choose_cost",
    "choose_source",
    "load_calibration",
    "simulate",
]
