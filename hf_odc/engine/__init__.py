"""The ODC engine: one-sided gather and scatter-accumulate on FSDP2, one barrier pair per minibatch."""

from .odc import ODC, enable
from .timing import CollectiveMinibatch, MinibatchStats

__all__ = ["ODC", "CollectiveMinibatch", "MinibatchStats", "enable"]
