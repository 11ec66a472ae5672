"""``ODCRuntime``: what is done with an :class:`ODCPlugin`'s settings, for trainers and plain scripts alike.

It shards the model (:func:`~hf_odc.accelerate_plugin.shard_model`), installs ODC (:func:`hf_odc.enable`), runs each
minibatch (:meth:`ODCRuntime.minibatch`), keeps the last minibatch's device-timed stats and releases ODC. A plain
Accelerate script needs two lines::

    odc = ODCRuntime(ODCPlugin(), accelerator)                               # line 1
    model, optimizer, loader = odc.prepare(model, optimizer, loader)        # line 2 (was accelerator.prepare)
    for minibatch in loader:
        with odc.minibatch():                   # each rank runs its own microbatches; no collective inside
            for microbatch in my_share(minibatch):
                accelerator.backward(loss_sum(microbatch) * world_size / global_target_tokens)
        optimizer.step(); optimizer.zero_grad()
    odc.close()

Around the script's own collectives (a metrics all-reduce, clipping, a checkpoint), ``with odc.bounded("what"):``
makes a dead or stalled peer an error naming it within the ODC timeout instead of a hang, as the trainers do.

With ``HF_ODC_ENABLED=0`` the very same script runs plain FSDP2: ``minibatch()`` then only meets the other ranks at
its entry and exit, as ODC does (:class:`~hf_odc.engine.CollectiveMinibatch`), so that :attr:`ODCRuntime.last` times
both alike; the ranks must then run equal microbatch counts, e.g. with ``hf_odc.packing.lb_micro``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..engine import ODC, CollectiveMinibatch, MinibatchStats, enable, held_unsharded
from ..kernels import new_sequence_group
from ..liveness import bounded
from .plugin import ODCPlugin
from .sharding import remap_optimizer, shard_model

__all__ = ["ODCRuntime"]


class ODCRuntime:
    """ODC's lifecycle on one model: :meth:`shard`, :meth:`enable` (or both through :meth:`prepare`),
    :meth:`minibatch` for every optimizer step, :meth:`close` at the end.

    Args:
        plugin: the settings; ``None`` builds an :class:`ODCPlugin` from the environment.
        accelerator: the ``accelerate.Accelerator`` (device, world size, FSDP and mixed-precision settings).
    """

    def __init__(self, plugin: ODCPlugin | None = None, accelerator: Any = None):
        self.plugin = plugin if plugin is not None else ODCPlugin()  # its timeout is the process's from now on
        self.accelerator = accelerator
        self._odc: ODC | None = None
        self._runner: ODC | CollectiveMinibatch | None = None
        self._sequence_group: Any = None

    # -- setup ------------------------------------------------------------------------------------------------------

    def shard(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` with FSDP2 (:func:`~hf_odc.accelerate_plugin.shard_model`) when several processes run;
        with one process the model is returned as is."""
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return model
        plugin = self.plugin
        return shard_model(
            model, self.accelerator, reshard_after_forward=plugin.reshard_after_forward, shard_size=plugin.shard_size
        )

    def enable(self, model: nn.Module) -> ODC | None:
        """Install ODC on the sharded ``model`` (collective) if the plugin enables it; after :meth:`shard`, before any
        forward. Otherwise (disabled, or one process) :meth:`minibatch` runs the model as it is, between the same
        meeting points. Either way every process group of the job gets the plugin's timeout (gloo's default is 30
        minutes, and transformers passes none to a CPU group), so that no collective blocks for longer. With the
        plugin's ``sp_size`` above 1, the sequence-parallel groups are created first (:attr:`sequence_group`)."""
        if self.plugin.sp_size > 1 and self._sequence_group is None and isinstance(model, FSDPModule):
            self._sequence_group = new_sequence_group(self.plugin.sp_size)
        if self.plugin.enabled and isinstance(model, FSDPModule) and self._odc is None:
            self._odc = enable(model, transport=self.plugin.transport)  # on the timeout the plugin set
        bounded.bound_process_groups(self.plugin.timeout)
        if self._runner is None:
            self._runner = self._odc or CollectiveMinibatch(next(model.parameters()).device)
        return self._odc

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, *others: Any) -> tuple:
        """``accelerator.prepare(model, optimizer, *others)`` with the model sharded by hf_odc and ODC installed.

        The optimizer may have been built over the unsharded model (as for ``accelerator.prepare``). Returns the
        prepared objects in the order given. Without an FSDP2 Accelerate config (e.g. ``MULTI_CPU``), Accelerate only
        adds autocast to the model: wrapping the sharded model in DDP would be wrong.
        """
        accelerator = self.accelerator
        names = {id(p): n for n, p in model.named_parameters()}
        was_sharded = isinstance(model, FSDPModule)
        sharded = self.shard(model)
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
    def active(self) -> bool:
        """Whether minibatches run with ODC (``False``: plain FSDP2, or one process, or not enabled yet)."""
        return self._odc is not None

    @property
    def hybrid(self) -> bool:
        """Whether ODC runs hybrid: shard groups replicated across hosts, all-reduced once per minibatch."""
        return self._odc is not None and self._odc.replicas is not None

    @property
    def sequence_group(self) -> Any:
        """This rank's sequence-parallel process group (the plugin's ``sp_size`` consecutive ranks, which split long
        documents together: :mod:`hf_odc.kernels.ulysses`), once :meth:`enable` created it; ``None`` without."""
        return self._sequence_group

    @property
    def odc(self) -> ODC | None:
        """The engine's handle, once :meth:`enable` installed ODC."""
        return self._odc

    @property
    def last(self) -> MinibatchStats | None:
        """Busy and wait seconds of this rank's last minibatch, device-timed (see :mod:`hf_odc.engine.timing`);
        ``None`` before :meth:`enable`."""
        return self._runner.last if self._runner is not None else None

    def minibatch(self, *, backward: bool = True) -> contextlib.AbstractContextManager:
        """Context for one rank's share of a minibatch: ODC's ``minibatch()``, or without ODC the model as it is
        between the same two meeting points (a no-op before :meth:`enable`). ``backward=False``: forwards only,
        under ``torch.no_grad()``, leaving gradients as they are."""
        if self._runner is None:
            return torch.no_grad() if not backward else contextlib.nullcontext()
        return self._runner.minibatch(backward=backward)

    @contextlib.contextmanager
    def gathered(self, model: nn.Module) -> Iterator[None]:
        """``model``'s whole parameters unsharded until the block ends, for many forwards without communication (e.g.
        decoding a generation batch, where each rank may run a different number of forwards).

        They are assembled once, inside a forward-only :meth:`minibatch` (with ODC: one-sided reads of the peers'
        shards, no collective; without it, FSDP's all-gather once per group), held through any number of forwards,
        and freed on exit. Costs the unsharded parameters' memory (in the compute dtype) while held. A no-op for a
        model that is not sharded."""
        if not isinstance(model, FSDPModule):
            yield
            return
        with held_unsharded(model) as unshard:
            with self.minibatch(backward=False):
                unshard()
            yield

    def full_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``model``'s parameters unsharded, by name (a shared one once), one FSDP group at a time: to hand the full
        weights elsewhere (a vLLM engine) while holding one group unsharded, not the whole model.

        Each group is unsharded (FSDP's ``unshard``) inside one forward-only :meth:`minibatch` (with ODC: one-sided
        reads of the peers' shards, no collective; without it, FSDP's all-gather per group), in the compute dtype,
        and resharded before the next: a tensor is valid until the next group's first one is yielded, so a consumer
        that keeps one longer copies it. The minibatch meets the shard group's ranks at its entry and exit: each of
        them runs this to the end, or an empty ``minibatch(backward=False)`` in its place. A model that is not
        sharded yields its parameters as they are."""
        if not isinstance(model, FSDPModule):
            yield from ((name, param.detach()) for name, param in model.named_parameters())
            return
        groups = _parameters_by_group(model)
        with self.minibatch(backward=False):
            for prefix, module, names in groups:
                module.unshard()
                for name in names:
                    yield prefix + name, module.get_parameter(name).detach()
                module.reshard()

    def lap(self) -> None:
        """Mark the end of a microbatch inside :meth:`minibatch`, so that :attr:`last` holds each one's device time
        (what a calibrated cost model learns from); a no-op before :meth:`enable`."""
        if self._runner is not None:
            self._runner.lap()

    # -- failures -----------------------------------------------------------------------------------------------------

    def bounded(self, what: str) -> contextlib.AbstractContextManager:
        """Run the collectives of ``what`` once every rank has met (:meth:`hf_odc.ODC.meet` names a rank that died or
        stalled, within the ODC timeout, where the collective would block); a collective that fails inside is
        re-raised as :class:`~hf_odc.PeerFailureError` naming the rank if it is known. Every rank must enter the same
        blocks in the same order, as they run the same collectives. Without ODC the process groups' timeout alone
        bounds them (:func:`hf_odc.liveness.bounded.bounded`)."""
        return bounded.bounded(self._odc, what)

    def failing_together(self, what: str = "training") -> contextlib.AbstractContextManager:
        """Around a whole run: if it fails on this rank, the others are told at once (their next meeting fails naming
        this rank, instead of waiting out the timeout), and a collective that failed because a peer went away is
        re-raised as :class:`~hf_odc.PeerFailureError` naming it (:func:`hf_odc.liveness.bounded.failing_together`)."""
        return bounded.failing_together(self._odc, what)

    def close(self) -> None:
        """Release ODC (collective: :meth:`hf_odc.ODC.close` waits for every rank first)."""
        if self._odc is not None:
            self._odc.close()
            self._odc = None
        self._runner = None


def _parameters_by_group(model: nn.Module) -> list[tuple[str, FSDPModule, list[str]]]:
    """Each FSDP module of ``model`` (name prefix, module, the names of the parameters its group holds, relative to
    it), the root's first: a parameter belongs to its innermost FSDP module, a shared one to the first that has it."""
    modules = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    owner: dict[int, str] = {}
    for name, module in reversed(modules):  # the innermost first
        for param in module.parameters():
            owner.setdefault(id(param), name)
    groups, seen = [], set()
    for name, module in modules:
        names = []
        for relative, param in module.named_parameters():
            if owner[id(param)] == name and id(param) not in seen:
                seen.add(id(param))
                names.append(relative)
        groups.append((f"{name}." if name else "", module, names))
    return groups


def _as_tuple(prepared: Any) -> tuple:
    return prepared if isinstance(prepared, tuple) else (prepared,)
