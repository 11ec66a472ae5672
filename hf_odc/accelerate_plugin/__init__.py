"""On-Demand Communication for plain Accelerate scripts and the trainers: settings, lifecycle and sharding.

:class:`ODCPlugin` holds the settings (``HF_ODC_*`` fallbacks), :class:`ODCRuntime` does the work (shard, enable,
minibatch, close; see :mod:`hf_odc.accelerate_plugin.runtime` for the two lines that switch a script to ODC), and
:mod:`hf_odc.accelerate_plugin.sharding` says why hf_odc, not Accelerate, applies ``fully_shard``, and
:mod:`hf_odc.accelerate_plugin.parallelism` how it takes Accelerate's ``parallelism_config`` over.
"""

from .parallelism import accelerate_without_parallelism, parallelism_config_from, sequence_parallel_size
from .plugin import ODCPlugin
from .runtime import ODCRuntime
from .sharding import device_mesh, mixed_precision_policy, remap_optimizer, shard_model

__all__ = [
    "ODCPlugin",
    "ODCRuntime",
    "accelerate_without_parallelism",
    "device_mesh",
    "mixed_precision_policy",
    "parallelism_config_from",
    "remap_optimizer",
    "sequence_parallel_size",
    "shard_model",
]
