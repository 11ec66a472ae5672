"""What ODC runs on the device: the transports (:mod:`hf_odc.kernels.transports`: memory every rank can reach,
one-sided gather and scatter-accumulate) and the packed-attention kernel (:mod:`hf_odc.kernels.attention`).

Nothing here imports :mod:`hf_odc.liveness`, which sits above: how ranks meet and name a failed peer is not a
kernel's concern.

The transports' public names are re-exported here, where the engine and users import them from.
"""

from .transports import TRANSPORTS, CpuShmTransport, SymmetricTensor, Transport, host_ranks, make_transport

__all__ = ["TRANSPORTS", "CpuShmTransport", "SymmetricTensor", "Transport", "host_ranks", "make_transport"]
