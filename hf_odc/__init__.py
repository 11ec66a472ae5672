"""hf_odc: On-Demand Communication for FSDP2 on the Hugging Face stack.

``hf_odc.enable(model)`` switches an FSDP2-sharded model to ODC; :mod:`hf_odc.packing` plans balanced minibatches.

The engine's names are imported on first use: planning (``hf-odc plan``, :mod:`hf_odc.packing`) needs no torch, and
importing torch would add seconds to every start of the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .liveness import launch as _launch

if TYPE_CHECKING:
    from .engine import ODC, CollectiveMinibatch, MinibatchStats, enable
    from .liveness import PeerFailureError

_LAZY = {
    "ODC": ".engine",
    "CollectiveMinibatch": ".engine",
    "MinibatchStats": ".engine",
    "enable": ".engine",
    "PeerFailureError": ".liveness",
}

__all__ = ["ODC", "CollectiveMinibatch", "MinibatchStats", "PeerFailureError", "enable"]
__version__ = "0.1.0"

_launch.on_import()  # under a launcher: end with it, start beating; always: exit without gloo's shutdown race


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
