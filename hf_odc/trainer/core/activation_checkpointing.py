"""What activation checkpointing does once it is enabled on a model: keep the attention
(:func:`save_attention_in_checkpoints`, ``checkpoint_attention="save"``) and checkpoint only a share of the decoder
layers (:func:`checkpoint_layer_share`, ``checkpoint_layer_share``).

Why a share: a checkpointed layer runs its forward again in the backward (all of it but the attention, with
``"save"``), so every layer checkpointed costs about a third more of the step's GEMMs. A run whose device memory holds
more than the checkpoints can keep the whole activations of some layers instead: those layers' backward reads what
their forward kept and recomputes nothing. The gradients are the same, since a layer computes the same values whether
it is checkpointed or not; only the memory held between a layer's forward and its backward changes.

Both are applied by wrapping the model's enabling method (``activation_checkpointing_enable``,
``gradient_checkpointing_enable`` before transformers 5.23, which the other one calls) on the instance, whoever calls
it (the Trainer, TRL, the user) and however often (TRL turns checkpointing off and on around generation): the callable
stays out of the serialised ``TrainingArguments``. transformers checkpoints a decoder layer (a
``GradientCheckpointingLayer``) when its ``gradient_checkpointing`` flag is set, which enabling sets on every such
layer; the wrapper then clears it on the layers beyond the share.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import _base_model, save_attention_checkpoint_kwargs

__all__ = ["check_layer_share", "checkpoint_layer_share", "checkpointed_layers", "save_attention_in_checkpoints"]


@dataclass
class _Settings:
    """What a model's wrapped enabling method applies each time it is called."""

    save_attention: bool = False
    layer_share: float = 1.0


def save_attention_in_checkpoints(model: nn.Module) -> None:
    """From now on, whenever activation checkpointing is enabled on ``model`` (a transformers model, or a PEFT model
    around one), it saves the attention (:func:`~hf_odc.trainer.core.attention.save_attention_checkpoint_kwargs`).
    Idempotent; a model that cannot checkpoint is left as it is."""
    settings = _settings(model)
    if settings is not None:
        settings.save_attention = True


def checkpoint_layer_share(model: nn.Module, share: float) -> None:
    """From now on, whenever activation checkpointing is enabled on ``model`` (a transformers model, or a PEFT model
    around one), only its first ``ceil(share x n)`` of its ``n`` checkpointing layers (transformers'
    ``GradientCheckpointingLayer``: the decoder layers, in the model's order) checkpoint; the others keep their
    activations. ``share`` in ``(0, 1]``; 1 checkpoints them all, as transformers does. Refuses a model without such
    layers, where a share cannot apply."""
    check_layer_share(share)
    if share < 1 and not _checkpointing_layers(model):
        raise ValueError(
            f"checkpoint_layer_share={share} needs decoder layers that transformers checkpoints one by one "
            f"(GradientCheckpointingLayer); {type(_base_model(model)).__name__} has none. Leave it at 1."
        )
    settings = _settings(model)
    if settings is not None:
        settings.layer_share = share


def check_layer_share(share: float) -> None:
    """Refuse a ``checkpoint_layer_share`` outside ``(0, 1]``, saying what to set."""
    if not 0 < share <= 1:
        raise ValueError(
            f"checkpoint_layer_share must be in (0, 1] (the share of the decoder layers activation checkpointing "
            f"recomputes; turn checkpointing off with gradient_checkpointing=False), got {share}."
        )


def checkpointed_layers(share: float, layers: int) -> int:
    """How many of ``layers`` decoder layers a ``share`` checkpoints (at least one)."""
    return max(1, math.ceil(share * layers - 1e-9))


def _settings(model: nn.Module) -> _Settings | None:
    """The settings ``model``'s enabling method applies, the method wrapped on first use; ``None`` for a model
    without one."""
    model = _base_model(model)
    name = (
        "activation_checkpointing_enable"
        if hasattr(model, "activation_checkpointing_enable")
        else "gradient_checkpointing_enable"
    )
    enable = getattr(model, name, None)
    if enable is None:
        return None
    settings = getattr(enable, "odc_settings", None)
    if settings is not None:
        return settings
    settings = _Settings()
    keyword = next(iter(inspect.signature(enable).parameters))  # the checkpoint kwargs: the first parameter

    @functools.wraps(enable)
    def enable_as_set(*args: Any, **kwargs: Any) -> Any:
        if settings.save_attention:
            if args:
                args = (save_attention_checkpoint_kwargs(args[0]), *args[1:])
            else:
                kwargs[keyword] = save_attention_checkpoint_kwargs(kwargs.get(keyword))
        result = enable(*args, **kwargs)
        layers = _checkpointing_layers(model)
        for layer in layers[checkpointed_layers(settings.layer_share, len(layers)) :]:
            layer.gradient_checkpointing = False
        return result

    enable_as_set.odc_settings = settings
    setattr(model, name, enable_as_set)
    return settings


def _checkpointing_layers(model: nn.Module) -> list[nn.Module]:
    """``model``'s layers that transformers checkpoints one by one, in its order."""
    return [module for module in _base_model(model).modules() if isinstance(module, GradientCheckpointingLayer)]
