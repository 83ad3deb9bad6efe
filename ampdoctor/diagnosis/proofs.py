"""Fixes proven on the saved step: what the forensic replay's trials found, on each fix, in
the evidence, and in the fixes' order.

At the event the recorder tried the fixes one step can test on the failing step
(``record/forensic/proofs.py``: an fp32 island around the culprit, bf16 instead of fp16, the loss in
fp32, the logits form) and kept each outcome in the snapshot (``detail.trials``); a loss
whose backward is singular had the clamp of its op's input tried on the held values
(``singular.clamp_trial``). ``apply`` gives each fix of a diagnosis its ``tried``,
``outcome`` ("with this fix, step 12 is finite (loss 2.31; the run's losses before it: 1.9
to 2.4)", "still non-finite at step 12 (in the backward): not enough on its own", or why it
was not tried), ``finite`` and ``proven``, says the same in the evidence, and ranks the
fixes.

A finite step is not a fixed step (issue 28): a trial is proven only when its loss lies in the
run's own range (``healthy_range``: the finite losses of the applied steps before the
failure, less a spike into it). A finite trial whose loss is outside that range is "finite but
the loss L is outside the run's range [a, b]: not proven", and ranks with those not enough.
Where the run had no such loss, or the trial kept none, ``proven`` is None and the outcome
says so. A trial that failed inside ampdoctor says why in the evidence.

1. the verdict's own first fix stays first, unless a trial found it does not help;
2. then the fixes a trial made finite, then those not tried, then those a trial found not
   enough (or not proven), each group in the verdict's order.

``island_outcome`` is the sentence an ``unstable_op`` summary ends with once the fp32 island
was tried on the saved step (the engine adds it).

Example::

    d = ampdoctor.diagnose("run.h5")
    [(fx.id, fx.tried, fx.finite) for fx in d.fixes]
    # [('fp32_island', True, True), ('scale_attention', False, None), ('use_bf16', True, True)]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..numfmt import fmt
from ..runfile.detail import TriedFix
from ..runfile.payloads import SnapshotDetail
from . import singular
from .fixes import Fix
from .verdict import Evidence, Finding

# A fix tried through another one's trial (the same change to the step).
TRIAL_OF = {"norm_in_fp32": "fp32_island"}
WHERE = {"forward": "in the forward", "loss": "in the loss", "backward": "in the backward"}


def apply(f: Any, top: Finding, fixes: list[Fix], evidence: list[Evidence]) -> list[Fix]:
    """``fixes`` (the diagnosis's, in its order) with the trials' outcomes filled in and
    ranked as the module docstring says; a line of ``evidence`` per tried fix."""
    trials = found(f, top)
    error = trials_error(f, top)
    if error is not None and not trials:
        evidence.append(Evidence(f"the fixes could not be tried on the saved step {error[0]}: "
                                 f"the trials failed inside ampdoctor ({error[1]})",
                                 "trials_error", None, error[0]))
    if not trials:
        return fixes
    band = healthy_range(f, (top.first_bad or {}).get("step"))
    for fx in fixes:
        t = trials.get(TRIAL_OF.get(fx.id, fx.id))
        if t is None:
            continue
        if not t.tried:
            if t.note:
                fx.outcome = f"not tried: {t.note}"
                if "failed" in t.note:
                    evidence.append(Evidence(f"{fx.id} {fx.outcome}", f"trial_{fx.id}", None,
                                             t.step))
            continue
        fx.tried, fx.finite = True, bool(t.finite)
        fx.proven = judged(t, band) if fx.finite else False
        fx.outcome = t.text if isinstance(t, singular.Clamped) else outcome(t, band)
        evidence.append(Evidence(f"tried {fx.id} on the saved step: {fx.outcome}",
                                 f"trial_{fx.id}", 1.0 if fx.proven else 0.0, t.step))
    return ranked(fixes)


# The band around the run's range that a trial's loss may fall in: the range's own width, and
# at least half the loss's size (a step at the failure may sit a little off the losses before
# it; a fix that leaves the loss at 1248 where the run's was 2 did not fix the step).
BAND = 0.5
# A loss this many times the median of the losses before the failure is the spike into it
# (``overflow.LOSS_SPIKE``'s factor), not part of the run's healthy range.
SPIKE = 10.0


def healthy_range(f: Any, step: Any) -> Any:
    """The run's own range of losses before ``step``: (lo, hi) of the finite losses of applied
    steps before it, less a spike (above SPIKE times their median); None where there is none.

    Example::

        healthy_range(facts, 12)   # (1.93, 2.41)
    """
    if step is None or not f.n:
        return None
    s = f.steps
    before = (s["step"] < int(step)) & np.isfinite(s["loss"]) & ~f.skipped
    loss = s["loss"][before].astype(float)
    if not len(loss):
        return None
    median = float(np.median(loss))
    if median > 0:
        loss = loss[loss <= SPIKE * median]
    return float(loss.min()), float(loss.max())


def judged(t: TriedFix, band: Any) -> Any:
    """A finite trial: proven (its loss in the band around the run's range), not (outside),
    or None (no range, or no loss kept)."""
    loss = t.loss
    if band is None or loss is None or not np.isfinite(loss):
        return None
    lo, hi = band
    margin = max(hi - lo, BAND * max(abs(lo), abs(hi)))
    return bool(lo - margin <= loss <= hi + margin)


def trials_error(f: Any, top: Finding) -> Any:
    """(step, error) of the replay of ``top``'s step whose trials failed inside ampdoctor."""
    step = (top.first_bad or {}).get("step")
    if step is None:
        return None
    for s in f.snapshots:
        err = SnapshotDetail.from_json(s["detail"]).trials_error
        if s["step"] >= step and err:
            return s["step"], str(err)[:200]
    return None


def found(f: Any, top: Finding) -> dict[str, TriedFix]:
    """The trials of the replay of ``top``'s first bad step (or the first replay after it; of
    its module where one names it), with the clamp of a singular loss's op."""
    step = (top.first_bad or {}).get("step")
    if step is None:
        return {}
    out: dict[str, TriedFix] = {}
    tried = [s for s in f.snapshots if s["step"] >= step and
             SnapshotDetail.from_json(s["detail"]).trials]
    # a trial is of its replay's module: the verdict's own module's replay where one tried
    # (an island around another module says nothing of an island around the culprit)
    module = (top.first_bad or {}).get("module")
    own = [s for s in tried if module is not None and s["module"] == module]
    for s in (own or tried)[:1]:
        out = dict(SnapshotDetail.from_json(s["detail"]).trials)
    if top.kind == "loss_backward":
        sing = singular.measured(f, step)
        clamp = singular.clamp_trial(sing) if sing is not None else None
        if clamp is not None:
            out["clamp_loss_input"] = clamp
    return out


def outcome(t: TriedFix, band: Any = None) -> str:
    """A trial's result in one clause, for the fix and the evidence."""
    step = t.step
    if t.finite:
        loss = t.loss
        proven = judged(t, band)
        if proven is False:
            return (f"step {step} is finite but the loss {fmt(loss)} is outside the run's "
                    f"range [{fmt(band[0])}, {fmt(band[1])}] (its losses before step {step}): "
                    "not proven")
        shown = f" (loss {fmt(loss)}" if loss is not None else " (its loss was not kept"
        if proven:
            shown += f"; the run's losses before it: {fmt(band[0])} to {fmt(band[1])})"
        else:
            shown += "; the run had no finite loss before it)" if band is None \
                else ")"
        if t.at_scale is not None:
            shown += (f" at loss scale {fmt(t.at_scale)} (at the recorded "
                      f"{fmt(t.recorded_scale)} its gradients overflow fp16, and "
                      "GradScaler lowers the scale by itself)")
        return f"with this fix, step {step} is finite{shown}"
    where = WHERE.get(str(t.first), "")
    return f"still non-finite at step {step}{f' ({where})' if where else ''}: not enough on its own"


def ranked(fixes: list[Fix]) -> list[Fix]:
    """The verdict's first fix first unless a trial found it not enough; then tried and
    finite, not tried, tried and not enough (stable within each)."""
    if not fixes:
        return fixes
    keep = [] if _failed(fixes[0]) else [fixes[0]]
    rest = fixes[len(keep):]
    return keep + sorted(rest, key=_rank)


def _failed(fx: Fix) -> bool:
    return fx.tried and (fx.finite is False or fx.proven is False)


def _rank(fx: Fix) -> int:
    if _failed(fx):
        return 2
    return 0 if fx.tried and fx.finite else 1


def island_outcome(fixes: list) -> str:
    """The sentence an unstable_op's summary ends with once the island was tried on the saved
    step: it fixed the step, or it did not (measured, not promised)."""
    island = next((fx for fx in fixes if fx.id == "fp32_island" and fx.tried), None)
    if island is None:
        return ""
    if island.proven:
        return " Tried on the saved step, an fp32 island around it fixes the step."
    if island.finite and island.proven is None:
        return " Tried on the saved step, an fp32 island around it makes the step finite."
    return " Tried on the saved step, an fp32 island around it alone does not fix the step."
