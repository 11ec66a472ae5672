"""The policy's weights into vLLM, for ``ODCGRPOTrainer(use_vllm=True)``: TRL's ``VLLMGeneration`` generates, only
its weight sync is hf_odc's.

TRL's sync reads an FSDP2 policy with ``full_tensor()``: one all-gather per parameter, on every rank. Here the full
weights are assembled one FSDP group at a time by one-sided reads of the peers' shards
(:meth:`~hf_odc.accelerate_plugin.ODCRuntime.full_parameters`), with no collective, when TRL syncs (once per
generation batch: the step changed), outside any training minibatch:

* ``vllm_mode="colocate"``: every rank assembles the weights and loads them into its own engine, in place. Where the
  engine's model runner reloads from an iterator (vLLM's ``reload_weights``, reached through ``LLM.collective_rpc``),
  that is used: it takes checkpoint-format tensors and re-runs each layer's post-load processing, which engines that
  change a layer's layout after loading need (CPU builds prepack linear weights and drop the checkpoint-layout
  tensor, so the model's ``load_weights``, TRL's path, refuses them; online-quantised kernels alike). Other engines
  get the model's ``load_weights``, as from TRL. With sleep mode the weights are woken first, as TRL does.
* ``vllm_mode="server"``: rank 0 alone assembles the weights and streams them through TRL's ``VLLMClient``
  (``update_named_params``: vLLM's NCCL weight transfer); the other ranks only publish their shards for it to read.

Names are the checkpoint's, as vLLM loads them: PEFT's wrapping (``base_model.model.``, ``.base_layer``,
``modules_to_save.default.``) and activation checkpointing's are removed, and LoRA adapters are merged into their
base weights on the assembled tensors (``W + scaling * B @ A``, PEFT's merge of each active adapter), leaving the
sharded model untouched (TRL merges them in the model and unmerges after).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import _compat
from ..accelerate_plugin import ODCRuntime

__all__ = ["ODCWeightSync", "checkpoint_name", "shut_down_engine", "vllm_named_weights"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "modules_to_save.default.")


# -- the weights, as vLLM names them ---------------------------------------------------------------------------------


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


def vllm_named_weights(model: nn.Module, runtime: ODCRuntime) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights under the names vLLM loads, one FSDP group at a time, LoRA adapters merged (see the
    module docstring); what :meth:`ODCRuntime.full_parameters` says of its tensors' lifetime and of the other ranks
    holds."""
    return _named(model, runtime, _LoraMerge(model))


def _named(model: nn.Module, runtime: ODCRuntime, lora: _LoraMerge) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in lora.merge(runtime.full_parameters(model)):
        # Not modules_to_save's frozen original, nor an adapter left unmerged (inactive).
        if "original_module" not in name and (lora.prefix is None or lora.prefix not in name):
            yield checkpoint_name(name), tensor


# -- the sync --------------------------------------------------------------------------------------------------------


def _reloads_from_iterator(worker: Any) -> bool:
    """Run on each vLLM worker (``LLM.collective_rpc``): does its model runner reload weights in place from an
    iterator (vLLM's ``reload_weights(weights_iterator=...)``; older ones reload only from disk)?"""
    reload = getattr(worker.model_runner, "reload_weights", None)  # private: vllm Worker.model_runner, as TRL reads
    return reload is not None and "weights_iterator" in inspect.signature(reload).parameters


def _load_weights(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run on each vLLM worker: TRL's load, straight into the model's parameters."""
    worker.model_runner.model.load_weights(weights)  # private: vllm Worker.model_runner.model, TRL's path


class ODCWeightSync:
    """Stands in for ``sync_weights`` of TRL's ``VLLMGeneration`` (see the module docstring); :meth:`install` makes it
    so. Built once the policy is sharded; an unsupported PEFT setup is refused here.

    Args:
        generation: TRL's ``VLLMGeneration``, its engine (colocate) or client (server, rank 0) started.
        model: the policy as the trainer runs it (sharded by hf_odc, ODC installed).
        runtime: the policy's :class:`~hf_odc.accelerate_plugin.ODCRuntime`.
    """

    def __init__(self, generation: Any, model: nn.Module, runtime: ODCRuntime):
        self.generation, self.model, self.runtime = generation, model, runtime
        self._lora = _LoraMerge(model)
        self._metadata: list[tuple[str, str, list[int]]] | None = None  # server: what rank 0 announces
        self._reload = generation.mode == "colocate" and all(generation.llm.collective_rpc(_reloads_from_iterator))

    @classmethod
    def install(cls, generation: Any, model: nn.Module, runtime: ODCRuntime) -> ODCWeightSync:
        """Build the sync and make it ``generation``'s ``sync_weights``, through which TRL pushes every time: the
        trainer's sync when the step changed, and ``VLLMGeneration.generate`` after sleep level 2."""
        sync = cls(generation, model, runtime)
        generation.sync_weights = sync
        return sync

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights one sync pushes, named and laid out as vLLM loads them."""
        return _named(self.model, self.runtime, self._lora)

    def __call__(self) -> None:
        if self.generation.mode == "colocate":
            self._load_colocated()
        elif self.generation.accelerator.is_main_process:
            self._push_to_server()
        else:
            self._publish_for_rank_0()

    def _load_colocated(self) -> None:
        generation = self.generation
        llm = generation.llm
        if generation.enable_sleep_mode:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the training's cached blocks, before the engine maps its weights again
            llm.wake_up(tags=["weights"])
            _compat.mark_vllm_weights_awake(generation)
        if self._reload:
            # vLLM holds a layer's tensors until the layer is complete, a padded one (the vocabulary) to the end.
            weights = ((name, tensor.clone()) for name, tensor in self.weights())
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        else:
            llm.collective_rpc(_load_weights, args=(self.weights(),))
        llm.reset_prefix_cache()  # cached prefixes hold keys and values of the old weights

    def _push_to_server(self) -> None:
        """Rank 0: announce every tensor (name, vLLM's dtype name, shape), then stream them. What to announce is read
        by one more pass on the first sync, as TRL does: the FSDP groups' order, PEFT's merged weights."""
        client = self.generation.vllm_client
        if self._metadata is None:
            self._metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in self.weights()]
        client.update_named_params(self._metadata, self.weights())
        client.reset_prefix_cache()

    def _publish_for_rank_0(self) -> None:
        """Any other rank: publish its shards for each pass rank 0 makes (two on the first sync), and wait for it."""
        for _ in range(2 if self._metadata is None else 1):
            with self.runtime.minibatch(backward=False):
                pass
        self._metadata = []


def shut_down_engine(generation: Any) -> None:
    """Shut a colocated engine down now, while the process groups it made still exist (a no-op in server mode).

    A colocated engine (``distributed_executor_backend="external_launcher"``) makes its own process groups beside the
    trainer's and destroys them when its engine core shuts down, which vLLM leaves to a finalizer run at interpreter
    exit. A trainer that destroys the process groups first (``Trainer.end``: ``destroy_process_group()`` destroys them
    all) would leave that finalizer destroying groups that are gone: ``ValueError: Invalid process group specified``
    on every rank after training. Shut down here, the engine destroys its groups and then the default one (vLLM's
    ``cleanup_dist_env_and_memory``), and its finalizer is detached."""
    if generation.mode == "colocate":
        generation.llm.llm_engine.engine_core.shutdown()
