"""How busy this machine is, so that the suite's timeouts scale with it: a timeout guards against a hang, and a run
that shares two cores with other jobs, or starts more processes than there are cores, is slow without hanging."""

from __future__ import annotations

import os


def scaled(seconds: float, processes: int = 1) -> float:
    """``seconds`` stretched by the processes per core beyond one and by the load average per core, as measured now
    (an idle machine with enough cores leaves it as it is)."""
    cores = os.cpu_count() or 1
    return seconds * max(1.0, processes / cores) * (1.0 + os.getloadavg()[0] / cores)
