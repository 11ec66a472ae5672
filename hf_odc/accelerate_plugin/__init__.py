"""On-Demand Communication for plain Accelerate scripts: :class:`ODCPlugin` and the FSDP2 sharding it applies.

See :mod:`hf_odc.accelerate_plugin.plugin` for the two lines that switch a script to ODC, and
:mod:`hf_odc.accelerate_plugin.sharding` for why hf_odc, not Accelerate, applies ``fully_shard``.
"""

from .plugin import ODCPlugin
from .sharding import mixed_precision_policy, remap_optimizer, shard_model

__all__ = ["ODCPlugin", "mixed_precision_policy", "remap_optimizer", "shard_model"]
