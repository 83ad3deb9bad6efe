"""The diagnosis rules: small functions from ``Facts`` to a ``Finding`` (or None).

Each rule follows one failure class of ``shared/reference/taxonomy.md`` (class ids in the
docstrings) and decides on the signal the taxonomy names as its discriminator; the thresholds
are the taxonomy's §3 defaults unless a comment says otherwise. ``analyze._conclude`` picks
the root cause among the findings by priority and turns the rest into the causal chain.

Priorities (higher wins among root causes): exact fingerprints of the training script's own
failure (exceptions, API misuse events) above located numeric causes, above trends, above the
fallbacks. A rule that can only be a consequence (scale collapse, underflow after a collapse)
returns ``root=False``.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import numpy as np

from ..runfile import schema
from ..runfile.schema import DType, Event, Kind
from . import fixes
from .facts import ADAM_FAMILY, Facts, fp16_rounds_to_zero, module_of
from .thresholds import LAYER_UNDERFLOW, LOW_SCALE, UNCHANGED_HIGH
from .verdict import Evidence, Finding

# -- thresholds ------------------------------------------------------------------------------

# LAYER_UNDERFLOW, LOW_SCALE and UNCHANGED_HIGH are shared: see thresholds.py.
# A layer under 10 % is "training normally" (C8a needs other layers healthy; C1 does not).
LAYER_HEALTHY = 0.1
# C8a: the scale is healthy at >= 2**10.
HEALTHY_SCALE = 2.0 ** 10
# taxonomy §1 / §3: an update ratio |dW|/|W| above 1e-2 per step, sustained, is too large
# (Adam's healthy ~1e-3).
UPDATE_TOO_LARGE = 1e-2
# taxonomy C2: weight norms grow with the LR (OMG PR #8: Q/K norms 18.8 -> 57.4, 3x); we ask
# for 2x of the total norm between the first sample and the last one before the failure.
WEIGHT_GROWTH = 2.0
# taxonomy C2: activation abs-max trends upward over the run; 10x between the first sample and
# the last before the failure (marian #699's grad norm went 2e4 -> 4e4 -> NaN: we are looser).
ACTIVATION_GROWTH = 10.0
# A loss 10x its earlier median right before the failure is a spike (C2 step 4).
LOSS_SPIKE = 10.0
# Gradient norm growth, same idea: median of the last tenth vs the first tenth before failure.
GRAD_GROWTH = 10.0
# taxonomy C2 ("near the end of warmup, or at peak"): an LR that rose 10x from the first step
# to the failure (a warmup or one-cycle ramp) is the cause side of the same story.
LR_RISE = 10.0
# C2 needs two of the growth signals above; one alone is common in healthy early training.
GROWTH_SIGNALS = 2
# C2 at its most abrupt: one step moved the weights by as much as the weights themselves
# (|dW|/|W| >= 1; Adam's first step at a sane LR is ~lr/|w|, 1e-2..0.3). A failure a step or
# two later has no ramp to show, but the weights were not steady: never one op's overflow.
REPLACED = 1.0
# C6a: clip_grad_norm_'s returned norm over the unscaled norm equals the loss scale S when the
# clip ran on scaled gradients; within a factor 4 of S counts (S is a power of 2, norms noisy).
CLIP_SCALED_TOLERANCE = 4.0
# C6a: the clip saw scaled gradients on at least half of the steps it ran.
CLIP_SCALED_SHARE = 0.5
# C6h: after one overflow, gradients never zeroed stay inf: skips go on and on with a finite
# loss. Five in a row with the forward finite is beyond any calibration that ends.
STALE_RUN = 5

PRIORITY = {
    "exception": 95, "misuse": 90,  # the script's own errors and API misuse events: exact
    "state_poisoning": 88, "adam_eps": 87, "accum_overflow": 86, "bad_input": 84,
    "fp16_loss": 82,
    "mask_overflow": 81, "unstable_op": 80, "lr_overflow": 80,  # located by a replay
    "sampled": 70, "no_training": 70,  # located by sampled statistics only
    "grad_underflow": 62, "masked_underflow": 60, "bf16_precision": 55,  # trends, no NaN
    "diverged": 54, "dead_units": 53,  # no NaN, no precision signal (progress.py)
    "risk": 20, "nonfinite": 5,  # a configuration that will fail; the honest fallback
}


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


def _first_bad(step: Optional[int], module: Optional[str], phase: Optional[str]) -> dict:
    return {"step": step, "module": module, "phase": phase}


def context(f: Facts, module: Optional[str] = None, module_type: Optional[str] = None,
            step: Optional[int] = None) -> fixes.Context:
    """What fix snippets may name, from the run's recorded configuration."""
    opt = f.optimizers[0] if f.optimizers else {}
    hyper = opt.get("hyper") or {}
    scaler = f.scaler or {}
    lrs = f.steps["lr"][np.isfinite(f.steps["lr"])] if f.n else np.zeros(0)
    lr = float(lrs.max()) if len(lrs) else hyper.get("lr")
    if module and not module_type:
        module_type = f.module_type(module)
    return fixes.Context(device=f.device_type, optimizer=opt.get("class") or "AdamW",
                         lr=lr, eps=hyper.get("eps"), init_scale=scaler.get("init_scale"),
                         growth_interval=scaler.get("growth_interval"), module=module,
                         module_type=module_type, autocast=f.autocast_dtype, step=step,
                         low=f.low_precision, scaler=f.has_scaler if f.n else bool(f.scaler))


# ---------------------------------------------------------------------------------------------
# The training script stopped: no steps, or a known exception


def rule_no_training(f: Facts) -> Optional[Finding]:
    """No optimizer step was recorded at all."""
    if f.n:
        return None
    stopped = f.stopped
    if stopped is not None:  # the recorder faulted: the script may well have trained
        why = stopped["why"][:200]
        return Finding("recording_stopped", 1.0, f"ampdoctor stopped recording at step "
                       f"{stopped['step']}, before any step was kept, after an internal error "
                       f"({why}); training went on unrecorded, so there is nothing to "
                       "diagnose.", [Evidence(f"recorder error: {why}", "recorder_error",
                                              None, stopped["step"])],
                       priority=PRIORITY["no_training"])
    exc = f.exception
    if exc is not None:
        summary = (f"The script raised {exc[0]} before its first optimizer step; nothing was "
                   "trained." + (f" ({exc[1][:200]})" if exc[1] else ""))
    else:
        summary = ("No optimizer step was recorded: the script never trained (or was stopped "
                   "before its first step).")
    # Below the exception and misuse rules: a script that died on its first step of an AMP
    # error (a -1e9 mask in fp16, fp16 weights under a scaler) is told by its error.
    return Finding("no_training", 1.0, summary, priority=PRIORITY["no_training"])


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
                           "recorded steps.", ev, fixes.make(fix_ids, context(f, step=step)),
                           _first_bad(step, None, None), priority=priority, kind=kind)
    return None


# ---------------------------------------------------------------------------------------------
# C6: GradScaler API misuse


def rule_clip_before_unscale(f: Facts) -> Optional[Finding]:
    """C6a: clip_grad_norm_ on scaled gradients (the event, or the norm it returned ~ S x)."""
    if not f.n or not f.has_scaler:
        return None
    ev_rows = f.events(Event.CLIP_BEFORE_UNSCALE)
    s = f.steps
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
    if len(ev_rows):
        ev.append(Evidence(f"clip_grad_norm_ ran before scaler.unscale_ on {len(ev_rows)} steps "
                           f"(first at step {first})", "clip_before_unscale_steps",
                           float(len(ev_rows)), first))
    if scaled.any():
        i = int(np.flatnonzero(scaled)[0])
        ev.append(Evidence(
            f"at step {f.step_at(i)} clip_grad_norm_ measured {_fmt(clip[i])} while the true "
            f"(unscaled) norm was {_fmt(norm[i])}: a ratio of {_fmt(ratio[i])}, the loss scale "
            f"{_fmt(scale[i])}", "clip_norm_over_grad_norm", float(ratio[i]), f.step_at(i)))
        ev.append(Evidence(f"{int(scaled.sum())} of {int(ran.sum())} clipped steps clipped a "
                           "scaled norm", "scaled_clip_share", float(share)))
    cut = _clip_cut(f, clip, ran)
    if cut:
        ev.append(cut)
    return Finding("clip_order", 0.95 if len(ev_rows) else 0.85,
                   "Gradients are clipped before scaler.unscale_: clip_grad_norm_ sees the "
                   "loss-scaled norm (S times too large), so every step is cut down by the "
                   "scale and the model barely learns.", ev,
                   fixes.make(["unscale_before_clip"], context(f, step=first)),
                   _first_bad(first, None, "optimizer"), priority=PRIORITY["misuse"],
                   kind="clip_before_unscale")


def _clip_cut(f: Facts, clip: np.ndarray, ran: np.ndarray) -> Optional[Evidence]:
    """With clip_grad_norm_'s recorded max_norm (/meta ``clip``): how much the clip cut the
    updates, the median norm it saw over max_norm."""
    max_norm = (f.run.clip or {}).get("max_norm")
    if not isinstance(max_norm, (int, float)) or max_norm <= 0 or not ran.any():
        return None
    seen = float(np.median(clip[ran]))
    clipped = float(np.mean(clip[ran] > max_norm))
    return Evidence(f"clip_grad_norm_(max_norm={_fmt(float(max_norm))}) saw a median norm of "
                    f"{_fmt(seen)}: {clipped:.0%} of the clipped steps were cut, to "
                    f"1/{_fmt(seen / max_norm)} of their size", "clip_cut",
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
    return Finding("clip_order", 0.9, "The optimizer is stepped directly (optimizer.step()) "
                   "although a GradScaler scales the loss: the update uses gradients still "
                   "multiplied by the scale, and steps with inf/NaN are not skipped.", ev,
                   fixes.make(["use_scaler_step"], context(f, step=first)),
                   _first_bad(first, None, "optimizer"), priority=PRIORITY["misuse"],
                   kind="step_bypasses_scaler")


def rule_scaler_recreated(f: Facts) -> Optional[Finding]:
    """C6f/C6g: the scale jumps back up outside update() (a new scaler, or a reset)."""
    if not f.n or not f.has_scaler:
        return None
    created = f.events(Event.SCALER_CREATED)
    s = f.steps
    before, after = s["scale"][1:].astype(float), s["scale_after"][:-1].astype(float)
    with np.errstate(invalid="ignore"):
        jumps = np.flatnonzero(np.isfinite(before) & np.isfinite(after) & (before > after * 1.5))
    later = created[created["step"] > f.step_at(0)] if len(created) else created
    if not len(jumps) and not len(later):
        return None
    if not len(jumps) and len(later) and not f.story.post_skips:
        return None  # a second scaler made mid-run that changed nothing measurable
    first = f.step_at(int(jumps[0]) + 1) if len(jumps) else int(later["step"][0])
    ev = []
    if len(jumps):
        i = int(jumps[0])
        ev.append(Evidence(f"the loss scale jumped from {_fmt(after[i])} to {_fmt(before[i])} "
                           f"between steps {f.step_at(i)} and {f.step_at(i + 1)} without a "
                           f"growth interval ({len(jumps)} such resets)", "scale_resets",
                           float(len(jumps)), f.step_at(i + 1)))
    if len(created):
        ev.append(Evidence(f"GradScaler was created {len(created)} times "
                           f"(steps {', '.join(str(int(x)) for x in created['step'][:6])})",
                           "scalers_created", float(len(created))))
    found = Finding("clip_order", 0.8, "The GradScaler is re-created (or its scale reset) "
                    "during training: each new scaler starts again at init_scale and skips "
                    "steps to recalibrate, and its growth never accumulates.", ev,
                    fixes.make(["create_scaler_once"], context(f, step=first)),
                    _first_bad(first, None, None), priority=PRIORITY["misuse"] - 2,
                    kind="scaler_recreated")
    found.explains = _recalibration_skips(f, [0] + [int(i) + 1 for i in jumps] + [
        f.index_of(int(x)) for x in created["step"]])
    return found


def _recalibration_skips(f: Facts, resets: list[int]) -> frozenset:
    """Step numbers of the skips that follow each reset of the scale (a new scaler's
    calibration from init_scale): the run of skipped steps starting at each reset index."""
    skipped, out = f.skipped, set()
    for i in set(resets):
        while 0 <= i < f.n and skipped[i]:
            out.add(f.step_at(i))
            i += 1
    return frozenset(out)


def rule_stale_grads(f: Facts) -> Optional[Finding]:
    """C6h: gradients not zeroed after an overflow; every later step overflows, forward clean."""
    if not f.n or not f.has_scaler:
        return None
    events = f.events(Event.GRAD_NOT_ZEROED)
    stale = [s for s in f.snapshots if s["detail"].get("stale_grads")]
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
    return Finding("clip_order", 0.8, "Gradients are not zeroed after a skipped step: the inf "
                   "left in .grad is added to every later gradient, so every step overflows "
                   "and the scale halves towards 0 while the forward pass is fine.", ev,
                   fixes.make(["zero_grad_every_step"], context(f, step=first)),
                   _first_bad(first, None, "backward"), priority=PRIORITY["misuse"],
                   kind="grad_not_zeroed")


def rule_unscale_twice(f: Facts) -> Optional[Finding]:
    """C6d: unscale_ called more than once per optimizer step (per micro-batch)."""
    rows = f.events(Event.UNSCALE_TWICE)
    if not len(rows):
        return None
    first = int(rows["step"][0])
    return Finding("clip_order", 0.85, "scaler.unscale_ runs more than once per optimizer step "
                   "(per micro-batch with gradient accumulation).",
                   [Evidence(f"unscale_ repeated on {len(rows)} steps (first at step {first})",
                             "unscale_twice_steps", float(len(rows)), first)],
                   fixes.make(["fix_scaler_calls"], context(f, step=first)),
                   _first_bad(first, None, "optimizer"), priority=PRIORITY["misuse"],
                   kind="unscale_twice")


# ---------------------------------------------------------------------------------------------
# Located causes of the first non-finite value


def input_out_of_range(f: Facts, snap: dict) -> Optional[float]:
    """The batch's largest magnitude, when a forward culprit of an fp16 run was fed a batch
    beyond fp16's range (C5's range subtype); else None."""
    if snap["phase"] != "forward" or not snap["in_absmax"] > schema.FP16_MAX or \
            f.low_precision != "fp16":
        return None
    biggest, bad = f.batch_absmax(snap["id"])
    return biggest if biggest > schema.FP16_MAX or bad else None


def _run_start(f: Facts, step: int) -> int:
    """The first step of the unbroken run of failing steps that ``step`` belongs to (the
    first steps of a run are not replayed while the recorder discovers the model)."""
    i = f.index_of(step)
    bad = f.loss_bad | f.skipped
    while i > 0 and bad[i - 1] and bad[i]:
        i -= 1
    return f.step_at(i)


def _inputs_from_replays(f: Facts) -> tuple[Optional[dict], float, list[Evidence]]:
    """Replays that found the batch non-finite, or an fp16 culprit fed a batch beyond range."""
    inputs = [s for s in f.snapshots if s["phase"] == "input"]
    if inputs:
        s = inputs[0]
        how = "batch check; no replay under FSDP" if str(
            (s["detail"] or {}).get("replay", "")).startswith("off") else "forensic replay"
        ev = [Evidence(f"the batch given to {s['module'] or 'the model'} at step {s['step']} "
                       f"held NaN/inf ({how})", "input_nonfinite_step", None,
                       s["step"], s["module"])]
        if len(inputs) > 1:
            ev.append(Evidence(f"{len(inputs)} replayed steps had non-finite inputs (steps "
                               f"{', '.join(str(x['step']) for x in inputs[:8])})",
                               "input_nonfinite_replays", float(len(inputs))))
        return _first_bad(s["step"], s["module"], "input"), 0.95, ev
    for s in f.snapshots:
        biggest = input_out_of_range(f, s)
        if biggest is not None:
            ev = [Evidence(f"the batch at step {s['step']} holds values up to {_fmt(biggest)}, "
                           f"beyond fp16's 65504; {s['module']} overflows on them",
                           "input_absmax", biggest, s["step"], s["module"])]
            return _first_bad(s["step"], s["module"], "input"), 0.85, ev
    return None, 0.0, []


def _inputs_from_samples(f: Facts, known: bool) -> tuple[Optional[dict], float, list[Evidence]]:
    """The sampled tier's audit of the batch: non-finite, or beyond fp16's range (the latter
    only counts beside a failure: a large input that fp32 layers take in stride is fine)."""
    st, where, conf, ev = f.stats, None, 0.0, []
    bad_steps = np.flatnonzero(st.input_bad > 0)
    if len(bad_steps):
        i = int(bad_steps[0])
        ev.append(Evidence(f"sampled step {f.step_at(i)}: the model's input held NaN/inf",
                           "sampled_input_nonfinite", None, f.step_at(i)))
        where, conf = _first_bad(f.step_at(i), None, "input"), 0.8
    over = np.flatnonzero(st.input_over > 0) if f.low_precision == "fp16" else []
    if len(over) and (known or where is not None or f.failure_index is not None):
        i = int(over[0])
        ev.append(Evidence(f"sampled step {f.step_at(i)}: input values up to "
                           f"{_fmt(float(st.input_absmax[i]))}, beyond fp16's 65504",
                           "sampled_input_absmax", float(st.input_absmax[i]), f.step_at(i)))
        if where is None:
            where, conf = _first_bad(f.step_at(i), None, "input"), 0.7
    return where, conf, ev


def _micro_rise(f: Facts, step: int) -> Optional[Evidence]:
    """Micro-batches per step at the failure against the run's first steps (a batch-size
    warmup raises the sum in .grad step after step)."""
    micro = f.steps["micro"].astype(int)
    i = f.index_of(step)
    if not len(micro) or micro[i] <= micro[0]:
        return None
    return Evidence(f"micro-batches per step rose from {micro[0]} at step {f.step_at(0)} to "
                    f"{micro[i]} at step {step}", "micro_batches", float(micro[i]), step)


def rule_accum_overflow(f: Facts) -> Optional[Finding]:
    """C6 (accumulation): every micro-batch's gradient is finite, but their sum in an fp16
    .grad passes 65504 (fp16 parameters, no fp32 master copy): the replay summed them in
    fp16, in order, and found where the running sum turned inf."""
    snap = next((x for x in f.snapshots if isinstance(x["detail"].get("accum_overflow"), dict)),
                None)
    if snap is None:
        return None
    acc = snap["detail"]["accum_overflow"]
    where = _first_bad(snap["step"], snap["module"], "backward")
    ev = [Evidence(f"replay of step {snap['step']}: each of the {acc['micro_batches']} "
                   f"micro-batches' gradients is finite, but their sum in {acc['dtype']} .grad "
                   f"passes 65504 at micro-batch {acc['micro']} ({acc['param']}, "
                   f"{_fmt(acc['fp32_absmax'])} in fp32)", "accum_overflow",
                   acc["fp32_absmax"], snap["step"], snap["module"]),
          Evidence(f"the parameters are {acc['dtype']}: backward() adds every micro-batch into "
                   f"a {acc['dtype']} .grad", "param_dtype", None)]
    rise = _micro_rise(f, snap["step"])
    if rise:
        ev.append(rise)
    return Finding("accum_overflow", 0.9, "Gradient accumulation overflows fp16 .grad: each "
                   "micro-batch's gradient is finite, but the parameters (and so .grad) are "
                   "fp16 and backward() sums the micro-batches there, past 65504. No op "
                   "overflowed; the accumulation buffer did.", ev,
                   fixes.make(["fp32_master_weights", "divide_loss_by_accum"],
                              context(f, snap["module"], step=snap["step"])),
                   where, priority=PRIORITY["accum_overflow"])


def rule_bad_input(f: Facts) -> Optional[Finding]:
    """C5: the batch itself holds NaN/inf, or values beyond fp16's range."""
    if not f.n:
        return None
    where, conf, ev = _inputs_from_replays(f)
    sampled_where, sampled_conf, sampled_ev = _inputs_from_samples(f, where is not None)
    ev += sampled_ev
    if where is None:
        where, conf = sampled_where, sampled_conf
    if where is None:
        return None
    where["step"] = _run_start(f, where["step"])
    bad_losses = int(f.loss_bad.sum())
    if bad_losses:
        ev.append(Evidence(f"{bad_losses} of {f.n} steps had a non-finite loss"
                           + ("; the others trained normally" if bad_losses < f.n / 2 else ""),
                           "nonfinite_loss_steps", float(bad_losses)))
    return Finding("bad_input", conf, "The data is the cause: a batch held NaN/inf (or values "
                   "beyond fp16's range) before the model touched it. GradScaler skipped those "
                   "steps; the model itself is fine.", ev,
                   fixes.make(["check_data"], context(f, step=where["step"])), where,
                   priority=PRIORITY["bad_input"])


def _poisoned_buffers(f: Facts) -> tuple[list[str], int, int]:
    """Buffers that went non-finite and stayed so (first-poisoned first), the step they were
    first seen so, and the last step they were seen so. Two sources: the sampled tier (still
    non-finite at the buffer's last sample) and the recorder's audit on failing steps (unless a
    later sample shows the buffer finite again)."""
    st, names, kinds = f.stats, f.tensor_names, f.tensor_kinds
    bad: dict[str, tuple[int, int]] = {}
    for t in np.flatnonzero((kinds == Kind.BUFFER) & st.last_bad):
        bad[names[t]] = (int(st.first_bad_step[t]), int(st.last_step[t]))
    rows = f.events(Event.NONFINITE_BUFFER)
    for step, t in zip(rows["step"].tolist(), rows["tensor"].tolist()):
        if not 0 <= t < len(names) or (st.last_step[t] > step and not st.last_bad[t]):
            continue  # unknown, or finite again at a later sample
        first, last = bad.get(names[t], (step, step))
        bad[names[t]] = (min(first, step), max(last, step))
    if not bad:
        return [], -1, -1
    order = sorted(bad, key=lambda name: (bad[name][0], name))
    return order, bad[order[0]][0], max(last for _, last in bad.values())


def rule_state_poisoning(f: Facts) -> Optional[Finding]:
    """C10: buffers (BatchNorm running stats, EMA) non-finite while the parameters are finite."""
    if not f.n:
        return None
    buffers, first_seen, last_seen = _poisoned_buffers(f)
    if not buffers or f.stats.param_bad[f.index_of(last_seen)] > 0:
        return None  # nothing poisoned, or the weights are gone too
    after = slice(f.index_of(first_seen), f.n)
    if not np.any(~f.loss_bad[after] & ~f.skipped[after]):
        return None  # training did not go on: this is no buffer-only damage
    module = module_of(buffers[0]) or None
    trigger = f.failure_step if f.failure_step is not None and f.failure_step <= first_seen \
        else first_seen
    ev = [Evidence(f"{buffers[0]} is non-finite from step {first_seen}"
                   + (f" to the last sample ({last_seen})" if last_seen > first_seen else ""),
                   "buffer_nonfinite_step", float(first_seen), first_seen, module)]
    if len(buffers) > 1:
        ev.append(Evidence(f"{len(buffers)} buffers non-finite: {', '.join(buffers[:6])}",
                           "buffers_nonfinite", float(len(buffers))))
    ev.append(Evidence(f"the parameters stay finite and training goes on with finite losses "
                       f"after step {trigger}: only the buffers were poisoned",
                       "params_finite", None, last_seen))
    if trigger != first_seen:
        ev.append(Evidence(f"the buffers took the inf/NaN of step {trigger}, whose optimizer step "
                           "GradScaler skipped", "trigger_step", float(trigger), trigger))
    ids = ["guard_buffers"] + (["check_data"] if any(s["phase"] == "input" for s in f.snapshots)
                               else [])
    return Finding("state_poisoning", 0.85, "Module buffers (BatchNorm running statistics) hold "
                   "inf/NaN while the weights are finite: GradScaler skipped the bad step but "
                   "the forward pass had already updated the statistics. Training loss looks "
                   "fine (train mode uses batch statistics); every evaluation is NaN.", ev,
                   fixes.make(ids, context(f, module, step=trigger)),
                   _first_bad(trigger, module, "forward"), priority=PRIORITY["state_poisoning"])


def _adam_eps_config(f: Facts) -> Optional[dict]:
    for o in f.optimizers:
        cls = str(o.get("class") or "")
        eps = (o.get("hyper") or {}).get("eps")
        if not any(cls == a or cls.endswith(a) for a in ADAM_FAMILY) or not isinstance(
                eps, (int, float)):
            continue
        dtypes = o.get("param_dtypes") or {}
        total = sum(dtypes.values()) or 1
        fp16_params = dtypes.get("float16", 0) * 2 >= total
        fp16_state = "float16" in (o.get("state_dtypes") or {}).values()
        if (fp16_params or fp16_state) and fp16_rounds_to_zero(float(eps)):
            return {"class": cls, "eps": float(eps), "fp16_params": fp16_params,
                    "fp16_state": fp16_state}
    return None


def _adam_eps_confirmed(f: Facts) -> tuple[float, Optional[dict], list[Evidence]]:
    """How sure the failure is the optimizer's (C4's discriminator: weights non-finite after a
    step whose gradients were finite). Returns a confidence (0: it is not), where, evidence."""
    fi = f.failure_index
    if fi is None or not f.loss_bad[fi]:
        return 0.5, None, [Evidence("no NaN yet: it appears as soon as a gradient element is 0 "
                                    "(0/0) or below 2.4e-4 (its square flushes to 0, m/0 = inf)",
                                    "not_yet", None)]
    s = f.steps
    prev_ok = fi > 0 and np.isfinite(s["loss"][fi - 1]) and np.isfinite(
        s["grad_norm"][fi - 1]) and not f.skipped[fi - 1]
    culprit = _snapshot_at(f, f.failure_step)
    poisoned = list(culprit["detail"].get("weights_nonfinite") or []) if culprit else []
    weights_bad = culprit is not None and (culprit["fp32_finite"] == 0 or bool(poisoned))
    module = culprit["module"] if culprit else None
    ev = []
    if prev_ok:
        ev.append(Evidence(f"step {f.step_at(fi - 1)} had a finite loss "
                           f"({_fmt(float(s['loss'][fi - 1]))}) and finite gradients (norm "
                           f"{_fmt(float(s['grad_norm'][fi - 1]))}); after its optimizer step, "
                           f"step {f.step_at(fi)}'s loss is NaN", "first_nan_after_step",
                           float(f.step_at(fi)), f.step_at(fi)))
    if weights_bad:
        which = f" ({', '.join(poisoned[:4])})" if poisoned else ""
        ev.append(Evidence(f"replay of step {culprit['step']}: the weights of {module} are "
                           f"non-finite{which} while its inputs are finite", "weights_nonfinite",
                           None, culprit["step"], module))
    if culprit is not None and culprit["fp32_finite"] == 1 and not poisoned:
        conf = 0.0  # the culprit's weights are finite: an op overflowed, not the update
    elif weights_bad:
        conf = 0.9 if prev_ok else 0.8
    elif prev_ok:
        conf = 0.75 if fi <= 3 else 0.55  # the first updates are the ones eps breaks
    else:
        conf = 0.0
    where = _first_bad(f.step_at(fi - 1) if prev_ok else f.step_at(fi), module, "optimizer")
    return conf, where, ev


def rule_adam_eps(f: Facts) -> Optional[Finding]:
    """C4: fp16 parameters/state with an eps that rounds to 0: NaN/inf made by the update."""
    cfg = _adam_eps_config(f)
    if cfg is None:
        return None
    conf, where, confirm = _adam_eps_confirmed(f)
    ev = [Evidence(f"{cfg['class']}(eps={cfg['eps']:g}) updates fp16 "
                   f"{'parameters' if cfg['fp16_params'] else 'optimizer state'}: eps is 0.0 "
                   "in fp16", "eps", cfg["eps"])] + confirm
    # A failure the update did not cause: the risk is still worth a line beside the real cause.
    priority = PRIORITY["adam_eps"] if conf else PRIORITY["risk"]
    return Finding("adam_eps", conf or 0.4, f"{cfg['class']} runs on fp16 weights with eps="
                   f"{cfg['eps']:g}, which is 0 in fp16: wherever the gradient is 0 or tiny the "
                   "update divides by zero, and the weights become NaN/inf inside "
                   "optimizer.step() although every gradient is finite.", ev,
                   fixes.make(["adam_eps", "fp32_master_weights"], context(
                       f, where["module"] if where else None, step=where and where["step"])),
                   where if conf else None, priority=priority)


def _calibration_artefact(f: Facts, snap: dict) -> bool:
    """A replay of a skip that GradScaler's calibration or probing explains, with a finite loss:
    whichever phase overflowed at that scale (an fp16 loss always does at 65536), it is
    healthy."""
    if not f.n or snap["detail"].get("loss_nonfinite"):
        return False
    i = f.index_of(snap["step"])
    return f.step_at(i) == snap["step"] and bool(f.story.benign_mask[i])


def _loss_backward_only(snap: dict) -> bool:
    """A loss replay whose loss is finite, and whose loss scale fits the loss's dtype, but whose
    backward sent NaN/inf into the model's output: the loss's derivative, not its value."""
    d = snap["detail"]
    return bool(d.get("output_grad_nonfinite")) and not d.get("loss_nonfinite") and \
        not (d.get("loss") or {}).get("grad_nonfinite")


def _loss_snapshot_text(snap: dict) -> str:
    """What a loss replay saw, from its detail (never more than it saw)."""
    d = snap["detail"]
    loss = d.get("loss") or {}
    dtype = loss.get("dtype", "?")
    head = f"replay of step {snap['step']}: every module output is finite"
    if d.get("loss_nonfinite"):
        return f"{head}; the loss ({dtype}) is not"
    if loss.get("grad_nonfinite"):
        return (f"{head} and so is the loss ({_fmt(loss.get('value'))}, {dtype}), but the loss "
                f"scale {_fmt(loss.get('grad_fp32'))} does not fit the {dtype} loss: the "
                f"gradient reaching it is {_fmt(loss.get('grad_fp32'))} cast to {dtype} = inf")
    text = (f"{head} and so is the loss ({_fmt(loss.get('value'))}, {dtype}), but the gradient "
            "the loss's backward sends into the model's output is not")
    grad = d.get("output_grad") or {}
    if grad.get("numel"):
        text += (f" ({grad['nonfinite']} of {grad['numel']} elements NaN/inf, the largest "
                 f"finite one {_fmt(grad.get('finite_absmax'))})")
    values = grad.get("output_values")
    if values:
        shown = " or ".join(_fmt(v) for v in values)
        saturated = all(v in (0.0, 1.0) for v in values)
        text += (f"; the model's output is exactly {shown} there (saturated in fp16)"
                 if saturated else f"; the model's output there is {shown}")
    return text


def rule_fp16_loss(f: Facts) -> Optional[Finding]:
    """C7b: the loss is computed in fp16 and is non-finite while the model's values are not."""
    if not f.n:
        return None
    s = f.steps
    seen = s["loss_dtype"] != DType.UNKNOWN
    if not seen.any() or np.mean(s["loss_dtype"][seen] == DType.FLOAT16) < 0.5:
        return None
    alone = f.loss_bad & np.isfinite(s["grad_norm"]) & ~f.skipped
    # A calibration skip is healthy; an infinite derivative is rule_loss_backward's.
    loss_snaps = [x for x in f.snapshots if x["phase"] == "loss"
                  and not _calibration_artefact(f, x) and not _loss_backward_only(x)]
    if not alone.any() and not loss_snaps:
        return None
    ev = [Evidence(f"the loss is float16 on {int(seen.sum())} of {f.n} steps: computed outside "
                   "autocast (or by a .half() model)", "loss_dtype_fp16", float(seen.sum()))]
    first = f.first(f.loss_bad)
    if alone.any():
        i = int(np.flatnonzero(alone)[0])
        ev.append(Evidence(f"{int(alone.sum())} applied steps have a non-finite loss with finite "
                           f"gradients (first step {f.step_at(i)}, "
                           f"loss {_fmt(float(s['loss'][i]))}, "
                           f"grad norm {_fmt(float(s['grad_norm'][i]))})", "loss_alone_steps",
                           float(alone.sum()), f.step_at(i)))
    if loss_snaps:
        x = loss_snaps[0]
        first = x["step"] if first is None else first
        ev.append(Evidence(_loss_snapshot_text(x), "replay_loss_phase", None, x["step"]))
    return Finding("fp16_loss", 0.9 if alone.any() else 0.75, "The loss is computed in fp16 and "
                   "overflows (a sum or reduction past 65504) although the model's outputs and "
                   "gradients are finite.", ev,
                   fixes.make(["loss_in_fp32"], context(f, step=first)),
                   _first_bad(first, None, "loss"), priority=PRIORITY["fp16_loss"])


def _root_grad_output(f: Facts) -> Optional[dict]:
    """The sampled tier's first non-finite gradient, when it is the one arriving at the model's
    own output (it came from the loss's backward) and no module output was non-finite."""
    st = f.stats
    x = st.first_backward
    if not x or x["module"] not in f.root_names or x["step"] < f.failure_step:
        return None
    return x if not (st.first_forward and st.first_forward["step"] <= x["step"]) else None


def _skipping_text(f: Facts) -> Evidence:
    story, fi = f.story, f.failure_index
    skipped = int(f.skipped[fi:].sum())
    finite = not f.loss_bad[fi:].any()
    return Evidence(f"the skipping began at step {f.failure_step} and went on ({skipped} of "
                    f"{f.n - fi} steps skipped) while the scale fell from "
                    f"{_fmt(story.calibrated_scale)} to {_fmt(story.final_scale)}"
                    + (", every loss finite" if finite else "")
                    + ": no scale fits, the loss's derivative is infinite at these values "
                    "(a probability rounded to 1.0 or 0.0 in fp16 under BCELoss, a power "
                    "below 1, a log or a division at 0)", "loss_backward_skips",
                    float(skipped), f.failure_step)


def rule_loss_backward(f: Facts) -> Optional[Finding]:
    """C7b (backward): the loss and the model are finite, but the loss's backward sends inf into
    the model's output at any scale (BCELoss on an fp16 sigmoid saturated to 1.0, sqrt or log
    at 0): GradScaler skips step after step while every loss is finite."""
    if f.failure_index is None or not f.story.collapsed:
        return None  # one overflow at a high scale is calibration (taxonomy C0)
    snaps = [x for x in f.snapshots if x["phase"] == "loss" and x["step"] >= f.failure_step
             and _loss_backward_only(x) and not _calibration_artefact(f, x)]
    sampled = None if snaps else _root_grad_output(f)
    if not snaps and sampled is None:
        return None
    if any(x["phase"] in ("forward", "backward", "input") and x["step"] >= f.failure_step
           and x["step"] < (snaps[0]["step"] if snaps else sampled["step"]) for x in f.snapshots):
        return None  # a module failed first
    if snaps:
        ev = [Evidence(_loss_snapshot_text(snaps[0]), "replay_loss_backward", None,
                       snaps[0]["step"])]
    else:
        ev = [Evidence(f"sampled step {sampled['step']}: the first non-finite value is the "
                       f"gradient arriving at the model's output ({sampled['module']}), from the "
                       "loss's backward; every module output is finite",
                       "sampled_loss_backward", None, sampled["step"], sampled["module"])]
    ev.append(_skipping_text(f))
    first = f.failure_step
    return Finding("fp16_loss", 0.85 if snaps else 0.7, "The loss's backward overflows: the "
                   "model's outputs and the loss are finite, but the loss's derivative is "
                   "infinite where fp16 rounded the model's output to a value the loss is "
                   "singular at (a sigmoid saturated to 1.0 under BCELoss, a sqrt or log at 0). "
                   "No loss scale fixes it: GradScaler skips step after step.", ev,
                   fixes.make(["loss_on_logits", "loss_in_fp32"], context(f, step=first)),
                   _first_bad(first, None, "loss"), priority=PRIORITY["fp16_loss"],
                   kind="loss_backward")


# -- the culprit of a forward/backward failure -----------------------------------------------


def _snapshot_at(f: Facts, step: Optional[int]) -> Optional[dict]:
    """The replay that best describes the failure at ``step``: the first located one at or
    after it (replays land on failing steps), else the last located one before it."""
    located = [s for s in f.snapshots if s["phase"] in ("forward", "backward")
               and not _scale_explains(s)]
    if not located:
        return None
    if step is None:
        return located[0]
    later = [s for s in located if s["step"] >= step]
    return later[0] if later else located[-1]


def _weight_growth(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    st = f.stats
    full = idx[st.wcount[idx] == st.wcount[idx].max()] if len(idx) else idx
    if len(full) < 2:
        return None
    w0, w1 = math.sqrt(st.wnorm2[full[0]]), math.sqrt(st.wnorm2[full[-1]])
    if not (w0 > 0 and w1 / w0 >= WEIGHT_GROWTH):
        return None
    return Evidence(f"the weight norm grew {w1 / w0:.1f}x, from {_fmt(w0)} at step "
                    f"{f.step_at(full[0])} to {_fmt(w1)} at step {f.step_at(full[-1])}",
                    "weight_norm_growth", w1 / w0, f.step_at(full[-1]))


def _update_size(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    upd = f.stats.upd_log[idx] if len(idx) else np.zeros(0)
    upd = upd[np.isfinite(upd)]
    # Two samples at least: the very first updates are large for every optimizer.
    if len(upd) < 2 or np.median(upd) < math.log10(UPDATE_TOO_LARGE):
        return None
    ratio = 10 ** float(np.median(upd))
    return Evidence(f"update ratio |dW|/|W| ~{_fmt(ratio)} per step (median of {len(upd)} "
                    f"samples; above {UPDATE_TOO_LARGE:g} is too large)", "update_ratio", ratio)


def _activation_growth(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    act = f.stats.out_absmax[idx] if len(idx) else np.zeros(0)
    ok = np.isfinite(act)
    if ok.sum() < 2:
        return None
    a_idx, act = idx[ok], act[ok]
    a0, a1 = float(act[0]), float(np.max(act[-max(1, len(act) // 3):]))
    if not (a0 > 0 and a1 / a0 >= ACTIVATION_GROWTH):
        return None
    return Evidence(f"the largest activation grew {a1 / a0:.0f}x, from {_fmt(a0)} at step "
                    f"{f.step_at(a_idx[0])} to {_fmt(a1)} by step {f.step_at(a_idx[-1])}",
                    "activation_growth", a1 / a0, f.step_at(a_idx[-1]))


def _loss_spike(f: Facts, hi: int) -> Optional[Evidence]:
    loss = f.steps["loss"][:hi + 1].astype(float)
    fin = np.flatnonzero(np.isfinite(loss))
    if len(fin) < 6:
        return None
    early = np.median(loss[fin[: len(fin) // 2]])
    recent = fin[-3:]
    peak = int(recent[np.argmax(loss[recent])])
    if not (early > 0 and loss[peak] >= LOSS_SPIKE * early):
        return None
    return Evidence(f"the loss rose to {_fmt(float(loss[peak]))} at step {f.step_at(peak)}, "
                    f"{loss[peak] / early:.0f}x its earlier median {_fmt(float(early))}",
                    "loss_spike", float(loss[peak] / early), f.step_at(peak))


def _grad_growth(f: Facts, hi: int) -> Optional[Evidence]:
    gn = f.steps["grad_norm"][:hi].astype(float)
    fin = np.flatnonzero(np.isfinite(gn) & (gn > 0))
    if len(fin) < 5:  # an early failure still shows its ramp (first vs last of five)
        return None
    tenth = max(1, len(fin) // 10)
    g0, g1 = np.median(gn[fin[:tenth]]), np.median(gn[fin[-tenth:]])
    if not (g0 > 0 and g1 / g0 >= GRAD_GROWTH):
        return None
    return Evidence(f"the gradient norm grew {g1 / g0:.0f}x before the failure "
                    f"({_fmt(float(g0))} -> {_fmt(float(g1))})", "grad_norm_growth",
                    float(g1 / g0))


def _short_ramp(f: Facts, hi: int) -> list[Evidence]:
    """A failure within the first few steps, too early for the loss-spike and gradient-ramp
    checks (6 and 5 finite steps), still shows C2 when the loss and the gradient norm both
    grew LOSS_SPIKE² and GRAD_GROWTH² (100x) over the finite steps before it: two signals."""
    loss = f.steps["loss"][:hi + 1].astype(float)
    gn = f.steps["grad_norm"][:hi].astype(float)
    lf = np.flatnonzero(np.isfinite(loss) & (loss > 0))
    gf = np.flatnonzero(np.isfinite(gn) & (gn > 0))
    if not (3 <= len(lf) < 6 and 3 <= len(gf) < 5):
        return []  # too few points to call anything, or the usual checks judge
    l0, g0 = float(loss[lf[0]]), float(gn[gf[0]])
    li, gi = lf[-2:][np.argmax(loss[lf[-2:]])], gf[-2:][np.argmax(gn[gf[-2:]])]
    l1, g1 = float(loss[li]), float(gn[gi])
    if l1 / l0 < LOSS_SPIKE ** 2 or g1 / g0 < GRAD_GROWTH ** 2:
        return []
    return [Evidence(f"the loss rose from {_fmt(l0)} at step {f.step_at(int(lf[0]))} to "
                     f"{_fmt(l1)} at step {f.step_at(int(li))} ({l1 / l0:.2g}x in "
                     f"{int(li - lf[0])} steps)", "loss_spike", l1 / l0, f.step_at(int(li))),
            Evidence(f"the gradient norm grew {g1 / g0:.2g}x in {int(gi - gf[0])} steps "
                     f"({_fmt(g0)} -> {_fmt(g1)})", "grad_norm_growth", g1 / g0,
                     f.step_at(int(gi)))]


def _weights_replaced(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    upd = f.stats.upd_log[idx] if len(idx) else np.zeros(0)
    big = np.flatnonzero(np.isfinite(upd) & (upd >= math.log10(REPLACED)))
    if not len(big):
        return None
    log, step = float(upd[big[0]]), f.step_at(int(idx[big[0]]))
    size = "10x or more" if log >= 1.0 else f"{10 ** log:.2g}x"  # (ratios are kept up to 10)
    return Evidence(f"the optimizer step at step {step} changed the weights by {size} their "
                    "norm (|dW|/|W|, sampled): the weights were not steady", "weights_replaced",
                    10 ** log, step)


def _lr_rise(f: Facts, hi: int) -> Optional[Evidence]:
    lr = f.steps["lr"][:hi + 1].astype(float)
    fin = np.flatnonzero(np.isfinite(lr) & (lr > 0))
    if len(fin) < 2 or fin[-1] != hi:
        return None
    rise = lr[hi] / lr[fin[0]]
    if rise < LR_RISE:
        return None
    return Evidence(f"the LR rose {rise:.0f}x before the failure ({_fmt(float(lr[fin[0]]))} at "
                    f"step {f.step_at(fin[0])} -> {_fmt(float(lr[hi]))} at step "
                    f"{f.step_at(hi)})", "lr_rise", float(rise), f.step_at(hi))


def growth_evidence(f: Facts) -> tuple[int, list[Evidence]]:
    """C2's signature before the failure: weights, updates, activations, gradients and the loss
    growing. Returns how many of those signals fired, and their evidence."""
    if not f.n:
        return 0, []
    hi = f.failure_index if f.failure_index is not None else f.n
    idx = np.flatnonzero(f.stats.sampled[:hi] & ~f.skipped[:hi])
    found = [e for e in (_weight_growth(f, idx), _update_size(f, idx),
                         _activation_growth(f, idx), _loss_spike(f, hi), _grad_growth(f, hi),
                         _weights_replaced(f, idx)) if e is not None]
    found += _short_ramp(f, hi)
    if found and hi < f.n:  # the LR ramp counts beside an effect, never alone
        rise = _lr_rise(f, hi)
        found += [rise] if rise is not None else []
    return len(found), found


def lr_evidence(f: Facts) -> list[Evidence]:
    """Where the failure sits on the LR schedule (C2: near the end of warmup, or at peak)."""
    fi = f.failure_index
    lr = f.steps["lr"].astype(float)
    if fi is None or not np.isfinite(lr[: fi + 1]).any():
        return []
    peak = float(np.nanmax(lr))
    at = float(lr[fi])
    reach = int(np.flatnonzero(lr >= peak * 0.999)[0])
    rising = reach > 0 and lr[0] < peak * 0.5
    text = f"the LR was {_fmt(at)} at the failure (peak {_fmt(peak)}"
    text += f", reached at step {f.step_at(reach)} after a warmup)" if rising else ")"
    return [Evidence(text, "lr_at_failure", at, f.step_at(fi))]


def mask_pattern(op: Optional[dict]) -> Optional[str]:
    """Does the first op that went non-finite look like an attention mask (C7a)? Returns the
    reason, or None.

    ``op`` is what the forensic replay recorded inside the culprit: the op's name, which kinds
    of non-finite value it created (``created``: a subset of nan/posinf/neginf) and the inputs
    it had. A mask overflows one-sidedly: a big negative constant becomes -inf (and only -inf);
    a row whose every entry is -inf then becomes NaN in softmax.
    """
    if not op:
        return None
    created = set(op.get("created") or ())
    name = str(op.get("op", ""))
    # A large operand is a mask only when one input is mask-like (one negative constant where
    # not 0): a dense residual add of two large activations making -inf is an overflow. Files
    # written before the probe recorded mask_operand keep the old reading.
    masky = op.get("mask_operand", True)
    if created == {"neginf"} and (abs(op.get("big_scalar") or 0) > schema.FP16_MAX
                                  or (masky and (op.get("in_absmax") or 0) >= schema.FP16_NEAR)):
        return (f"{name} turned a large negative constant "
                f"({_fmt(-abs(op.get('big_scalar') or op.get('in_absmax') or 0))}) into -inf "
                f"in {op.get('dtype', 'fp16')}")
    if created == {"nan"} and "softmax" in name and op.get("in_neginf") and \
            not op.get("in_posinf") and not op.get("in_nan"):
        return f"{name} of rows that are -inf everywhere (every key masked) gave NaN"
    return None


def _culprit_evidence(f: Facts, snap: dict, op: Optional[dict]) -> list[Evidence]:
    """What the replay of the failing step showed: the culprit, its first bad op, fp32."""
    module, phase = snap["module"], snap["phase"]
    passed = snap["detail"].get("passed_on_by")
    same = [s for s in f.snapshots if s["module"] == (passed or module) and s["phase"] == phase]
    if passed:
        text = (f"replay of step {snap['step']}: {module} is the first module whose output "
                f"went non-finite (-inf); {passed} then turned it into NaN")
    else:
        text = (f"replay of step {snap['step']}: the first non-finite value appears in the "
                f"{phase} of {module} ({snap['module_type']}) while its inputs are finite")
    ev = [Evidence(text + (f"; {len(same)} replays agree" if len(same) > 1 else ""),
                   "culprit", None, snap["step"], module)]
    if op:
        ev.append(Evidence(_op_text(op, module), "first_nonfinite_op", op.get("in_absmax"),
                           snap["step"], module))
    if snap["fp32_finite"] == 1:
        beyond = ", beyond fp16's 65504" if snap["fp32_absmax"] > schema.FP16_MAX else ""
        ev.append(Evidence(f"re-run in fp32, {module} is finite (output abs max "
                           f"{_fmt(snap['fp32_absmax'])}{beyond})", "fp32_absmax",
                           snap["fp32_absmax"], snap["step"], module))
    elif snap["fp32_finite"] == 0:
        ev.append(Evidence(f"re-run in fp32, {module} is still non-finite: the values reaching "
                           "it are themselves out of range", "fp32_nonfinite", None,
                           snap["step"], module))
    return ev


def _scale_explains(snap: dict) -> bool:
    """A backward overflow whose fp32 re-run is finite, beyond fp16 only by the loss scale: the
    unscaled gradient (fp32 abs max / S) fits fp16, so a lower scale fixes it, which GradScaler
    is there to find (taxonomy C0). A singularity (fp32 small, fp16 inf) is not this."""
    scale, absmax = snap["scale"], snap["fp32_absmax"]
    return snap["phase"] == "backward" and snap["fp32_finite"] == 1 and scale > 1 and \
        absmax > schema.FP16_MAX and absmax / scale <= schema.FP16_MAX


def _failure_replay(f: Facts) -> Optional[dict]:
    """The replay that locates the failure: the first forward culprit from the failure on;
    else a backward one, but only when the skipping persists (an overflow of gradients alone,
    which GradScaler answers by lowering the scale, is its calibration at work: taxonomy C0)."""
    after = [s for s in f.snapshots if s["step"] >= f.failure_step]
    forward = [s for s in after if s["phase"] == "forward"]
    if forward:
        return forward[0]
    stale = any(s["detail"].get("stale_grads") for s in f.snapshots)  # C6h explains it
    if not stale and (f.story.collapsed or f.story.terminal_run >= 3):
        backward = [s for s in after if s["phase"] == "backward" and not _scale_explains(s)]
        return backward[0] if backward else None
    return None


def chain_origin(chain: list, roots: set) -> Optional[str]:
    """The first module in a replay's propagation chain (modules whose output went
    non-finite, in execution order) that is not a container of the next one."""
    names = [c for c in chain or [] if c not in roots]
    for i, name in enumerate(names):
        if i + 1 == len(names) or not names[i + 1].startswith(name + "."):
            return name
    return None


def _producer(f: Facts, snap: dict) -> dict:
    """A culprit that only turned an incoming -inf into NaN (the replay could not follow the
    -inf back, e.g. through a residual add in the parent's own code) is not where the overflow
    happened: the first module of the propagation chain is. Returns the snapshot as seen from
    the producer (its fp32 verdict then unknown)."""
    if "turned -inf in its inputs" not in str(snap["detail"].get("how", "")):
        return snap
    origin = chain_origin(snap["detail"].get("chain"), f.root_names)
    if origin is None or origin == snap["module"]:
        return snap
    detail = dict(snap["detail"], op=None, passed_on_by=snap["module"])
    return dict(snap, module=origin, module_type=f.module_type(origin), fp32_finite=-1,
                in_absmax=math.nan, detail=detail)


def rule_culprit(f: Facts) -> Optional[Finding]:
    """C3 / C7a / C2 located by the forensic replay of the failing step."""
    if f.failure_index is None:
        return None
    snap = _failure_replay(f)
    if snap is None or input_out_of_range(f, snap) is not None:
        return None  # (a batch beyond fp16's range is bad_input's)
    snap = _producer(f, snap)
    module, phase, fp32 = snap["module"], snap["phase"], snap["fp32_finite"]
    first = min(f.failure_step, snap["step"])
    where = _first_bad(first, module, phase)
    op = snap["detail"].get("op") if isinstance(snap["detail"].get("op"), dict) else None
    ev = _culprit_evidence(f, snap, op)
    mask = mask_pattern(op) if phase == "forward" else None
    if mask:
        ev.insert(1, Evidence(mask, "mask_overflow", None, snap["step"], module))
        return Finding("mask_overflow", 0.85, f"An attention mask overflows fp16 in {module}: "
                       "a large negative constant becomes -inf and fully masked rows turn into "
                       "NaN in softmax. In fp32 the same code is fine.", ev,
                       fixes.make(["safe_mask", "fp32_island"],
                                  context(f, module, snap["module_type"], first)),
                       where, priority=PRIORITY["mask_overflow"])
    score, growth = growth_evidence(f)
    poisoned = bool(snap["detail"].get("weights_nonfinite"))  # an update made them non-finite
    replaced = any(e.key == "weights_replaced" for e in growth)
    if replaced and poisoned and snap["step"] > f.failure_step:
        where = _first_bad(f.failure_step, None, None)  # the culprit shows the poison only
    if score >= GROWTH_SIGNALS or replaced or (fp32 == 0 and score >= 1 and not poisoned):
        return _lr_finding(f, where, ev + growth, 0.8 if score >= GROWTH_SIGNALS else 0.6)
    if (fp32 == 0 or poisoned) and phase == "forward":
        return None  # out of range in fp32 too (or its weights are): not one op's overflow
    return _unstable_op(f, snap, where, ev + growth)


def _unstable_op(f: Facts, snap: dict, where: dict, ev: list[Evidence]) -> Finding:
    module = snap["module"]
    low = "bf16" if f.low_precision == "bf16" else "fp16"
    if snap["phase"] == "backward":
        text = (f"{module}'s backward produces inf/NaN from finite incoming gradients (a "
                "derivative at a singularity: log/sqrt/division near 0, or a clamp that rounds "
                "to its bound in low precision). Doing that op in fp32 avoids it.")
    elif low == "fp16":
        text = (f"One op in {module} overflows fp16 while the weights are steady: its output "
                "passes 65504 (or feeds an fp32 op that is already inf). An fp32 island around "
                "it fixes the step.")
    else:
        text = (f"One op in {module} produces inf/NaN in bf16 while the weights are steady (a "
                "singularity such as log(0) or 0/0 that bf16's 8-bit precision reaches where "
                "fp32 does not). An fp32 island around it fixes the step.")
    ids = ["fp32_island"] + (["scale_attention"] if fixes.is_attention(
        module, snap["module_type"]) else []) + ["use_bf16"]
    ctx = context(f, module, snap["module_type"], where["step"])
    op = snap["detail"].get("op")
    ctx.op = op.get("op") if isinstance(op, dict) else None
    ctx.root = module in f.root_names
    return Finding("unstable_op", 0.9 if snap["fp32_finite"] == 1 else 0.65, text, ev,
                   fixes.make(ids, ctx), where, priority=PRIORITY["unstable_op"])


def _op_text(op: dict, module: str) -> str:
    created = ", ".join({"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}.get(c, c)
                        for c in op.get("created") or ())
    text = (f"inside {module}, the first op to produce {created or 'non-finite values'} is "
            f"{op.get('op')} ({op.get('dtype', '?')}")
    if op.get("in_absmax") is not None:
        text += f", inputs up to {_fmt(float(op['in_absmax']))}"
    return text + ")"


def _lr_finding(f: Facts, where: dict, ev: list[Evidence], conf: float) -> Finding:
    ev = ev + lr_evidence(f)
    module = where.get("module") if where else None
    if f.low_precision == "fp16":
        text = ("The learning rate is too high: weights and activations grew step after step "
                "until the forward pass overflowed fp16 (it diverges in bf16/fp32 too, later). "
                "Lowering the LR, not the precision, fixes it.")
    else:
        text = ("The learning rate is too high: weights and activations grew step after step "
                "until they overflowed even "
                + ("bf16, which has fp32's range" if f.low_precision == "bf16" else "fp32")
                + ". This is divergence, not a precision problem: lower the LR.")
    return Finding("lr_overflow", conf, text, ev,
                   fixes.make(["lower_lr", "use_bf16"], context(f, module, step=where.get(
                       "step") if where else None)), where, priority=PRIORITY["lr_overflow"])


def rule_sampled_culprit(f: Facts) -> Optional[Finding]:
    """No replay of the failure: locate it from the sampled tier and the growth signals."""
    fi = f.failure_index
    if fi is None or _snapshot_at(f, f.failure_step) is not None:
        return None
    if any(s["phase"] == "input" for s in f.snapshots):
        return None
    # The first forward overflow names the module (gradients overflow first on the way there
    # but only say where the scale was too high); else the first backward one.
    # (A parameter's .grad is left out: it can hold an inf from an earlier step.)
    st = f.stats
    located = next((x for x in (st.first_forward, st.first_backward) if x and x["step"] >=
                    f.failure_step), None)
    if located is not None and located is _root_grad_output(f):
        located = None  # the gradient the loss sent in: rule_loss_backward's, not a module's
    score, growth = growth_evidence(f)
    where = _first_bad(f.failure_step, located["module"] if located else None,
                       located["phase"] if located else None)
    ev = []
    if located:
        ev.append(Evidence(f"sampled step {located['step']}: the first non-finite "
                           f"{located['phase']} value is in {located['module']}",
                           "sampled_first_nonfinite", None, located["step"],
                           located["module"]))
    if score >= GROWTH_SIGNALS:
        return _lr_finding(f, where, ev + growth, 0.75 if located else 0.65)
    if not located:
        return None
    module = located["module"]
    ev += growth
    return Finding("unstable_op", 0.5, f"{module} is the first module with non-finite values "
                   f"({located['phase']}) on a sampled step while the weights were steady; the "
                   "failing step was not replayed, so whether fp32 fixes it is not known.", ev,
                   fixes.make(["fp32_island", "use_bf16"], context(f, module, step=where["step"])),
                   where, priority=PRIORITY["sampled"])


# ---------------------------------------------------------------------------------------------
# Trends with no non-finite value: underflow and rounding


def _underflowing(f: Facts) -> tuple[np.ndarray, np.ndarray]:
    """Tensor ids of gradients with a high underflow fraction, and every measured one."""
    under = f.stats.layer_under
    measured = np.flatnonzero(np.isfinite(under) & (f.tensor_kinds == Kind.PARAM_GRAD))
    hot = measured[under[measured] >= LAYER_UNDERFLOW]
    return hot[np.argsort(-under[hot], kind="stable")], measured


def _post_calibration_scale(f: Facts) -> float:
    s = f.steps["scale"][f.story.calib_len:].astype(float)
    s = s[np.isfinite(s)]
    return float(np.median(s)) if len(s) else math.nan


def _common_module(names: list[str]) -> Optional[str]:
    parts = [module_of(n).split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or None


def _underflow_evidence(f: Facts, hot: np.ndarray, measured: np.ndarray) -> list[Evidence]:
    st, names = f.stats, f.tensor_names
    under, zeros = st.layer_under, st.layer_zeros
    band, tiny = ("bf16", "1.2e-38") if f.low_precision == "bf16" else ("fp16", "6.1e-5")
    scaled = " once multiplied by the loss scale" if f.has_scaler else ""

    def layer(t: int) -> str:
        z = f", {zeros[t]:.0%} exactly zero" if zeros[t] >= 0.01 else ""
        return f"{names[t]}: {under[t]:.0%} of its non-zero gradient subnormal{z}"

    ev = [Evidence(f"{len(hot)} of {len(measured)} parameter gradients sit in {band}'s "
                   f"subnormal band (below {tiny}{scaled}), where they keep a few significant "
                   "bits and the smallest flush to 0", "layers_underflowing", float(len(hot)),
                   None, module_of(names[hot[0]]))]
    for t in hot[:4]:
        ev.append(Evidence(layer(t), "layer_underflow", float(under[t]), None,
                           module_of(names[t])))
    n = st.grad_n[: f.failure_index].sum() if f.failure_index is not None else st.grad_n.sum()
    u = st.grad_under[: f.failure_index].sum() if f.failure_index is not None else \
        st.grad_under.sum()
    if n:
        ev.append(Evidence(f"{u / n:.0%} of all sampled gradient elements are subnormal or "
                           "flushed to zero", "grad_underflow_fraction", float(u / n)))
    return ev


def _first_underflow_step(f: Facts) -> Optional[int]:
    st = f.stats
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(st.grad_n > 0, st.grad_under / np.maximum(st.grad_n, 1), np.nan)
    idx = np.flatnonzero(frac >= LAYER_HEALTHY)
    if len(idx):
        return f.step_at(int(idx[0]))
    idx = np.flatnonzero(st.sampled)
    return f.step_at(int(idx[0])) if len(idx) else None


def _scaling_evidence(f: Facts, scale: float) -> Evidence:
    """Why fp16 gradients get no help: the scaler is missing, or its scale is low."""
    if f.has_scaler:
        return Evidence(f"the loss scale sat at {_fmt(scale)} (median after calibration; "
                        f"{LOW_SCALE:g} or less cannot lift small fp16 gradients)",
                        "median_scale", scale)
    if f.autocast_dtype == "float16":
        return Evidence("fp16 autocast runs without a GradScaler: gradients below 6e-8 flush to "
                        "zero, below 6.1e-5 lose precision", "no_scaler", None)
    return Evidence("the parameters are fp16 and no GradScaler is used", "no_scaler", None)


def _underflow_fixes(f: Facts) -> list[str]:
    if f.params_mostly("float16"):  # GradScaler refuses fp16 weights: master weights first
        return ["fp32_master_weights", "use_bf16"]
    return ["raise_init_scale", "use_bf16"] if f.has_scaler else ["add_grad_scaler", "use_bf16"]


def rule_grad_underflow(f: Facts) -> Optional[Finding]:
    """C1: fp16 gradients flush to zero: no scaler, or a scale stuck low."""
    if not f.n or f.low_precision != "fp16":
        return None
    scale = _post_calibration_scale(f)
    if f.has_scaler and not scale <= LOW_SCALE:
        return None
    hot, measured = _underflowing(f)
    ev = [_scaling_evidence(f, scale)]
    if len(hot):
        ev += _underflow_evidence(f, hot, measured)
        module = _common_module([f.tensor_names[t] for t in hot]) or \
            module_of(f.tensor_names[hot[0]])
        conf = 0.85 if f.sampled_steps >= 2 else 0.7
        step = _first_underflow_step(f)
    elif len(measured) or f.failure_index is not None:
        # measured and nothing underflows (a note says the risk), or something else failed
        # and an unmeasured risk explains nothing
        return None
    else:
        module, conf, step = None, 0.4, None
        ev.append(Evidence("no sampled step measured the gradients, so the underflow itself "
                           "was not seen", "not_measured", None))
    how = "no loss scaling" if not f.has_scaler else f"a loss scale of {_fmt(scale)}"
    return Finding("grad_underflow", conf, f"fp16 gradients underflow: with {how}, small "
                   "gradients fall below fp16's smallest values and flush to zero or lose their "
                   "precision, so those weights stop learning (no NaN, no error).", ev,
                   fixes.make(_underflow_fixes(f), context(f, module, step=step)),
                   _first_bad(step, module, "backward"), root=not f.story.collapsed,
                   priority=PRIORITY["grad_underflow"])


def rule_masked_underflow(f: Facts) -> Optional[Finding]:
    """C8a: the scale looks healthy but some layers' gradients flush anyway."""
    if not f.n or f.low_precision != "fp16" or not f.has_scaler or f.story.collapsed:
        return None
    scale = _post_calibration_scale(f)
    if not scale >= HEALTHY_SCALE:
        return None
    hot, measured = _underflowing(f)
    if not len(hot):
        return None
    under = f.stats.layer_under
    healthy = measured[under[measured] < LAYER_HEALTHY]
    if not len(healthy):
        return None  # nothing trains normally: that is not a per-layer mismatch
    names = f.tensor_names
    module = _common_module([names[t] for t in hot]) or module_of(names[hot[0]])
    ev = [Evidence(f"the loss scale is healthy ({_fmt(scale)}, median after calibration) and "
                   f"{len(healthy)} of {len(measured)} gradients are in range",
                   "median_scale", scale)]
    ev += _underflow_evidence(f, hot, measured)
    step = _first_underflow_step(f)
    rms = f.stats.layer_grad_rms
    small, rest = rms[hot], rms[healthy]
    small, rest = small[np.isfinite(small)], rest[np.isfinite(rest)]
    ratio = float(np.median(rest) / np.median(small)) if len(small) and len(rest) and \
        np.median(small) > 0 else None
    if ratio:
        ev.append(Evidence(f"their gradients are ~{ratio:.0e} times smaller (rms) than the "
                           "others'", "grad_rms_ratio", ratio, None, module))
    ctx = context(f, module, step=step)
    ctx.ratio = ratio
    conf = 0.8 if f.sampled_steps >= 2 else 0.6
    return Finding("masked_underflow", conf, f"The gradients of {module} are far smaller than "
                   "the rest of the model's: one loss scale serves every layer and is set by "
                   "the largest gradients, so even at a healthy scale these flush to zero or "
                   "sit in fp16's subnormal band, and that part of the model hardly learns.", ev,
                   fixes.make(["use_bf16", "rebalance_losses"], ctx),
                   _first_bad(step, module, "backward"), priority=PRIORITY["masked_underflow"])


def rule_bf16_precision(f: Facts) -> Optional[Finding]:
    """C9a: bf16 weights updated in place; updates below ~0.4 % of a weight round away."""
    if not f.n or not f.params_mostly("bfloat16"):
        return None
    st = f.stats
    lay = st.layer_unchanged
    measured = np.flatnonzero(np.isfinite(lay) & (f.tensor_kinds == Kind.PARAM))
    if not len(measured):
        return None
    hot = measured[lay[measured] >= UNCHANGED_HIGH]
    share = len(hot) / len(measured)
    if share < 0.5:
        return None
    names = f.tensor_names
    hot = hot[np.argsort(-lay[hot], kind="stable")]
    module = None if share >= 0.8 else (_common_module([names[t] for t in hot])
                                         or module_of(names[hot[0]]))
    upd = st.layer_update[hot]
    upd = upd[np.isfinite(upd)]
    ev = [Evidence(f"{len(hot)} of {len(measured)} parameters: {np.mean(lay[hot]):.0%} of their "
                   "sampled elements unchanged by the step although their gradient was not 0",
                   "unchanged_fraction", float(np.mean(lay[hot])), None, module)]
    if len(upd):
        ev.append(Evidence(f"update ratio |dW|/|W| ~{_fmt(10 ** float(np.median(upd)))}, below "
                           "bf16's resolution (2**-8 = 0.4 % of a weight)", "update_ratio",
                           10 ** float(np.median(upd))))
    ev.append(Evidence(f"the optimizer updates bf16 weights directly "
                       f"({f.param_dtypes.get('bfloat16', 0)} bf16 elements, no fp32 master copy)",
                       "bf16_params", float(f.param_dtypes.get("bfloat16", 0))))
    idx = np.flatnonzero(st.sampled & (st.unchanged >= UNCHANGED_HIGH))
    step = f.step_at(int(idx[0])) if len(idx) else None
    return Finding("bf16_precision", 0.85 if f.sampled_steps >= 2 else 0.7,
                   "The weights are bf16 and the optimizer writes into them: bf16 keeps 8 "
                   "significant bits, so an update smaller than ~0.4 % of a weight rounds back "
                   "to the same weight. Most steps change nothing; the loss stalls without any "
                   "NaN.", ev, fixes.make(["fp32_master_weights"], context(f, module, step=step)),
                   _first_bad(step, module, "optimizer"), priority=PRIORITY["bf16_precision"])


# ---------------------------------------------------------------------------------------------
# Consequences and fallbacks


def rule_scale_collapse(f: Facts) -> Optional[Finding]:
    """The scale fell and kept falling (a consequence; the root when nothing else is known)."""
    story = f.story
    if not f.n or not story.collapsed:
        return None
    s = f.steps
    skipped = int(f.skipped.sum())
    ev = [Evidence(f"the loss scale fell from {_fmt(story.init_scale)} to "
                   f"{_fmt(story.final_scale)}; {skipped} of {f.n} steps were skipped"
                   + (f", the last {story.terminal_run} in a row" if story.terminal_run else ""),
                   "scale_fall", story.final_scale, int(s["step"][-1]))]
    first = f.failure_step
    return Finding("scale_collapse", 0.5, "GradScaler kept finding inf/NaN and halved its scale "
                   "again and again: every one of those steps was thrown away.", ev,
                   fixes.make(["use_bf16"], context(f, step=first)),
                   _first_bad(first, None, None), root=False)


def rule_nonfinite(f: Facts) -> Optional[Finding]:
    """Non-finite values that no rule explains (an honest fallback, low confidence)."""
    fi = f.failure_index
    # A non-finite loss, or non-finite gradients with no scaler to skip them; gradient
    # overflows that GradScaler skipped are its job (scale_collapse judges when they persist).
    if fi is None or not (f.loss_bad.any() or (not f.has_scaler and f.grad_bad.any())):
        return None
    if f.story.collapsed:
        return None  # scale_collapse speaks for it
    snap = _snapshot_at(f, f.failure_step)
    loc = None
    ev = [Evidence(f"first non-finite loss or gradient at step {f.failure_step}",
                   "first_bad_step", float(f.failure_step), f.failure_step)]
    if snap:
        loc = _first_bad(f.failure_step, snap["module"], snap["phase"])
        text = (f"replay of step {snap['step']}: first non-finite in the {snap['phase']} of "
                f"{snap['module']}")
        if snap["fp32_finite"] == 0:
            text += ", non-finite in fp32 too (its inputs or weights are out of range)"
        ev.append(Evidence(text, "culprit", None, snap["step"], snap["module"]))
    elif f.stats.first_nonfinite:
        x = f.stats.first_nonfinite
        loc = _first_bad(f.failure_step, x["module"], x["phase"])
        ev.append(Evidence(f"sampled step {x['step']}: first non-finite {x['phase']} value in "
                           f"{x['module']}", "sampled_first_nonfinite", None, x["step"],
                           x["module"]))
    loss_only = [s for s in f.snapshots if s["phase"] == "loss"]
    if loss_only:
        ev.append(Evidence(f"replay of step {loss_only[0]['step']}: the model's outputs are "
                           "finite; the loss computation (or the targets) is not",
                           "replay_loss_phase", None, loss_only[0]["step"]))
        loc = loc or _first_bad(f.failure_step, None, "loss")
    return Finding("nonfinite", 0.3, "Non-finite values appeared and no failure class fits the "
                   "evidence recorded (see the notes for what could not be checked).", ev,
                   fixes.make(["check_data"], context(f, step=f.failure_step)),
                   loc or _first_bad(f.failure_step, None, None), priority=PRIORITY["nonfinite"])


RULES = [
    rule_no_training,
    rule_exception,
    rule_clip_before_unscale,
    rule_scaler_bypass,
    rule_scaler_recreated,
    rule_stale_grads,
    rule_unscale_twice,
    rule_state_poisoning,
    rule_adam_eps,
    rule_accum_overflow,
    rule_bad_input,
    rule_fp16_loss,
    rule_loss_backward,
    rule_culprit,
    rule_sampled_culprit,
    rule_grad_underflow,
    rule_masked_underflow,
    rule_bf16_precision,
    rule_scale_collapse,
    rule_nonfinite,
]
