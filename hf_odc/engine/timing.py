"""How long a rank worked and waited in a minibatch, measured the same way with ODC and with plain FSDP2.

A minibatch runs between two meeting points (ODC's barriers, or :class:`CollectiveMinibatch`'s for plain FSDP2); at
each the device has drained, so host clock and device clock agree there. In between the host only enqueues work,
so the host clock says when the *host* finished, not the device: on a GPU, ``busy`` is read from CUDA events
recorded on the compute stream, with no synchronisation inside the minibatch.

* ``step``: from the entry meeting point to the exit meeting point, the same span on every rank.
* ``busy``: from the entry until this rank's last microbatch has finished on its device.
* ``wait``: ``step - busy``, the time this rank idled at the exit meeting point for slower peers.
* ``microbatches``: each microbatch's device time, where the loop marks their ends (``lap()``).

The measured bubble of a minibatch is ``hf_odc.packing.idle_fraction(busy of every rank, step)``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CollectiveMinibatch", "MinibatchClock", "MinibatchStats"]


@dataclass
class MinibatchStats:
    """Timings of one rank's last minibatch, in seconds (see the module docstring)."""

    busy: float = 0.0
    wait: float = 0.0
    microbatches: list[float] = field(default_factory=list)
    """Device seconds of each microbatch marked with :meth:`MinibatchClock.lap`, in order (the first from the
    entry meeting point), what the cost model is calibrated on."""

    all_reduce: float = 0.0
    """Seconds of hybrid ODC's all-reduce across hosts at the exit (part of ``wait``; 0 within one host)."""

    @property
    def step(self) -> float:
        return self.busy + self.wait


class MinibatchClock:
    """Times one minibatch on ``device``: :meth:`start` after the entry meeting point, :meth:`lap` after each
    microbatch is enqueued, :meth:`done` after the last one, :meth:`stop` after the exit meeting point."""

    def __init__(self, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._device = device
        self._start = 0.0
        self._marks: list = []  # CUDA events, or host times on a CPU: start, each lap, done

    def _mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._device))
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())  # CPU ops run synchronously: the host clock is the device's

    def start(self) -> None:
        """The device must be idle here (the meeting point drained it), so the event and the host clock agree."""
        self._start = time.perf_counter()
        self._marks = []
        self._mark()

    def lap(self) -> None:
        """One more microbatch has been enqueued (no synchronisation: an event on the compute stream)."""
        self._mark()

    def done(self) -> None:
        self._mark()

    def stop(self) -> MinibatchStats:
        """After the exit meeting point (the device drained, so the events have completed)."""
        step = time.perf_counter() - self._start
        first, *laps, last = self._marks
        if self._cuda:
            since = [first.elapsed_time(mark) / 1e3 for mark in (*laps, last)]
        else:
            since = [mark - first for mark in (*laps, last)]
        busy = min(max(since[-1], 0.0), step)
        ends = [0.0, *since[:-1]]
        return MinibatchStats(busy=busy, wait=step - busy, microbatches=[b - a for a, b in itertools.pairwise(ends)])


class CollectiveMinibatch:
    """Plain FSDP2's minibatch with ODC's two meeting points, so that its :class:`MinibatchStats` mean the same.

    On entry and on exit: wait for this device's work, then a barrier of ``group`` (none with one process). The
    exit point is where FSDP2's last reduce-scatter would make the ranks meet anyway; the entry point keeps the
    previous optimizer step out of the span.

    Args:
        device: the device the model computes on.
        group: the ranks that meet; ``None`` is the default group.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = torch.device(device)
        self.group = group
        self.last = MinibatchStats()
        self._clock = MinibatchClock(self.device)

    def _meet(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if self.device.type == "cuda" and "nccl" in str(dist.get_backend(self.group)):
                dist.barrier(self.group, device_ids=[self.device.index])
                torch.cuda.synchronize(self.device)
            else:
                dist.barrier(self.group)

    @contextlib.contextmanager
    def minibatch(self, *, backward: bool = True) -> Iterator[CollectiveMinibatch]:
        """Run this rank's microbatches (every rank the same number: FSDP2's collectives pair them up);
        ``backward=False``: forwards only, under ``torch.no_grad()``."""
        self._meet()
        self._clock.start()
        with contextlib.nullcontext() if backward else torch.no_grad():
            yield self
        self._clock.done()
        self._meet()
        self.last = self._clock.stop()

    def lap(self) -> None:
        """Mark the end of a microbatch (its device time lands in ``last.microbatches``)."""
        self._clock.lap()
