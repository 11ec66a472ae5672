"""What ``tests/distributed/test_kernels_ulysses.py``'s processes run: a row split over the ranks, attended with
``sharded_causal_attention``, against the whole row attended by one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_odc.kernels import SequenceShard, new_sequence_group, sharded_causal_attention
from hf_odc.kernels.attention import packed_causal_attention

LENGTHS = (23, 9, 31)  # documents that cross the shards' bounds
SIZES = (32, 31)  # a shard per rank, unequal


def sharded_against_whole(rank: int, world_size: int) -> dict[int, tuple[float, float]]:
    """For 6 query heads over 2 and over 3 key/value heads (split among the 2 ranks, and repeated for their query
    heads): the largest difference of this rank's outputs, and of its inputs' gradients (the sum over ranks of the
    gradient of a weighted sum of every output), from the whole row's."""
    group = new_sequence_group(world_size)
    shard = SequenceShard(group, SIZES, LENGTHS)
    start = sum(SIZES[:rank])
    mine = slice(start, start + SIZES[rank])
    errors = {}
    for kv_heads in (2, 3):
        generator = torch.Generator().manual_seed(kv_heads)
        tokens = sum(LENGTHS)
        query = torch.randn(tokens, 6, 8, generator=generator, requires_grad=True)
        key, value = (torch.randn(tokens, kv_heads, 8, generator=generator, requires_grad=True) for _ in range(2))
        weights = torch.randn(tokens, 6, 8, generator=generator)
        whole = packed_causal_attention(query, key, value, LENGTHS)
        (whole * weights).sum().backward()
        expected = [t.grad.clone() for t in (query, key, value)]
        parts = [t.detach()[mine].clone().requires_grad_() for t in (query, key, value)]
        out = sharded_causal_attention(*parts, shard)
        (out * weights[mine]).sum().backward()
        gradients = [torch.zeros_like(t) for t in expected]
        for gradient, part in zip(gradients, parts, strict=True):
            gradient[mine] = part.grad
            dist.all_reduce(gradient)
        errors[kv_heads] = (
            (out - whole[mine]).abs().max().item(),
            max((g - e).abs().max().item() for g, e in zip(gradients, expected, strict=True)),
        )
    return errors
