"""The ODC engine: one-sided gather and scatter-accumulate on FSDP2, one barrier pair per minibatch."""

from ._fsdp_internals import held_unsharded, lazy_init_root
from .odc import ODC, enable
from .timing import CollectiveMinibatch, MinibatchStats

__all__ = ["ODC", "CollectiveMinibatch", "MinibatchStats", "enable", "held_unsharded", "lazy_init_root"]
