"""Where each FSDP group's shards live in peer-reachable memory.

Two kinds of symmetric buffers, one of each per dtype, packed group after group:

* the *parameter mirror*: this rank's shard of every parameter, in the dtype FSDP all-gathers in (bf16 under a bf16
  ``MixedPrecisionPolicy``: half the bytes of the fp32 master), refreshed once per minibatch. Peers read it.
* the *gradient accumulator*: this rank's shard of every trainable parameter's gradient, in at least fp32. Peers add
  their gradient pieces into it; at the minibatch's end it becomes the parameters' ``.grad``.

A group's slot in either buffer has the layout of FSDP's own all-gather input and reduce-scatter chunk (each
parameter's padded shard, in FSDP's parameter order), so a slot is exactly one rank's row of the collective it
replaces.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..kernels import SymmetricTensor, Transport
from ._fsdp_internals import GroupSpec


def accumulate_dtype(reduce_dtype: torch.dtype) -> torch.dtype:
    """Gradients are accumulated in at least fp32, whatever FSDP reduces in (bf16 sums of many pushes drift)."""
    return torch.promote_types(reduce_dtype, torch.float32)


@dataclass
class GroupSlots:
    """One group's slots: ``mirror[gather_offset:][:gather_numel]`` and ``accum[grad_offset:][:grad_numel]``."""

    spec: GroupSpec
    mirror: SymmetricTensor
    gather_offset: int
    accum: SymmetricTensor | None
    grad_offset: int

    def mirror_slot(self) -> torch.Tensor:
        return self.mirror.local[self.gather_offset : self.gather_offset + self.spec.gather_numel]

    def accum_slot(self) -> torch.Tensor:
        assert self.accum is not None
        return self.accum.local[self.grad_offset : self.grad_offset + self.spec.grad_numel]


def allocate_slots(specs: list[GroupSpec], transport: Transport) -> list[GroupSlots]:
    """Collective: allocate the mirror and accumulator buffers for ``specs`` and hand each group its slots."""
    gather_sizes: dict[torch.dtype, int] = defaultdict(int)
    grad_sizes: dict[torch.dtype, int] = defaultdict(int)
    placements = []
    for spec in specs:
        gather_offset = gather_sizes[spec.gather_dtype]
        gather_sizes[spec.gather_dtype] += spec.gather_numel
        acc_dtype = accumulate_dtype(spec.reduce_dtype) if spec.grad_numel else None
        grad_offset = 0
        if acc_dtype is not None:
            grad_offset = grad_sizes[acc_dtype]
            grad_sizes[acc_dtype] += spec.grad_numel
        placements.append((spec, gather_offset, acc_dtype, grad_offset))
    # Every rank iterates the same sorted dtypes, so the collective allocations line up.
    mirrors = {d: transport.allocate(n, d) for d, n in sorted(gather_sizes.items(), key=lambda kv: str(kv[0]))}
    accums = {d: transport.allocate(n, d) for d, n in sorted(grad_sizes.items(), key=lambda kv: str(kv[0]))}
    return [
        GroupSlots(spec, mirrors[spec.gather_dtype], g_off, accums[a_dtype] if a_dtype else None, r_off)
        for spec, g_off, a_dtype, r_off in placements
    ]
