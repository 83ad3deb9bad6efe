"""The training script's own mistakes, told by exact fingerprints: an AMP error it raised
(``EXCEPTIONS``, taxonomy §0.2) and GradScaler API misuse (taxonomy C6) seen in the recorder's
events and in the norms it recorded. These outrank every numeric cause (``PRIORITY``): the
numbers that follow a misuse are its consequence.

``preflight/amp_step.py`` reuses the event rules and ``rule_exception`` as they are.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Tuple

import numpy as np

from ...numfmt import count, fmt
from ...runfile.payloads import SnapshotDetail
from ...runfile.schema import Event
from .. import fixes
from ..facts import Facts
from ..restarts import recalibration_skips, scale_jumps, scale_resets
from ..verdict import FAILED, HELD, NOT_MEASURED, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("clip_norm", "grad_norm", "scale", "scale_after", "step"),
         "stats": ()}

# -- thresholds --------------------------------------------------------------------------------

# C6a: clip_grad_norm_'s returned norm over the unscaled norm equals the loss scale S when the
# clip ran on scaled gradients; within a factor 4 of S counts (S is a power of 2, norms noisy).
CLIP_SCALED_TOLERANCE = 4.0
# C6a: the clip saw scaled gradients on at least half of the steps it ran.
CLIP_SCALED_SHARE = 0.5
# C6h: after one overflow, gradients never zeroed stay inf: skips go on and on with a finite
# loss. Five in a row with the forward finite is beyond any calibration that ends.
STALE_RUN = 5


# Messages PyTorch raises for AMP mistakes (taxonomy §0.2 and C6, C7): (pattern, verdict,
# kind, fix ids, explanation).
EXCEPTIONS = [
    (r"cannot be converted to type at::Half without overflow", "mask_overflow", "constant",
     ["safe_mask", "fp32_island"],
     "A constant outside fp16's range (such as a -1e9 attention mask) was written into an fp16 "
     "tensor."),
    (r"Attempting to unscale FP16 gradients", "clip_order", "fp16_params_with_scaler",
     ["fp32_master_weights", "adam_eps"],
     "The parameters are fp16 (model.half()), so their gradients are fp16 and GradScaler cannot "
     "unscale them."),
    (r"non_finite_check_and_unscale.*BFloat16", "clip_order", "bf16_params_with_scaler",
     ["use_bf16", "fp32_master_weights"],
     "The parameters are bf16 and a GradScaler was used: bf16 needs no scaler."),
    (r"unscale_\(\) has already been called|unscale_\(\) is being called after step|"
     r"step\(\) has already been called since the last update|No inf checks were recorded|"
     r"_scale is None", "clip_order", "call_order", ["fix_scaler_calls"],
     "GradScaler's calls came in the wrong order or number (unscale_/step/update once per "
     "optimizer step, in that order)."),
    (r"binary_cross_entropy.*unsafe to autocast", "fp16_loss", "bce", ["loss_in_fp32"],
     "BCELoss on probabilities is refused under autocast: use BCEWithLogitsLoss on logits."),
]


def rule_exception(f: Facts) -> Optional[Finding]:
    """A training script that raised one of AMP's own errors (taxonomy §0.2 fingerprints)."""
    exc = f.exception
    if exc is None:
        return None
    text = f"{exc[0]}: {exc[1]}"
    for pattern, verdict, kind, fix_ids, why in EXCEPTIONS:
        if re.search(pattern, text):
            step = f.step_at(f.n - 1) + 1 if f.n else 0
            ev = [Evidence(f"the script raised {text[:300]}", "exception", None, step)]
            # The call-order errors are what a misuse leads to; the misuse's own event, when
            # recorded (optimizer.step() bypassing the scaler), says more and wins.
            priority = PRIORITY["exception"] - (6 if kind == "call_order" else 0)
            return Finding(verdict, 0.9, f"{why} The script raised {exc[0]} after {f.n} "
                           "recorded steps.", ev, fixes.make(fix_ids, f.fix_context(step=step)),
                           first_bad(step, None, None), priority=priority, kind=kind)
    return None


def rule_clip_before_unscale(f: Facts) -> Optional[Finding]:
    """C6a: a clip on scaled gradients (the event, or the norm clip_grad_norm_ returned, or
    clip_grads_with_norm_ was given, ~ S x)."""
    if not f.n or not f.has_scaler:
        return None
    ev_rows = f.events(Event.CLIP_BEFORE_UNSCALE)
    s = f.steps
    if not len(ev_rows) and not np.isfinite(s["clip_norm"]).any():
        return None  # no clip ran (what follows finds none; on 10^7 steps, in seconds)
    clip, norm, scale = (s["clip_norm"].astype(float), s["grad_norm"].astype(float),
                         s["scale"].astype(float))
    ran = np.isfinite(clip) & np.isfinite(norm) & (norm > 0) & np.isfinite(scale) & (scale > 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(ran, clip / norm, np.nan)
        off = np.abs(np.log2(ratio) - np.log2(np.where(ran, scale, 1)))
    scaled = ran & (off <= math.log2(CLIP_SCALED_TOLERANCE)) & (scale >= 16)
    share = scaled.sum() / max(ran.sum(), 1)
    if not len(ev_rows) and not (ran.any() and share >= CLIP_SCALED_SHARE):
        return None
    first = int(ev_rows["step"][0]) if len(ev_rows) else f.first(scaled)
    ev = []
    how = _clip_call(f)
    if len(ev_rows):
        ev.append(Evidence(f"{how} ran before scaler.unscale_ on {len(ev_rows)} steps "
                           f"(first at step {first})", "clip_before_unscale_steps",
                           float(len(ev_rows)), first))
    if scaled.any():
        i = int(np.flatnonzero(scaled)[0])
        ev.append(Evidence(
            f"at step {f.step_at(i)} {how} measured {fmt(clip[i])} while the true "
            f"(unscaled) norm was {fmt(norm[i])}: a ratio of {fmt(ratio[i])}, the loss scale "
            f"{fmt(scale[i])}", "clip_norm_over_grad_norm", float(ratio[i]), f.step_at(i)))
        ev.append(Evidence(f"{int(scaled.sum())} of {int(ran.sum())} clipped steps clipped a "
                           "scaled norm", "scaled_clip_share", float(share)))
    cut = _clip_cut(f, clip, ran)
    if cut:
        ev.append(cut)
    sees = {"clip_grad_value_": "the loss-scaled values (S times too large), so it cuts them "
                                "at a bound S times too tight",
            "adaptive_clip_grad": "loss-scaled gradients (S times too large) against the "
                                  "weights' norms, so it cuts them S times too hard"
            }.get(how, "the loss-scaled norm (S times too large), so every step is cut down "
                       "by the scale")
    return _misuse(f, "clip_before_unscale", 0.95 if len(ev_rows) else 0.85,
                   f"Gradients are clipped before scaler.unscale_: {how} sees {sees} and the "
                   "model barely learns.", ev, "unscale_before_clip", first, "optimizer")


def _clip_call(f: Facts) -> str:
    """The clip function the run called (/meta ``clip``'s ``how``; files written before it was
    recorded clipped only through clip_grad_norm_)."""
    how = (f.run.clip or {}).get("how")
    return how if how in ("clip_grad_norm_", "clip_grads_with_norm_", "clip_grad_value_",
                          "adaptive_clip_grad") else "clip_grad_norm_"


def _clip_cut(f: Facts, clip: np.ndarray, ran: np.ndarray) -> Optional[Evidence]:
    """With clip_grad_norm_'s recorded max_norm (/meta ``clip``): how much the clip cut the
    updates, the median norm it saw over max_norm."""
    max_norm = (f.run.clip or {}).get("max_norm")
    if not isinstance(max_norm, (int, float)) or max_norm <= 0 or not ran.any():
        return None
    seen = float(np.median(clip[ran]))
    clipped = float(np.mean(clip[ran] > max_norm))
    return Evidence(f"{_clip_call(f)}(max_norm={fmt(float(max_norm))}) saw a median norm of "
                    f"{fmt(seen)}: {clipped:.0%} of the clipped steps were cut, to "
                    f"1/{fmt(seen / max_norm)} of their size", "clip_cut",
                    seen / max_norm if seen > max_norm else 1.0)


def rule_scaler_bypass(f: Facts) -> Optional[Finding]:
    """C6b: optimizer.step() called directly while a GradScaler scales the loss."""
    rows = f.events(Event.STEP_BYPASSES_SCALER)
    if not len(rows):
        return None
    first = int(rows["step"][0])
    ev = [Evidence(f"optimizer.step() ran outside scaler.step() on {len(rows)} steps (first at "
                   f"step {first}), with gradients still multiplied by the loss scale",
                   "bypass_steps", float(len(rows)), first)]
    return _misuse(f, "step_bypasses_scaler", 0.9, "The optimizer is stepped directly "
                   "(optimizer.step()) although a GradScaler scales the loss: the update uses "
                   "gradients still multiplied by the scale, and steps with inf/NaN are not "
                   "skipped.", ev, "use_scaler_step", first, "optimizer")


def rule_scaler_recreated(f: Facts) -> Optional[Finding]:
    """C6f/C6g: the scale jumps back up outside update() (a new scaler, or a reset)."""
    if not f.n or not f.has_scaler:
        return None
    created = f.events(Event.SCALER_CREATED)
    jumps = scale_jumps(f)
    later = created[created["step"] > f.step_at(0)] if len(created) else created
    if not len(jumps) and not len(later):
        return None
    if not len(jumps) and len(later) and not f.story.post_skips:
        return None  # a second scaler made mid-run that changed nothing measurable
    if len(scale_resets(f)) == 1:
        return None  # one resume whose scaler state was not restored: a note (resumed_note)
    first = f.step_at(int(jumps[0]) + 1) if len(jumps) else int(later["step"][0])
    ev = []
    if len(jumps):
        i = int(jumps[0])
        before, after = float(f.steps["scale"][i + 1]), float(f.steps["scale_after"][i])
        ev.append(Evidence(f"the loss scale jumped from {fmt(after)} to {fmt(before)} "
                           f"between steps {f.step_at(i)} and {f.step_at(i + 1)} without a "
                           f"growth interval ({len(jumps)} such resets)", "scale_resets",
                           float(len(jumps)), f.step_at(i + 1)))
    if len(created):
        ev.append(Evidence(f"GradScaler was created {len(created)} times "
                           f"(steps {', '.join(str(int(x)) for x in created['step'][:6])})",
                           "scalers_created", float(len(created))))
    # (below the other misuses: a scaler made per step also skips, which they may explain)
    found = _misuse(f, "scaler_recreated", 0.8, "The GradScaler is re-created (or its scale "
                    "reset) during training: each new scaler starts again at init_scale and "
                    "skips steps to recalibrate, and its growth never accumulates.", ev,
                    "create_scaler_once", first, None, priority=PRIORITY["misuse"] - 2)
    found.explains = recalibration_skips(f, [0] + [int(i) + 1 for i in jumps] + [
        f.index_of(int(x)) for x in created["step"]])
    return found


def rule_stale_grads(f: Facts) -> Optional[Finding]:
    """C6h: gradients not zeroed after an overflow; every later step overflows, forward clean."""
    if not f.n or not f.has_scaler:
        return None
    events = f.events(Event.GRAD_NOT_ZEROED)
    stale = [s for s in f.snapshots if SnapshotDetail.from_json(s["detail"]).stale_grads]
    run = f.story.terminal_run
    start = f.n - run
    forward_clean = run and not f.loss_bad[start:].any()
    if not len(events) and not (stale and run >= STALE_RUN and forward_clean):
        return None
    first = int(events["step"][0]) if len(events) else f.step_at(start)
    ev = []
    if len(events):
        ev.append(Evidence(f".grad held inf/NaN before backward on {len(events)} steps",
                           "grad_not_zeroed_steps", float(len(events)), first))
    if run:
        ev.append(Evidence(f"the last {run} steps were all skipped with a finite loss: the "
                           "forward is clean, the gradients are not", "skip_run", float(run),
                           f.step_at(start)))
    if stale:
        ev.append(Evidence(f"replaying step {stale[0]['step']} gave finite values everywhere, "
                           "yet .grad held inf/NaN: left over from an earlier step",
                           "stale_grads", None, stale[0]["step"]))
    found = _misuse(f, "grad_not_zeroed", 0.8, "Gradients are not zeroed after a skipped step: "
                    "the inf left in .grad is added to every later gradient, so every step "
                    "overflows and the scale halves towards 0 while the forward pass is fine.",
                    ev, "zero_grad_every_step", first, "backward")
    found.premises = [stale_persists(f, first)]
    return found


def stale_persists(f: Facts, first: int) -> Premise:
    """grad_not_zeroed's premise: an inf left in .grad is added to every later gradient, so
    every step after the first stale one is skipped. A step applied after it had finite
    gradients: they were zeroed (a loop that zeroes between the forward and the backward is
    legal; at the event its .grad still holds the step's own overflow)."""
    after = np.asarray(f.steps["step"]) > first
    if not after.any():
        return Premise("stale_persists", NOT_MEASURED, f"no step was recorded after step "
                       f"{first}")
    applied = int((after & ~f.skipped).sum())
    total = int(after.sum())
    if applied:
        return Premise("stale_persists", FAILED, f"{applied} of the {total} steps after step "
                       f"{first} were applied (GradScaler found their gradients finite): an "
                       "inf left in .grad would have made every one of them overflow")
    return Premise("stale_persists", HELD, f"every one of the {total} steps after step "
                   f"{first} was skipped")


def rule_unscale_twice(f: Facts) -> Optional[Finding]:
    """C6d: unscale_ called more than once per optimizer step (per micro-batch)."""
    rows = f.events(Event.UNSCALE_TWICE)
    if not len(rows):
        return None
    first = int(rows["step"][0])
    return _misuse(f, "unscale_twice", 0.85, "scaler.unscale_ runs more than once per "
                   "optimizer step (per micro-batch with gradient accumulation).",
                   [Evidence(f"unscale_ repeated on {len(rows)} steps (first at step {first})",
                             "unscale_twice_steps", float(len(rows)), first)],
                   "fix_scaler_calls", first, "optimizer")


def _scale_at_first(f: Facts, rows: np.ndarray) -> Tuple[int, int, float]:
    """The first step of ``rows``, its index in /steps and the loss scale there (NaN where the
    step is not in /steps)."""
    first = int(rows["step"][0])
    at = f.index_of(first)
    return first, at, float(f.steps["scale"][at]) if 0 <= at < f.n else math.nan


def _the_loss_scale(scale: float, step: int) -> str:
    """'the loss scale (S at step N)', or 'the loss scale' where S is not known."""
    return f"the loss scale ({fmt(scale)} at step {step})" if math.isfinite(scale) else \
        "the loss scale"


def rule_backward_unscaled(f: Facts) -> Optional[Finding]:
    """A loss backwarded without ``scaler.scale`` beside one that went through it: its
    gradients reach the optimizer divided by the loss scale (the AMP docs: every loss that is
    backwarded goes through ``scale``)."""
    rows = f.events(Event.BACKWARD_UNSCALED)
    if not len(rows):
        return None
    first, _, scale = _scale_at_first(f, rows)
    by = _the_loss_scale(scale, first)
    ev = [Evidence(f"a loss was backwarded without scaler.scale beside a scaled one on "
                   f"{count(len(rows), 'step')} (first at step {first}): its gradients reach "
                   f"the optimizer divided by {by}", "backward_unscaled_steps",
                   float(len(rows)), first)]
    return _misuse(f, "backward_unscaled", 0.9, "A loss is backwarded without scaler.scale in "
                   "steps where GradScaler scales another: scaler.step unscales every gradient "
                   "by the loss scale, so that loss's gradients arrive S times too small and it "
                   "barely trains.", ev, "scale_every_loss", first, "backward")


def rule_backward_after_unscale(f: Facts) -> Optional[Finding]:
    """A loss backwarded through ``scaler.scale`` after ``scaler.unscale_`` in the same step (a
    two-pass optimizer such as SAM, a second loss after the first's ``unscale_``): GradScaler
    unscales each optimizer once per ``update()``, so ``scaler.step`` applies the later
    gradients still multiplied by the loss scale, with the earlier pass's skip decision."""
    rows = f.events(Event.BACKWARD_AFTER_UNSCALE)
    if not len(rows):
        return None
    first, at, scale = _scale_at_first(f, rows)
    by = _the_loss_scale(scale, first)
    ev = [Evidence(f"a scaled loss was backwarded after scaler.unscale_ in the same step on "
                   f"{count(len(rows), 'step')} (first at step {first}): scaler.step does not "
                   f"unscale again, so the optimizer applied those gradients multiplied by {by}",
                   "backward_after_unscale_steps", float(len(rows)), first)]
    norm = float(f.steps["grad_norm"][at]) if 0 <= at < f.n else math.nan
    if math.isfinite(scale) and scale > 1 and math.isfinite(norm) and norm > 0:
        ev.append(Evidence(f"the gradient norm at step {first} was {fmt(norm)}: the loss scale "
                           f"times {fmt(norm / scale)}, the size the step should have had",
                           "scaled_grad_norm", norm, first))
    found = _misuse(f, "backward_after_unscale", 0.9, "scaler.unscale_ runs before a later "
                   "backward of the same step (a two-pass optimizer such as SAM, or a second "
                   "loss): GradScaler unscales each optimizer once per update(), so scaler.step "
                   "applies the later gradients still multiplied by the loss scale, and its "
                   "inf/NaN check is the earlier pass's. The updates are S times too large.",
                   ev, "unscale_after_last_backward", first, "optimizer")
    # weights moved S times too far: what every later step shows (an overflow, a collapse of
    # the scale, a climbing loss) is its consequence
    found.explains = frozenset(int(x) for x in f.steps["step"] if int(x) >= first)
    return found


def rule_scaled_grads_in_loss(f: Facts) -> Optional[Finding]:
    """A gradient penalty built from torch.autograd.grad of the scaled loss, never unscaled
    (the AMP docs' recipe multiplies those gradients by 1 / scaler.get_scale() first): the
    penalty is the scale (squared) times too large, an overflow read otherwise as an op's."""
    rows = f.events(Event.SCALED_GRADS_IN_LOSS)
    if not len(rows):
        return None
    first = int(rows["step"][0])
    ev = [Evidence(f"on {len(rows)} steps (first at step {first}) torch.autograd.grad of the "
                   "scaled loss fed the next scaled loss with no scaler.get_scale() between: "
                   "its gradients were not unscaled", "scaled_grads_steps", float(len(rows)),
                   first)]
    return _misuse(f, "scaled_grads_in_loss", 0.85, "A gradient penalty is built from "
                   "torch.autograd.grad of the scaled loss without unscaling those gradients: "
                   "they are the loss scale times too large, so the penalty is off by the "
                   "scale (its square for a squared norm).", ev,
                   "unscale_autograd_grad", first, "backward")


def _misuse(f: Facts, kind: str, confidence: float, summary: str, ev: list[Evidence],
            fix_id: str, first: Optional[int], phase: Optional[str],
            priority: int = PRIORITY["misuse"]) -> Finding:
    """A GradScaler API misuse: verdict ``clip_order`` of ``kind``, first seen at step
    ``first`` (in ``phase``), fixed by ``fix_id``."""
    return Finding("clip_order", confidence, summary, ev,
                   fixes.make([fix_id], f.fix_context(step=first)), first_bad(first, None, phase),
                   priority=priority, kind=kind)
