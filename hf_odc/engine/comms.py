"""FSDP2 custom comms that read peers' shards and push gradient pieces instead of running collectives.

FSDP2 calls ``comm(output_tensor, input_tensor, group, ...)`` exactly where it would run its all-gather /
reduce-scatter, on the stream it would run it on, so FSDP's prefetching and overlap stay as they are. Inside
``ODC.minibatch()`` these comms are one-sided; outside it (evaluation, generation, a forward before the first
minibatch) they fall back to the collectives, because peers' mirrors are only guaranteed consistent inside a
minibatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..kernels import Transport
from ._fsdp_internals import AllGather, ReduceScatter
from .buffers import GroupSlots


def _collective(name: str, before_torch_2_13: str) -> Callable[..., dist.Work | None]:
    """The ``torch.distributed`` collective ``name``, or its name before torch 2.13 (which renamed the tensor-in,
    tensor-out collectives; the old names stay as aliases that raise a deprecation warning at every call). Looked up
    at each call."""
    return getattr(dist, name, None) or getattr(dist, before_torch_2_13)


class ODCAllGather(AllGather):
    """Fills FSDP's all-gather output with every rank's mirror slot of one group; the owners do nothing."""

    def __init__(self, slots: GroupSlots, transport: Transport, in_minibatch: Callable[[], bool]):
        self.slots = slots
        self.transport = transport
        self._in_minibatch = in_minibatch
        self._layout_checked = False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_layout(self, input_tensor: torch.Tensor) -> None:
        """Once: FSDP's own all-gather input must equal what ODC published, or the layout assumption broke."""
        spec = self.slots.spec
        expected = self.slots.mirror_slot()
        if input_tensor.numel() != expected.numel() or input_tensor.dtype != expected.dtype:
            raise RuntimeError(
                f"hf_odc: FSDP all-gathers {input_tensor.numel()} x {input_tensor.dtype} for {spec.fqn!r}, but ODC "
                f"laid out {expected.numel()} x {expected.dtype}; this FSDP version or configuration is not supported."
            )
        if not torch.equal(input_tensor, expected):
            raise RuntimeError(
                f"hf_odc: the parameters of {spec.fqn!r} changed inside a minibatch, or ODC's shard layout differs "
                "from FSDP's. Update parameters only between minibatches (after `with odc.minibatch():` exits)."
            )
        self._layout_checked = True

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self._in_minibatch():
            gather = _collective("all_gather_single", "all_gather_into_tensor")
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)
        if not self._layout_checked:
            self._check_layout(input_tensor)
        slots = self.slots
        numel = slots.spec.gather_numel
        # FSDP copies the local shard into its row of the output before calling the comm: skip that row then.
        own_row = output_tensor.view(self.transport.world_size, numel)[self.transport.rank]
        in_place = input_tensor.data_ptr() == own_row.data_ptr()
        self.transport.gather(slots.mirror, slots.gather_offset, numel, output_tensor, include_self=not in_place)
        return None


class ODCReduceScatter(ReduceScatter):
    """Pushes each rank's chunk of FSDP's reduce-scatter input into that rank's accumulator slot.

    FSDP then post-processes the output as usual (divide, cast, accumulate into ``.grad``). Inside a minibatch the
    output is a shared, all-zero *sink*: FSDP accumulates zeros, and the real gradient is installed from the
    accumulator when the minibatch ends. Because every write into the sink is a zero, FSDP may alias it from many
    ``.grad`` s at once without harm, and no gradient-sized buffer is spent per microbatch.
    """

    def __init__(self, slots: GroupSlots, transport: Transport, in_minibatch: Callable[[], bool], sink: torch.Tensor):
        self.slots = slots
        self.transport = transport
        self._in_minibatch = in_minibatch
        self._sink = sink

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for s in size:
            numel *= int(s)
        if (
            self._in_minibatch()
            and self.transport.world_size > 1  # a one-rank group skips the comm: FSDP copies its gradient in
            and numel == self.slots.spec.grad_numel
            and dtype == self._sink.dtype
            and numel <= self._sink.numel()
        ):
            return self._sink[:numel]
        # Fresh memory: FSDP may keep the first output as a parameter's .grad.
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self._in_minibatch():
            reduce_scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
            return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        slots = self.slots
        numel = slots.spec.grad_numel
        if input_tensor.numel() != numel * self.transport.world_size:
            raise RuntimeError(
                f"hf_odc: FSDP reduce-scatters {input_tensor.numel()} elements for {slots.spec.fqn!r}, expected "
                f"{numel} x {self.transport.world_size} (every trainable parameter's padded shard). Either a trainable "
                "parameter got no gradient in this backward (torch < 2.13 cannot reduce-scatter it as zeros: freeze "
                "it or upgrade torch), or requires_grad changed after hf_odc.enable()."
            )
        self.transport.scatter_accumulate(slots.accum, slots.grad_offset, numel, input_tensor)
        output_tensor.zero_()
        return None
