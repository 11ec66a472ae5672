"""How long a rank worked and waited in a minibatch, measured the same way with ODC and with plain FSDP2.

A minibatch runs between two meeting points (ODC's barriers, or :class:`CollectiveMinibatch`'s for plain FSDP2); at
each the device has drained, so host clock and device clock agree there. In between the host only enqueues work,
so the host clock says when the *host* finished, not the device: on a GPU, ``busy`` is read from CUDA events
recorded on the compute stream, with no synchronisation inside the minibatch.

* ``step``: from the entry meeting point to the exit meeting point, the same span on every rank.
* ``busy``: from the entry until this rank's last microbatch has finished on its device.
* ``wait``: ``step - busy``, the time this rank idled at the exit meeting point for slower peers.

The measured bubble of a minibatch is ``hf_odc.packing.idle_fraction(busy of every rank, step)``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CollectiveMinibatch", "MinibatchClock", "MinibatchStats"]


@dataclass
class MinibatchStats:
    """Timings of one rank's last minibatch, in seconds (see the module docstring)."""

    busy: float = 0.0
    wait: float = 0.0

    @property
    def step(self) -> float:
        return self.busy + self.wait


class MinibatchClock:
    """Times one minibatch on ``device``: :meth:`start` after the entry meeting point, :meth:`done` after the last
    microbatch is enqueued, :meth:`stop` after the exit meeting point."""

    def __init__(self, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._device = device
        self._events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self._cuda else None
        )
        self._start = self._done = 0.0

    def start(self) -> None:
        """The device must be idle here (the meeting point drained it), so the event and the host clock agree."""
        self._start = time.perf_counter()
        if self._events is not None:
            self._events[0].record(torch.cuda.current_stream(self._device))

    def done(self) -> None:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._device))
        else:
            self._done = time.perf_counter()  # CPU ops run synchronously: the host clock is the device's

    def stop(self) -> MinibatchStats:
        """After the exit meeting point (the device drained, so the events have completed)."""
        step = time.perf_counter() - self._start
        if self._events is not None:
            busy = self._events[0].elapsed_time(self._events[1]) / 1e3
        else:
            busy = self._done - self._start
        busy = min(max(busy, 0.0), step)
        return MinibatchStats(busy=busy, wait=step - busy)


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
        clock = MinibatchClock(self.device)
        self._meet()
        clock.start()
        with contextlib.nullcontext() if backward else torch.no_grad():
            yield self
        clock.done()
        self._meet()
        self.last = clock.stop()
