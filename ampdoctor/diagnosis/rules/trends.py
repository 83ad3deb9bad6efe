"""Trends with no non-finite value: fp16 gradients that flush to zero (``grad_underflow``,
taxonomy C1; ``masked_underflow``, C8a: a healthy scale that still leaves some layers in the
subnormal band) and bf16 or fp16 weights whose updates round away (``lost_updates``, C9a;
``bf16_precision`` is its old id, still understood: ``verdict.canonical``). They read the
sampled tier's per-layer reductions (``Facts.reduced``).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import fmt
from ...runfile.meta import OptimizerInfo
from ...runfile.schema import DType, Kind
from .. import fixes
from ..curve import median
from ..facts import Facts, module_of
from ..thresholds import LAYER_UNDERFLOW, LOW_SCALE, UNCHANGED_HIGH
from ..verdict import FAILED, HELD, NOT_MEASURED, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("grad_norm", "lr", "scale"),
         "stats": ("always_zero", "grad_n", "grad_rows", "grad_under", "last_step",
                   "layer_grad_rms", "layer_unchanged", "layer_under", "layer_update",
                   "layer_zeros", "moving_last", "norm_first", "norm_first_step", "norm_last",
                   "out_zero_last", "sampled", "stuck_first", "unchanged", "wcount", "wnorm2")}

# -- thresholds ------------------------------------------------------------------------------

# LAYER_UNDERFLOW, LOW_SCALE and UNCHANGED_HIGH are shared: see thresholds.py.
# A layer under 10 % is "training normally" (C8a needs other layers healthy; C1 does not).
LAYER_HEALTHY = 0.1
# C8a: the scale is healthy at >= 2**10.
HEALTHY_SCALE = 2.0 ** 10


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
    how = "no loss scaling" if not f.has_scaler else f"a loss scale of {fmt(scale)}"
    return Finding("grad_underflow", conf, f"fp16 gradients underflow: with {how}, small "
                   "gradients fall below fp16's smallest values and flush to zero or lose their "
                   "precision, so those weights stop learning (no NaN, no error).", ev,
                   fixes.make(_underflow_fixes(f), f.fix_context(module, step=step)),
                   first_bad(step, module, "backward"), root=not f.story.collapsed,
                   priority=PRIORITY["grad_underflow"])


def rule_masked_underflow(f: Facts) -> Optional[Finding]:
    """C8a: the scale looks healthy but some layers' gradients flush anyway. Premise
    (``not_converged``): the run has something left to learn; a loss that fell to a thousandth
    of its start has converged, and a converged model's gradients are small everywhere."""
    found = _masked_underflow(f)
    if found is not None:
        hot, measured = _underflowing(f)
        found.premises = [not_converged(f)] + ([share_matters(f, hot, measured)] if len(hot)
                                                else [])
    return found


# The underflowing gradients must hold at least this share of the measured parameters'
# elements for the run to hinge on them (issue 28, blind4: one 64-element attention key bias,
# whose gradient is 0 in exact arithmetic, was called masked_underflow at 0.8).
MATTERS_SHARE = 0.005


def share_matters(f: Facts, hot: np.ndarray, measured: np.ndarray) -> Premise:
    """masked_underflow's premise ``share_matters``: the parameters whose gradients underflow
    hold ``MATTERS_SHARE`` or more of the measured parameters' elements."""
    numel = f.tensor_numel.astype(float)
    total = float(numel[measured].sum())
    mine = float(numel[hot].sum())
    if total <= 0:
        return Premise("share_matters", NOT_MEASURED, "the parameters' sizes were not recorded")
    share = mine / total
    names = ", ".join(f.tensor_names[t] for t in hot[:3]) + (" ..." if len(hot) > 3 else "")
    if share < MATTERS_SHARE:
        return Premise("share_matters", FAILED, f"the gradients that underflow ({names}) are "
                       f"{int(mine)} of the {int(total)} parameter elements measured "
                       f"({share:.2%}): too few for the run to hinge on them")
    return Premise("share_matters", HELD, f"the gradients that underflow ({names}) are "
                   f"{share:.1%} of the parameter elements measured")


# A loss that ended at this share of its start (or below) has converged: what its small
# gradients fail to teach the model is nothing (issue 28: a run at 1e-5 from ~1).
CONVERGED = 1e-3


def not_converged(f: Facts) -> Premise:
    """masked_underflow's premise: the loss did not converge (``CONVERGED``)."""
    c = f.curve
    if not c.judged:
        return Premise("not_converged", NOT_MEASURED, f"the loss curve was not judged "
                       f"({c.why or 'too few finite losses'})")
    if c.end <= CONVERGED * c.start:
        return Premise("not_converged", FAILED, f"the loss fell from {fmt(c.start)} to "
                       f"{fmt(c.end)} ({c.end / c.start:.1e} of its start): the run converged, "
                       "and a converged model's gradients are small everywhere")
    return Premise("not_converged", HELD, f"the loss went from {fmt(c.start)} to {fmt(c.end)} "
                   f"({c.end / c.start:.2g} of its start)")


def _masked_underflow(f: Facts) -> Optional[Finding]:
    if not f.n or f.low_precision != "fp16" or not f.has_scaler or f.story.collapsed:
        return None
    scale = _post_calibration_scale(f)
    if not scale >= HEALTHY_SCALE:
        return None
    hot, measured = _underflowing(f)
    under = f.reduced.layer_under
    healthy = measured[under[measured] < LAYER_HEALTHY]
    if not len(healthy):
        return None  # nothing trains normally: that is not a per-layer mismatch
    if not len(hot):
        return _flushed(f, scale, len(healthy), len(measured))
    names = f.tensor_names
    module = _common_module([names[t] for t in hot]) or module_of(names[hot[0]])
    ev = [Evidence(f"the loss scale is healthy ({fmt(scale)}, median after calibration) and "
                   f"{len(healthy)} of {len(measured)} gradients are in range",
                   "median_scale", scale)]
    ev += _underflow_evidence(f, hot, measured)
    step = _first_underflow_step(f)
    rms = f.reduced.layer_grad_rms
    small, rest = rms[hot], rms[healthy]
    small, rest = small[np.isfinite(small)], rest[np.isfinite(rest)]
    ratio = float(np.median(rest) / np.median(small)) if len(small) and len(rest) and \
        np.median(small) > 0 else None
    if ratio:
        ev.append(Evidence(f"their gradients are ~{ratio:.0e} times smaller (rms) than the "
                           "others'", "grad_rms_ratio", ratio, None, module))
    ev += _stopped_evidence(f, hot)
    ctx = f.fix_context(module, step=step)
    ctx.ratio = ratio
    conf = 0.8 if f.sampled_steps >= 2 else 0.6
    return Finding("masked_underflow", conf, f"The gradients of {module} are far smaller than "
                   "the rest of the model's: one loss scale serves every layer and is set by "
                   "the largest gradients, so even at a healthy scale these flush to zero or "
                   "sit in fp16's subnormal band, and that part of the model hardly learns.", ev,
                   fixes.make(["use_bf16", "rebalance_losses"], ctx),
                   first_bad(step, module, "backward"), priority=PRIORITY["masked_underflow"])


# A layer's gradient flushed whole: exactly 0 on every one of at least this many sampled steps
# (one sample could be a zero-initialised layer after it, on its first step).
FLUSHED_SAMPLES = 2


def flushed_layers(f: Facts) -> list[tuple[str, list[int], int]]:
    """Layers whose gradient flushed whole (issue 23's seed, asked per layer): each parameter's
    gradient exactly 0 on every sampled step (``FLUSHED_SAMPLES`` or more) although a gradient
    arrives at the module (its output's gradient is recorded, in fp16) and is exactly 0 too.
    (module, its parameter-gradient tensor ids, its output-gradient id), in recorded order.

    Structural zeros are not this: a frozen layer has no gradient at all (nothing recorded), an
    embedding's unused rows and dead ReLU units sit beside non-zero values, and a layer behind
    a dead one (a module output exactly 0 everywhere) gets zeros from the forward pass."""
    st, kinds, names = f.reduced, f.tensor_kinds, f.tensor_names
    if not len(kinds) or np.any((kinds == Kind.OUTPUT) & st.out_zero_last):
        return []
    zero = st.always_zero & (st.grad_rows >= FLUSHED_SAMPLES)
    arriving = {names[t]: int(t) for t in np.flatnonzero(
        zero & (kinds == Kind.GRAD_OUTPUT) & (_recorded_dtypes(f) == DType.FLOAT16))}
    found: dict[str, tuple[int, list[int]]] = {}
    for t in np.flatnonzero(zero & (kinds == Kind.PARAM_GRAD)):
        module = module_of(names[t])
        if module in arriving:
            found.setdefault(module, (arriving[module], []))[1].append(int(t))
    return [(m, ts, g) for m, (g, ts) in found.items()]


def _recorded_dtypes(f: Facts) -> np.ndarray:
    """Each tensor id's dtype as /tensors recorded it (DType.UNKNOWN where it holds none)."""
    def build() -> np.ndarray:
        t = f.run.tensors
        out = np.zeros(len(f.tensor_kinds), np.int64)
        if len(t) and "dtype" in (t.dtype.names or ()):
            out[t["id"]] = t["dtype"]
        return out
    return f.memo("recorded_dtypes", build)


def _flushed(f: Facts, scale: float, healthy: int, measured: int) -> Optional[Finding]:
    """masked_underflow of kind "flushed": layers whose gradient is exactly 0 throughout while
    the scale is high and the rest of the model trains."""
    layers = flushed_layers(f)
    if not layers:
        return None
    names, st = f.tensor_names, f.reduced
    params = [t for _, ts, _ in layers for t in ts]
    module = _common_module([names[t] for t in params]) or layers[0][0]
    sampled = [f.step_at(int(i)) for i in np.flatnonzero(st.sampled)]
    shown = ", ".join(names[t] for t in params[:4]) + (
        f" and {len(params) - 4} more" if len(params) > 4 else "")
    outputs = ", ".join(m for m, _, _ in layers[:3])
    ev = [Evidence(f"the loss scale is healthy ({fmt(scale)}, median after calibration) and "
                   f"{healthy} of {measured} measured gradients are in range", "median_scale",
                   scale),
          Evidence(f"{shown}: the gradient is exactly 0 on every one of the "
                   f"{int(st.grad_rows[params[0]])} sampled steps ({_steps_text(sampled)}), and "
                   f"so is the gradient arriving at the output of {outputs}, recorded in fp16 at "
                   f"a loss scale of {fmt(scale)}: flushed to zero in fp16 (below its smallest "
                   "subnormal, 6e-08, even multiplied by the scale), or a loss term weighted by "
                   "exactly 0; the run cannot tell the two apart", "flushed_layers",
                   float(len(params)), sampled[0] if sampled else None, module)]
    ev += _still_evidence(f, params)
    step = sampled[0] if sampled else None
    return Finding("masked_underflow", 0.8 if f.sampled_steps >= FLUSHED_SAMPLES else 0.6,
                   f"The gradient of {module} is exactly 0 on every sampled step although a "
                   f"gradient arrives at it, while the loss scale is high ({fmt(scale)}) and the "
                   f"rest of the model trains: {module} does not learn at all. Either its "
                   "gradient flushes to zero in fp16 (what reaches it is below fp16's smallest "
                   "value even multiplied by the scale: one loss scale, set by the largest "
                   "gradients, cannot hold it) or its loss term is weighted by exactly 0; the "
                   "run cannot tell which, and bf16, whose range holds such gradients, does.",
                   ev, fixes.make(["use_bf16", "rebalance_losses"],
                                  f.fix_context(module, step=step)),
                   first_bad(step, module, "backward"), priority=PRIORITY["masked_underflow"],
                   kind="flushed")


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:6])
    return shown + (f" ... {steps[-1]}" if len(steps) > 6 else "")


def _still_evidence(f: Facts, grads: list[int]) -> list[Evidence]:
    """Whether the weights of these gradients moved: the same norm at their first and last
    sampled step (no gradient, no update), else their update ratio."""
    st, names, kinds = f.reduced, f.tensor_names, f.tensor_kinds
    params = {names[t]: int(t) for t in np.flatnonzero(kinds == Kind.PARAM)}
    out = []
    for g in grads[:2]:
        t = params.get(names[g])
        if t is None or st.norm_first_step[t] < 0:
            continue
        first, last = st.norm_first[t], st.norm_last[t]
        since, until = int(st.norm_first_step[t]), int(st.last_step[t])
        if first == last and until > since:
            out.append(Evidence(f"{names[t]} does not move: its norm is {fmt(float(first))} at "
                                f"sampled step {since} and still at step {until}",
                                "weights_stopped", 1.0, since, module_of(names[t])))
        elif np.isfinite(st.layer_update[t]):
            out.append(Evidence(f"{names[t]} moves by ~{fmt(10 ** float(st.layer_update[t]))} "
                                "of its norm per step, with no gradient (weight decay)",
                                "weights_slow", 10 ** float(st.layer_update[t]), since,
                                module_of(names[t])))
    return out


# Half an ulp, relative to a weight: an update smaller than this share of the weight rounds
# back to it (round to nearest; a weight just above a power of two has the coarsest spacing:
# 2**-7 for bf16's 8 significant bits, 2**-10 for fp16's 11, and half of that). fp32 master
# weights keep 24 bits, so the same update would be applied.
HALF_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
HALF_NAMES = {"bfloat16": ("bf16", "2**-8 = 0.4 %"), "float16": ("fp16", "2**-11 = 0.05 %")}


# A sampled step ran "at the run's LR" within this factor of its peak LR: a warm-up far below
# it (timm's first epoch at 1e-5, then 0.05) rounds away updates that the peak may apply.
NEAR_PEAK_LR = 10.0


def at_peak_lr(f: Facts) -> Premise:
    """lost_updates' premise: the updates round away at the LR the run trains at, not only in
    a warm-up far below it. Held: the sampled steps within ``NEAR_PEAK_LR`` of the peak LR
    left most elements with a gradient unchanged; failed: they applied most updates; not
    measured: every sampled step ran far below the peak."""
    st, lr = f.reduced, f.steps["lr"].astype(float)
    idx = np.flatnonzero(st.sampled & np.isfinite(st.unchanged) & np.isfinite(lr))
    if not len(idx) or not np.nanmax(lr) > 0:
        return Premise("at_peak_lr", NOT_MEASURED, "no sampled step with a recorded LR "
                       "measured the share of updates left unchanged")
    peak = float(np.nanmax(lr))
    near = idx[lr[idx] * NEAR_PEAK_LR >= peak]
    if not len(near):
        top = float(lr[idx].max())
        # (a warm-up's first step at LR 0, where nothing moves: litgpt finetune_lora's)
        below = f"{peak / top:.0f}x below" if top > 0 else "below"
        return Premise("at_peak_lr", NOT_MEASURED, f"the updates were measured at LR "
                       f"{fmt(top)} or below ({_sampled_text(f, idx)}), {below} the run's "
                       f"peak LR {fmt(peak)}: no sampled step measured them there")
    share = float(np.mean(st.unchanged[near]))
    status = HELD if share >= UNCHANGED_HIGH else FAILED
    low, high = fmt(float(lr[near].min())), fmt(float(lr[near].max()))
    at = f"at LR {low}" if low == high else f"at LR {low} to {high}"
    return Premise("at_peak_lr", status, f"{at} (the run's peak {fmt(peak)}; "
                   f"{_sampled_text(f, near)}) {share:.0%} of the sampled elements with a "
                   "gradient were left unchanged by the step"
                   + ("" if status == HELD else ": there the updates are applied"))


def _sampled_text(f: Facts, idx: np.ndarray) -> str:
    return f"sampled step{'s' if len(idx) > 1 else ''} " + _steps_text(
        [f.step_at(int(i)) for i in idx])


def rule_lost_updates(f: Facts) -> Optional[Finding]:
    """C9a: half-precision (bf16 or fp16) weights updated in place; an update smaller than
    half an ulp of its weight rounds back to it (``bf16_precision`` before fp16 joined it).
    Premise ``at_peak_lr``: they round away at the LR the run trains at."""
    dtype = next((d for d in HALF_ULP if f.params_mostly(d)), None)
    if not f.n or dtype is None:
        return None
    st = f.reduced
    lay = st.layer_unchanged
    measured = np.flatnonzero(np.isfinite(lay) & (f.tensor_kinds == Kind.PARAM))
    if not len(measured):
        return None
    hot = measured[lay[measured] >= UNCHANGED_HIGH]
    numel = f.tensor_numel
    share = float(numel[hot].sum() / max(numel[measured].sum(), 1))  # of the elements
    if share < 0.5:
        return None
    names = f.tensor_names
    hot = hot[np.argsort(-lay[hot], kind="stable")]
    module = None if share >= 0.8 else (_common_module([names[t] for t in hot])
                                         or module_of(names[hot[0]]))
    low, half = HALF_NAMES[dtype]
    ev = [Evidence(f"{len(hot)} of {len(measured)} parameters ({share:.0%} of the weights' "
                   f"elements): {np.mean(lay[hot]):.0%} of their sampled elements unchanged by "
                   "the step although their gradient was not 0 (with fp32 master weights none "
                   "would be)", "unchanged_fraction", float(np.mean(lay[hot])), None, module)]
    upd = st.layer_update[hot]
    upd = upd[np.isfinite(upd)]
    if len(upd):
        ratio = 10 ** float(np.median(upd))
        below = "below" if ratio < HALF_ULP[dtype] else "near"
        ev.append(Evidence(f"update ratio |dW|/|W| ~{fmt(ratio)}, {below} {low}'s half-ulp "
                           f"ratio ({half} of a weight): what is smaller rounds away",
                           "update_ratio", ratio))
    ev += _intended_update(f, dtype)
    ev.append(Evidence(f"the optimizer updates {low} weights directly "
                       f"({f.param_dtypes.get(dtype, 0)} {low} elements, no fp32 master copy)",
                       "half_params", float(f.param_dtypes.get(dtype, 0))))
    idx = np.flatnonzero(st.sampled & (st.unchanged >= UNCHANGED_HIGH))
    step = f.step_at(int(idx[0])) if len(idx) else None
    bits = "8" if dtype == "bfloat16" else "11"
    c = f.curve
    loss = (" and the loss does not fall" if c.judged and not c.fell else
            f" and the loss fell only to {c.end / c.start:.0%} of its start" if c.judged and
            c.end > 0.5 * c.start else "")
    peak = at_peak_lr(f)
    conf = 0.85 if f.sampled_steps >= 2 else 0.7
    lost = f"Most of each step's update is lost{loss}, without any NaN."
    if peak.status == NOT_MEASURED:
        conf -= 0.1
        ev.append(Evidence(peak.fact, "at_peak_lr", None))
        lost = (f"Most of each sampled step's update is lost{loss}, without any NaN; the "
                "sampled steps ran far below the run's peak LR, where it was not measured.")
    return Finding("lost_updates", conf,
                   f"The weights are {low} and the optimizer writes into them: {low} keeps "
                   f"{bits} significant bits, so an update smaller than half an ulp of a weight "
                   f"(~{half.split('= ')[1]} of it) rounds back to the same weight. {lost}", ev,
                   fixes.make(["fp32_master_weights"], f.fix_context(module, step=step)),
                   first_bad(step, module, "optimizer"), priority=PRIORITY["lost_updates"],
                   premises=[peak])


def _intended_update(f: Facts, dtype: str) -> list[Evidence]:
    """What fp32 master weights would have applied, where the optimizer makes it plain: plain
    SGD moves the weights by LR x gradient (over 1 - momentum, once momentum has built up)."""
    opt = f.optimizers[0] if f.optimizers else OptimizerInfo()
    if opt.name != "SGD":
        return []
    momentum = float(opt.momentum or 0.0)
    st = f.reduced
    idx = np.flatnonzero(st.sampled & (st.wcount > 0))
    gn, lr = f.steps["grad_norm"].astype(float), f.steps["lr"].astype(float)
    idx = idx[np.isfinite(gn[idx]) & np.isfinite(lr[idx]) & (st.wnorm2[idx] > 0)]
    if not len(idx) or momentum >= 1.0:
        return []
    ratio = float(np.median(lr[idx] * gn[idx] / np.sqrt(st.wnorm2[idx]))) / (1.0 - momentum)
    low, half = HALF_NAMES[dtype]
    return [Evidence(f"SGD with fp32 master weights would move them by LR x gradient "
                     f"{'/ (1 - momentum) ' if momentum else ''}~{fmt(ratio)} of their norm per "
                     f"step (median over the sampled steps), "
                     f"{'below' if ratio < HALF_ULP[dtype] else 'not far above'} {low}'s half-ulp "
                     f"ratio ({half}): in {low} weights most of those updates round away",
                     "intended_update", ratio)]


# A layer whose update ratio is this far below the rest of the model's hardly moves.
SLOW_UPDATES = 10.0


def _stopped_evidence(f: Facts, hot: np.ndarray) -> list[Evidence]:
    """When the underflowing layers' weights stopped moving (issue 23's seed: the scale high
    and steady while one layer's gradients flush and its weights stay where they are): the
    first sampled step from which each step left them unchanged, else how much less they move
    than the rest of the model."""
    st, names, kinds = f.reduced, f.tensor_names, f.tensor_kinds
    params = {names[t]: t for t in np.flatnonzero(kinds == Kind.PARAM)}
    own = [params[names[g]] for g in hot if names[g] in params]
    if not own:
        return []
    upd = st.layer_update
    rest = [t for t in params.values() if t not in own and np.isfinite(upd[t])]
    out = []
    for t in own[:2]:
        first, seen = int(st.stuck_first[t]), int(st.norm_first_step[t])
        if first >= 0:
            since = "from the first sampled step" if first == seen else \
                f"from sampled step {first} on (it moved until step {int(st.moving_last[t])})"
            out.append(Evidence(f"{names[t]} stopped moving {since}: each step left "
                                f"{st.layer_unchanged[t]:.0%} of its sampled elements unchanged "
                                "although their gradient was not 0", "weights_stopped",
                                float(st.layer_unchanged[t]), first, module_of(names[t])))
        elif rest and np.isfinite(upd[t]):
            slow = 10 ** float(np.median(upd[rest]) - upd[t])
            if slow < SLOW_UPDATES:
                continue
            out.append(Evidence(f"{names[t]} hardly moves: ~{fmt(10 ** float(upd[t]))} of its "
                                f"norm per step from sampled step {seen} to "
                                f"{int(st.last_step[t])}, {slow:.0f}x less than the rest of "
                                f"the model (~{fmt(10 ** float(np.median(upd[rest])))})",
                                "weights_slow", slow, seen, module_of(names[t])))
    return out


def _underflowing(f: Facts) -> tuple[np.ndarray, np.ndarray]:
    """Tensor ids of gradients with a high underflow fraction, and every measured one (those
    of layers computed in fp32 left out: see ``computed_in_fp32``)."""
    under = f.reduced.layer_under
    measured = np.flatnonzero(np.isfinite(under) & (f.tensor_kinds == Kind.PARAM_GRAD)
                              & ~computed_in_fp32(f))
    hot = measured[under[measured] >= LAYER_UNDERFLOW]
    return hot[np.argsort(-under[hot], kind="stable")], measured


def computed_in_fp32(f: Facts) -> np.ndarray:
    """Per tensor id: a parameter gradient of a module whose recorded output is fp32 in an
    fp16-autocast run. Such a module ran in fp32 (an fp32 island, ``record --apply
    fp32_island`` or the FP32Island of the fix; an op autocast keeps in fp32), so its gradient
    never passed through fp16: small values there are accurate fp32, not flushed ones."""
    def build() -> np.ndarray:
        out = np.zeros(len(f.tensor_kinds), bool)
        t = f.run.tensors
        if f.autocast_dtype != "float16" or not len(t) or "dtype" not in t.dtype.names:
            return out
        # (by the column, not row by row: 10^5 modules are 466 664 tensors)
        fp32 = set(t["name"][(t["kind"] == int(Kind.OUTPUT))
                             & (t["dtype"] == int(DType.FLOAT32))].tolist())
        if not fp32:
            return out
        names = f.tensor_names
        for i in np.flatnonzero(f.tensor_kinds == Kind.PARAM_GRAD).tolist():
            out[i] = module_of(names[i]) in fp32
        return out
    return f.memo("computed_in_fp32", build)


def _post_calibration_scale(f: Facts) -> float:
    """The median finite loss scale after calibration (as stored: the same median as of
    its float64 copy, ``curve.median``), once per run."""
    def find() -> float:
        s = f.steps["scale"][f.story.calib_len:]
        s = s[np.isfinite(s)]
        return median(s) if len(s) else math.nan
    return float(f.memo("post_calibration_scale", find))


def _common_module(names: list[str]) -> Optional[str]:
    parts = [module_of(n).split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or None


def _underflow_evidence(f: Facts, hot: np.ndarray, measured: np.ndarray) -> list[Evidence]:
    st, names = f.reduced, f.tensor_names
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
    st = f.reduced
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
        return Evidence(f"the loss scale sat at {fmt(scale)} (median after calibration; "
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
