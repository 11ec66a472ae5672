"""What ODC runs on the device: the transports (:mod:`hf_odc.kernels.transports`: memory every rank can reach,
one-sided gather and scatter-accumulate), the packed-attention kernel (:mod:`hf_odc.kernels.attention`), the same
attention over a row split across a group of ranks (:mod:`hf_odc.kernels.ulysses`, sequence parallelism), one decoding
step's attention over a static KV cache (:mod:`hf_odc.kernels.decode_attention`) and the fused RMSNorm and SiLU-gated
activation of transformers' decoders (:mod:`hf_odc.kernels.fused`).

Nothing here imports :mod:`hf_odc.liveness`, which sits above: how ranks meet and name a failed peer is not a
kernel's concern.

The transports', the fused kernels' and sequence parallelism's public names are re-exported here, where the engine,
the trainers and users import them from.
"""

from .fused import install_fused_kernels, rms_norm, silu_mul
from .transports import TRANSPORTS, CpuShmTransport, SymmetricTensor, Transport, host_ranks, make_transport
from .ulysses import SequenceShard, group_sum, new_sequence_group, sharded_causal_attention

__all__ = [
    "TRANSPORTS",
    "CpuShmTransport",
    "SequenceShard",
    "SymmetricTensor",
    "Transport",
    "group_sum",
    "host_ranks",
    "install_fused_kernels",
    "make_transport",
    "new_sequence_group",
    "rms_norm",
    "sharded_causal_attention",
    "silu_mul",
]
