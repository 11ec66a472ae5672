"""``hf_odc.enable``: On-Demand Communication on a model sharded with FSDP2.

Inside ``with odc.minibatch():`` no collective and no barrier runs. A layer's forward/backward reads the parameter
shards it needs from their owners' mirrors and pushes its gradient pieces into their owners' accumulators, so each
rank may run a different number of microbatches (zero included). Entering and leaving ``minibatch()`` are the only
synchronisation points:

* enter: publish this rank's (freshly optimised) shards into its mirror, clear its accumulator, barrier;
* exit: barrier (every push has landed), then install the accumulated gradients as ``.grad``.

Gradient semantics (what a user scales the loss by)
---------------------------------------------------
On exit each trainable sharded parameter's ``.grad`` holds what FSDP2 produces for one backward per rank, with the
same DTensor placement and FSDP's divide factor ``F`` (the data-parallel world size ``W`` by default, or what
``set_gradient_divide_factor`` set)::

    grad = (1 / F) * sum over ranks r, sum over r's microbatches m of d(loss_m) / d(param)

and it is *added* to a ``.grad`` that was not cleared, as FSDP accumulates. With HSDP's 2-D mesh (hybrid ODC: shard
groups within hosts, replicated across hosts; :mod:`hf_odc.engine.hybrid`) the sum runs over every rank of every
host, ``W`` is the whole job's rank count, and the exit all-reduces each shard across the replicas after the barrier.

With FSDP's default ``F = W`` and
``loss_m`` the *sum* of the per-token losses of microbatch ``m``, the update equals full-minibatch training on the
mean token loss when every rank scales by the global count of target tokens ``N`` of the minibatch::

    (model(**mb).loss_sum * W / N).backward()     # W = world size, N = target tokens over all ranks' microbatches

``N`` is one all-reduce per minibatch, outside ``minibatch()`` (or the trainer's job). The ranks' splits of the
minibatch, including empty ones, do not change the result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..kernels import Transport, make_transport
from ..liveness import PeerFailureError, heartbeat
from ..liveness.host_barrier import HostBarrier
from ._fsdp_internals import (
    GroupSpec,
    check_fsdp_layout,
    describe_groups,
    gradient_divisor,
    install_comms,
    set_replica_all_reduce,
    take_unreduced_gradient,
)
from .buffers import GroupSlots, allocate_slots
from .comms import ODCAllGather, ODCReduceScatter
from .hybrid import ReplicaGroup
from .timing import MinibatchClock, MinibatchStats


class ODC:
    """The handle :func:`enable` returns. Use :meth:`minibatch` around each rank's share of a minibatch.

    It reaches the peers' memory through ``transport`` and meets them through ``host`` (its host's ranks) and, with
    hybrid ODC, ``replicas`` (the other hosts'). Both speak :class:`~hf_odc.liveness.PeerWatch`, and so does this
    handle, over the whole job (:meth:`meet`, :meth:`check`, :meth:`abort`)."""

    def __init__(
        self,
        model: nn.Module,
        specs: list[GroupSpec],
        transport: Transport,
        host: HostBarrier,
        replicas: ReplicaGroup | None = None,
    ):
        self.model = model
        self.transport = transport
        self.host = host
        self.replicas = replicas
        if replicas is not None:
            host.watch(replicas.check)  # a rank that gave up on another host ends this host's barriers too
        self.rank, self.world_size = transport.rank, transport.world_size
        self._slots: list[GroupSlots] = allocate_slots(specs, transport)
        self._in_minibatch = False
        self._closed = False
        self._failed = False  # this rank saw a peer fail, or failed itself: close() then waits for nobody
        self._requires_grad = [tuple(p.trainable for p in s.params) for s in specs]
        self.last = MinibatchStats()
        self._clock = MinibatchClock(self.device)
        self._grads: dict[int, DTensor] = {}  # param id -> its .grad as a DTensor over the accumulator (built once)
        self._sinks = self._make_sinks()
        for slots in self._slots:
            spec = slots.spec
            sink = self._sinks.get(spec.reduce_dtype)
            install_comms(
                spec,
                ODCAllGather(slots, transport, self._is_in_minibatch),
                ODCReduceScatter(slots, transport, self._is_in_minibatch, sink) if sink is not None else None,
            )

    def _make_sinks(self) -> dict[torch.dtype, torch.Tensor]:
        sizes: dict[torch.dtype, int] = {}
        device = None
        for slots in self._slots:
            spec = slots.spec
            if spec.grad_numel:
                sizes[spec.reduce_dtype] = max(sizes.get(spec.reduce_dtype, 0), spec.grad_numel)
                device = spec.params[0].param.device
        return {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}

    def _is_in_minibatch(self) -> bool:
        return self._in_minibatch

    # -- minibatch boundaries -------------------------------------------------------------------------------------

    def _check_frozen_set_unchanged(self) -> None:
        for slots, flags in zip(self._slots, self._requires_grad, strict=True):
            now = tuple(p.trainable for p in slots.spec.params)
            if now != flags:
                changed = [p.fqn for p, a, b in zip(slots.spec.params, flags, now, strict=True) if a != b]
                raise RuntimeError(
                    f"hf_odc: requires_grad changed after hf_odc.enable() for {changed}; freeze or unfreeze "
                    "parameters before enabling ODC (the gradient buffers are laid out for the frozen set)."
                )

    @torch.no_grad()
    def _publish(self, clear_accumulators: bool = True) -> None:
        """Copy this rank's shards into its mirror and (for a training minibatch) clear its accumulator."""
        for slots in self._slots:
            mirror = slots.mirror_slot()
            offset = 0
            for p in slots.spec.params:
                local = p.param.to_local()
                mirror[offset : offset + p.sharded_numel].copy_(local.reshape(-1))
                offset += p.padded_numel
            if slots.accum is not None and clear_accumulators:
                self._detach_grads_from_accumulator(slots)
                slots.accum_slot().zero_()

    def _detach_grads_from_accumulator(self, slots: GroupSlots) -> None:
        """A ``.grad`` kept from the last minibatch (no ``zero_grad``) still views the accumulator: copy it out."""
        acc = slots.accum_slot()
        lo, hi = acc.data_ptr(), acc.data_ptr() + acc.numel() * acc.element_size()
        for p in slots.spec.params:
            grad = p.param.grad
            if grad is not None and lo <= grad.to_local().data_ptr() < hi:
                p.param.grad = grad.clone()

    @torch.no_grad()
    def _install_grads(self) -> None:
        sink_ptrs = {t.untyped_storage().data_ptr() for t in self._sinks.values()}
        device_type = self.device.type
        for slots in self._slots:
            if slots.accum is None:
                continue
            spec = slots.spec
            divisor = gradient_divisor(spec, device_type)
            acc = slots.accum_slot()
            if divisor != 1.0:
                acc.div_(divisor)
            offset = 0
            for p in spec.params:
                if not p.trainable:
                    continue
                local = acc[offset : offset + p.sharded_numel].view(p.sharded_size)
                offset += p.padded_numel
                param = p.param
                grad = param.grad
                if grad is not None and grad.to_local().untyped_storage().data_ptr() not in sink_ptrs:
                    grad.to_local().add_(local)  # FSDP accumulates into a .grad that was not cleared
                    continue
                param.grad = self._grad_over(param, local)

    def _grad_over(self, param: nn.Parameter, local: torch.Tensor) -> DTensor:
        """``param``'s gradient DTensor over ``local``; reused across minibatches when it can view the accumulator."""
        if local.dtype != param.dtype:  # e.g. bf16 parameters: a cast copy, made anew each time
            return self._as_dtensor(param, local.to(param.dtype))
        grad = self._grads.get(id(param))
        if grad is None:
            grad = self._grads[id(param)] = self._as_dtensor(param, local)
        return grad

    @staticmethod
    def _as_dtensor(param: nn.Parameter, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    @property
    def device(self) -> torch.device:
        """The device the sharded parameters (and so the transport's buffers) live on."""
        return self._slots[0].spec.params[0].param.device if self._slots else torch.device("cpu")

    @contextlib.contextmanager
    def minibatch(self, *, backward: bool = True) -> Iterator[ODC]:
        """Run this rank's share of one minibatch (any number of microbatches, zero included).

        On entry the parameters of the last optimizer step become visible to every peer; on exit every peer's pushes
        have landed and the trainable parameters' ``.grad`` hold the minibatch's gradients (see the module docstring).
        Update parameters only outside this block. If the block raises, the peers' next barrier fails at once with
        this rank's error instead of waiting for it.

        ``backward=False`` runs forwards only (e.g. scoring log-probabilities), under ``torch.no_grad()``: parameters
        are read the same one-sided way, but the accumulators and ``.grad`` are left as they are.
        """
        if self._closed:
            raise RuntimeError("hf_odc: this ODC handle was closed.")
        if self._in_minibatch:
            raise RuntimeError("hf_odc: minibatch() blocks do not nest.")
        self._check_frozen_set_unchanged()
        self._publish(clear_accumulators=backward)
        self._barrier()
        hybrid = backward and self.replicas is not None
        self._replica_all_reduce(not hybrid)
        self._in_minibatch = True
        self._clock.start()
        try:
            with contextlib.nullcontext() if backward else torch.no_grad():
                yield self
        except BaseException as e:
            self._in_minibatch = False
            self._replica_all_reduce(True)
            self.abort(f"{type(e).__name__}: {e}")
            raise
        self._in_minibatch = False
        self._clock.done()
        self._barrier()
        all_reduce_s = self._reduce_across_replicas() if hybrid else 0.0
        self.last = self._clock.stop()
        self.last.all_reduce = all_reduce_s
        if backward:
            self._install_grads()

    def lap(self) -> None:
        """Mark the end of a microbatch inside :meth:`minibatch` (its device time lands in ``last.microbatches``)."""
        self._clock.lap()

    def _replica_all_reduce(self, enabled: bool) -> None:
        """HSDP's per-backward all-reduce across hosts: off inside a hybrid training minibatch, on elsewhere."""
        if self.replicas is not None:
            for slots in self._slots:
                if slots.accum is not None:
                    set_replica_all_reduce(slots.spec, enabled)

    @torch.no_grad()
    def _reduce_across_replicas(self) -> float:
        """After the host barrier: sum each accumulator with its replicas on the other hosts; returns the seconds.

        A one-rank shard group has no pushes: FSDP kept its gradient shard in HSDP's unreduced buffer instead, so it
        is moved into the accumulator first (with more ranks that buffer is ODC's all-zero sink)."""
        start = time.perf_counter()
        single = self.transport.world_size == 1
        buffers = {}
        for slots in self._slots:
            if slots.accum is None:
                continue
            unreduced = take_unreduced_gradient(slots.spec)
            if single and unreduced is not None:
                slots.accum_slot().add_(unreduced)
            buffers[slots.accum.index] = slots.accum.local
        self._replica_all_reduce(True)
        try:
            self.replicas.all_reduce([buffers[i] for i in sorted(buffers)])
        except PeerFailureError as e:
            self.abort(str(e))
            raise
        return time.perf_counter() - start

    def abort(self, reason: str) -> None:
        """Give up on this rank: every peer's next barrier or meeting fails at once, naming this rank and ``reason``,
        instead of waiting for it (the peers of its host through shared memory, every other host through the job's
        store)."""
        self._failed = True
        self.host.abort(reason)
        if self.replicas is not None:
            self.replicas.abort(reason)

    def meet(self, what: str) -> None:
        """Collective over the whole job, outside :meth:`minibatch`: wait until every rank arrives at ``what`` (its
        host's barrier, and with hybrid ODC the replicas' meeting), or raise :class:`PeerFailureError` naming the rank
        that died, gave up, or did not arrive within the timeout.

        Collectives cannot name a peer that never arrives: a caller meets before each collective that a dead or
        stalled peer would otherwise block (the ODC trainers do before every collective of a step)."""
        if self._in_minibatch:
            raise RuntimeError("hf_odc: meet() runs between minibatches, not inside one.")
        self._barrier(what)
        if self.replicas is not None:
            try:
                self.replicas.meet(what)
            except PeerFailureError as e:
                self.abort(str(e))
                raise

    def check(self) -> None:
        """Raise :class:`PeerFailureError` naming a rank known to have died or given up (host peers, and with hybrid
        ODC any rank of the job); return at once otherwise."""
        self.host.check()
        if self.replicas is not None:
            self.replicas.check()

    def _meet_host(self, what: str = "the minibatch barrier") -> None:
        """Meet the host's ranks once this rank's writes into their memory are done: after it, every write any rank of
        the host issued before it is visible."""
        self.transport.fence()
        self.host.meet(what)

    def _barrier(self, what: str = "the minibatch barrier") -> None:
        try:
            self._meet_host(what)
        except PeerFailureError as e:
            self._failed = True
            if self.replicas is not None:
                self.replicas.abort(str(e))
            raise

    def close(self) -> None:
        """Collective: wait for every rank, then release ODC's transport. Afterwards the model runs as plain FSDP2
        (collectives) outside ``minibatch()``, and ``minibatch()`` refuses to start.

        Waiting first means no rank tears its buffers down while a peer still uses them (tearing down unevenly
        was seen to crash gloo at interpreter exit). After a peer failure there is nobody to wait for: it just
        releases.
        """
        if self._closed:
            return
        self._closed = True
        if not self._failed:
            with contextlib.suppress(PeerFailureError):
                self._meet_host()
        self.transport.close()
        if self.replicas is not None and not self._failed:
            self.replicas.close()  # after a failure a communicator's teardown may block on the dead peer


def enable(
    model: nn.Module,
    *,
    timeout: float | None = None,
    transport: Transport | str | None = None,
) -> ODC:
    """Install On-Demand Communication on ``model``, already sharded with FSDP2's ``fully_shard``.

    Call it after every ``fully_shard`` (and after freezing parameters, e.g. PEFT), before the first forward. It is
    collective over the FSDP mesh's ranks. On HSDP's 2-D mesh (``fully_shard(mesh=...)`` with a replicate and a shard
    dimension) it runs hybrid ODC: one-sided within each shard group, one all-reduce across replicas per minibatch.

    Args:
        model: the root module; every :class:`~torch.distributed.fsdp.FSDPModule` in it is switched to ODC.
        timeout: seconds a minibatch barrier (and hybrid ODC's cross-host all-reduce) waits for a live peer before
            raising :class:`~hf_odc.PeerFailureError` (a dead peer on the same host is reported at once); given, it
            becomes the process's ODC timeout (:func:`hf_odc.liveness.heartbeat.set_timeout`). Default: the
            process's (an ``ODCPlugin``'s, else ``HF_ODC_TIMEOUT``, else ``hf_odc.liveness.DEFAULT_TIMEOUT_S``).
        transport: a transport, or the name of one (``hf_odc.kernels.TRANSPORTS``), instead of the device's default
            (tests, new hardware).

    Returns:
        The :class:`ODC` handle; run each rank's microbatches inside ``with odc.minibatch():``.
    """
    check_fsdp_layout()
    if not isinstance(model, FSDPModule):
        raise ValueError(
            "hf_odc.enable(model) expects the root module after `fully_shard(model)` (an FSDPModule); got "
            f"{type(model).__name__}. Shard it with torch.distributed.fsdp.fully_shard first."
        )
    specs = describe_groups(model)
    meshes = {(_ranks(s.process_group), _ranks(s.replicate_group)) for s in specs}
    if len(meshes) != 1:
        raise ValueError(
            f"hf_odc: every fully_shard call must use the same mesh; got (shard, replicate) rank groups "
            f"{sorted(meshes, key=str)}."
        )
    replicate_group = specs[0].replicate_group
    timeout = heartbeat.current_timeout() if timeout is None else heartbeat.set_timeout(timeout)
    heartbeat.start_in_default_group()  # unless beating since import, under a launcher
    host = HostBarrier.create(specs[0].process_group, timeout)  # first: it refuses a shard group that spans hosts
    if transport is None or isinstance(transport, str):
        device = specs[0].params[0].param.device
        transport = make_transport(device, specs[0].process_group, kind=transport)
    replicas = ReplicaGroup.create(replicate_group, timeout) if replicate_group is not None else None
    return ODC(model, specs, transport, host, replicas)


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else ()
