"""Is the loss still falling? A running view of the loss on the host, and when it says no, one
more sampled step (with the op probe) on a coming step.

An overflow hidden inside a module (``opprobe.StepProbe``) can begin after the last sampled
step: at the default interval (100) an 80-step run is sampled at step 0 only, and a
hand-written fp16 RMSNorm whose residual stream passes 256 from step 5 on zeroes the norm's
output, so the model stops learning without one NaN or skipped step. A loss that stops
falling is what such a failure leaves in the sentinel's own columns, so the recorder watches
for it: at each drain (``StepLog.drain``, where the steps' losses have just been read: no host
read of its own) ``see`` takes their losses, and when the recent loss has not fallen against
the run's start for long enough, ``take`` at the next step's start says that step is sampled
once more, and why (an ``Event.FLAT_LOSS_PROBE`` row: the diagnosis says the step was probed
because the loss was flat).

The test, in the spirit of ``diagnosis/curve.py``'s (whose start and 0.9 it takes), simpler:
the start is the median of the first ``START_STEPS`` finite losses, a step's recent loss the
median of the ``RECENT_STEPS`` finite losses ending at it; the step is flat when its recent
loss is no lower than ``FELL`` x the start. Flat steps are counted while they run on; a step
whose recent loss has fallen resets the count. The first probe comes after ``FIRST`` flat
steps, each next one once the flat stretch has doubled since the one before (20, 40, 80, 160,
320), ``MAX_PROBES`` per run at most: a run whose loss falls by a tenth within its first 20
steps or so gets none, and a flat run of any length gets at most five extra sampled steps.
Steps come to ``see`` a drain at a time (about once a second), so a probe lands on the step
after the drain that saw the count reach its mark. A short run of fast steps may see no drain
before it ends, so the watch also asks for a drain of its own (``wants_drain``) at the step
where the count could first have reached its mark (the count at the last drain plus the steps
since); ``DRAINS`` such drains per run at most, each the documented sync of a flush, none once
the probe budget is spent.

Example::

    flat = FlatLoss()
    flat.see(rows["loss"])     # at each drain: the losses just read
    why = flat.take()          # at a step's start: None, or a payloads.FlatLossProbe
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..runfile.payloads import FlatLossProbe

# The start: the median of the first five losses (curve.START_STEPS: one step is as noisy as
# its batch, five are not).
START_STEPS = 5
# A step's recent loss: the median of the ten ending at it (two batches' worth of noise do
# not move it).
RECENT_STEPS = 10
# Fallen: the recent loss below 0.9 x the start (curve.FLAT_END: a loss that fell by less than
# a tenth has not been shown to fall).
FELL = 0.9
# The first probe after 20 flat steps; the next after 40, 80, ...: the stretch doubled.
FIRST = 20
# Extra sampled steps per run at most (20, 40, 80, 160 and 320 flat steps).
MAX_PROBES = 5
# Drains the watch may ask for per run (a run flat from its start asks for five: after 29,
# 49, 89, 169 and 329 steps; one whose loss falls asks every 20 steps until these are used).
DRAINS = 8


class FlatLoss:
    """The recorder's view of whether the loss still falls (see the module docstring)."""

    def __init__(self) -> None:
        self.start = math.nan  # median of the first START_STEPS finite losses
        self.recent = math.nan  # the last step's recent loss
        self.flat_steps = 0  # flat steps in a row, up to the last loss seen
        self.probes = 0  # probes armed so far
        self.due: Optional[FlatLossProbe] = None  # armed, not taken yet
        self.seen = 0  # steps seen (with a loss or not)
        self.asked = 0  # drains asked for
        self._head: list[float] = []  # the first losses, until the start is known
        self._tail = np.zeros(0)  # the last RECENT_STEPS - 1 finite losses
        self._last = 0  # flat_steps when the last probe was armed (0: none in this stretch)

    @property
    def spent(self) -> bool:
        """Nothing more to look for: the budget is armed, or the loss has no start to be
        measured against (a loss that is not positive: its ratios mean nothing)."""
        return self.probes >= MAX_PROBES or (len(self._head) >= START_STEPS
                                             and not self.start > 0)

    def see(self, losses: np.ndarray) -> None:
        """The losses of the steps a drain has just written (NaN where a step had none), in
        step order."""
        self.seen += len(losses)
        if self.spent:
            return
        v = np.asarray(losses, dtype=np.float64)
        v = v[np.isfinite(v)]
        if not len(v):
            return
        if len(self._head) < START_STEPS:
            self._head += v[:START_STEPS - len(self._head)].tolist()
            if len(self._head) == START_STEPS:
                self.start = float(np.median(self._head))
        tail = np.concatenate([self._tail, v])
        self._tail = tail[-(RECENT_STEPS - 1):]
        first = max(len(tail) - len(v), RECENT_STEPS - 1)  # new losses with a full window
        if not self.start > 0 or first >= len(tail):
            return
        windows = np.lib.stride_tricks.sliding_window_view(tail, RECENT_STEPS)
        recent = np.median(windows[first - (RECENT_STEPS - 1):], axis=1)
        flat = recent >= FELL * self.start
        self.recent = float(recent[-1])
        if flat.all():
            self.flat_steps += len(flat)
        else:
            self.flat_steps = len(flat) - 1 - int(np.flatnonzero(~flat)[-1])
            self._last = 0  # it fell: a new stretch starts the back-off again
        self._arm()

    def wants_drain(self, steps: int) -> bool:
        """Should the step log drain now, ``steps`` steps ended, for the watch's sake: could
        the flat count have reached its next mark since the last drain? (Counted: ``DRAINS``
        per run.)"""
        since = steps - max(self.seen, RECENT_STEPS - 1)  # (no count before a full window)
        if self.due is not None or self.asked >= DRAINS or self.spent or \
                self.flat_steps + since < self._mark:
            return False
        self.asked += 1
        return True

    @property
    def _mark(self) -> int:
        return max(FIRST, 2 * self._last)

    def _arm(self) -> None:
        if self.due is not None or self.probes >= MAX_PROBES or self.flat_steps < self._mark:
            return
        self.probes += 1
        self._last = self.flat_steps
        self.due = FlatLossProbe(start=self.start, recent=self.recent,
                                 flat_steps=self.flat_steps, probe=self.probes)

    def take(self) -> Optional[FlatLossProbe]:
        """At a step's start: why this step is to be probed (the loss's start and recent
        level, the flat steps so far, which probe of the run it is), or None."""
        due, self.due = self.due, None
        return due
