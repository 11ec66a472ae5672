"""The Mixture-of-Experts router's load-balancing loss under ODC: expert load counted over the whole global minibatch.

transformers' ``load_balancing_loss_func`` (Switch Transformer's loss, which Qwen3-MoE, Mixtral and OLMoE train with,
and which TRL adds as ``router_aux_loss_coef * aux_loss``) is, over the ``N`` router rows it sees (every real token
of the forward, once per MoE layer, pooled over the layers)::

    aux = E * sum_e f_e * P_e,   f_e = (top-k assignments to expert e) / N,   P_e = (sum of p_e over the rows) / N

``f`` carries no gradient (it counts an argmax), ``P`` does. Stock TRL evaluates it per forward pass, over that
microbatch's tokens, so its value depends on how the batch is cut: by the accumulation steps and the number of
processes in TRL, by the plan in ODC, whose ranks run different numbers of microbatches of different sizes. hf_odc
evaluates it over the whole global minibatch instead (global-batch load balancing): ``f`` and ``P`` count every real
token of the optimizer step. That is the value stock TRL computes when the whole minibatch is one forward pass, it
does not change with the plan, the world size or the accumulation, and balancing the experts over the batch that one
update sees, rather than within each microbatch, is what the loss is for (a microbatch of a few similar documents
cannot use every expert evenly, and per-microbatch balancing then works against expert specialisation).

As ``f`` is a constant of the step, the loss is linear in the router's probabilities, so it splits exactly over the
microbatches: microbatch ``m`` adds ``coef * E * sum_e f_e * P_{m,e}``, ``P_{m,e}`` its rows' probabilities over
the minibatch's ``N``. ``f`` is needed before the first backward, so when the loss is on, each step first runs a
forward-only ODC minibatch over this rank's microbatches that counts the router's assignments (:meth:`ExpertLoad.
count`), then one all-reduce of the counts; that pass costs a forward of the minibatch.

Packed rows have no padding (and no attention mask), so every token of a row is a real token and counts, as TRL's
padding-free rows do and as its padded batches do through their attention mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ... import _compat

__all__ = ["ExpertActivity", "ExpertLoad"]


class ExpertLoad:
    """The router's load-balancing loss of one model, over each step's global minibatch (see the module docstring).

    Records the router logits of ``model``'s MoE layers (forward hooks on the modules transformers records as
    ``router_logits``) while :meth:`recording`; :meth:`count` turns a forward's logits into its share of the step's
    statistics, :meth:`start_step` takes the statistics summed over every rank, and :meth:`loss` is a microbatch's
    term of the loss, differentiable in its router logits.
    """

    def __init__(self, model: nn.Module, num_experts: int, top_k: int, coef: float):
        routers = _compat.router_modules(model)
        if not routers:
            raise ValueError(
                f"{type(model).__name__} has no router whose logits transformers records, so hf_odc cannot compute "
                "its load-balancing loss; set router_aux_loss_coef=0."
            )
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self._recorded: list[torch.Tensor] | None = None
        self._weights: torch.Tensor | None = None
        for module, index in routers:
            module.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            if self._recorded is not None:
                self._recorded.append(output[index] if isinstance(output, tuple | list) else output)

        return record

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the router logits of the forwards inside the block (and only those: not the recomputation of
        activation checkpointing in the backward, nor generation or scoring passes)."""
        self._recorded = []
        try:
            yield
        finally:
            self._recorded = None

    def _probabilities(self) -> list[torch.Tensor]:
        """Each recorded layer's router probabilities, ``(rows, E)`` in float32, as transformers computes them."""
        if not self._recorded:
            raise RuntimeError("No router logits were recorded in this forward: is the model a Mixture-of-Experts?")
        return [torch.softmax(logits.reshape(-1, self.num_experts).float(), dim=-1) for logits in self._recorded]

    def count(self) -> torch.Tensor:
        """The recorded forward's statistics, without gradient: ``[assignments per expert (E), probability sums per
        expert (E), rows]``, rows counted once per layer."""
        with torch.no_grad():
            layers = self._probabilities()
            stats = torch.zeros(2 * self.num_experts + 1, dtype=torch.float64, device=layers[0].device)
            for probabilities in layers:
                chosen = probabilities.topk(self.top_k, dim=-1).indices.reshape(-1)
                stats[: self.num_experts] += torch.bincount(chosen, minlength=self.num_experts)
                stats[self.num_experts : -1] += probabilities.sum(0)
                stats[-1] += probabilities.shape[0]
        return stats

    def start_step(self, totals: torch.Tensor) -> float:
        """Take the step's statistics summed over every rank's microbatches (:meth:`count`'s layout); returns the
        minibatch's loss value (before the coefficient: TRL's logged ``aux_loss``)."""
        rows = totals[-1].clamp(min=1)
        fractions = totals[: self.num_experts] / rows
        self._weights = (self.num_experts * fractions / rows).float()
        return float((self._weights.double() * totals[self.num_experts : -1]).sum())

    def loss(self) -> torch.Tensor:
        """The recorded forward's term of the minibatch's loss, ``coef * E * sum_e f_e * P_{m,e}`` (differentiable in
        the router logits): the terms of every microbatch of every rank add up to ``coef`` times the minibatch's
        loss."""
        probability_sums = torch.stack([probabilities.sum(0) for probabilities in self._probabilities()]).sum(0)
        return self.coef * (self._weights.to(probability_sums.device) * probability_sums).sum()


class ExpertActivity:
    """How many (layer, expert) pairs each microbatch's routers activate: the feature of the calibrated cost's expert
    term (:class:`~hf_odc.packing.CalibratedCost`), which sees what a token count cannot (a microbatch pays for every
    expert its tokens reach, once per layer, whatever it sends each).

    Forward hooks on ``model``'s routers (those transformers records as ``router_logits``) take, while
    :meth:`recording`, each layer's top-``top_k`` experts of every token from its router logits (the order of the
    probabilities the router picks by) and count the distinct ones, on the device: counts only, no synchronisation.
    :meth:`take` hands over the counts of the microbatches recorded since the last call, in their order.
    """

    def __init__(self, model: nn.Module, num_experts: int, top_k: int):
        routers = _compat.router_modules(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no router whose logits transformers records.")
        self.num_experts, self.top_k = num_experts, top_k
        self.slots = len(routers) * num_experts
        """The most pairs a microbatch can activate: every expert of every MoE layer."""
        self._layers: list[torch.Tensor] | None = None  # the recorded forward's count per layer
        self._counts: list[torch.Tensor] = []
        for module, index in routers:
            module.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def count(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            if self._layers is not None:
                logits = output[index] if isinstance(output, tuple | list) else output
                with torch.no_grad():
                    chosen = logits.reshape(-1, self.num_experts).topk(self.top_k, dim=-1).indices.reshape(-1)
                    hit = torch.zeros(self.num_experts, dtype=torch.bool, device=logits.device)
                    self._layers.append(hit.index_fill_(0, chosen, True).sum())

        return count

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count the forward inside the block as one microbatch's (and only it: not the recomputation of activation
        checkpointing in the backward)."""
        self._layers = []
        try:
            yield
            self._counts.append(torch.stack(self._layers).sum() if self._layers else torch.zeros((), dtype=torch.int64))
        finally:
            self._layers = None

    def take(self) -> list[torch.Tensor]:
        """The active pairs of each microbatch recorded since the last call (0-d tensors, on the device they were
        counted on), in the order they ran."""
        counts, self._counts = self._counts, []
        return counts
