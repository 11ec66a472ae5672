"""The policy's full weights assembled from its shards, under its checkpoint's names: what the ``"static"`` generation
mode copies into its decoding copy and what a vLLM sync hands the engine (``hf_odc.trainer.generation.modes``).

The weights come one FSDP group at a time (:meth:`~hf_odc.accelerate_plugin.ODCRuntime.full_parameters`: with ODC,
one-sided reads of the peers' shards, no collective), each group valid until the next one's first tensor. Names are
the checkpoint's, as transformers and vLLM load them: PEFT's wrapping (``base_model.model.``, ``.base_layer``,
``modules_to_save.default.``) and activation checkpointing's are removed, and LoRA adapters are merged into their base
weights on the assembled tensors (``W + scaling * B @ A``, PEFT's merge of each active adapter), leaving the sharded
model untouched. (The ``"gathered"`` mode holds the whole model unsharded in place instead,
:meth:`~hf_odc.accelerate_plugin.ODCRuntime.gathered`: its forwards need the weights where the model's modules are.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...accelerate_plugin import ODCRuntime

__all__ = ["FullWeights", "checkpoint_name", "full_named_weights"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "modules_to_save.default.")


class _LoraMerge:
    """The LoRA adapters of ``model`` (a PEFT model, or not) by their base weight's name: what to add to each base
    weight once it is assembled. Only PEFT's plain LoRA on linear layers is merged; anything else is refused when the
    sync is built, not when it runs."""

    def __init__(self, model: nn.Module):
        self.prefix: str | None = None
        self.deltas: dict[str, list[tuple[str, str, float, bool]]] = {}
        if getattr(model, "peft_config", None) is None:
            return
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        self.prefix = model.prefix
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not isinstance(module, LoraLinear) or module.merged:
                raise NotImplementedError(
                    f"ODCGRPOTrainer merges plain LoRA on linear layers into the weights it pushes to vLLM; {name} is "
                    f"a {type(module).__name__}{', already merged' if module.merged else ''}. Target linear layers "
                    "only, or generate without vLLM (use_vllm=False)."
                )
            for adapter in module.active_adapters:
                if adapter not in module.lora_A:
                    continue
                if adapter in getattr(module, "lora_variant", {}) or module.lora_bias.get(adapter, False):
                    raise NotImplementedError(
                        f"ODCGRPOTrainer merges plain LoRA into the weights it pushes to vLLM; adapter {adapter!r} of "
                        f"{name} uses a variant (DoRA or another) or lora_bias. Use plain LoRA, or use_vllm=False."
                    )
                self.deltas.setdefault(f"{name}.base_layer.weight", []).append(
                    (
                        f"{name}.lora_A.{adapter}.weight",
                        f"{name}.lora_B.{adapter}.weight",
                        float(module.scaling[adapter]),
                        bool(module.fan_in_fan_out),
                    )
                )
        self._adapters = {name for entries in self.deltas.values() for entry in entries for name in entry[:2]}

    def _complete(self, base: str, adapters: dict[str, torch.Tensor]) -> bool:
        """Whether every adapter of the base weight ``base`` has been assembled."""
        return all(a_name in adapters and b_name in adapters for a_name, b_name, *_ in self.deltas[base])

    def merge(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each LoRA base weight merged and the adapters' own weights kept back. A base weight waits
        for its adapters, which FSDP holds in the same group (the layer's)."""
        if not self.deltas:
            yield from weights
            return
        waiting: dict[str, torch.Tensor] = {}
        adapters: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name in self._adapters:
                adapters[name] = tensor
            elif name in self.deltas:
                waiting[name] = tensor
            else:
                yield name, tensor
                continue
            for base in [base for base in waiting if self._complete(base, adapters)]:
                merged = waiting.pop(base)
                for a_name, b_name, scaling, fan_in_fan_out in self.deltas[base]:
                    merged = _merged(merged, adapters.pop(a_name), adapters.pop(b_name), scaling, fan_in_fan_out)
                yield base, merged
        if waiting:
            raise RuntimeError(f"hf_odc: the LoRA adapters of {sorted(waiting)} were not among the model's weights.")


def _merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> torch.Tensor:
    """PEFT's merge of one plain LoRA adapter (``lora.Linear.merge``), out of place: ``base + scaling * B @ A``, the
    product in float32 for a half-precision adapter on the CPU (as PEFT), the sum in ``base``'s dtype."""
    half_on_cpu = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    delta = b.float() @ a.float() if half_on_cpu else b @ a
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    if half_on_cpu:
        delta = delta.to(b.dtype)
    return (base + delta).to(base.dtype)


def checkpoint_name(name: str) -> str:
    """The checkpoint name of a policy parameter: PEFT's and activation checkpointing's wrapping removed."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class FullWeights:
    """The full weights of ``model`` (the policy as the trainer runs it), by checkpoint name, LoRA merged: each call
    assembles them anew (see the module docstring). An unsupported PEFT setup is refused when this is built.

    Args:
        model: the policy (sharded by hf_odc, or not).
        runtime: its :class:`~hf_odc.accelerate_plugin.ODCRuntime`.
    """

    def __init__(self, model: nn.Module, runtime: ODCRuntime):
        self.model, self.runtime = model, runtime
        self._lora = _LoraMerge(model)

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        lora = self._lora
        for name, tensor in lora.merge(self.runtime.full_parameters(self.model)):
            # Not modules_to_save's frozen original, nor an adapter left unmerged (inactive).
            if "original_module" not in name and (lora.prefix is None or lora.prefix not in name):
                yield checkpoint_name(name), tensor


def full_named_weights(model: nn.Module, runtime: ODCRuntime) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights of ``model`` once (:class:`FullWeights`); what :meth:`ODCRuntime.full_parameters` says of its
    tensors' lifetime and of the other ranks holds."""
    return FullWeights(model, runtime)()
