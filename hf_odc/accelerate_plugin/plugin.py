"""``ODCPlugin``: On-Demand Communication for a plain Accelerate training script.

Why a plugin object and not an Accelerate config key: Accelerate's yaml rejects unknown top-level keys, silently drops
unknown ``fsdp_config`` keys, and has no hook after ``prepare``. So ODC's settings live in this dataclass (each field
falls back to an ``ODC_*`` environment variable, the way Accelerate's own plugins read ``FSDP_*``), and
:meth:`ODCPlugin.prepare` stands in for ``accelerator.prepare``: it shards the model (:func:`shard_model`), lets
Accelerate prepare everything else, then installs ODC. A script written as::

    odc = ODCPlugin()                                                    # line 1
    model, optimizer, loader = odc.prepare(accelerator, model, optimizer, loader)   # line 2 (was accelerator.prepare)
    for minibatch in loader:
        with odc.minibatch():                   # each rank runs its own microbatches; no collective inside
            for microbatch in my_share(minibatch):
                accelerator.backward(loss_sum(microbatch) * world_size / global_target_tokens)
        optimizer.step(); optimizer.zero_grad()

runs ODC, and with ``ODC_ENABLED=0`` the very same script runs plain FSDP2 (``minibatch()`` then only meets the other
ranks at its entry and exit, as ODC does, so that :attr:`ODCPlugin.last` times both alike; the ranks must run equal
microbatch counts, e.g. with ``hf_odc.packing.lb_micro``).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..engine import ODC, CollectiveMinibatch, MinibatchStats, enable
from ._env import parse_bool
from .sharding import remap_optimizer, shard_model

__all__ = ["ODCPlugin"]


@dataclass
class ODCPlugin:
    """Settings and handle of On-Demand Communication for one model.

    Args:
        enabled (`bool`, *optional*):
            Run each minibatch with ODC. ``False``: the sharded model stays plain FSDP2 (collectives per layer), the
            fair baseline. ``None`` reads ``ODC_ENABLED`` (default ``True``).
        timeout (`float`, *optional*):
            Seconds a minibatch barrier waits for a live peer before raising ``hf_odc.PeerFailureError`` (a dead
            peer is reported at once). ``None`` reads ``ODC_TIMEOUT``, else the engine's default (``HF_ODC_TIMEOUT``
            or 600).
        reshard_after_forward (`bool`, *optional*):
            FSDP2's option for the layers :meth:`prepare` shards. ``None`` reads ``ODC_RESHARD_AFTER_FORWARD``, then
            the Accelerate FSDP config (``fsdp_reshard_after_forward``), then ``True``.
    """

    enabled: bool | None = field(default=None, metadata={"help": "Run with ODC (env ODC_ENABLED, default true)."})
    timeout: float | None = field(
        default=None, metadata={"help": "Minibatch barrier timeout in seconds (env ODC_TIMEOUT, default 600)."}
    )
    reshard_after_forward: bool | None = field(
        default=None,
        metadata={"help": "FSDP2 reshard_after_forward (env ODC_RESHARD_AFTER_FORWARD, then the FSDP config)."},
    )
    _odc: ODC | None = field(default=None, init=False, repr=False)
    _runner: ODC | CollectiveMinibatch | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.enabled is None:
            self.enabled = os.environ.get("ODC_ENABLED", "true")
        self.enabled = parse_bool(self.enabled, "ODCPlugin.enabled / ODC_ENABLED")
        if self.timeout is None and os.environ.get("ODC_TIMEOUT"):
            self.timeout = os.environ["ODC_TIMEOUT"]
        if self.timeout is not None:
            try:
                self.timeout = float(self.timeout)
            except ValueError:
                raise ValueError(
                    f"ODCPlugin.timeout / ODC_TIMEOUT must be a number of seconds, got {self.timeout!r}."
                ) from None
            if not (math.isfinite(self.timeout) and self.timeout > 0):
                raise ValueError(f"ODCPlugin.timeout / ODC_TIMEOUT must be positive and finite, got {self.timeout}.")
        if self.reshard_after_forward is None and os.environ.get("ODC_RESHARD_AFTER_FORWARD"):
            self.reshard_after_forward = os.environ["ODC_RESHARD_AFTER_FORWARD"]
        if self.reshard_after_forward is not None:
            self.reshard_after_forward = parse_bool(
                self.reshard_after_forward, "ODCPlugin.reshard_after_forward / ODC_RESHARD_AFTER_FORWARD"
            )

    # -- setup ------------------------------------------------------------------------------------------------------

    def shard(self, model: nn.Module, accelerator: Any) -> nn.Module:
        """Shard ``model`` with FSDP2 (see :func:`~hf_odc.accelerate_plugin.shard_model`) when several processes
        run; with one process the model is returned as is."""
        if accelerator.num_processes == 1:
            return model
        return shard_model(model, accelerator, reshard_after_forward=self.reshard_after_forward)

    def enable(self, model: nn.Module) -> ODC | None:
        """Install ODC on the sharded ``model`` (collective), if enabled; after :meth:`shard`, before any forward.

        Otherwise (disabled, or one process) :meth:`minibatch` runs the model as it is, between the same meeting
        points (:class:`~hf_odc.engine.CollectiveMinibatch`)."""
        if self.enabled and isinstance(model, FSDPModule) and self._odc is None:
            self._odc = enable(model, timeout=self.timeout)
        if self._runner is None:
            self._runner = self._odc or CollectiveMinibatch(next(model.parameters()).device)
        return self._odc

    def prepare(self, accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer, *others: Any) -> tuple:
        """``accelerator.prepare(model, optimizer, *others)`` with the model sharded by hf_odc and ODC installed.

        The optimizer may have been built over the unsharded model (as for ``accelerator.prepare``). Returns the
        prepared objects in the order given. Without an FSDP2 Accelerate config (e.g. ``MULTI_CPU``), Accelerate only
        adds autocast to the model: wrapping the sharded model in DDP would be wrong.
        """
        names = {id(p): n for n, p in model.named_parameters()}
        was_sharded = isinstance(model, FSDPModule)
        sharded = self.shard(model, accelerator)
        if isinstance(sharded, FSDPModule) and not was_sharded:
            remap_optimizer(optimizer, names, sharded)
        if not isinstance(sharded, FSDPModule) or getattr(accelerator, "is_fsdp2", False):
            prepared = accelerator.prepare(sharded, optimizer, *others)
        else:
            prepared = (
                accelerator.prepare_model(sharded, device_placement=False, evaluation_mode=True),
                *_as_tuple(accelerator.prepare(optimizer, *others)),
            )
        self.enable(prepared[0])
        return prepared

    # -- training -----------------------------------------------------------------------------------------------------

    @property
    def odc(self) -> ODC | None:
        """The engine's handle, once :meth:`enable` installed ODC (``None`` when disabled or single-process)."""
        return self._odc

    @property
    def last(self) -> MinibatchStats | None:
        """Busy and wait seconds of this rank's last minibatch, device-timed (see :mod:`hf_odc.engine.timing`);
        ``None`` before :meth:`enable`."""
        return self._runner.last if self._runner is not None else None

    def minibatch(self) -> contextlib.AbstractContextManager:
        """Context for one rank's share of a minibatch: ODC's ``minibatch()``, or without ODC the model as it is
        between the same two meeting points (a no-op before :meth:`enable`)."""
        return self._runner.minibatch() if self._runner is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Release ODC (collective: :meth:`hf_odc.ODC.close` waits for every rank first)."""
        if self._odc is not None:
            self._odc.close()
            self._odc = None
        self._runner = None


def _as_tuple(prepared: Any) -> tuple:
    return prepared if isinstance(prepared, tuple) else (prepared,)
