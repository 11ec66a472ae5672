"""hf_odc: On-Demand Communication for FSDP2 on the Hugging Face stack.

``hf_odc.enable(model)`` switches an FSDP2-sharded model to ODC; :mod:`hf_odc.packing` plans balanced minibatches.
"""

from .engine import ODC, MinibatchStats, enable
from .kernels import PeerFailureError

__all__ = ["ODC", "MinibatchStats", "PeerFailureError", "enable"]
__version__ = "0.1.0"
