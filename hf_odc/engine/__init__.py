"""The ODC engine: one-sided gather and scatter-accumulate on FSDP2, one barrier pair per minibatch."""

from .odc import ODC, MinibatchStats, enable

__all__ = ["ODC", "MinibatchStats", "enable"]
