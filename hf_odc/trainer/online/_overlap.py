"""The overlap of ``max_rollout_staleness=1``: the next generation batch decoded in a background thread while this one
trains (:class:`Prefetch`), its prompts read ahead from the Trainer's data loader in the order the loop takes them
(:class:`Lookahead`), and the log-probabilities of the policy that decoded them (:func:`behaviour_log_probs`), against
which the update's ratio is taken.

The thread only decodes, on the ``"static"`` decoding copy as the last refresh left it, and scores its completions
there: no collective, no write to the policy, so the update's meetings and the decoding never interleave. The main
thread waits for it before anything else touches the copy (the next refresh, an evaluation's generation)."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Lookahead", "Prefetch", "RolloutPrefetchError", "behaviour_log_probs"]


class RolloutPrefetchError(RuntimeError):
    """Decoding the next generation batch in the background (``max_rollout_staleness=1``) failed; the error the thread
    raised is chained as the cause."""


class Prefetch:
    """At most one generation batch decoded ahead, in a daemon thread: :meth:`start` it, :meth:`take` its result (the
    thread's error re-raised as :class:`RolloutPrefetchError`), :meth:`close` at the run's end."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self.key: Any = None
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        """Whether a batch was started and not yet taken or dropped."""
        return self._thread is not None

    def start(self, key: Any, decode: Callable[[], Any]) -> None:
        """Run ``decode()`` in a new thread; its result is for the caller that asks for ``key``."""
        if self.pending:
            raise RuntimeError(
                "hf_odc: the generation batch decoded ahead was not taken: the loop's prompts were not those read "
                "ahead. Set max_rollout_staleness=0 and report it."
            )

        def run() -> None:
            try:
                self._result = decode()
            except BaseException as error:  # handed to the main thread by take()
                self._error = error

        self.key, self._result, self._error = key, None, None
        self._thread = threading.Thread(target=run, name="hf_odc-rollout-prefetch", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Until the thread has ended (at most ``timeout`` seconds)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def take(self, key: Any) -> Any | None:
        """The result decoded for ``key`` (after waiting for it), or ``None`` when none was started for ``key``, which
        is then left pending. Raises :class:`RolloutPrefetchError` if the thread failed."""
        if not self.pending or key != self.key:
            return None
        self.wait()
        result, error = self._result, self._error
        self._drop()
        if error is not None:
            raise RolloutPrefetchError(
                f"Decoding the next generation batch in the background (max_rollout_staleness=1) failed: {error!r}"
            ) from error
        return result

    def close(self, timeout: float | None) -> None:
        """At the run's end: wait for the thread (at most ``timeout`` seconds: it is a daemon, a process that ends
        does not wait for it) and drop what it decoded."""
        self.wait(timeout)
        self._drop()

    def _drop(self) -> None:
        self._thread, self.key, self._result, self._error = None, None, None, None


class Lookahead:
    """The Trainer's epoch iterator, ``source``, read ahead: iterating gives its items in order, those read ahead first,
    so that the loop takes exactly what it would have taken; :meth:`fill` reads ahead, :meth:`peek` looks."""

    def __init__(self, source: Iterator):
        self.source = source
        self._ahead: deque = deque()

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        return self._ahead.popleft() if self._ahead else next(self.source)

    def fill(self, count: int) -> None:
        """Read ahead until ``count`` items are held (fewer at the epoch's end)."""
        while len(self._ahead) < count:
            try:
                self._ahead.append(next(self.source))
            except StopIteration:
                return

    def peek(self, index: int) -> Any | None:
        """The item ``index`` places after the last one taken, if it was read ahead."""
        return self._ahead[index] if index < len(self._ahead) else None


@contextlib.contextmanager
def recording_log_probs(decoder: Any, temperature: float) -> Iterator[None]:
    """Within: the static copy's decoding loop records each chosen token's log-probability under the logits divided by
    ``temperature`` as it decodes (``decoder.last_log_probs``)."""
    decoder.log_prob_temperature = temperature
    try:
        yield
    finally:
        decoder.log_prob_temperature = None


@torch.no_grad()
def behaviour_log_probs(
    decoder: Any, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], temperature: float
) -> list[torch.Tensor]:
    """Each completion token's log-probability under the decoding copy that sampled it, its logits divided by
    ``temperature`` as the trainer's scoring divides them (CPU float32 tensors, one per rollout): those the decoding
    loop recorded from the very logits it chose the token from (:func:`recording_log_probs`), one row per completion
    in the call's order; else (transformers' ``generate`` decoded) scored again on the copy (:func:`_scored`)."""
    recorded = decoder.last_log_probs
    if recorded is not None and recorded.shape[0] == len(completion_ids):
        rows = recorded.float().cpu()
        return [rows[row, : len(completion)].clone() for row, completion in enumerate(completion_ids)]
    return _scored(decoder.model, prompt_ids, completion_ids, temperature)


@torch.no_grad()
def _scored(
    model: nn.Module, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], temperature: float
) -> list[torch.Tensor]:
    """Each completion token's log-probability under ``model`` (the decoding copy that sampled it), its logits divided
    by ``temperature``: one rollout per forward (no padding), its LM head applied only at the completion's positions.
    CPU float32 tensors, one per rollout."""
    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    out = []
    for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
        if not len(completion):
            out.append(torch.zeros(0))
            continue
        ids = torch.tensor([*prompt, *completion], device=device)[None]
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
        scored = hidden[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        logps = torch.log_softmax(head(scored).float() / temperature, dim=-1)
        out.append(logps.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu())
    return out
