"""How ``ODCGRPOTrainer`` decodes its rollouts on a sharded policy: each rank alone, never in lockstep.

transformers' ``generate`` on an FSDP2 model all-gathers every layer group for every decoded token, and keeps the
ranks in lockstep (``synced_gpus``): a rank whose completions end early runs dummy forwards until the longest one
anywhere ends. Two ways out, by :data:`GENERATION_MODES`:

* ``"gathered"``: the policy's full weights are assembled once per generation batch
  (:meth:`~hf_odc.accelerate_plugin.ODCRuntime.gathered`: one-sided reads with ODC, no collective), every rank decodes
  its own prompts with no communication at all, and the copy is freed before the policy update. Costs the full
  weights in the compute dtype while decoding, on top of the shards.
* ``"sharded"``: decoding inside one forward-only ODC minibatch: each forward reads the layer shards it needs from the
  peers one-sidedly, as in training, so no copy is held and no collective runs; each token pays the reads.
* ``"lockstep"``: TRL's own path, kept as the baseline the other two are measured against.

Either way a rank that finishes early goes on to the rollouts' gather, where the others join it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .. import _compat
from ..accelerate_plugin import ODCRuntime

__all__ = ["GENERATION_MODES", "choose_generation_mode", "decoding"]

GENERATION_MODES = ("gathered", "sharded", "lockstep")

_COPY_SHARE_OF_FREE_MEMORY = 0.5  # the rest is left to the KV cache and the decoding's activations


def choose_generation_mode(requested: str | None, model: nn.Module, runtime: ODCRuntime, dtype: torch.dtype) -> str:
    """``requested`` checked against the run, or (``None``) ``"gathered"`` when the full weights in ``dtype`` take at
    most half of the device's free memory, else ``"sharded"`` (with ODC; the plain FSDP2 baseline always gathers)."""
    if requested is not None:
        if requested not in GENERATION_MODES:
            raise ValueError(f"odc_generation must be one of {GENERATION_MODES}, got {requested!r}.")
        if requested == "sharded" and isinstance(model, FSDPModule) and not runtime.active:
            raise ValueError(
                "odc_generation='sharded' decodes inside an ODC minibatch, which plain FSDP2 (odc=False) cannot run "
                "(its per-layer all-gathers would need every rank's forwards in lockstep). Use 'gathered' or "
                "'lockstep'."
            )
        return requested
    if not isinstance(model, FSDPModule) or not runtime.active:
        return "gathered"
    device = next(model.parameters()).device
    if device.type != "cuda":
        return "gathered"
    copy_bytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return "gathered" if copy_bytes <= _COPY_SHARE_OF_FREE_MEMORY * free_bytes else "sharded"


@contextlib.contextmanager
def decoding(model: nn.Module, runtime: ODCRuntime, mode: str) -> Iterator[None]:
    """The context in which ``model`` decodes a generation batch in ``mode`` (see the module docstring); nothing
    changes for a model that is not sharded, or in ``"lockstep"``."""
    if mode == "lockstep" or not isinstance(model, FSDPModule):
        yield
        return
    with _compat.decoding_alone(model):
        if mode == "sharded":
            with runtime.minibatch(backward=False):
                yield
        else:
            with runtime.gathered(model):
                yield
