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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .._env import parse_bool

__all__ = ["mixed_precision_policy", "remap_optimizer", "shard_model"]


def shard_model(
    model: nn.Module,
    accelerator: Any = None,
    *,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """``fully_shard`` every decoder layer of ``model``, then the root; return ``model`` (sharded in place).

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
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layers = _decoder_layers(model, fsdp_plugin)
    kwargs = {"mesh": mesh, "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward}
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # transformers' generate() decodes in lockstep (synced_gpus) only for modules it knows are FSDP-managed: without
    # it, a rank whose sequences finish first stops calling forward and its peers' all-gathers wait for it forever.
    model._is_fsdp_managed_module = True
    return model


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
    return set(getattr(base, "_no_split_modules", None) or ())


def _reshard_after_forward(fsdp_plugin: Any) -> bool:
    value = getattr(fsdp_plugin, "reshard_after_forward", None)
    if isinstance(value, bool):
        return value
    return parse_bool(os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true"), "FSDP_RESHARD_AFTER_FORWARD")


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
