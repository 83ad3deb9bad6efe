"""The learning rate a trial measured: the LR range test the recorder ran from the run's first
state at its first failure (``record/forensic/lrrange.py``: ``detail.lr_range``), or at
the first step whose loss rose to 3x the first step's with no non-finite value (/meta
``lr_range``), read for ``dose.py``.

Each rung trained the failing step's batch again for a few steps at the failing LR times a
factor. A rung *trains* when every loss stayed finite and the last fell below the first
(``LrRange.trains``), and it *stays in range* when the last third of its losses (where it
ended, not the transient of Adam's first, sign-sized steps) lie below the top of the run's own
healthy range (``proofs.healthy_range``, widened as a trial's loss is judged there:
``proofs.judged``), and not above the rung's own start (the kept state's loss) by more than
that band. The rungs are read from the highest LR down, whatever order they ran in.
The prescribed LR is the rung below the highest that trains, the margin:
that rung's own trial is then quoted ("tried: LR 0.016 kept the loss at 2.72 over 12 steps").
Where that rung was not run (the time budget) or rose, the highest that trained, one rung
lower, is prescribed, and the clause says it was not tried itself.

No LR is read from the trial (``Tried.lr`` None, ``Tried.why`` says why) when none ran (no
state kept, a loss written by hand, no non-finite loss), when no rung trained, or when the
failing LR itself trained over the trial's steps: weights that grow over hundreds of steps
fail later than a trial looks. ``dose.py`` then falls back on the update ratios and the LR
history, and says that its LR is a bound, not a trial, and why; where no rung trained, that
bound is kept a decade below the lowest LR the test tried (``Tried.failed_at``: a ladder
stopped by its time budget, as a bf16 UNet's on a CPU is, proved every LR down to it fails).

Example::

    tried(facts)   # Tried(lr=0.016, source='tried: LR 0.016 kept the loss at 2.72 ...', why='')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ..numfmt import fmt
from ..runfile.payloads import LrRange, LrRung, SnapshotDetail
from .proofs import BAND, healthy_range

# the margin below the highest rung that trained, where the rung below it was not run: the
# recorder's half-decade (record/forensic/lrrange.py)
RUNG = 10 ** -0.5


@dataclass(frozen=True)
class Tried:
    """The LR the range test measured, with its clause; or None and why not."""

    lr: Optional[float]
    source: str = ""
    why: str = ""
    # the lowest LR the test tried where no rung trained: a bound from elsewhere must lie
    # below it (None: the test proved no LR fails)
    failed_at: Optional[float] = None


def read(f: Any) -> Optional[LrRange]:
    """The run's LR range test (the first snapshot that holds one, else the one run where the
    loss rose with no non-finite value: /meta ``lr_range``), or None."""
    for s in f.snapshots:
        found = SnapshotDetail.from_json(s["detail"]).lr_range
        if found is not None:
            return found
    rose = getattr(f.run, "lr_range", None)
    return rose if isinstance(rose, LrRange) else None


def tried(f: Any) -> Tried:
    """The LR to prescribe from the run's range test (see the module docstring)."""
    found = read(f)
    if found is None:
        return Tried(None, why="the recorder ran no LR range test on this run (it runs one at "
                     "the first non-finite loss at an LR above 0, or where the loss rose to "
                     "3x the first step's)")
    test = found
    if test.note:
        return Tried(None, why=f"no LR range test ran: {test.note}")
    rungs = sorted((r for r in test.rungs or [] if r.lr is not None),
                   key=lambda r: -_lr(r))
    if not rungs:
        return Tried(None, why="the LR range test ran no rung")
    if all(_first(r) is None for r in rungs):  # nothing measured: no LR is shown to fail
        return Tried(None, why=f"the LR range test measured nothing: "
                     f"{test.stopped or 'its loss at the kept state was non-finite'}")
    band = _ceiling(f, test.event_step, rungs[0])
    good = [LrRange.trains(r) and _in_range(r, band) for r in rungs]
    n = test.steps or 0
    where = (f"on {test.batch or 'the failing step, repeated'}, from the weights "
             f"before step {test.state_step if test.state_step is not None else 0}")
    if good[0]:
        return Tried(None, why=f"in the LR range test the failing LR {fmt(_lr(rungs[0]))} "
                     f"itself trained over {n} steps ({_path(rungs[0])}): the failure takes "
                     "longer than a trial looks")
    if not any(good):
        stopped = f", stopped by {test.stopped}" if test.stopped else ""
        return Tried(None, why=f"the LR range test found no LR that trained, down to LR "
                     f"{fmt(_lr(rungs[-1]))}{stopped}", failed_at=_lr(rungs[-1]))
    i = good.index(True)
    high = rungs[i]
    failed = f"; LR {fmt(_lr(rungs[i - 1]))} above it did not ({_failure(rungs[i - 1])})"
    below = rungs[i + 1] if i + 1 < len(rungs) else None
    if below is not None and _held(below) and _in_range(below, band):
        return Tried(_lr(below), (
            f"tried: LR {fmt(_lr(below))} kept the loss at {fmt(_last(below))} over {n} steps "
            f"({_path(below)}, {where}); LR {fmt(_lr(high))}, a rung above, is the highest "
            f"that trained ({_path(high)}){failed}; the rung below it is the margin"))
    return Tried(_lr(high) * RUNG, (
        f"LR {fmt(_lr(high))} is the highest that trained in the LR range test "
        f"({_path(high)} over {n} steps, {where}){failed}; set a rung below it for a margin "
        f"(not tried itself: {_why_not_below(below, test)})"))


def _ceiling(f: Any, step: Any, top: LrRung) -> Optional[float]:
    """The highest loss a rung may reach and stay in the run's range: the top of the range
    before the failing step, widened as a trial's loss is judged (``proofs.judged``); None
    where the run has no range, or where the trial's own first loss lies outside it (the run
    records its loss scaled otherwise than the loss function the trial recomputes)."""
    band = healthy_range(f, step)
    if band is None:
        return None
    lo, hi = band
    margin = max(hi - lo, BAND * max(abs(lo), abs(hi)))
    first = _first(top)
    if first is None or not lo - margin <= first <= hi + margin:
        return None
    # nor above the trial's own start (a loss of the kept, healthy state) by more than the
    # band: a range read from steps that had begun to blow up (diffusers' UNet at LR 10: 1.1,
    # 1.1, 700 before the NaN) would let a rung that swung to 34x and back count as trained
    return min(hi + margin, first + BAND * abs(first)) if first > 0 else hi + margin


def _in_range(rung: LrRung, ceiling: Optional[float]) -> bool:
    """The rung's last third of losses within the run's range: where it ended, not the
    transient of its first steps (Adam's first, sign-sized update from an empty state)."""
    if ceiling is None:
        return True
    losses = [x for x in rung.losses if math.isfinite(x)]
    tail = losses[-max(1, len(losses) // 3):]
    return bool(tail) and max(tail) <= ceiling


def _lr(rung: LrRung) -> float:
    return float(rung.lr or 0.0)


def _held(rung: LrRung) -> bool:
    """Finite to the end, the last loss not above the first."""
    losses = rung.losses
    return rung.finite and len(losses) >= 2 and all(
        math.isfinite(x) for x in losses) and float(losses[-1]) <= float(losses[0])


def _first(rung: LrRung) -> Optional[float]:
    losses = rung.losses
    return float(losses[0]) if losses and math.isfinite(losses[0]) else None


def _last(rung: LrRung) -> Any:
    losses = rung.losses
    if not losses:
        return None
    return losses[-1] if math.isfinite(losses[-1]) else str(losses[-1])


def _path(rung: LrRung) -> str:
    return f"the loss {fmt(_first(rung))} to {fmt(_last(rung))}"


def _failure(rung: LrRung) -> str:
    """How a rung failed, in a clause."""
    losses = rung.losses
    bad = next((j for j, x in enumerate(losses) if not math.isfinite(x)), None)
    if bad is not None:
        return f"the loss was {losses[bad]} after {bad} steps"
    numbers = [float(x) for x in losses]
    if numbers and max(numbers) > numbers[0]:
        return f"the loss rose to {fmt(max(numbers))}"
    return f"{_path(rung)}: not enough fall"


def _why_not_below(below: Optional[LrRung], test: LrRange) -> str:
    if below is None:
        return f"the ladder stopped: {test.stopped or 'its last rung'}"
    return f"at LR {fmt(_lr(below))} {_failure(below)}"
