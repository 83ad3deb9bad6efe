"""The LR schedulers a recording sees step, and how many of their steps took effect in each
optimizer step: a scheduler stepped once per micro-batch (a warm-up that reaches its peak as
many times too early as there are micro-batches) is written as a ``SCHEDULER_STEPS`` event.

Python only, no device work: ``seen`` is called from ``LRScheduler.step`` (``patches``'
scheduler door) and keeps a weak reference; ``end_step`` reads each scheduler's own
``_step_count`` (torch's count of steps that ran), so a step left out by ``record --apply
scheduler_per_step`` does not count, nor does the step a scheduler's constructor takes.

Example::

    schedules = Schedules(journal)
    schedules.seen(scheduler)        # in LRScheduler.step
    schedules.end_step(step)         # at the step boundary: an event when it changed
"""

from __future__ import annotations

import weakref
from typing import Any

from ..runfile.schema import Event
from .journal import Journal
from .steps import Step


class Schedules:
    """The schedulers seen, each with its step count at the last optimizer step's end."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self._known: dict[int, tuple[weakref.ref, int]] = {}
        self._said = 1  # the per-step count the last event wrote (1: none, or back to once)

    def seen(self, scheduler: Any) -> None:
        """``scheduler.step()`` is about to run: remember it, from its count before this call
        (LRScheduler's constructor sets the count to 0 and steps once: that step is its own,
        not the loop's)."""
        known = self._known.get(id(scheduler))
        if known is not None and known[0]() is scheduler:
            return
        count = getattr(scheduler, "_step_count", None)
        if not isinstance(count, int):
            return
        try:
            ref = weakref.ref(scheduler)
        except TypeError:
            return
        self._known[id(scheduler)] = (ref, max(count, 1))

    def end_step(self, st: Step) -> None:
        """The optimizer step ended: the most steps one scheduler took in it; an event when
        that passes 1 for the first time or changes."""
        most, who = 0, ""
        for key, (ref, last) in list(self._known.items()):
            scheduler = ref()
            if scheduler is None:
                del self._known[key]
                continue
            count = getattr(scheduler, "_step_count", last)
            count = count if isinstance(count, int) else last
            self._known[key] = (ref, count)
            if count - last > most:
                most, who = count - last, type(scheduler).__name__
        if most > 1 and most != self._said:
            self.journal.event(Event.SCHEDULER_STEPS, st, value=float(most), text=who)
            self._said = most
        elif most == 1:
            self._said = 1
