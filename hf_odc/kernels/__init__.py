"""What ODC runs on the device: the transports (:mod:`hf_odc.kernels.transports`: memory every rank can reach,
one-sided gather and scatter-accumulate, a barrier that cannot hang) and the packed-attention kernel
(:mod:`hf_odc.kernels.attention`).

The transports' public names are re-exported here, where the engine and users import them from.
"""

from .transports import (
    DEFAULT_TIMEOUT_S,
    TRANSPORTS,
    CpuShmTransport,
    PeerFailureError,
    SymmetricTensor,
    Transport,
    host_ranks,
    make_transport,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TRANSPORTS",
    "CpuShmTransport",
    "PeerFailureError",
    "SymmetricTensor",
    "Transport",
    "host_ranks",
    "make_transport",
]
