"""Failures of a run that already trains in fp8 (torchao's ``Float8Linear``), read from the
casts its fp8 layers made on the sampled steps (``diagnosis/fp8.py``):

* ``fp8_flushed``: an operand flushed whole: its amax was 0 on some sampled steps (and not on
  others: a layer fed nothing, which torchao casts silently, clamping the amax at 1e-12), or
  below torchao's floor of 1e-12 (the scale clamped), or every non-zero value cast to 0;
* ``fp8_grad_underflow``: the output gradient loses more than ``thresholds.FP8_FLUSHED`` of
  its non-zero values (or ``FP8_SUBNORMAL`` go subnormal) in the format the layer casts it
  to, and a tenth of them lie at the bottom (flushed or subnormal together: a tail of a few
  percent is a gradient that spans many binades by nature, a softmax's); the discriminator is
  the same gradient under per-tensor e5m2 scaling (the /fp8
  ``tensorwise`` row): where that keeps it, the e4m3 format is the cause and per-tensor
  scaling the fix, else the layer stays in bf16;
* ``fp8_drift``: the loss drifts from a bf16 (or fp32) baseline's, beyond the parity
  tolerance ``ampdoctor compare`` uses (``diagnosis/parity.py``), with no NaN; given only
  with the baseline (``diagnose fp8.h5 --baseline bf16.h5``). The layer named is the one whose
  own casts lose the most (lowest SQNR): a ranking, not a proof;
* ``fp8_saturated``: an operand clamped at the format's max on a sampled step (more than
  ``thresholds.FP8_SATURATED``): a scale not taken from the tensor itself (torchao before
  0.10's ``delayed`` scaling, read from the /fp8 ``delayed`` rows) that an amax jump outgrew;
  the discriminator is the same tensor under its current amax, which must not clamp.

No NaN is needed, and none is made: torchao's casts saturate and clamp, so these failures
show only as lost values. ``rules/fp8own.py`` holds the classes measured against the run
itself (a tensor mostly flushed, a drift without a baseline). Not decided here: amaxes that
differ across ranks (each rank's file holds its own casts; the rank merge does not compare
them).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import fmt
from ...runfile.schema import Recipe
from .. import fixes, parity
from ..facts import Facts
from ..fp8 import (
    Cast,
    cast_text,
    in_fp8,
    layer_casts,
    layer_context,
    phase_of,
    role_text,
    steps_text,
)
from ..thresholds import FP8_FLUSHED, FP8_SATURATED, FP8_SUBNORMAL, PARITY_DIVERGE, PARITY_RTOL
from ..verdict import FAILED, HELD, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": (),
         "stats": ()}

# The SQNR of rounding alone: 4 significant bits in e4m3, 3 in e5m2 (docs/fp8.md); a cast 3 dB
# below it loses twice the error rounding does.
ROUNDING_DB = {"e4m3": 30.0, "e5m2": 25.0}
DEFICIT_DB = 3.0
_WHOLE = {"zero": "was entirely zero (amax 0; torchao clamps it at 1e-12 and casts zeros)",
          "clamped": "had an amax below torchao's floor of 1e-12: its scale was clamped",
          "flushed": "had every non-zero value cast to 0"}


def rule_fp8_flushed(f: Facts) -> Optional[Finding]:
    """An fp8 layer's input or output gradient flushed whole on some sampled steps."""
    made, _ = layer_casts(f)
    hits = [c for c in made if c.whole and c.role != "weight" and math.isfinite(c.amax)]
    if not hits:
        return None  # (a weight at exactly 0 is an initialisation, cast exactly)
    # an input before a gradient: a zero input makes the gradients behind it zero too
    first = min(hits, key=lambda c: (c.step, c.role == "grad_output"))
    mine = [c for c in made if (c.layer, c.role) == (first.layer, first.role)]
    flushed = sorted({c.step for c in mine if c.whole})
    live = sorted({c.step for c in mine if not c.whole and c.amax > 0})
    role = role_text(first.role)
    ev = [Evidence(f"{first.layer}'s {role} {_WHOLE[first.whole or 'zero']} on "
                   f"{steps_text(flushed)} of {len(mine)} sampled steps", "fp8_flushed",
                   float(len(flushed)), first.step, first.layer),
          Evidence(f"the cast: {cast_text(f, first)}, scale {fmt(first.scale)}, amax "
                   f"{fmt(first.amax)}; no NaN, no inf: nothing in the run says so",
                   "fp8_scale", first.scale, first.step, first.layer)]
    if live:
        ev.append(Evidence(f"on {steps_text(live)} the same {role} was non-zero (amax up to "
                           f"{fmt(max(c.amax for c in mine))})", "fp8_live", float(len(live)),
                           live[0], first.layer))
    others = list(dict.fromkeys(f"{c.layer} ({role_text(c.role)})" for c in hits
                                if (c.layer, c.role) != (first.layer, first.role)))
    if others:
        ev.append(Evidence("the same in " + ", ".join(others[:4]) +
                           (" ..." if len(others) > 4 else ""), "fp8_flushed_elsewhere",
                           float(len(others))))
    zero = first.whole == "zero"
    premise = Premise("not_always_zero", HELD if live or not zero else FAILED,
                      f"{first.layer}'s {role} was non-zero on {steps_text(live)}" if live else
                      f"{first.layer}'s {role} was zero on every sampled step: a layer that is "
                      "never fed, not a cast that flushed" if zero else
                      f"{first.layer}'s {role} is non-zero: its values were lost in the cast")
    what = (f"torchao clamps a zero amax at 1e-12 and casts with the scale {fmt(first.scale)}, "
            "finite, so the matmul runs on zeros with no NaN and no warning: fp8 hides a dead "
            f"{role} (bf16 would pass the same zeros). Look at what feeds {first.layer} on "
            f"those steps; where zeros are expected (an expert with no token, a masked branch) "
            f"keep {first.layer} in bf16, out of the clamped cast" if zero else
            f"its values were lost in the cast, and {first.layer} learns nothing from them on "
            f"those steps; keeping {first.layer} in bf16 takes it out of the cast")
    found = Finding("fp8_flushed", 0.8 if len(flushed) >= 2 else 0.65,
                    f"{first.layer}'s {role} in fp8 "
                    f"{'was entirely zero' if zero else _WHOLE[first.whole or 'zero']} on "
                    f"{steps_text(flushed)}: {what}.", ev,
                    fixes.make(["fp8_keep_layer"], layer_context(f, first)),
                    first_bad(first.step, first.layer, phase_of(first.role)),
                    priority=PRIORITY["fp8_flushed"], kind=first.whole or "")
    found.premises = [in_fp8(f, first), premise]
    return found


def rule_fp8_grad_underflow(f: Facts) -> Optional[Finding]:
    """An fp8 layer's output gradient underflows the format it is cast to."""
    made, every = layer_casts(f)
    hits = [c for c in made if c.role == "grad_output" and math.isfinite(c.amax)
            and not c.whole and _underflows(c)]
    if not hits:
        return None
    first = hits[0]
    mine = [c for c in hits if c.layer == first.layer]
    wide = every.other(first, Recipe.TENSOR)  # per tensor, e5m2: the /fp8 tensorwise row
    held = wide is not None and wide.format == "e5m2" and not _underflows(wide) and \
        first.format == "e4m3"
    ev = [Evidence(f"on sampled step {first.step}, {first.layer}'s output gradient under its "
                   f"cast ({cast_text(f, first)}): {_lost_text(first)}; lost so on {len(mine)} of "
                   f"{len({c.step for c in made if c.layer == first.layer})} sampled steps",
                   "fp8_grad_flushed", first.flushed_share, first.step, first.layer)]
    if wide is not None:
        ev.append(Evidence(f"per tensor in e5m2, the same gradient on the same step: "
                           f"{_lost_text(wide)}", "fp8_grad_e5m2", wide.flushed_share,
                           first.step, first.layer))
    others = sorted({c.layer for c in hits if c.layer != first.layer})
    if others:
        ev.append(Evidence("the same in " + ", ".join(others[:4]), "fp8_grad_elsewhere",
                           float(len(others))))
    ids = ["fp8_tensorwise", "fp8_keep_layer"] if held else ["fp8_keep_layer"]
    cause = ("e4m3 keeps values down to 2^-9, 2^18 below its top of 448, and e5m2 per tensor, "
             "down to 2^32 below its top, keeps them: the format is the cause" if held else
             "the wider e5m2 per-tensor cast loses them too: the gradient's values span more "
             "binades than any fp8 format holds")
    found = Finding("fp8_grad_underflow", 0.85 if len(mine) >= 2 else 0.7,
                    f"{first.layer}'s output gradient underflows its fp8 cast "
                    f"({cast_text(f, first)}) with no NaN: on sampled step {first.step}, "
                    f"{_lost_text(first)}. "
                    f"Here {cause}.", ev, fixes.make(ids, layer_context(f, first)),
                    first_bad(first.step, first.layer, "backward"),
                    priority=PRIORITY["fp8_grad_underflow"], kind=first.format)
    found.premises = [in_fp8(f, first),
                      Premise("wider_format_keeps_it", HELD,
                              f"per tensor in e5m2, the same gradient: {_lost_text(wide)}"
                              if wide is not None else "the per-tensor e5m2 cast was not "
                              "measured on that step")]
    return found


def rule_fp8_saturated(f: Facts) -> Optional[Finding]:
    """An fp8 layer's cast clamps its operand at the format's max: a scale not taken from the
    tensor itself (delayed: from earlier amaxes) that an amax jump outgrew."""
    made, every = layer_casts(f)
    hits = [c for c in made if c.saturated_share > FP8_SATURATED and math.isfinite(c.amax)]
    if not hits:
        return None  # (current scaling maps the amax to the top: it never clamps)
    first = min(hits, key=lambda c: (c.step, c.role == "grad_output", -c.saturated_share))
    mine = [c for c in made if (c.layer, c.role) == (first.layer, first.role)]
    steps = sorted({c.step for c in mine if c.saturated_share > FP8_SATURATED})
    before = [c.amax for c in mine if c.step < first.step]
    jump = first.amax / max(before) if before and max(before) > 0 else None
    now = every.other(first, Recipe.TENSOR)  # the same tensor under its current amax
    role = role_text(first.role)
    ev = [Evidence(f"{first.layer}'s {role} ({cast_text(f, first)}) on sampled step {first.step}: "
                   f"{first.saturated_share:.2%} of its values clamped at {first.format}'s max"
                   f" (scale {fmt(first.scale)}, amax {fmt(first.amax)}); so on "
                   f"{steps_text(steps)} of {len(mine)} sampled steps", "fp8_saturated",
                   first.saturated_share, first.step, first.layer)]
    if jump is not None:
        ev.append(Evidence(f"its amax grew {jump:.3g}x over the earlier sampled steps' largest "
                           f"({fmt(max(before))} -> {fmt(first.amax)})", "fp8_amax_jump",
                           jump, first.step, first.layer))
    if now is not None:
        ev.append(Evidence(f"scaled by its current amax, the same {role}: "
                           f"{now.saturated_share:.2%} clamped", "fp8_current_saturated",
                           now.saturated_share, first.step, first.layer))
    found = Finding("fp8_saturated", 0.8 if len(steps) >= 2 or (jump or 0) > 1.05 else 0.65,
                    f"{first.layer}'s {role} in fp8 saturates: on {steps_text(steps)} "
                    f"{first.saturated_share:.2%} of its values were clamped at the format's "
                    f"max, with no inf and no NaN (the cast clamps; the largest values, those "
                    f"that carry the tensor, lose what is above the max). Its scale does not "
                    f"come from the tensor it casts"
                    + (f", and its amax jumped {jump:.3g}x" if jump else "") + ".", ev,
                    fixes.make(["fp8_current_scaling", "fp8_keep_layer"], layer_context(f, first)),
                    first_bad(first.step, first.layer, phase_of(first.role)),
                    priority=PRIORITY["fp8_saturated"],
                    kind="amax_jump" if jump is not None and jump > 1.0 else "scale")
    clamps_now = now is not None and now.saturated_share > FP8_SATURATED
    found.premises = [in_fp8(f, first),
                      Premise("current_scale_keeps_it", FAILED if clamps_now else HELD,
                              "scaled by its current amax, the same tensor is not clamped"
                              if now is not None and not clamps_now else
                              f"scaled by its current amax, {now.saturated_share:.2%} is "
                              "clamped too: not a scale that lags" if now is not None else
                              "the current-amax cast was not measured on that step")]
    return found


def rule_fp8_drift(f: Facts) -> Optional[Finding]:
    """A run in fp8 whose loss drifts from its baseline's (``diagnose --baseline``) with no
    NaN: the layer whose own casts lose the most named first."""
    base, made = f.baseline, layer_casts(f)[0]
    if base is None or not made or f.failure_index is not None or f.loss_bad.any():
        return None  # (without a baseline: rules/fp8own.py measures the run's own drift)
    lined = parity.line_up(base.steps, f.steps)
    if lined is None or np.isinf(lined.raw).any():
        return None  # (a loss non-finite where the baseline's is not: not a drift)
    decided = ~np.isnan(lined.smooth)
    beyond = np.flatnonzero(decided & (lined.smooth > PARITY_RTOL))
    if not len(beyond):
        return None  # within the tolerance: the fp8 run matches its baseline
    start = parity.diverged_at(lined.smooth, lined.raw, lined.w, PARITY_RTOL, PARITY_DIVERGE)
    began = int(lined.steps[start if start is not None else beyond[0]])
    last = int(np.flatnonzero(decided)[-1])
    worst = _worst_casts(made)
    first = worst[0]
    out = _stands_out(first)
    how = "diverges from" if start is not None else "drifts from"
    ev = [Evidence(f"the loss {how} the {base.precision} baseline ({base.path}) from step "
                   f"{began}: {lined.smooth[last]:.1%} apart at step {lined.steps[last]} "
                   f"(trailing mean of {lined.w} steps; {PARITY_RTOL:.0%} is within), no "
                   "NaN, no inf", "fp8_drift", float(lined.smooth[last]), began)]
    ev += [Evidence(f"{c.layer}'s {role_text(c.role)} ({cast_text(f, c)}) on sampled step "
                    f"{c.step}: {_lost_text(c)}, SQNR {c.sqnr_db:.1f} dB (rounding alone: about "
                    f"{ROUNDING_DB[c.format]:.0f})", "fp8_cast_loss", _badness(c)[0], c.step,
                    c.layer) for c in worst[:3]]
    which = (f"Of its fp8 layers, {first.layer}'s casts lose the most ({role_text(first.role)}: "
             f"{_lost_text(first)}, SQNR {first.sqnr_db:.1f} dB): keep it in bf16 first. A "
             "ranking from the casts, not a proof" if out else
             "No fp8 layer's cast loses more than its format's rounding: the drift is that "
             f"rounding, compounded over the layers and steps; {first.layer}, with the least "
             "margin, is only the first to try")
    found = Finding("fp8_drift", (0.7 if start is not None else 0.6) if out else 0.45,
                    f"The fp8 run's loss {how} its {base.precision} baseline from step {began} "
                    f"({lined.smooth[last]:.1%} apart at step {lined.steps[last]}) with no NaN. "
                    f"{which}: `record --apply` with it kept, then `compare`, says whether it "
                    "was the one.", ev, fixes.make(["fp8_keep_layer"], layer_context(f, first)),
                    first_bad(began, first.layer, phase_of(first.role)),
                    priority=PRIORITY["fp8_drift"], kind="diverged" if start is not None
                    else "drift")
    ok = not base.fp8_layers
    found.premises = [Premise("baseline_not_fp8", HELD if ok else FAILED,
                              f"{base.path} trains no layer in fp8" if ok else
                              f"{base.path} trains {len(base.fp8_layers)} layers in fp8 too: "
                              "it is no baseline for fp8"),
                      Premise("same_training", HELD, f"{len(lined.steps)} steps in common, "
                              f"the baseline's loss finite on "
                              f"{int(np.isfinite(lined.base).sum())} of them")]
    return found


def _worst_casts(made: list[Cast]) -> list[Cast]:
    """Each fp8 layer's worst cast over its operands and sampled steps, the worst layer first:
    by the share of values lost (flushed, and a tenth of those left subnormal, as the
    readiness ranks), then by the SQNR below what the format's rounding alone gives."""
    worst: dict[str, Cast] = {}
    for c in made:
        if c.layer not in worst or _badness(c) > _badness(worst[c.layer]):
            worst[c.layer] = c
    return sorted(worst.values(), key=lambda c: (_badness(c), c.layer), reverse=True)


def _badness(c: Cast) -> tuple[float, float]:
    sub = c.subnormal / c.nonzero if c.nonzero else 0.0
    deficit = ROUNDING_DB[c.format] - c.sqnr_db if not math.isnan(c.sqnr_db) else 0.0
    return (c.flushed_share + sub / 10, deficit)


def _stands_out(c: Cast) -> bool:
    """A cast that loses more than rounding: past the readiness thresholds, or 3 dB (half the
    signal's precision bits' worth of one) below the format's rounding SQNR."""
    return _lost(c) or _badness(c)[1] > DEFICIT_DB


def _underflows(c: Cast) -> bool:
    """A gradient lost at the bottom of the format: past the readiness thresholds, and a
    tenth of its non-zero values flushed or subnormal together. A tail of a few percent
    flushed with the rest normal is a gradient that spans many binades by nature (a
    softmax's, where the improbable classes' terms are 2^-18 below their row's largest and
    negligible in every sum: blind7's padded tagger, 3.3 % flushed, 5.5 % subnormal)."""
    bottom = (c.flushed + c.subnormal) / c.nonzero if c.nonzero else 0.0
    return _lost(c) and bottom > FP8_SUBNORMAL


def _lost(c: Cast) -> bool:
    return c.flushed_share > FP8_FLUSHED or \
        (c.subnormal / c.nonzero if c.nonzero else 0.0) > FP8_SUBNORMAL


def _lost_text(c: Optional[Cast]) -> str:
    """"12.0 % of its non-zero values flushed to 0 (and 80.0 % subnormal)"."""
    if c is None:
        return "not measured"
    sub = c.subnormal / c.nonzero if c.nonzero else 0.0
    return f"{c.flushed_share:.1%} of its non-zero values flushed to 0" + (
        f" and {sub:.1%} subnormal (1 to 3 significant bits left)" if sub > FP8_SUBNORMAL
        else "")
