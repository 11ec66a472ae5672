"""The policy's weights into vLLM, for the ``"vllm"`` generation mode (``hf_odc.trainer.generation.modes``): TRL's
``VLLMGeneration`` generates, only its weight sync is hf_odc's, and a colocated engine is shut down at the run's end.

TRL's sync reads an FSDP2 policy with ``full_tensor()``: one all-gather per parameter, on every rank. Here the full
weights are assembled one FSDP group at a time by one-sided reads of the peers' shards, with no collective
(:class:`~hf_odc.trainer.generation.full_weights.FullWeights`: checkpoint names, LoRA merged on the assembled tensors,
leaving the sharded model untouched, where TRL merges them in the model and unmerges after), when TRL syncs (once per
generation batch: the step changed), outside any training minibatch:

* ``vllm_mode="colocate"``: every rank assembles the weights and loads them into its own engine, in place. Where the
  engine's model runner reloads from an iterator (vLLM's ``reload_weights``, reached through ``LLM.collective_rpc``),
  that is used: it takes checkpoint-format tensors and re-runs each layer's post-load processing, which engines that
  change a layer's layout after loading need (CPU builds prepack linear weights and drop the checkpoint-layout
  tensor, so the model's ``load_weights``, TRL's path, refuses them; online-quantised kernels alike). Other engines
  get the model's ``load_weights``, as from TRL. With sleep mode the weights are woken first, as TRL does.
* ``vllm_mode="server"``: rank 0 alone assembles the weights and streams them through TRL's ``VLLMClient``
  (``update_named_params``: vLLM's NCCL weight transfer); the other ranks only publish their shards for it to read.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ... import _compat
from ...accelerate_plugin import ODCRuntime
from .full_weights import FullWeights

__all__ = ["ODCWeightSync", "shut_down_engine"]


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
        self._weights = FullWeights(model, runtime)
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
        return self._weights()

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
