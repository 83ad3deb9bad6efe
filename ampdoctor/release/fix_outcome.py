"""What a fix changed: the facts ``compare(run, fixed)`` reads when it is not an fp32 parity check.

numpy only. ``compare`` asks ``question(first, second, steps)`` which comparison the two runs
call for (``Comparison.kind``):

- ``"fix"`` when the first run is no baseline for the second: its loss went non-finite on a
  step both recorded (a run that went NaN is what is being treated, not a reference to match),
  or the runs differ by what ``record --apply`` applied and the first does not compute in a
  higher precision than the second (an fp16 run treated with an fp32 island, compared with an
  fp32 baseline, is still a parity question);
- ``"parity"`` otherwise.

For a fix, the verdict reads each run's diagnosis (``VERDICTS``), and calls a treated run
``fixed`` only where its loss fell from where it started (``levels``: a run whose loss stays at
its untrained level is ``not_trained``); ``outcome(run, diagnosis)``
gives what each run was treated with, its verdict and first bad step, its non-finite and
skipped steps, its first and last finite loss (each with its step) and its loss scale from the
first step to the last; ``at_steps`` lines the two losses up at a few steps both recorded.

Example::

    c = ampdoctor.compare("run.h5", "fixed.h5")
    c.kind, c.verdict                                   # ('fix', 'fixed')
    c.treatment["base"]["first_bad"], c.treatment["amp"]["nonfinite"]
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from ..diagnosis.parity import LOSS_FLOOR, relative, trailing
from ..numfmt import count, fmt
from ..runfile.meta import AppliedFix
from ..runfile.schema import Event, flag
from .curves import percent
from .readiness import precision

VERDICTS = {
    "fixed": "the first run failed and the second is healthy, its loss fallen from where it "
             "started",
    "not_trained": "the first run failed and the second has no failure, but its loss stayed "
                   "at the level it started at: it stopped failing by not training",
    "still_failing": "both runs fail (diagnose the second for what is left)",
    "worse": "the first run was healthy and the second fails",
    "both_healthy": "both runs are healthy (the loss difference says what changed)",
}
# A baseline computes in a higher precision than the run it is compared with.
RANK = {"float16": 0, "bfloat16": 1, "float32": 2}
QUANTILES = (0.25, 0.5, 0.75)  # besides the first and last common step, where at_steps looks


def names(first: str, second: str) -> tuple[str, str]:
    """Two runs as a comparison names them: their file names, or the paths if those agree."""
    b, a = os.path.basename(first), os.path.basename(second)
    return (b, a) if b != a else (first, second)


def nonfinite_loss(run: Any) -> np.ndarray:
    """Per step: the recorder saw a non-finite loss (a loss it never saw is NaN, unflagged)."""
    return (run.steps["flags"] & flag(Event.NONFINITE_LOSS)) != 0


def applied(run: Any) -> list[str]:
    """The ``--apply`` arguments a run was recorded with."""
    return [x.arg for x in _applied(run)]


def incomplete(run: Any) -> list[str]:
    """The ``--apply`` arguments that were not applied in full: an error, a module not found,
    a module left as it was (the run's diagnosis notes say which and why)."""
    return [x.arg for x in _applied(run) if x.error or x.missing or x.skipped]


def change(first: Any, second: Any) -> dict:
    """What ``record --apply`` applied to the second run and not to the first (``added``), and
    the reverse (``removed``)."""
    a, b = applied(first), applied(second)
    return {"added": [x for x in b if x not in a], "removed": [x for x in a if x not in b]}


def question(first: Any, second: Any, steps: np.ndarray) -> str:
    """``"fix"`` or ``"parity"`` (see the module doc); ``steps``: the step numbers both runs
    recorded."""
    bad = nonfinite_loss(first)
    if np.isin(first.steps["step"][bad], steps).any():
        return "fix"
    moved = change(first, second)
    if (moved["added"] or moved["removed"]) and _rank(first) <= _rank(second):
        return "fix"
    return "parity"


def _rank(run: Any) -> int:
    """A run's precision in RANK's order; Linears converted to fp8 (``--apply fp8``) rank
    below fp16: a run against its fp8 treatment is a parity question, as one against bf16."""
    return -1 if _fp8(run) else RANK[precision(run)]


def _applied(run: Any) -> list[AppliedFix]:
    applied: list[AppliedFix] = run.applied  # (a run is untyped here: its entries are not)
    return applied


def _fp8(run: Any) -> Optional[AppliedFix]:
    """The ``--apply fp8`` entry of a run whose Linears were converted, or None."""
    return next((a for a in _applied(run) if a.fix == "fp8" and a.converted), None)


def label(run: Any) -> str:
    """The precision a comparison names a run by: its autocast dtype, with the fp8 recipe
    its Linears were converted to (``float8 tensorwise + bfloat16``)."""
    fp8 = _fp8(run)
    return f"float8 {fp8.recipe or ''} + {precision(run)}" if fp8 else precision(run)


# A treated run is fixed only where its loss fell: its end level at least this fraction below
# its start level (the untrained loss). A fix that stops the failure by stopping the training
# (an LR so low, or a model so broken, that the loss stays where it began) is not_trained.
FALL = 0.1
# The start and end levels: the median of this share of the finite losses (at least LEVEL_MIN).
LEVEL_SHARE = 0.1
LEVEL_MIN = 3


def verdict(first_healthy: bool, second_healthy: bool, learned: Optional[bool] = True) -> str:
    """``learned``: the second run's loss fell from its start (``levels``); None: too few
    losses to tell, taken as learned."""
    if first_healthy:
        return "both_healthy" if second_healthy else "worse"
    if not second_healthy:
        return "still_failing"
    return "not_trained" if learned is False else "fixed"


def levels(loss: np.ndarray) -> Optional[dict]:
    """The start and end levels of a loss curve (the medians of its first and last
    ``LEVEL_SHARE`` of finite losses) and whether it fell by ``FALL`` (``learned``); None with
    fewer than 2 * ``LEVEL_MIN`` finite losses."""
    finite = loss[np.isfinite(loss)].astype(np.float64)
    k = max(LEVEL_MIN, int(LEVEL_SHARE * len(finite)))
    if len(finite) < 2 * LEVEL_MIN:
        return None
    start, end = float(np.median(finite[:k])), float(np.median(finite[-k:]))
    return {"start": start, "end": end, "learned": bool(end <= start - FALL * abs(start))}


# The /steps columns ``outcome`` reads (``comparison`` holds only these for it).
OUTCOME_COLUMNS = ("step", "loss", "flags", "skipped", "scale", "scale_after")


def outcome(run: Any, diagnosis: Any) -> dict:
    """One run's side of a fix comparison: applied (and what of it was not applied in full),
    verdict (with its confidence and first
    bad), steps, non-finite losses and skipped steps (count, first), the first and last
    finite loss ({"step", "loss"}) and the loss scale story (None without GradScaler)."""
    s = run.steps
    loss = s["loss"].astype(np.float64)
    finite = np.flatnonzero(np.isfinite(loss))
    bad = nonfinite_loss(run)
    skipped = s["skipped"] == 1

    def point(i: int) -> dict:
        return {"step": int(s["step"][i]), "loss": float(loss[i])}

    return {"path": run.path, "applied": applied(run), "incomplete": incomplete(run),
            "verdict": diagnosis.verdict,
            "confidence": float(diagnosis.confidence), "first_bad": diagnosis.first_bad,
            "steps": int(len(s)), "nonfinite": int(bad.sum()),
            "first_nonfinite": _first(s["step"][bad]), "skipped": int(skipped.sum()),
            "first_skipped": _first(s["step"][skipped]),
            "first_loss": point(int(finite[0])) if len(finite) else None,
            "last_loss": point(int(finite[-1])) if len(finite) else None,
            "levels": levels(loss), "scale": scale_story(run)}


def scale_story(run: Any) -> Optional[dict]:
    """GradScaler's scale at the first step, after the last update, and the lowest it went
    (with the first step it was reached); None for a run without an enabled GradScaler."""
    if run.scaler is None or not run.scaler.enabled:
        return None
    s = run.steps
    before, after = s["scale"].astype(np.float64), s["scale_after"].astype(np.float64)
    ok = np.isfinite(after)
    if not len(s) or not ok.any():
        return None
    low = int(np.flatnonzero(ok)[np.argmin(after[ok])])
    first = before[np.isfinite(before)]
    return {"initial": float(first[0]) if len(first) else None,
            "final": float(after[ok][-1]), "lowest": float(after[low]),
            "lowest_step": int(s["step"][low])}


def at_steps(steps: np.ndarray, first: np.ndarray, second: np.ndarray) -> list[dict]:
    """Both losses at a few common steps: the first and the last, the quartiles, and each
    run's last finite loss before the end (where it stood before it went non-finite)."""
    n = len(steps)
    if not n:
        return []
    picks = {0, n - 1, *(int(round(q * (n - 1))) for q in QUANTILES)}
    for loss in (first, second):
        finite = np.flatnonzero(np.isfinite(loss))
        if len(finite) and finite[-1] < n - 1:
            picks.add(int(finite[-1]))
    return [{"step": int(steps[i]), "base": float(first[i]), "amp": float(second[i])}
            for i in sorted(picks)]


def _first(steps: np.ndarray) -> Optional[int]:
    return int(steps[0]) if len(steps) else None


def applies(args: list[str]) -> str:
    return ", ".join(f"--apply {x}" for x in args)


# Both losses finite on at least this share of the common steps: their difference is measured
# (fewer, and the losses at the same steps tell the story better).
SHARED = 0.5


def loss_difference(steps: np.ndarray, first: np.ndarray, second: np.ndarray,
                    w: int) -> Optional[dict]:
    """Parity's measure (relative difference of trailing means of ``w`` steps) on the steps
    where both losses are finite, when those are at least ``SHARED`` of the common steps;
    else None."""
    both = np.isfinite(first) & np.isfinite(second)
    if both.sum() < max(2, SHARED * len(steps)):
        return None
    x, y, at = first[both], second[both], steps[both]
    rel = relative(trailing(x, w), trailing(y, w), LOSS_FLOOR * float(np.max(np.abs(x))))
    worst = int(np.argmax(rel))
    return {"steps": int(both.sum()), "max_rel": float(rel[worst]),
            "max_rel_step": int(at[worst]), "final_rel": float(rel[-1]),
            "final_step": int(at[-1])}


# ---------------------------------------------------------------------------------------------
# The sentences


def summary(verdict: str, t: dict, common: int, tolerance: dict) -> str:
    """The comparison's summary: what the change did, each run's failure or health, and how far
    apart the losses are where both are finite. ``t``: ``Comparison.treatment``."""
    nb, na = names(t["base"]["path"], t["amp"]["path"])
    what, before, after = _what(t["change"]), t["base"], t["amp"]
    if verdict == "fixed":
        text = (f"{what} fixed the run: {nb} failed with {_failure(before)}. {na} is "
                f"healthy: {_losses(after)}.")
    elif verdict == "not_trained":
        lv = after["levels"] or {}
        text = (f"{what} stopped the failure but not by training: {nb} failed with "
                f"{_failure(before)}. {na} has no failure, but its loss stayed at the level it "
                f"started at ({fmt(lv.get('start'))} at the start, {fmt(lv.get('end'))} at the "
                f"end, less than {FALL:.0%} lower): it did not learn. ampdoctor diagnose "
                f"{after['path']} says what the fix should be.")
    elif verdict == "still_failing":
        text = (f"{_what(t['change'], with_=True)}, the run still fails: {nb} with "
                f"{_failure(before)}. {na} with {_failure(after)}. ampdoctor diagnose "
                f"{after['path']} says what is left.")
    elif verdict == "worse":
        text = (f"{what} made a healthy run fail. {nb} is healthy: {_losses(before)}. {na} "
                f"fails with {_failure(after)}.")
    else:
        text = f"Both runs are healthy: {what[0].lower() + what[1:]} changed no verdict."
    return text + _difference_text(t["loss_difference"], common, tolerance)


def notes(t: dict, first_steps: int, second_steps: int, common: int) -> list[str]:
    """Why this is not parity, what was not applied in full, which steps were compared."""
    nb, na = names(t["base"]["path"], t["amp"]["path"])
    before, moved = t["base"], t["change"]
    if moved["added"] or moved["removed"]:
        out = ["A run against its treatment (ampdoctor record --apply), not fp32 parity: the "
               "verdict says what the fix changed (--fail-on, a parity check, does not read "
               "it)."]
    else:
        out = [f"Neither run was treated with ampdoctor record --apply, and {nb}'s loss went "
               f"non-finite ({before['nonfinite']} of {before['steps']} steps, from step "
               f"{before['first_nonfinite']}): it is no baseline for fp32 parity, so this says "
               f"what changed from it to {na}."]
    if moved["removed"] and not moved["added"]:
        out.append("The first run is the treated one: give the untreated run first "
                   "(ampdoctor compare run.h5 fixed.h5) to read the verdict as what the fix "
                   "did.")
    for o, name in ((t["base"], nb), (t["amp"], na)):
        if o["incomplete"]:
            out.append(f"In {name}, {applies(o['incomplete'])} was not applied in full: "
                       f"ampdoctor diagnose {o['path']} says what was left out.")
    if common < max(first_steps, second_steps):
        out.append(f"Compared on the {common} steps both runs recorded ({nb} {first_steps}, "
                   f"{na} {second_steps}).")
    return out


def _what(moved: dict, with_: bool = False) -> str:
    """The change the verdict is about: the subject of a sentence, or (``with_``) its
    opening ('With --apply X')."""
    added, removed = applies(moved["added"]), applies(moved["removed"])
    if added:
        out = f"{added} instead of {removed}" if removed else added
        return f"With {out}" if with_ else out
    if removed:
        return f"Without {removed}" if with_ else f"Leaving out {removed}"
    return "With the change between the runs" if with_ else "The change between the runs"


def _failure(o: dict) -> str:
    """'adam_eps from step 0 (module 0, optimizer), its loss non-finite on 99 of 100 steps
    from step 1'."""
    out = o["verdict"]
    bad = o["first_bad"] or {}
    if bad.get("step") is not None:
        out += f" from step {bad['step']}"
    where = [f"module {bad['module']}" if bad.get("module") else "", bad.get("phase") or ""]
    if any(where):
        out += " (" + ", ".join(x for x in where if x) + ")"
    return f"{out}, {_losses(o, ranges=False)}"


def _losses(o: dict, ranges: bool = True) -> str:
    """'no non-finite loss, 6 steps skipped; finite loss from 21.16 (step 0) to 8.21 (step
    59)' (``ranges``: with the first and last finite loss)."""
    n, bad, skipped = o["steps"], o["nonfinite"], o["skipped"]
    if bad == n:
        out = f"its loss non-finite on every one of its {n} steps"
    elif bad:
        out = f"its loss non-finite on {bad} of {n} steps from step {o['first_nonfinite']}"
    else:
        out = "no non-finite loss"
    if skipped:
        out += (", every step skipped" if skipped == n else
                f", {count(skipped, 'step')} skipped")
    first, last = o["first_loss"], o["last_loss"]
    if not ranges or not (first and last):
        return out
    if first["step"] == last["step"]:
        return out + f"; one finite loss, {fmt(first['loss'])} (step {first['step']})"
    return (out + f"; finite loss from {fmt(first['loss'])} (step {first['step']}) to "
            f"{fmt(last['loss'])} (step {last['step']})")


def _difference_text(d: Optional[dict], common: int, tolerance: dict) -> str:
    if d is None:
        return ""
    rtol, w = tolerance["rtol"], tolerance["window"]
    where = (f" Where both losses are finite ({d['steps']} of {common} steps"
             + (f", trailing means of {w}" if w > 1 else "") + ")")
    final = f"final {percent(d['final_rel'])} at step {d['final_step']}"
    if d["max_rel"] <= rtol:
        return (f"{where} they agree within {percent(rtol)}: largest difference "
                f"{percent(d['max_rel'])} at step {d['max_rel_step']}, {final}.")
    return (f"{where} they differ by up to {percent(d['max_rel'])} (step "
            f"{d['max_rel_step']}), {final}.")
