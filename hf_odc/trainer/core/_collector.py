"""Python's garbage collector run between steps, on every rank alike (``manual_gc``).

Why: the collector runs whenever its allocation counters say, and a full collection walks every tracked object of the
process (torch, transformers, TRL and the model make hundreds of thousands), which takes tens to hundreds of
milliseconds on the host. Under ODC the ranks meet only at the minibatch's end, so a rank whose collector fires inside
its minibatch is late by that much and every other rank waits for it; a step-paced host (short rows, small
microbatches) shows it as bubble at equal work. So for the run the collector is off, the objects alive when training
starts are frozen (``gc.freeze``: out of every later collection, as they live for the run anyway), and every rank
collects at the same place of every step, before its minibatch: the young generations each step, all of them every
:data:`FULL_EVERY` steps, which the freeze keeps short. Reference cycles made by a step are freed by the next one.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

FULL_EVERY = 50
"""Steps between two collections of every generation (the others collect generations 0 and 1 only)."""


class StepCollector:
    """The collector of one trainer: off during :meth:`training` and run by :meth:`before_step`, where ``enabled``
    and the collector was on when training began (a script that turned it off manages it itself)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.active = False

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around training: collect once, freeze what is alive, turn automatic collection off; restored on the way
        out, however it is left. Where something froze objects already (vLLM's engine freezes the process at its
        start and unfreezes it at its shutdown, whose finalizer also destroys the default process group), the freeze
        is left to its owner: ``gc.unfreeze`` would release every frozen object, theirs too."""
        if not self.enabled or not gc.isenabled():
            yield
            return
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.collect()
            gc.freeze()
        gc.disable()
        self.active = True
        try:
            yield
        finally:
            self.active = False
            gc.enable()
            if freeze:
                gc.unfreeze()

    def before_step(self, step: int) -> None:
        """Step ``step``'s collection, before its minibatch, where this collector is active."""
        if self.active:
            gc.collect(2 if step % FULL_EVERY == 0 else 1)
