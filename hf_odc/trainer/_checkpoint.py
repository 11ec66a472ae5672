"""Checkpoints of a model that hf_odc sharded, with ``torch.distributed.checkpoint`` (DCP).

The Trainer's own save/load paths either assume Accelerate did the FSDP wrapping (its FSDP branch, which is absent on
CPU) or that rank 0 holds the whole model and optimizer (its default branch, wrong for DTensor shards). DCP writes
each rank's shards in parallel and reshards on load, so a checkpoint resumes on any number of ranks, on CPU and GPU
alike. The directory layout is one DCP checkpoint with ``model`` and ``optimizer`` entries.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE_DIR = "odc_sharded_state"
"""Sub-directory of a Trainer checkpoint that holds the DCP checkpoint."""


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on CPU, on rank 0 (empty elsewhere; collective): what ``save_pretrained`` writes.

    Gathering copies each name's tensor separately, so tied parameters (input embeddings and LM head) are made to
    share one tensor again: ``save_pretrained`` recognises ties by shared storage and writes them once.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first_name.setdefault(id(param), name)
        if canonical != name and canonical in state and name in state:
            state[name] = state[canonical]
    return state


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Write the model and optimizer shards of every rank to ``path`` (collective)."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path)


def load_sharded_model(model: nn.Module, path: str) -> None:
    """Load the model entry of the checkpoint at ``path`` into ``model``'s shards (collective)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load the optimizer entry of the checkpoint at ``path`` (collective)."""
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
