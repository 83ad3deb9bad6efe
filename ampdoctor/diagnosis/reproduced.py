"""Did the replay reproduce the failure? The forensic replays read (``record/forensic/
reproduced.py`` writes the snapshot's ``recorded``, ``rerun``, ``reproduced`` and
``compiled``): the first failing step that was replayed, whether its replay repeated what the
real step saw, and what "it did not reproduce" needs (``premises``).

Read by the rules (``rules/reproduced.py``'s ``not_reproducible`` and ``compiler``,
``rules/fallbacks.py``'s ``nonfinite``), by the notes of a healthy verdict (``notes``: one
skip that did not reproduce) and by the rank merge (``ranks``: where a failure began).
``first_replay`` and ``unreproduced`` are what ``rules.rule_nonfinite`` asks before it speaks:
``nonfinite`` is never the verdict where the replay of the failure was finite.

Example::

    snap = first_replay(f)              # the replay of the first failing step, or None
    unreproduced(snap)                  # True: the machine, not the numbers
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..numfmt import fmt
from ..runfile.detail import Recorded, TrialOutcome
from ..runfile.payloads import SnapshotDetail
from .facts import Facts
from .verdict import FAILED, HELD, NOT_MEASURED, Premise


def unreproduced(snap: dict) -> bool:
    """Did this replay find the step finite where the real step was not? (Files written
    before the comparison existed: a replay whose every micro-batch stayed finite.)"""
    d = SnapshotDetail.from_json(snap["detail"])
    if compiled_reproduced(snap):
        return False
    if d.reproduced is not None:
        return d.reproduced is False
    return snap["phase"] == "none" and not d.stale_grads and not d.input_modified


def compiled_reproduced(snap: dict) -> bool:
    """Did the compiled replay repeat the failure the eager replay did not?"""
    got = SnapshotDetail.from_json(snap["detail"]).compiled
    return got is not None and got.reproduced is True


def began_here(snap: dict) -> bool:
    """The real step's own loss or model output was non-finite (not only the gradients, which
    an all-reduce brings from another rank)."""
    seen = SnapshotDetail.from_json(snap["detail"]).recorded or Recorded()
    return bool(seen.loss_nonfinite or seen.output_nonfinite)


def failing(f: Facts) -> np.ndarray:
    """Per step: a recorded failure (a non-finite loss, non-finite gradients with no
    GradScaler to skip them, or a skip that GradScaler's calibration and probing do not
    explain)."""
    if not f.n:
        return np.zeros(0, bool)
    applied = f.grad_bad if not f.has_scaler else np.zeros(f.n, bool)
    return f.loss_bad | applied | f.story.bad_skip


def on_failing(f: Facts, bad: np.ndarray) -> list[dict]:
    if not f.n:
        return []
    out = []
    for s in f.snapshots:
        i = f.index_of(s["step"])
        if f.step_at(i) == s["step"] and bad[i] and s["phase"] != "unknown":
            out.append(s)
    return out


def first_replay(f: Facts) -> Optional[dict]:
    """The replay of the first failing step that was replayed (snapshots are in step order)."""
    found = on_failing(f, failing(f))
    return found[0] if found else None


def first_unreproduced(f: Facts) -> Optional[dict]:
    """The replay of the first failing step, when it did not reproduce and the premises of
    "it did not reproduce" hold (``premises``)."""
    snap = first_replay(f)
    if snap is None or not unreproduced(snap):
        return None
    return None if any(p.status == FAILED for p in premises(f, snap)) else snap


# ---------------------------------------------------------------------------------------------
# not_reproducible's premises


def premises(f: Facts, snap: dict) -> list[Premise]:
    """What "the replay is finite where the step was not" needs: that the replay recomputed
    the quantity the step found non-finite (``same_quantity``), and that the run's later
    failures do not reproduce (``later_unreproduced``)."""
    return [_same_quantity(f, snap), _later_failures(f, snap)]


def _same_quantity(f: Facts, snap: dict) -> Premise:
    """The loss or the model's output: the replay recomputes them. A gradient norm of +inf
    over a finite loss: the replay checks each gradient, never their norm, and the norm of
    large finite gradients overflows to +inf (a NaN norm needs a NaN gradient)."""
    step = snap["step"]
    i = f.index_of(step)
    d = SnapshotDetail.from_json(snap["detail"])
    seen = d.recorded or Recorded()
    loss = float(f.steps["loss"][i])
    norm = float(f.steps["grad_norm"][i])
    if bool(f.loss_bad[i]) or seen.loss_nonfinite:
        again = d.rerun or TrialOutcome()
        if again.loss_finite is not None:
            return Premise("same_quantity", HELD, f"step {step}'s loss was non-finite; the "
                           f"replay recomputed it: {fmt(_num(again.loss))}")
        if seen.output_nonfinite:
            return Premise("same_quantity", HELD, f"step {step}'s model output held NaN/inf; "
                           "the replay recomputed it finite")
        if d.loss_not_recomputed:
            return Premise("same_quantity", NOT_MEASURED, f"step {step}'s loss was non-finite "
                           f"and the replay did not recompute it ({d.loss_not_recomputed})")
        return Premise("same_quantity", HELD, f"step {step}'s loss was non-finite; the replay "
                       "recomputed the forward and the backward finite")
    if seen.output_nonfinite:
        return Premise("same_quantity", HELD, f"step {step}'s model output held NaN/inf; the "
                       "replay recomputed it finite")
    if norm == np.inf:
        before = _last_finite_norm(f, i)
        return Premise("same_quantity", FAILED, f"step {step}'s loss was finite "
                       f"({fmt(loss)}) and only its gradient norm was non-finite (+inf"
                       + (f"; {fmt(before[1])} at step {before[0]}" if before else "")
                       + "); the replay found every gradient finite but does not recompute "
                       "their norm: the norm of large finite gradients overflowing is an "
                       "overflow of the norm, not a device fault")
    if np.isnan(norm):
        return Premise("same_quantity", HELD, f"step {step}'s gradient norm was NaN (a NaN "
                       "gradient: no norm of finite values is NaN); the replay found every "
                       "gradient finite")
    return Premise("same_quantity", NOT_MEASURED, f"step {step}'s loss and gradient norm were "
                   "finite; what GradScaler found non-finite was not recorded")


def _last_finite_norm(f: Facts, i: int) -> Optional[tuple[int, float]]:
    norms = f.steps["grad_norm"][:i].astype(float)
    fin = np.flatnonzero(np.isfinite(norms))
    return (f.step_at(int(fin[-1])), float(norms[fin[-1]])) if len(fin) else None


def _later_failures(f: Facts, snap: dict) -> Premise:
    """Never "the machine" over a run whose later failures reproduce on finite weights."""
    later = [s for s in on_failing(f, failing(f)) if s["step"] > snap["step"]
             and not SnapshotDetail.from_json(s["detail"]).weights_nonfinite]
    again = [s for s in later if not unreproduced(s) and s["phase"] not in ("none", "unknown")]
    if again:
        first = again[0]
        where = f"in the {first['phase']} of {first['module']}" if first["module"] else \
            f"in its {first['phase']}"
        return Premise("later_unreproduced", FAILED, f"the replays of {len(again)} later "
                       f"failing steps reproduce the failure (step {first['step']}: "
                       f"non-finite {where}): the numbers make it")
    if later:
        return Premise("later_unreproduced", HELD, f"none of the {len(later)} later failing "
                       "steps replayed on finite weights reproduced")
    return Premise("later_unreproduced", HELD, "no later failing step was replayed on finite "
                   "weights")


def lone_skip(f: Facts, bad: np.ndarray, unrep: list, skipped: list) -> bool:
    """One non-reproducible failure, skipped by GradScaler, and no other failure in the run."""
    return f.has_scaler and len(unrep) == 1 and skipped[0] and int(bad.sum()) == 1


def _num(x: object) -> Optional[float]:
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def notes(f: Facts) -> list[str]:
    """The note a healthy verdict carries for one non-reproducible skip."""
    first = first_unreproduced(f)
    if first is None:
        return []
    bad = failing(f)
    unrep = [s for s in on_failing(f, bad) if unreproduced(s)]
    skipped = [bool(f.skipped[f.index_of(s["step"])]) for s in unrep]
    if not lone_skip(f, bad, unrep, skipped):
        return []
    return [f"Step {first['step']} was non-finite and GradScaler skipped it, but its replay on "
            "the same batch and weights is finite: it did not reproduce. One transient fault "
            "(a device error, a nondeterministic kernel) that GradScaler absorbed; if it "
            "recurs, test the device (`test_device`)."]
