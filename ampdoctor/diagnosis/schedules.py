"""When the learning rate itself is the bug: an LR scheduler stepped several times per
optimizer step (once per micro-batch), seen by the recorder (``Event.SCHEDULER_STEPS``), or a
schedule that passed zero (a negative LR: each step then climbs the loss).

A warm-up stepped once per micro-batch reaches its peak as many times too early as there are
micro-batches; the fix is to step it once per optimizer step (``scheduler_per_step``), which
comes before any advice to lower the peak: the same peak with the schedule the script meant
may train. A schedule sized for fewer steps than the run takes (a one-cycle's annealing with
no clamp) goes below 0; the fix is to floor it (``floor_lr``), before any lower peak. The LR
rules (``overflow._lr_finding``, ``progress``'s divergence) ask here.

Example::

    ev = per_micro(f)            # Evidence "scheduler_per_micro", or None
    ids = lr_fixes(f, ["lower_lr", "use_bf16"])   # ['scheduler_per_step', 'lower_lr', ...]
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..numfmt import fmt
from ..runfile.schema import Event
from .facts import Facts
from .verdict import Evidence


def per_micro(f: Facts) -> Optional[Evidence]:
    """Evidence that a scheduler stepped more than once per optimizer step, or None."""
    rows = f.events(Event.SCHEDULER_STEPS)
    if not len(rows):
        return None
    most = int(np.nanmax(rows["value"]))
    step = int(rows["step"][0])
    who = str(rows["text"][0]) or "the LR scheduler"
    micro = int(f.steps["micro"][f.index_of(step)]) if f.n else 0
    per = (f" ({micro} backward calls per step: once per micro-batch)" if micro == most else "")
    return Evidence(f"the LR scheduler ({who}) stepped {most} times per optimizer step from "
                    f"step {step} on{per}: a warm-up reaches its peak {most}x too early",
                    "scheduler_per_micro", float(most), step)


def negative(f: Facts, before: Optional[int] = None) -> Optional[Evidence]:
    """Evidence that the LR went below 0 (at or before step ``before``, when given), or None."""
    if not f.n:
        return None
    lr = f.steps["lr"].astype(float)
    below = np.isfinite(lr) & (lr < 0)
    if before is not None:
        below &= np.asarray(f.steps["step"]) <= before
    at = np.flatnonzero(below)
    if not len(at):
        return None
    step, low = f.step_at(int(at[0])), float(np.min(lr[below]))
    return Evidence(f"the LR went below 0 at step {step} (down to {fmt(low)}): a schedule that "
                    "passes zero, and from there each step moves the weights up the gradient",
                    "lr_negative", low, step)


def lr_fixes(f: Facts, ids: list[str], before: Optional[int] = None) -> list[str]:
    """``ids`` with ``scheduler_per_step`` first when the scheduler is the cause, and
    ``floor_lr`` when the LR went below 0 (at or before step ``before``)."""
    first = (["scheduler_per_step"] if per_micro(f) is not None else []) + (
        ["floor_lr"] if negative(f, before) is not None else [])
    return first + [x for x in ids if x not in first]


def summary(f: Facts, before: Optional[int] = None) -> str:
    """A sentence for the LR finding's summary when the schedule is the cause, else ""."""
    ev, below = per_micro(f), negative(f, before)
    if ev is not None:
        return (f" The LR itself is a bug: the scheduler stepped {int(ev.value or 0)} times per "
                "optimizer step, so its schedule ran that many times too fast; step it once per "
                "optimizer step before lowering the peak.")
    if below is not None:
        return (f" The LR itself is a bug: the schedule went below 0 at step {below.step} (down "
                f"to {fmt(float(below.value or 0))}), and a negative LR climbs the loss; keep "
                "it at or above 0 before lowering the peak.")
    return ""


def moving(f: Facts, step: Optional[int]) -> Optional[int]:
    """Where an LR-driven failure begins, at or after ``step``: past any steps at LR 0 (a
    warm-up's first steps move no weight, so an LR cannot have broken anything there; litgpt's
    warm-up starts at 0). ``step`` itself where its LR is above 0 or not known, or where no
    later step has one."""
    if step is None or not f.n:
        return step
    lr = f.steps["lr"].astype(float)
    i = f.index_of(step)
    if not (np.isfinite(lr[i]) and lr[i] == 0):
        return step
    later = np.flatnonzero((np.arange(f.n) >= i) & np.isfinite(lr) & (lr > 0))
    return f.step_at(int(later[0])) if len(later) else step
