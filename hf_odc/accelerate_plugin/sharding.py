"""FSDP2 sharding for ODC, applied by hf_odc itself rather than by Accelerate.

Accelerate 1.15 only builds an FSDP2 model for GPU-like devices: on CPU, ``distributed_type: FSDP`` degrades to
``MULTI_CPU`` and ``prepare`` would wrap the model in DDP. ODC also wants one layout on every device (one FSDP group
per decoder layer, plus the root for the embeddings, final norm and LM head). So :func:`shard_model` applies
``fully_shard`` itself, reading the same knobs an Accelerate FSDP config sets (layer classes, ``reshard_after_forward``,
mixed precision). Accelerate's ``fsdp2_prepare_model`` returns early for a model that is already an ``FSDPModule``, so
sharding first and preparing afterwards is safe with an FSDP2 config too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .._compat import mark_fsdp_managed, no_split_modules
from .._env import parse_bool
from ..kernels import host_ranks

__all__ = ["device_mesh", "mixed_precision_policy", "remap_optimizer", "shard_model"]


def shard_model(
    model: nn.Module,
    accelerator: Any = None,
    *,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_size: int | None = None,
) -> nn.Module:
    """``fully_shard`` every decoder layer of ``model``, then the root; return ``model`` (sharded in place).

    The mesh is :func:`device_mesh`'s: one shard group over every rank within one host, one per host (replicated
    across hosts, HSDP's layout, which hybrid ODC runs on) when the job spans hosts.

    A model that is already an ``FSDPModule`` is returned unchanged. The decoder-layer classes come from the
    Accelerate FSDP plugin (``fsdp_transformer_layer_cls_to_wrap``), the ``FSDP_TRANSFORMER_CLS_TO_WRAP`` variable, or
    the model's ``_no_split_modules`` (what Accelerate's ``TRANSFORMER_BASED_WRAP`` uses). Freeze parameters (PEFT)
    before calling it: ODC lays its gradient buffers out for the trainable set.

    Args:
        model: the root module (a ``PreTrainedModel`` or a PEFT model around one).
        accelerator: the ``accelerate.Accelerator``, for the device, the world size, its FSDP plugin (if any) and
            its mixed precision. ``None``: the current device and the default process group.
        reshard_after_forward: FSDP's option; ``None`` takes the FSDP plugin's value, then
            ``FSDP_RESHARD_AFTER_FORWARD``, then ``True``.
        mp_policy: FSDP2's mixed-precision policy; ``None`` derives it (see :func:`mixed_precision_policy`).
        shard_size: ranks per shard group (see :func:`device_mesh`); ``None``: a host's ranks.
    """
    if isinstance(model, FSDPModule):
        return model
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised process group (launch with `accelerate launch`).")
    fsdp_plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if fsdp_plugin is not None:
        # Resolve Accelerate's auto-wrap policy now, on the unsharded model, as its prepare() would: prepare() resolves
        # it again only while it is unresolved, and would not find the layer classes by name once FSDP renamed them
        # (``Qwen2DecoderLayer`` becomes ``FSDPQwen2DecoderLayer``).
        fsdp_plugin.set_auto_wrap_policy(model)
    if reshard_after_forward is None:
        reshard_after_forward = _reshard_after_forward(fsdp_plugin)
    if mp_policy is None:
        mp_policy = mixed_precision_policy(accelerator)
    if mp_policy.param_dtype is not None:
        # FSDP2 needs one dtype per group; keep fp32 master weights and compute in param_dtype (as Accelerate does).
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    device_type = accelerator.device.type if accelerator is not None else _default_device_type()
    mesh = device_mesh(device_type, shard_size)
    layers = _decoder_layers(model, fsdp_plugin)
    kwargs = {"mesh": mesh, "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward}
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # transformers' generate() decodes in lockstep (synced_gpus) only for modules it knows are FSDP-managed: without
    # it, a rank whose sequences finish first stops calling forward and its peers' all-gathers wait for it forever.
    mark_fsdp_managed(model)
    return model


def device_mesh(device_type: str, shard_size: int | None = None) -> DeviceMesh:
    """Collective: FSDP2's mesh for ODC over every rank of the job.

    ODC reads and pushes one-sidedly only within a shard group, so a shard group must lie within one host. Within one
    host the mesh is 1-D over every rank (plain FSDP2 sharding). A job that spans hosts gets a 2-D mesh
    ``("replicate", "shard")``: each host's ranks form one shard group and hosts hold replicas, as FSDP2's HSDP
    lays them out, and hybrid ODC all-reduces each gradient shard across the replicas once per minibatch.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        shard_size: ranks per shard group, overriding the host's rank count (e.g. 4 to run two hybrid replicas on one
            8-GPU host); it must divide the world size, and each group of consecutive ranks must share a host.
    """
    world_size = dist.get_world_size()
    hosts = host_ranks()
    if shard_size is None:
        shard_size = len(hosts[0]) if len(hosts) > 1 else world_size
        if any(len(ranks) != shard_size for ranks in hosts):
            raise ValueError(
                f"hf_odc shards within each host and replicates across hosts, which needs the same number of ranks "
                f"on every host; the ranks by host are {hosts}. Launch as many processes on every machine."
            )
    if not isinstance(shard_size, int) or shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"The shard group size (odc_shard_size / HF_ODC_SHARD_SIZE) must divide the world size {world_size}; "
            f"got {shard_size!r}."
        )
    host_of = {rank: index for index, ranks in enumerate(hosts) for rank in ranks}
    for start in range(0, world_size, shard_size):
        group = range(start, start + shard_size)
        if len({host_of[rank] for rank in group}) > 1:
            raise ValueError(
                f"hf_odc's shard group of ranks {list(group)} spans hosts (the ranks by host are {hosts}): ODC reads "
                "peers' memory only within a host. Number the ranks host by host (as `accelerate launch` and torchrun "
                f"do), and pick a shard size that divides the ranks of a host ({len(hosts[0])})."
            )
    if shard_size == world_size:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def mixed_precision_policy(accelerator: Any = None) -> MixedPrecisionPolicy:
    """The FSDP2 policy for ``accelerator``: its FSDP plugin's policy if it has one, else one derived from its
    ``mixed_precision`` (``bf16``: compute in bf16, reduce in fp32; ``no``: fp32 throughout). ``fp16`` is refused:
    FSDP2 has no gradient scaler."""
    fsdp_plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    precision = str(getattr(accelerator, "mixed_precision", "no") or "no")
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "no":
        return MixedPrecisionPolicy()
    raise ValueError(f"hf_odc shards with FSDP2, which supports mixed_precision 'no' or 'bf16', not {precision!r}.")


def remap_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer`` at ``model``'s parameters after sharding replaced them.

    ``names`` maps ``id(param)`` of the parameters before sharding to their names (``fully_shard`` swaps each
    parameter for a DTensor one under the same name). The optimizer must not have taken a step yet.
    """
    if optimizer.state:
        raise ValueError("The optimizer has already taken a step; create it before sharding, or pass it untouched.")
    new = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [new[names[id(p)]] for p in group["params"]]
        except KeyError as e:
            raise ValueError(f"The optimizer holds a parameter that is not in the model ({e}).") from None


def _decoder_layers(model: nn.Module, fsdp_plugin: Any) -> list[nn.Module]:
    class_names = _layer_class_names(model, fsdp_plugin)
    layers = [m for m in model.modules() if type(m).__name__ in class_names]
    if not layers:
        raise ValueError(
            f"hf_odc found no decoder layer of class {sorted(class_names)} in {type(model).__name__}; set "
            "`fsdp_transformer_layer_cls_to_wrap` in the Accelerate config (or FSDP_TRANSFORMER_CLS_TO_WRAP)."
        )
    return layers


def _layer_class_names(model: nn.Module, fsdp_plugin: Any) -> set[str]:
    configured = getattr(fsdp_plugin, "transformer_cls_names_to_wrap", None) or os.environ.get(
        "FSDP_TRANSFORMER_CLS_TO_WRAP"
    )
    if configured:
        names = configured.split(",") if isinstance(configured, str) else configured
        return {n.strip() for n in names if n.strip()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return no_split_modules(base)


def _reshard_after_forward(fsdp_plugin: Any) -> bool:
    value = getattr(fsdp_plugin, "reshard_after_forward", None)
    if isinstance(value, bool):
        return value
    return parse_bool(os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true"), "FSDP_RESHARD_AFTER_FORWARD")


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
