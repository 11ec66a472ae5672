"""The CPU shared-memory transport: one-sided reads, lossless concurrent accumulation, no leftovers."""

from __future__ import annotations

import glob

import pytest
import torch
from _dist import launch
from _transport_workers import hammer, two_hosts

from hf_odc.kernels import make_transport


@pytest.mark.slow
def test_concurrent_pushes_into_every_owner_lose_no_update():
    world_size, numel, rounds = 4, 1 << 15, 40
    out = launch(hammer, world_size, numel, rounds, timeout=180)
    for owner, result in enumerate(out):
        expected = rounds * sum(src + 1 + owner for src in range(world_size))
        assert torch.equal(result["acc"], torch.full((numel,), float(expected))), owner
        rows = result["gathered"].view(world_size, numel)
        for peer in range(world_size):
            assert torch.equal(rows[peer], (torch.arange(numel) + 1000 * peer).to(torch.bfloat16).float())
    assert glob.glob(f"/dev/shm/{out[0]['prefix']}*") == []


@pytest.mark.slow
def test_ranks_on_several_hosts_are_refused_with_a_clear_error():
    for message in launch(two_hosts, 2):
        assert "span 2 hosts" in message and "docs/multi_host.md" in message, message


def test_a_transport_is_chosen_by_name_and_must_match_the_device():
    with pytest.raises(ValueError, match="Unknown transport 'nvshmem'"):
        make_transport(torch.device("cpu"), kind="nvshmem")
    with pytest.raises(ValueError, match="serves cuda tensors"):
        make_transport(torch.device("cpu"), kind="cuda-symm-mem")
    with pytest.raises(NotImplementedError, match="no transport for 'meta'"):
        make_transport(torch.device("meta"))
