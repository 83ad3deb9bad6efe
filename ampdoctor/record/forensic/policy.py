"""When the forensic tier replays an event (``forensics`` docstring: "Rate limit"): events at
most ``EPISODE_GAP`` steps apart form an episode, whose 1st, 2nd, 4th, 8th... events are
replayed (and the next one whenever a replay found nothing); a skip with a finite loss is
GradScaler calibrating far more often than a failure, and is replayed only as the first of
its kind or once it has lasted ``GRAD_REPLAY_RUN`` steps in a row.

Example::

    policy = EventPolicy()
    if not policy.calibrating(step, why):
        start, due = policy.due(step.index)   # due: replay it
        policy.found(True)                    # what the replay found
"""

from __future__ import annotations

from typing import Any, Optional

from ...runfile.schema import Event

EPISODE_GAP = 16  # events at most this many steps apart belong to one episode
# A skipped step whose loss is finite is GradScaler calibrating or probing (gradients overflow
# at too high a scale) far more often than a failure: the first such step is replayed, then
# only an overflow that has lasted this many steps in a row (deeper than a calibration from
# 2**16 usually goes), so that the budget is left for the failures that follow.
GRAD_REPLAY_RUN = 8


class EventPolicy:
    """The episodes and the runs of finite-loss skips seen so far."""

    def __init__(self) -> None:
        self._episode = (-1, -EPISODE_GAP - 1, 0, True)  # start, last event, events, found
        # finite-loss skips: last step, run length, and None / "calibrated" (the initial
        # calibration was seen) / "replayed" (the first later one was replayed)
        self._overflows: tuple[int, int, Optional[str]] = (-2, 0, None)

    def calibrating(self, step: Any, why: Event) -> bool:
        """A skip with a finite loss that is not the first one, nor the GRAD_REPLAY_RUN-th of a
        run of them: GradScaler adjusting its scale, not worth a replay.

        The skips from step 0 on (GradScaler's first calibration at its initial scale) do not
        use up "the first one": their first is replayed, and so is the first later
        finite-loss skip that comes after the scale held for GRAD_REPLAY_RUN applied steps,
        where a failure begins (an overflow in the loss's backward skips at every scale and
        would otherwise only be replayed after 8 in a row). Skips closer to the calibration
        are the scale still settling."""
        if why != Event.SKIPPED or getattr(step, "loss_nonfinite", None) is not False:
            return False
        last, run, seen = self._overflows
        applied = step.index - last - 1  # steps since the last finite-loss skip
        run = run + 1 if step.index == last + 1 else 1
        if step.index == run - 1:  # every step so far was skipped: the initial calibration
            self._overflows = (step.index, run, "calibrated")
            return run != 1 and run != GRAD_REPLAY_RUN
        first = seen is None or (seen == "calibrated" and applied >= GRAD_REPLAY_RUN)
        self._overflows = (step.index, run, "replayed" if first else seen)
        return not first and run != GRAD_REPLAY_RUN

    def due(self, index: int) -> tuple[int, bool]:
        """The event at step ``index`` counted in its episode: (the episode's first step,
        whether this event is replayed)."""
        start, last, n, found = self._episode
        if index - last > EPISODE_GAP:
            start, n, found = index, 0, True
        n += 1
        self._episode = (start, index, n, found)
        return start, (n & (n - 1)) == 0 or not found

    def found(self, explained: bool) -> None:
        """What the episode's latest replay found (nothing: the next event is replayed too)."""
        self._episode = self._episode[:3] + (explained,)
