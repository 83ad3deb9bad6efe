"""Failures of a run in fp8 measured against itself, with no baseline (``rules/fp8.py`` holds
the casts' own classes):

* ``fp8_flushed`` kind ``mostly``: most of an operand's non-zero values cast to 0
  (``thresholds.FP8_MOSTLY_FLUSHED``) while the tensor is not zero: a few large values (a
  massive activation, a sink token) took the per-tensor scale and pushed the rest below the
  format's smallest subnormal. The discriminator is the same tensor under row-wise scaling
  (the /fp8 ``rowwise`` row): where it keeps the values, the one scale is the cause and
  row-wise scaling the first fix;
* ``fp8_drift`` kind ``self``: the fp8 trial re-ran the saved step with the run's fp8 layers in
  high precision (``record/forensic/fp8trial.py``, ``own``), and the step as recorded moves
  the gradient (or the loss) beyond the trial's thresholds from that re-run. One step, not the
  curve: a lower confidence than against a baseline (``diagnose --baseline``).

Both read the trial's re-runs of each fp8 layer alone kept in high precision (and, for a layer
cast per tensor, cast row-wise) as the fixes tried on the saved step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

from ...numfmt import fmt
from ...runfile.payloads import Fp8Effect, Fp8Own, Fp8OwnLayer
from ...runfile.schema import Recipe
from .. import fixes
from ..facts import Facts
from ..fp8 import (
    cast_text,
    in_fp8,
    layer_casts,
    layer_context,
    own_trial,
    phase_of,
    role_text,
    steps_text,
)
from ..thresholds import FP8_SELF_GRAD_ERROR, PARITY_DIVERGE
from ..verdict import FAILED, HELD, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("loss", "step"),
         "stats": ()}

# What each trial re-run is called, and the fix it tries.
_TRIED = {"fp8_keep_layer": ("high_precision", "kept in high precision"),
          "fp8_rowwise": ("rowwise", "cast row-wise")}


def rule_fp8_mostly_flushed(f: Facts) -> Optional[Finding]:
    """An fp8 layer's operand mostly (not wholly) flushed to 0 on some sampled steps."""
    made, every = layer_casts(f)
    hits = [c for c in made if c.mostly and math.isfinite(c.amax)]
    if not hits:
        return None
    first = min(hits, key=lambda c: (c.step, c.role == "grad_output", -c.flushed_share))
    mine = [c for c in made if (c.layer, c.role) == (first.layer, first.role)]
    flushed = sorted({c.step for c in mine if c.mostly})
    role = role_text(first.role)
    row = every.other(first, Recipe.ROWWISE)
    per_tensor = first.recipe in (Recipe.TENSOR, Recipe.DELAYED)
    # row-wise keeps what one scale lost: it flushes less than half as much (the outlier's own
    # rows only: 6 % of blind7's sink-token input, 11 % of fixtures/fp8/sink_token.py's)
    row_keeps = per_tensor and row is not None and not row.mostly and \
        row.flushed_share < first.flushed_share / 2
    ev = [Evidence(f"{first.layer}'s {role} ({cast_text(f, first)}) on sampled step {first.step}: "
                   f"{first.flushed_share:.1%} of its non-zero values cast to 0, its amax "
                   f"{fmt(first.amax)} under the scale {fmt(first.scale)}; so on "
                   f"{steps_text(flushed)} of {len(mine)} sampled steps", "fp8_flushed_share",
                   first.flushed_share, first.step, first.layer)]
    if row is not None and per_tensor:
        ev.append(Evidence(f"row-wise, the same {role} on the same step: {row.flushed_share:.1%}"
                           " flushed", "fp8_rowwise_flushed", row.flushed_share, first.step,
                           first.layer))
    own, _ = own_trial(f.run)
    ids = ["fp8_rowwise", "fp8_keep_layer"] if row_keeps else ["fp8_keep_layer"]
    made_fixes = fixes.make(ids, layer_context(f, first))
    ev += _trial_evidence(own, first.layer)
    for fix in made_fixes:
        _tried(fix, own, first.layer)
    cause = ("one scale for the whole tensor: its largest values (an outlier, a massive "
             "activation) take the top of the format and the rest fall below its smallest "
             f"subnormal; row-wise, each row has its own scale and "
             f"{row.flushed_share:.1%} are flushed" if row_keeps and row is not None
             else "the values span more binades than the format holds under any scale "
             "measured")
    found = Finding("fp8_flushed", (0.8 if len(flushed) >= 2 else 0.65) +
                    (0.05 if own is not None and _over(own, own.as_recorded) else 0.0),
                    f"{first.layer}'s {role} in fp8 is mostly flushed: on {steps_text(flushed)}, "
                    f"{first.flushed_share:.0%} of its non-zero values cast to 0, with no NaN "
                    f"and no inf. The cause: {cause}.", ev, made_fixes,
                    first_bad(first.step, first.layer, phase_of(first.role)),
                    priority=PRIORITY["fp8_flushed"], kind="mostly")
    found.premises = [in_fp8(f, first), _matters(own, first.layer)]
    return found


def rule_fp8_self_drift(f: Facts) -> Optional[Finding]:
    """Without a baseline: the fp8 trial's re-run with the fp8 layers in high precision moves
    the saved step's gradient or loss beyond its thresholds."""
    if f.baseline is not None or f.failure_index is not None or f.loss_bad.any():
        return None
    made = layer_casts(f)[0]
    own, step = own_trial(f.run)
    own = _with_loss(f, own, step)
    fp8 = own.as_recorded if own is not None else None
    if not made or own is None or fp8 is None or not _drifts(fp8):
        return None
    layers = own.layers or {}
    kept = {n: t.high_precision for n, t in layers.items()
            if t.high_precision is not None and _num(t.high_precision.grad_error) is not None}
    best = min(kept, key=lambda n: _drift(kept[n])) if kept else None
    ev = [Evidence(f"the saved step re-run with every fp8 layer in high precision: the step as "
                   f"recorded moves the gradient by {_pct(fp8.grad_error)}"
                   f"{_loss_text(fp8)} (a drift: past {FP8_SELF_GRAD_ERROR:.0%} of the gradient or "
                   f"{PARITY_DIVERGE:.0%} of the loss); no NaN, no inf", "fp8_self_drift",
                   _num(fp8.grad_error) or 0.0, step)]
    ev += _trial_evidence(own, None)
    layer = best or next(iter(layers), None)
    ctx = f.fix_context(layer, step=step)
    first = next((c for c in made if c.layer == layer), made[0])
    ctx = layer_context(f, first) if layer == first.layer else ctx
    made_fixes = fixes.make(["fp8_keep_layer"], ctx)
    for fix in made_fixes:
        _tried(fix, own, layer)
    which = (f"Kept in high precision alone, {best} leaves the least of it (the gradient "
             f"{_pct(kept[best].grad_error)} off{_loss_text(kept[best], short=True)})"
             if best else "No layer was tried alone")
    found = Finding("fp8_drift", 0.5,
                    f"The fp8 run moves its own gradient from high precision: on the saved "
                    f"step, re-run with its fp8 layers as plain Linears, the gradient is "
                    f"{_pct(fp8.grad_error)} off{_loss_text(fp8)}, with no NaN. "
                    f"{which}. One step, with no baseline run: `record` a bf16 run and "
                    "`diagnose --baseline` it to see the drift over the run.", ev, made_fixes,
                    first_bad(step, layer, "backward"), priority=PRIORITY["fp8_drift"],
                    kind="self")
    found.premises = [Premise("measured_in_high_precision", HELD,
                              f"the fp8 trial re-ran step {step} with "
                              f"{len(layers) or 'the'} fp8 layers in high precision"),
                      in_fp8(f, first)]
    return found


def _trial_evidence(own: Optional[Fp8Own], layer: Optional[str]) -> list[Evidence]:
    """What the trial's re-runs measured: each layer's (or ``layer``'s) re-runs against the
    high-precision one, beside the step as recorded."""
    if own is None:
        return []
    fp8 = own.as_recorded or Fp8Effect()
    out = []
    for name, runs in (own.layers or {}).items():
        if layer is not None and name != layer:
            continue
        said = "; ".join(f"{what} {_pct(effect.grad_error)}" for effect, what in _runs(runs))
        out.append(Evidence(f"on the saved step, the gradient's error against the "
                            f"high-precision re-run: as recorded {_pct(fp8.grad_error)}"
                            f"; with {name} {said}", "fp8_trial", _num(
                                (runs.high_precision or Fp8Effect()).grad_error) or 0.0,
                            None, name))
    return out[:4]


def _runs(runs: Fp8OwnLayer) -> list[tuple[Fp8Effect, str]]:
    """A layer's re-runs that ran, each with what it is called (``_TRIED``'s order)."""
    tried = {"high_precision": runs.high_precision, "rowwise": runs.rowwise}
    return [(e, what) for key, what in _TRIED.values() if (e := tried[key]) is not None]


def _tried(fix: Any, own: Optional[Fp8Own], layer: Optional[str]) -> None:
    """``fix`` as the trial tried it on the saved step, where it did."""
    key, what = _TRIED.get(fix.id, ("", ""))
    runs = (own.layers or {}).get(layer or "") if own is not None else None
    effect = (runs.high_precision if key == "high_precision" else runs.rowwise) \
        if runs is not None and key else None
    if own is None or effect is None:
        return
    error, fp8 = _num(effect.grad_error), own.as_recorded or Fp8Effect()
    fix.tried = True
    fix.finite = error is not None
    fix.proven = error is not None and not _drifts(effect)
    fix.outcome = (f"on the saved step, with {layer} {what}: the gradient is "
                   f"{_pct(error)} off the high-precision re-run (as recorded: "
                   f"{_pct(fp8.grad_error)})")


def _matters(own: Optional[Fp8Own], layer: str) -> Premise:
    """Do the values lost move the step? Measured by the trial where it ran."""
    fp8 = own.as_recorded if own is not None else None
    if own is None or fp8 is None:
        return Premise("values_lost_matter", HELD, "not measured on a saved step (no fp8 "
                       "trial): the share flushed decides")
    runs = (own.layers or {}).get(layer)
    kept = runs.high_precision if runs is not None else None
    matters = _over(own, fp8) or (_num(kept.grad_error if kept else None) or 0.0) < \
        0.5 * (_num(fp8.grad_error) or 0.0)
    return Premise("values_lost_matter", HELD if matters else FAILED,
                   f"the step as recorded is {_pct(fp8.grad_error)} off its "
                   f"high-precision re-run" + (f", {_pct(kept.grad_error)} with {layer} "
                                               "kept" if kept else ""))


def _with_loss(f: Facts, own: Optional[Fp8Own], step: int) -> Optional[Fp8Own]:
    """``own`` with each effect's loss change where the trial could not recompute the loss
    (the backward ran from the recorded output gradient g): to first order, the change of
    sum <g, y> (``output_term``) over the step's recorded loss (``_loss_text`` says so)."""
    steps = f.steps
    at = steps["loss"][steps["step"] == step] if own is not None and len(steps) else []
    loss = abs(float(at[0])) if len(at) and math.isfinite(float(at[0])) else 0.0
    if own is None or not loss:
        return own

    def first_order(e: Optional[Fp8Effect]) -> Optional[Fp8Effect]:
        term = _num(e.output_term) if e is not None else None
        if e is None or e.loss_change is not None or term is None:
            return e
        return replace(e, loss_change=term / loss)

    layers = {n: Fp8OwnLayer(high_precision=first_order(r.high_precision),
                             rowwise=first_order(r.rowwise))
              for n, r in (own.layers or {}).items()}
    return replace(own, as_recorded=first_order(own.as_recorded),
                   layers=layers if own.layers is not None else None)


def _drift(effect: Fp8Effect) -> float:
    """How far a re-run is from high precision, in units of its thresholds (> 1: a drift)."""
    error, change = _num(effect.grad_error), _num(effect.loss_change)
    if error is None and effect.grad_error is not None:
        return math.inf  # (inf/nan: not finite)
    return max((error or 0.0) / FP8_SELF_GRAD_ERROR, abs(change or 0.0) / PARITY_DIVERGE)


def _drifts(effect: Fp8Effect) -> bool:
    """The step as recorded is a drift from high precision (``FP8_SELF_GRAD_ERROR``)."""
    return effect != Fp8Effect() and _drift(effect) > 1.0


def _over(own: Fp8Own, effect: Optional[Fp8Effect]) -> bool:
    if effect is None or effect == Fp8Effect():
        return False
    error, change = _num(effect.grad_error), _num(effect.loss_change)
    return (error is None and effect.grad_error is not None) or \
        (error or 0.0) > _threshold(own, "grad_error") or \
        abs(change or 0.0) > _threshold(own, "loss_change")


def _threshold(own: Fp8Own, name: str) -> float:
    value = _num((own.thresholds or {}).get(name))
    return value if value is not None else {"grad_error": 0.1, "loss_change": 0.01}[name]


def _num(value: Any) -> Optional[float]:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _pct(value: Any) -> str:
    v = _num(value)
    return "not measured" if v is None and value is None else f"{v:.1%}" if v is not None \
        else str(value)


def _loss_text(effect: Fp8Effect, short: bool = False) -> str:
    """The loss change, where known: to first order where no loss was recomputed (the
    re-runs' ``output_term``, read by ``_with_loss``)."""
    change = _num(effect.loss_change)
    if change is None:
        return ""
    return f" and the loss by {change:+.1%}" + (
        " (to first order, from the recorded output gradient: the loss is computed by the "
        "training code)" if effect.output_term is not None and not short else "")
