"""A located overflow: one op (``unstable_op``, ``mask_overflow``; taxonomy C3, C7a) or the
learning rate growing everything until something overflowed (``lr_overflow``, C2).

``rule_culprit`` reads the forensic replay of the failing step (``diagnosis/culprit.py``), and
``rule_sampled_culprit`` the sampled tier when no replay was made; both ask the C2 growth
signals (``growth_evidence``: weights, updates, activations, gradients, the loss and the LR
growing before the failure) whether the weights were steady. Steady weights and a finite fp32
re-run: one op's overflow, fixed by an fp32 island. Growth: the LR, fixed by lowering it.

The overflow that never becomes a failure, inside a module, is ``hidden.py``'s.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import count, fmt
from ...runfile.detail import Computed, OpRecord
from ...runfile.payloads import SnapshotDetail
from .. import culprit, fixes, schedules
from ..facts import Facts
from ..verdict import FAILED, HELD, NOT_MEASURED, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("grad_norm", "loss", "lr"),
         "stats": ("first_backward", "first_forward", "out_absmax", "sampled", "upd_log", "wcount",
                   "wnorm2")}

# -- the growth signals' thresholds (taxonomy C2) ---------------------------------------------

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
# An LR this many times the one the update ratios were sampled at: they no longer measure the
# step, which is judged by the ratio scaled by the rise (timm's warm-up epoch at 1e-5, then
# the LR it was given; a linear warm-up sampled at its first step).
LR_RAISED = 1.5
# A verdict that prescribes an LR rests on the LR: the weights or their updates grew with it
# (their norm, the update ratio, a step that replaced them), the LR rose into the failure, or
# the loss blew up. Activations and gradients growing alone at a constant LR are not the LR's
# doing (a temperature schedule, the data: fixtures/forecast/attn_logits.py's growth).
LR_SIGNALS = ("weight_norm_growth", "update_ratio", "weights_replaced", "lr_rise", "loss_spike")

# ---------------------------------------------------------------------------------------------
# The rules


def rule_culprit(f: Facts) -> Optional[Finding]:
    """C3 / C7a / C2 located by the forensic replay of the failing step."""
    if f.failure_index is None:
        return None
    snap = culprit.failure_replay(f)
    if snap is None or culprit.input_out_of_range(f, snap) is not None:
        return None  # (a batch beyond fp16's range is bad_input's)
    snap = culprit.producer(f, snap)
    module, phase, fp32 = snap["module"], snap["phase"], snap["fp32_finite"]
    first = min(f.failure_step, snap["step"])
    where = first_bad(first, module, phase)
    op = culprit.op_of(snap)
    ev = culprit.evidence(f, snap, op)
    mask = culprit.mask_pattern(op) if phase == "forward" else None
    if mask:
        ev.insert(1, Evidence(mask, "mask_overflow", None, snap["step"], module))
        return _mask_finding(f, snap, where, ev, op)
    score, growth = growth_evidence(f)
    steady, moved = steadiness(f)
    # an update made them non-finite
    poisoned = bool(SnapshotDetail.from_json(snap["detail"]).weights_nonfinite)
    replaced = any(e.key == "weights_replaced" for e in growth) or moved
    if replaced and poisoned and snap["step"] > f.failure_step:
        where = first_bad(f.failure_step, None, None)  # the culprit shows the poison only
    # Decided from growth, not from where the first inf appeared (issue 28): weights that are
    # not steady are the LR's, unless the culprit shows only their poison in fp32 too.
    grew = steady.status == FAILED and not (poisoned and fp32 == 0)
    if moved or grew or ((score >= GROWTH_SIGNALS or replaced or (
            fp32 == 0 and score >= 1 and not poisoned)) and rests_on_lr(growth)):
        return _lr_finding(f, where, ev + growth, 0.8 if score >= GROWTH_SIGNALS else 0.6,
                           steady)
    if (fp32 == 0 or poisoned) and phase == "forward":
        return None  # out of range in fp32 too (or its weights are): not one op's overflow
    return _unstable_op(f, snap, where, ev + growth, steady)


def _mask_finding(f: Facts, snap: dict, where: dict, ev: list[Evidence],
                  op: Optional[OpRecord]) -> Finding:
    """mask_overflow: a mask constant turned -inf, or a softmax over rows every key of which is
    masked. Where fp32 gives NaN too, the mask (or the data that masks every key) is the cause:
    no precision fixes it, so no fp32 island is offered."""
    module, fp32 = snap["module"], snap["fp32_finite"]
    ctx = f.fix_context(module, snap["module_type"], where["step"])
    if fp32 == 0:
        return Finding("mask_overflow", 0.7, f"Rows of the attention in {module} have every key "
                       "masked and softmax makes them NaN; in fp32 it is NaN too, so not the "
                       "precision: the mask (or the data that masks every key of a row).", ev,
                       fixes.make(["safe_mask"], ctx), where,
                       priority=PRIORITY["mask_overflow"])
    made = "a large negative constant becomes -inf and fully masked rows turn into NaN in " \
        "softmax" if culprit.nonfinite_kind(op) != culprit.DOMAIN else \
        "rows whose every key is masked turn into NaN in softmax"
    fine = " In fp32 the same code is fine." if fp32 == 1 else \
        " Whether fp32 does the same was not measured."
    return Finding("mask_overflow", 0.85 if fp32 == 1 else 0.7,
                   f"An attention mask overflows fp16 in {module}: {made}.{fine}", ev,
                   fixes.make(["safe_mask", "fp32_island"], ctx), where,
                   priority=PRIORITY["mask_overflow"])


def _unstable_op(f: Facts, snap: dict, where: dict, ev: list[Evidence],
                 steady: Premise) -> Finding:
    module = snap["module"]
    low = "bf16" if f.low_precision == "bf16" else "fp16"
    while_steady = "while the weights are steady" if steady.status == HELD else \
        "(whether the weights were steady was not measured)"
    op = culprit.op_of(snap)
    kind = culprit.nonfinite_kind(op) if snap["phase"] == "forward" else None
    made = SnapshotDetail.from_json(snap["detail"]).computed
    if made is not None:  # (record/forensic/computed.py) an op between two model calls
        text = _between_text(made, low)
    elif snap["phase"] == "backward":
        text = _backward_text(module, snap, op, low)
    elif kind in (culprit.DOMAIN, culprit.OPERAND):
        what = ("makes NaN from finite inputs whose squares pass fp32's range (an overflow "
                "inside the op)" if culprit.squares_overflow(op) else
                "makes NaN from finite inputs (a domain error, no overflow)" if kind ==
                culprit.DOMAIN else "turns an inf made earlier into NaN (0 x inf or inf - inf)")
        text = (f"One op in {module}, {op.op if op else None}, {what} in {low} {while_steady}. "
                + _in_fp32(module, snap))
    elif low == "fp16":
        text = (f"One op in {module} overflows fp16 {while_steady}: its output "
                "passes 65504 (or feeds an fp32 op that is already inf). " + _in_fp32(module, snap))
    else:
        text = (f"One op in {module} produces inf/NaN in bf16 {while_steady} (a "
                "singularity such as log(0) or 0/0 that bf16's 8-bit precision reaches where "
                "fp32 does not). " + _in_fp32(module, snap))
    ids = ["fp32_island"] + (["scale_attention"] if fixes.is_attention(
        module, snap["module_type"]) else []) + ["use_bf16"]
    ctx = f.fix_context(module, snap["module_type"], where["step"])
    ctx.op = op.op if op else None
    ctx.root = f.is_the_model(module)
    if made is not None:  # no module to wrap: the island goes around the op itself
        ctx.op, ctx.root = made.op, True
        ids = ["fp32_island", "use_bf16"]
    conf = 0.9 if snap["fp32_finite"] == 1 else 0.65
    return Finding("unstable_op", conf if steady.status == HELD else min(conf, 0.7), text,
                   ev, fixes.make(ids, ctx), where, priority=PRIORITY["unstable_op"],
                   premises=[steady])


def _between_text(made: Computed, low: str) -> str:
    """unstable_op's sentence for an op that ran between two calls of the model, outside any
    module: the value it gave the next call held NaN/inf, which the batch check would
    otherwise have blamed on the data."""
    op, into = made.op, made.into
    ran = f"in {made.autocast} under autocast" if made.autocast else f"in {made.dtype}"
    if made.function:
        return (f"{op}, a custom autograd.Function called between modules (outside any "
                f"module), overflows {low}: it ran {ran}, and the value it gave {into} held "
                "NaN/inf. The data is fine. Autocast does not look inside a custom Function: "
                "its forward runs on the low-precision tensors it is given unless it is "
                "decorated with torch.amp.custom_fwd(cast_inputs=torch.float32).")
    return (f"The op {op}, called between modules (outside any module), overflows {low}: it "
            f"ran {ran}, and the value it gave {into} held NaN/inf. The data is fine. Run "
            "that op in fp32.")


def _backward_text(module: str, snap: dict, op: Optional[OpRecord], low: str) -> str:
    """What a backward culprit did, as far as the replay measured it: the op and its kind
    where the probe named it, else both ways a derivative fails, none asserted; and what fp32
    did, as the re-run found it (never "fp32 avoids it" where it was not finite there)."""
    kind = culprit.nonfinite_kind(op)
    name = op.op if op else None
    if kind == culprit.OVERFLOW:
        how = (f"{name} in its backward overflows {low}: finite inputs and a result past its "
               "largest value")
    elif kind == culprit.DOMAIN:
        how = (f"{name} in its backward makes NaN from finite inputs: a derivative at a "
               "singularity (log/sqrt/division at a value rounded to 0)")
    else:
        how = ("its backward produces inf/NaN from finite incoming gradients: a derivative "
               f"that passes {low}'s range (exp of a large argument, a product of large values) "
               "or one at a singularity (log/sqrt/division at a value rounded to 0); the "
               "replay did not name the op")
    fp32 = {1: " Re-run in fp32, the module is finite: doing it in fp32 avoids it.",
            0: " Re-run in fp32, it is non-finite too: not the precision."}.get(
        snap["fp32_finite"], " Whether fp32 avoids it was not measured.")
    return f"In {module}, {how}.{fp32}"


def _in_fp32(module: str, snap: dict) -> str:
    """What the replay measured of the module in fp32; whether an island fixes the whole step
    is the trial's to say (``engine``: ``proofs.island_outcome``)."""
    if snap["fp32_finite"] == 1:
        return f"Re-run in fp32, {module} is finite."
    return "Whether it is finite in fp32 was not measured."


def rests_on_lr(growth: list[Evidence]) -> bool:
    """Do the growth signals tie the failure to the LR (``LR_SIGNALS``)?"""
    return any(e.key in LR_SIGNALS for e in growth)


def _lr_finding(f: Facts, where: dict, ev: list[Evidence], conf: float,
                steady: Premise) -> Finding:
    if steady.status == FAILED and not any(e.key in ("weights_replaced", "update_ratio")
                                           for e in ev):
        ev = ev + [Evidence(steady.fact, "weights_not_steady")]
    ev = ev + lr_evidence(f)
    module = where.get("module") if where else None
    if where and where.get("step") is not None:
        moved = schedules.moving(f, where["step"])
        if moved != where["step"]:  # (the module was located at the LR-0 step: not there)
            where = first_bad(moved, None, None)
            module = None
    bad = where.get("step") if where else None
    ev = [x for x in (schedules.per_micro(f), schedules.negative(f, bad)) if x is not None] + ev
    if f.low_precision == "fp16":
        text = ("The learning rate is too high: weights and activations grew step after step "
                "until the forward pass overflowed fp16 (it diverges in bf16/fp32 too, later). "
                "Lowering the LR, not the precision, fixes it.")
    else:
        text = ("The learning rate is too high: weights and activations grew step after step "
                "until they overflowed even "
                + ("bf16, which has fp32's range" if f.low_precision == "bf16" else "fp32")
                + ". This is divergence, not a precision problem: lower the LR.")
    return Finding("lr_overflow", conf, text + schedules.summary(f, bad), ev,
                   fixes.make(schedules.lr_fixes(f, ["lower_lr", "use_bf16"], bad),
                              f.fix_context(module, step=where.get("step") if where else None)),
                   where, priority=PRIORITY["lr_overflow"], premises=[_grew(ev, steady)])


def _grew(ev: list[Evidence], steady: Premise) -> Premise:
    """lr_overflow's premise: the weights or their updates grew (the negation of
    ``weights_steady``), from the update ratios or the other growth signals."""
    if steady.status == FAILED:
        return Premise("weights_grew", HELD, steady.fact)
    grown = [e.text for e in ev if e.key in LR_SIGNALS + ("activation_growth",
                                                          "grad_norm_growth")]
    if grown:
        return Premise("weights_grew", HELD, "; ".join(grown[:2]))
    return Premise("weights_grew", NOT_MEASURED, steady.fact)


def weights_steady(f: Facts) -> Premise:
    """unstable_op's premise, measured by the update ratios |dW|/|W| of the sampled steps up
    to the failure (its own step included): steady while no step moved the weights by their
    own norm (``REPLACED``) and the median stays below ``UPDATE_TOO_LARGE``."""
    return steadiness(f)[0]


def steadiness(f: Facts) -> tuple[Premise, bool]:
    """``weights_steady``'s premise, and whether one step moved the weights by their norm."""
    hi = f.failure_index if f.failure_index is not None else f.n - 1
    if f.failure_index is not None and f.skipped[:hi].all():
        return Premise("weights_steady", HELD, f"step {f.step_at(hi)} failed before any "
                       "optimizer step was applied: the weights were the ones the run started "
                       "with"), False
    idx = _past_adams_first(f, np.flatnonzero(f.reduced.sampled[:hi + 1]))
    upd = f.reduced.upd_log[idx] if len(idx) else np.zeros(0)
    ok = np.isfinite(upd)
    idx, upd = idx[ok], upd[ok]
    if not len(upd):
        return Premise("weights_steady", NOT_MEASURED, "no update ratio |dW|/|W| was sampled "
                       "before the failure"), False
    top = int(np.argmax(upd))
    biggest, step = 10 ** float(upd[top]), f.step_at(int(idx[top]))
    shown = "10 or more" if upd[top] >= 1.0 else fmt(biggest)  # (ratios are kept up to 10)
    if biggest >= REPLACED:
        return Premise("weights_steady", FAILED, f"the update ratio |dW|/|W| was {shown} at "
                       f"step {step} (sampled): one step moved the weights by their own "
                       "norm"), True
    median = 10 ** float(np.median(upd))
    if len(upd) >= 2 and median >= UPDATE_TOO_LARGE:
        return Premise("weights_steady", FAILED, f"the update ratio |dW|/|W| was ~"
                       f"{fmt(median)} per step (median of {len(upd)} samples up to step "
                       f"{f.step_at(int(idx[-1]))}; above {UPDATE_TOO_LARGE:g} is too "
                       "large)"), False
    raised = _lr_raised_since(f, int(idx[-1]), hi)
    if raised is not None:  # the samples were taken at a smaller LR than the failure's
        factor, lr_then, lr_now, at = raised
        guess = biggest * factor
        fact = (f"the update ratio |dW|/|W| was at most {fmt(biggest)} at LR {fmt(lr_then)} "
                f"(sampled up to step {f.step_at(int(idx[-1]))}), but the LR rose "
                f"{fmt(factor)}x to {fmt(lr_now)} by step {f.step_at(at)}: a step's update "
                f"grows with the LR, to a ratio of about {fmt(guess)}")
        if guess >= UPDATE_TOO_LARGE:
            return Premise("weights_steady", FAILED, fact), guess >= REPLACED
        return Premise("weights_steady", HELD, fact), False
    return Premise("weights_steady", HELD, f"the update ratio |dW|/|W| was at most "
                   f"{fmt(biggest)} (step {step}) over {count(len(upd), 'sampled step')} up "
                   f"to step {f.step_at(int(idx[-1]))}"), False


def _lr_raised_since(f: Facts, last: int, hi: int) -> Optional[tuple[float, float, float, int]]:
    """(factor, the LR at the last sampled step, the highest LR after it up to the failure,
    where) when the LR rose ``LR_RAISED`` x or more in between (a warm-up): the sampled update
    ratios then describe a smaller step than the failure's, and a step's update grows with
    the LR (SGD's and Adam's alike)."""
    if not f.n or hi <= last:
        return None
    lr = f.steps["lr"].astype(float)
    then = lr[last]
    later = lr[last + 1:hi + 1]
    ok = np.isfinite(later)
    if not math.isfinite(then) or then <= 0 or not ok.any():
        return None
    top = int(np.argmax(np.where(ok, later, -np.inf)))
    now = float(later[top])
    if now < then * LR_RAISED:
        return None
    return now / then, float(then), now, last + 1 + top


def rule_sampled_culprit(f: Facts) -> Optional[Finding]:
    """No replay of the failure: locate it from the sampled tier and the growth signals."""
    fi = f.failure_index
    if fi is None or culprit.snapshot_at(f, f.failure_step) is not None:
        return None
    if any(s["phase"] == "input" for s in f.snapshots):
        return None
    if any(s["phase"] == "loss" and s["step"] == f.failure_step and
           SnapshotDetail.from_json(s["detail"]).loss_nonfinite for s in f.snapshots):
        return None  # its replay found every module finite and the loss not: not a module's
    # The first forward overflow names the module (gradients overflow first on the way there
    # but only say where the scale was too high); else the first backward one.
    # (A parameter's .grad is left out: it can hold an inf from an earlier step.)
    st = f.reduced
    located = next((x for x in (st.first_forward, st.first_backward) if x and x["step"] >=
                    f.failure_step), None)
    if located is not None and located is culprit.root_grad_output(f):
        located = None  # the gradient the loss sent in: rule_loss_backward's, not a module's
    score, growth = growth_evidence(f)
    where = first_bad(f.failure_step, located["module"] if located else None,
                       located["phase"] if located else None)
    ev = []
    if located:
        ev.append(Evidence(f"sampled step {located['step']}: the first non-finite "
                           f"{located['phase']} value is in {located['module']}",
                           "sampled_first_nonfinite", None, located["step"],
                           located["module"]))
    steady = weights_steady(f)
    if steady.status == FAILED or (score >= GROWTH_SIGNALS and rests_on_lr(growth)):
        return _lr_finding(f, where, ev + growth, 0.75 if located else 0.65, steady)
    if not located:
        return None
    module = located["module"]
    ev += growth
    while_steady = "while the weights were steady" if steady.status == HELD else \
        "(whether the weights were steady was not measured)"
    replayed = any(x["step"] == f.failure_step for x in f.snapshots)
    why = "no replay of the failing step located it" if replayed else \
        "the failing step was not replayed"
    return Finding("unstable_op", 0.5, f"{module} is the first module with non-finite values "
                   f"({located['phase']}) on a sampled step {while_steady}; {why}, so "
                   "whether fp32 fixes it is not known.", ev,
                   fixes.make(["fp32_island", "use_bf16"],
                              f.fix_context(module, step=where["step"])),
                   where, priority=PRIORITY["sampled"],
                   premises=[steady, beyond_scaling(f, located)])


def beyond_scaling(f: Facts, located: dict) -> Premise:
    """A non-finite value only in the scaled gradients, on steps GradScaler skipped with a
    finite loss, is its calibration and probing at work (taxonomy C0), as
    ``culprit.failure_replay`` reads a replay: an op's overflow only where a forward value
    went non-finite, a loss did, or the skipping persisted (the scale collapsed, or three
    steps or more skipped to the end)."""
    story = f.story
    if located["phase"] != "backward" or not f.has_scaler:
        return Premise("beyond_scaling", HELD, f"the first non-finite value is in the "
                       f"{located['phase']} of {located['module']} (sampled step "
                       f"{located['step']})")
    if f.loss_bad.any() or story.collapsed or story.terminal_run >= 3:
        what = ("a loss was non-finite" if f.loss_bad.any() else
                f"the skipping persisted ({count(int(f.skipped.sum()), 'step')} skipped, the "
                f"scale at {fmt(story.final_scale)} at the end)")
        return Premise("beyond_scaling", HELD, what)
    return Premise("beyond_scaling", FAILED, f"the non-finite values were only in the scaled "
                   f"gradients ({located['module']}, sampled step {located['step']}), on steps "
                   f"GradScaler skipped with a finite loss ({count(int(f.skipped.sum()), 'step')} "
                   f"skipped, the scale at {fmt(story.final_scale)} at the end): its "
                   "calibration and probing, not an op's overflow")


# ---------------------------------------------------------------------------------------------
# C2's growth signals before the failure


def growth_evidence(f: Facts) -> tuple[int, list[Evidence]]:
    """C2's signature before the failure: weights, updates, activations, gradients and the loss
    growing. Returns how many of those signals fired, and their evidence."""
    if not f.n:
        return 0, []
    hi = f.failure_index if f.failure_index is not None else f.n
    idx = np.flatnonzero(f.reduced.sampled[:hi] & ~f.skipped[:hi])
    found = [e for e in (_weight_growth(f, idx), _update_size(f, idx),
                         _activation_growth(f, idx), _loss_spike(f, hi), _grad_growth(f, hi),
                         _weights_replaced(f, idx)) if e is not None]
    found += _short_ramp(f, hi)
    if found and hi < f.n:  # the LR ramp counts beside an effect, never alone
        rise = _lr_rise(f, hi)
        found += [rise] if rise is not None else []
    return len(found), found


def _weight_growth(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    st = f.reduced
    full = idx[st.wcount[idx] == st.wcount[idx].max()] if len(idx) else idx
    if len(full) < 2:
        return None
    w0, w1 = math.sqrt(st.wnorm2[full[0]]), math.sqrt(st.wnorm2[full[-1]])
    if not (w0 > 0 and w1 / w0 >= WEIGHT_GROWTH):
        return None
    return Evidence(f"the weight norm grew {w1 / w0:.1f}x, from {fmt(w0)} at step "
                    f"{f.step_at(full[0])} to {fmt(w1)} at step {f.step_at(full[-1])}",
                    "weight_norm_growth", w1 / w0, f.step_at(full[-1]))


def _update_size(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    idx = _past_adams_first(f, idx)
    upd = f.reduced.upd_log[idx] if len(idx) else np.zeros(0)
    upd = upd[np.isfinite(upd)]
    # Two samples at least: the very first updates are large for every optimizer.
    if len(upd) < 2 or np.median(upd) < math.log10(UPDATE_TOO_LARGE):
        return None
    ratio = 10 ** float(np.median(upd))
    return Evidence(f"update ratio |dW|/|W| ~{fmt(ratio)} per step (median of {len(upd)} "
                    f"samples; above {UPDATE_TOO_LARGE:g} is too large)", "update_ratio", ratio)


def _past_adams_first(f: Facts, idx: np.ndarray) -> np.ndarray:
    """The sampled steps ``idx`` less the run's first applied update when an Adam-family
    optimizer (one with ``betas``) made it: bias correction makes that step's m/sqrt(v) the
    sign of the gradient, so it moves every weight by the full LR whatever the gradient, and
    its update ratio says nothing of the ratios after it (blind10's Performer: 0.021 at step 0,
    0.007 at step 49)."""
    opts = f.optimizers
    if not len(idx) or not opts or "betas" not in opts[0].hyper:
        return idx
    applied = np.flatnonzero(~f.skipped)
    return idx[idx != applied[0]] if len(applied) else idx


def _activation_growth(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    act = f.reduced.out_absmax[idx] if len(idx) else np.zeros(0)
    ok = np.isfinite(act)
    a_idx, act = idx[ok], act[ok]
    steps = [f.step_at(int(i)) for i in a_idx]
    replay = culprit.replay_out_absmax(f) if len(act) == 1 else None
    if replay is not None and replay[0] > steps[-1]:  # one sample: the replay is the second
        steps, act = steps + [replay[0]], np.append(act, replay[1])
    if len(act) < 2:
        return None
    a0, a1 = float(act[0]), float(np.max(act[-max(1, len(act) // 3):]))
    if not (a0 > 0 and a1 / a0 >= ACTIVATION_GROWTH):
        return None
    return Evidence(f"the largest activation grew {a1 / a0:.0f}x, from {fmt(a0)} at step "
                    f"{steps[0]} to {fmt(a1)} by step {steps[-1]}"
                    + (" (the replay of the failing step)" if replay else ""),
                    "activation_growth", a1 / a0, steps[-1])


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
    return Evidence(f"the loss rose to {fmt(float(loss[peak]))} at step {f.step_at(peak)}, "
                    f"{loss[peak] / early:.0f}x its earlier median {fmt(float(early))}",
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
                    f"({fmt(float(g0))} -> {fmt(float(g1))})", "grad_norm_growth",
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
    return [Evidence(f"the loss rose from {fmt(l0)} at step {f.step_at(int(lf[0]))} to "
                     f"{fmt(l1)} at step {f.step_at(int(li))} ({l1 / l0:.2g}x in "
                     f"{int(li - lf[0])} steps)", "loss_spike", l1 / l0, f.step_at(int(li))),
            Evidence(f"the gradient norm grew {g1 / g0:.2g}x in {int(gi - gf[0])} steps "
                     f"({fmt(g0)} -> {fmt(g1)})", "grad_norm_growth", g1 / g0,
                     f.step_at(int(gi)))]


def _weights_replaced(f: Facts, idx: np.ndarray) -> Optional[Evidence]:
    upd = f.reduced.upd_log[idx] if len(idx) else np.zeros(0)
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
    if lr[0] == 0 and lr[hi] > 0:  # a warm-up from LR 0 (litgpt's first step moves nothing)
        return Evidence(f"the LR rose from 0 at step {f.step_at(0)} to {fmt(float(lr[hi]))} "
                        f"at step {f.step_at(hi)}, the failure", "lr_rise", None, f.step_at(hi))
    fin = np.flatnonzero(np.isfinite(lr) & (lr > 0))
    if len(fin) < 2 or fin[-1] != hi:
        return None
    rise = lr[hi] / lr[fin[0]]
    if rise < LR_RISE:
        return None
    return Evidence(f"the LR rose {rise:.0f}x before the failure ({fmt(float(lr[fin[0]]))} at "
                    f"step {f.step_at(fin[0])} -> {fmt(float(lr[hi]))} at step "
                    f"{f.step_at(hi)})", "lr_rise", float(rise), f.step_at(hi))


def lr_evidence(f: Facts) -> list[Evidence]:
    """Where the failure sits on the LR schedule (C2: near the end of warmup, or at peak)."""
    fi = f.failure_index
    lr = f.steps["lr"].astype(float)
    if fi is None or not np.isfinite(lr[: fi + 1]).any():
        return []
    peak = float(np.nanmax(lr))
    if not peak > 0:  # no schedule to place it on (a Run built in memory: the reader refuses)
        return []
    at = float(lr[fi])
    reach = int(np.flatnonzero(lr >= peak * 0.999)[0])
    rising = reach > 0 and lr[0] < peak * 0.5
    text = f"the LR was {fmt(at)} at the failure (peak {fmt(peak)}"
    last = len(lr) - 1
    if rising and reach == last and last > 0 and lr[last] > lr[last - 1]:
        # the highest it got, not a peak: the warm-up was still rising when the run ended
        text = (f"the LR was {fmt(at)} at the failure (the highest it reached, {fmt(peak)} at "
                f"step {f.step_at(reach)}, still rising in a warm-up when the run ended)")
    else:
        text += f", reached at step {f.step_at(reach)} after a warmup)" if rising else ")"
    return [Evidence(text, "lr_at_failure", at, f.step_at(fi))]
