"""Runs that failed without a single non-finite value: the loss blew up and never came back,
or the units died and the weights stopped moving.

numpy only (no torch). Two verdicts, two failures with different fixes:

- ``diverged``: the loss jumped far above where it was (``curve.SPIKE``) and either stayed up
  to the end, or the jump killed the network's units so that it never trained again. The
  learning rate (or its warm-up) is the cause; fp32 would do the same. Fix: ``lower_lr``.
- ``dead_units``: most of the model gets exactly zero gradient on the last sampled steps (a
  ReLU layer whose every unit is off for the whole batch blocks everything before it), with
  no blow-up that explains it. Units that lived and then died were pushed off by the updates
  (fix: ``lower_lr``, then ``revive_units``); units dead from the first sample were never on
  (the initialisation: ``revive_units`` first). When a spike came first, ``dead_units`` is the
  consequence in ``diverged``'s chain. Without exact zeros, update ratios that fell >= 1000x at
  an unchanged LR while the loss stays flat (saturated units) are the same verdict.

Each finding answers the precision question (``progress.precision_answer``, beside ``facts.py``
with the dead units it reads, as the learning rules read it too): would fp32 have done the
same? It would when nothing came near the low precision's limits and the updates were applied;
a bf16/fp16 stall where updates round away is ``lost_updates``' (``trends.rule_lost_updates``),
told apart by its own signal: gradients that are *not* zero but move nothing. Exact zeros in a
gradient are the opposite signal and never count there.

What cannot be told: with no sampled step (``--every 0``, or a run shorter than the interval)
dead units are invisible, and a spike after which the loss came back to where it began is not a
failure of its own: a loss that then did not fall is ``not_learning`` (``learning.py``), one
that fell but stayed above half its start a warning on a healthy verdict
(``progress.flat_warning``, the engine's); with fewer than ``curve.MIN_STEPS`` losses the curve
is not judged at all.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import fmt
from .. import curve, fixes, schedules
from ..facts import Facts
from ..fixes.premises import SMOOTH, relu_free
from ..progress import DEAD_SHARE, Dead, dead_units, precision_answer, untroubled
from ..verdict import PRIORITY, Evidence, Finding, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("grad_norm", "loss", "lr", "step"),
         "stats": ("out_absmax", "sampled", "upd_log")}

# -- thresholds ------------------------------------------------------------------------------
# (the loss curve's own thresholds, spike and recovery, are in curve.py)

# Update ratios collapse: the median |dW|/|W| on the last sample is >= 1000x below its
# largest earlier sample while the LR fell less than 10x. Over a healthy run Adam's ratio
# drifts 3-10x (its first step is sign-sized, the weights grow), SGD's follows the gradient,
# which shrinks as the loss falls; that case is kept out by asking the loss to be flat.
UPDATE_COLLAPSE = 1e3
LR_KEPT = 0.1
# Zero gradients with a zero loss are convergence (a perfect fit leaves nothing to learn), not
# dead units: a loss whose median from the first dead sample on is at most this share of its
# median over the first steps has reached its floor (a pointer network that fits its data
# exactly sits at loss 0.0).
LOSS_FLOOR_SHARE = 1e-3
# A gradient norm 10x its level before the spike, within the spike's window, says the jump
# came from the update (shown as evidence, never required: step 0 has no norm in some loops).
GRAD_JUMP = 10.0

# ---------------------------------------------------------------------------------------------
# What the sampled tier says: dead units


def _updates_collapsed(f: Facts) -> Optional[tuple[int, float, int, float]]:
    """(earlier step, its update ratio, last step, its ratio) when the median update ratio
    fell >= UPDATE_COLLAPSE x while the LR stayed within LR_KEPT of its level."""
    upd = f.reduced.upd_log
    idx = np.flatnonzero(np.isfinite(upd))
    if len(idx) < 2:
        return None
    last = int(idx[-1])
    top = int(idx[:-1][np.argmax(upd[idx[:-1]])])
    lr = f.steps["lr"].astype(float)
    if upd[top] - upd[last] < math.log10(UPDATE_COLLAPSE):
        return None
    if not (np.isfinite(lr[top]) and np.isfinite(lr[last]) and lr[last] >= LR_KEPT * lr[top]):
        return None  # the schedule brought the LR down: small updates are what it asked for
    return f.step_at(top), 10 ** float(upd[top]), f.step_at(last), 10 ** float(upd[last])


def _spike_into(f: Facts, dead: Dead) -> Optional[curve.Spike]:
    """The spike that killed the units: after the last sign of life, by the first dead
    sample."""
    alive = dead.last_alive
    for s in f.curve.spikes:
        step = f.step_at(s.onset)
        if step <= dead.first_step and (alive is None or step > alive):
            return s
    return None


# ---------------------------------------------------------------------------------------------
# Evidence


def _spike_evidence(f: Facts, s: curve.Spike) -> list[Evidence]:
    step, onset = f.step_at(s.index), f.step_at(s.onset)
    began = f" (rising from step {onset})" if onset != step else ""
    ev = [Evidence(f"the loss jumped to {fmt(s.value)} at step {step}{began}, {s.jump:.0f}x "
                   f"the {fmt(s.before)} before it"
                   + (f"; it peaked at {fmt(s.peak)} at step {f.step_at(s.peak_index)}"
                      if s.peak > s.value else ""), "loss_spike", s.jump, step)]
    ev += _lr_evidence(f, s.onset)
    gn = f.steps["grad_norm"].astype(float)
    before = gn[max(0, s.onset - curve.BEFORE_STEPS):s.onset]
    before = before[np.isfinite(before) & (before > 0)]
    window = gn[s.onset:s.index + curve.BEFORE_STEPS]
    if len(before) and np.isfinite(window).any():
        g0, top = float(np.median(before)), int(np.nanargmax(window))
        if window[top] >= GRAD_JUMP * g0:
            ev.append(_grad_jump(f, gn, g0, s.onset + top))
    return ev


def _grad_jump(f: Facts, gn: np.ndarray, g0: float, top: int) -> Evidence:
    """The gradient norm's jump to ``gn[top]``, told at the step where it began: a norm that
    rose on every step before its peak began rising at the first of those steps."""
    began = top
    while began > 0 and np.isfinite(gn[began - 1]) and 0 < gn[began - 1] < gn[began]:
        began -= 1
    peak, step = float(gn[top]), f.step_at(top)
    if top - began >= 2:
        text = (f"the gradient norm rose on every step from step {f.step_at(began)} "
                f"({fmt(float(gn[began]))}) to {fmt(peak)} at step {step}")
        return Evidence(text, "grad_norm_jump", peak / g0, f.step_at(began))
    return Evidence(f"the gradient norm jumped from {fmt(g0)} to {fmt(peak)} at step {step}",
                    "grad_norm_jump", peak / g0, step)


def _lr_evidence(f: Facts, index: int) -> list[Evidence]:
    """The LR where the blow-up began, and where that sits on the schedule."""
    lr = f.steps["lr"].astype(float)
    if not np.isfinite(lr[index]):
        return []
    step, peak = f.step_at(index), float(np.nanmax(lr))
    reach = f.step_at(int(np.flatnonzero(lr >= peak * 0.999)[0]))
    ramp = (f", rising in a warm-up to its peak {fmt(peak)} (reached at step {reach})"
            if lr[index] < peak * 0.5 and reach > step else
            f" (peak {fmt(peak)})" if lr[index] < peak * 0.999 else "")
    return [Evidence(f"the LR was {fmt(float(lr[index]))} at step {step}{ramp}",
                     "lr_at_spike", float(lr[index]), step)]


def _end_evidence(f: Facts) -> Evidence:
    c = f.curve
    text = (f"the loss ended at {fmt(c.end)} (median of the last {c.tail_steps} steps), "
            f"{c.end / c.start:.0%} of where it began ({fmt(c.start)})")
    if math.isfinite(c.best_after):
        text += f"; after the spike it never went below {fmt(c.best_after)}"
    return Evidence(text, "loss_end", c.end / c.start, f.step_at(f.n - 1))


def _dead_evidence(f: Facts, dead: Dead) -> list[Evidence]:
    sampled = [f.step_at(int(i)) for i in np.flatnonzero(f.reduced.sampled)]
    ev = []
    for name in dead.layers[:2]:
        kind = f.module_type(name)
        alive = dead.layer_alive.get(name)
        since = next((x for x in sampled if alive is None or x > alive), dead.first_step)
        ev.append(Evidence(f"{name}{f' ({kind})' if kind else ''} outputs exactly 0 for the "
                           f"whole batch on every sampled step from {since} to the last "
                           f"({sampled[-1]}): every unit is dead"
                           + (f" (at step {alive} some were still alive)" if alive is not None
                              else " (it never had a non-zero output)"),
                           "dead_layer", None, since, name))
    was = (f" (at step {dead.alive_step}: {dead.alive_share:.0%})" if dead.alive_step is not None
           else "")
    text = (f"from sampled step {dead.first_step} on, {DEAD_SHARE:.0%} or more of the trained "
            f"parameters' gradient elements are exactly 0 ({_pct(dead.share)} at step "
            f"{dead.steps[-1]}{was.replace(' (at', '; at').rstrip(')')})")
    if dead.silent:
        text += f"; no gradient at all reaches {', '.join(dead.silent[:4])}" + (
            f" and {len(dead.silent) - 4} more" if len(dead.silent) > 4 else "")
    if dead.learning and len(dead.learning) <= 3:
        text += f"; only {', '.join(dead.learning)} still get{'s' * (len(dead.learning) == 1)} one"
    ev.append(Evidence(text, "zero_gradient_share", dead.share, dead.first_step))
    collapse = _updates_collapsed(f)
    if collapse:
        ev.append(_collapse_evidence(f, collapse))
    return ev


def _collapse_evidence(f: Facts, c: tuple[int, float, int, float]) -> Evidence:
    top, u0, last, u1 = c
    lr0, lr1 = (float(f.steps["lr"][f.index_of(s)]) for s in (top, last))
    return Evidence(f"the update ratio |dW|/|W| fell {u0 / u1:.0f}x, from {fmt(u0)} at step "
                    f"{top} (LR {fmt(lr0)}) to {fmt(u1)} at step {last} (LR {fmt(lr1)})",
                    "update_ratio_collapse", u1, last)


# ---------------------------------------------------------------------------------------------
# The rules


def rule_diverged(f: Facts) -> Optional[Finding]:
    """A loss spike that never recovers, with no non-finite value (taxonomy C2 in a range that
    does not overflow): the loss jumped >= 10x and stayed up, or the jump killed the units, or
    it climbed >= 10x above its start and stayed there."""
    if not untroubled(f):
        return None
    c, dead = f.curve, dead_units(f)
    killer = _spike_into(f, dead) if dead else None
    if dead is not None and killer is not None:  # the jump killed the units, stayed up or not
        spike, kind, module = killer, "dead_units", dead.layers[0] if dead.layers else None
        how = ("the jump killed the network's units: from then on almost no gradient reaches "
               "the weights and it never trained again")
        ev = _spike_evidence(f, spike) + [_end_evidence(f)] + _dead_evidence(f, dead)
    elif c.stuck and c.spike is not None:
        spike, kind, module = c.spike, "stuck", None
        how = "it stayed far above its level before the jump to the end of the run"
        ev = _spike_evidence(f, spike) + [_end_evidence(f)]
    elif c.climbed:
        return _climbed(f)
    elif c.excursion is not None:
        spike, kind, module = c.excursion, "excursion", None
        how = (f"stood {curve.STUCK:g}x or more above its level before the jump on "
               f"{c.excursion_steps} of the {c.excursion_after} steps from there: it came back "
               f"only late, to {fmt(c.end)} at the end, {c.end / c.start:.2g}x where it began")
        ev = _spike_evidence(f, spike) + [_end_evidence(f)]
    else:
        return None
    onset = f.step_at(spike.onset)
    answer = precision_answer(f, dead)
    ctx = _blowup_context(f, module, spike.onset)
    conf = 0.85 if kind == "dead_units" and dead is not None and len(dead.steps) >= 2 else \
        0.7 if kind == "excursion" else 0.75
    return Finding("diverged", _sure(conf, answer),
                   f"Training diverged without any inf/NaN: the loss jumped {spike.jump:.0f}x at "
                   f"step {f.step_at(spike.index)} and {how}. {_conclusion(f, answer)}"
                   + schedules.summary(f, onset), _scheduled(f, ev + [answer], onset),
                   fixes.make(schedules.lr_fixes(f, ["lower_lr"] + (
                       ["revive_units"] if kind == "dead_units" else []), onset), ctx),
                   first_bad(schedules.moving(f, onset), module, None),
                   priority=PRIORITY["diverged"], kind=kind)


def _climbed(f: Facts) -> Finding:
    c = f.curve
    onset = f.step_at(c.climb_onset)
    ev = [Evidence(f"the loss climbed from {fmt(c.start)} at the start to {fmt(c.end)} at the "
                   f"end (median of the last {c.tail_steps} steps), {c.end / c.start:.0f}x; it "
                   f"stood above {curve.RISE:g}x its start from step {onset} on",
                   "loss_climb", c.end / c.start, onset)]
    ev += _lr_evidence(f, c.climb_onset)
    answer = precision_answer(f)
    return Finding("diverged", _sure(0.7, answer),
                   f"Training diverged without any inf/NaN: the loss climbed "
                   f"{c.end / c.start:.0f}x above where it began, from step {onset} on, and "
                   f"never came back. {_conclusion(f, answer)}" + schedules.summary(f, onset),
                   _scheduled(f, ev + [answer], onset),
                   fixes.make(schedules.lr_fixes(f, ["lower_lr"], onset),
                              _blowup_context(f, None, c.climb_onset)),
                   first_bad(schedules.moving(f, onset), None, None),
                   priority=PRIORITY["diverged"], kind="climbed")


def _scheduled(f: Facts, ev: list[Evidence], onset: Optional[int] = None) -> list[Evidence]:
    """The evidence, with a scheduler stepped per micro-batch, or an LR gone below 0 by the
    ``onset``, first when there was one."""
    found = [x for x in (schedules.per_micro(f), schedules.negative(f, onset)) if x is not None]
    return found + ev


def _blowup_context(f: Facts, module: Optional[str], index: int) -> fixes.Context:
    ctx = f.fix_context(module, step=f.step_at(index))
    lr = float(f.steps["lr"][index])
    ctx.blowup_lr = lr if math.isfinite(lr) and lr > 0 else None
    ctx.blowup_step = f.step_at(index)
    return ctx


def rule_dead_units(f: Facts) -> Optional[Finding]:
    """Most of the model gets exactly zero gradient (dead ReLU units), or the update ratios
    collapsed, while the loss no longer falls; a consequence when a spike killed them."""
    if not untroubled(f):
        return None
    dead = dead_units(f)
    if dead is None:
        found = _collapsed_only(f)
        return None if found and found.first_bad and _at_floor(f, found.first_bad["step"]) \
            else found
    if _at_floor(f, dead.first_step):
        return None
    c = f.curve
    spike = _spike_into(f, dead)
    module = dead.layers[0] if dead.layers else None
    ev = _dead_evidence(f, dead) + ([_end_evidence(f)] if c.judged else [])
    answer = precision_answer(f, dead)
    ev.append(answer)
    began = dead.first_step
    lived = dead.last_alive is not None
    where = (f"It happened between sampled steps {dead.last_alive} and {began}" if lived else
             f"They were dead from the first sampled step ({began}) on: the initialisation (or "
             "the inputs' scale) leaves them off for every example")
    what = (f"every unit of {module} is dead (its output is exactly 0 for the whole batch), so "
            "no gradient reaches the layers before it" if module else
            "the gradients are exactly zero almost everywhere")
    conf = 0.85 if len(dead.steps) >= 2 else 0.7
    # units that lived and died: the LR pushed them off; never alive: the init
    ids = (["lower_lr", "revive_units"] if lived else ["revive_units", "lower_lr"])
    exploded = _exploded(f)
    if exploded is not None:  # ... and the activations' size is the cause
        ev.insert(0, exploded)
        where += (f"; the activations exploded first (up to {fmt(exploded.value or 0)}) and the "
                  "model has no ReLU-family unit: that, not a ReLU, is what zeroed them")
    return Finding("dead_units", _sure(conf, answer),
                   f"The network stopped learning without any inf/NaN: {what}. "
                   f"{_pct(dead.share)} of the gradient is exactly 0, the weights no longer move "
                   f"and the loss stays where it was. {where}. {_conclusion(f, answer)}", ev,
                   fixes.make(ids + _underflow_fix(f, dead), f.fix_context(module, step=began)),
                   first_bad(began, module, "forward" if module else None),
                   root=spike is None, priority=PRIORITY["dead_units"],
                   kind="dead_layer" if module else "zero_gradients")


def _at_floor(f: Facts, since: int) -> bool:
    """Has the loss reached its floor from step ``since`` on (median at most LOSS_FLOOR_SHARE
    of the first steps' median, exactly 0 included)?"""
    loss = f.steps["loss"].astype(float)
    ok = np.isfinite(loss)
    tail = np.abs(loss[ok & (f.steps["step"] >= since)])
    head = np.abs(loss[ok][:10])
    if not len(tail) or not len(head):
        return False
    return float(np.median(tail)) <= LOSS_FLOOR_SHARE * float(np.median(head))


def _collapsed_only(f: Facts) -> Optional[Finding]:
    """No exact zeros, but the updates shrank >= 1000x at an unchanged LR and the loss is flat
    (vanishing gradients: saturated units)."""
    collapse = _updates_collapsed(f)
    c = f.curve
    if collapse is None or not c.flat:
        return None
    ev = [_collapse_evidence(f, collapse), _end_evidence(f)]
    answer = precision_answer(f)
    ev.append(answer)
    return Finding("dead_units", 0.6, "The weights stopped moving without any inf/NaN: the "
                   f"update ratio fell {collapse[1] / collapse[3]:.0e}x while the LR did not, "
                   "and the loss stays where it was (gradients vanished: saturated units). "
                   f"{_conclusion(f, answer)}", ev,
                   fixes.make(["revive_units", "lower_lr"], f.fix_context(step=collapse[2])),
                   first_bad(collapse[2], None, None), priority=PRIORITY["dead_units"],
                   kind="updates_collapsed")


# An activation this large is no healthy one: it exploded (a UNet's at 6e18).
EXPLODED = 1e8


def _exploded(f: Facts) -> Optional[Evidence]:
    """Evidence that the units died of exploded activations in a model with no ReLU-family
    unit to swap, else None."""
    if not relu_free(f.tensor_types):
        return None  # a ReLU could be to blame, or the activations are functional calls
    types = {t.lower() for t in f.tensor_types if t}
    out = f.reduced.out_absmax
    biggest = float(np.nanmax(out)) if np.isfinite(out).any() else 0.0
    if biggest < EXPLODED:
        return None
    return Evidence(f"the largest activation sampled reached {fmt(biggest)} and the model's "
                    f"activations are {', '.join(sorted(types & set(SMOOTH)))}: no ReLU-family "
                    "unit, so the units were zeroed by activations that exploded",
                    "activations_exploded", biggest)


RULES = [rule_diverged, rule_dead_units]


def _pct(x: float) -> str:
    """A share as a percentage that does not round 99.98 % up to a claim of 100 %."""
    return f"{x:.2%}" if 0.999 <= x < 1.0 else f"{x:.1%}" if x < 1.0 else "100%"


# When something points at the precision (fp32_same cannot be told), no more sure than this.
UNSURE = 0.5


def _sure(conf: float, answer: Evidence) -> float:
    return conf if answer.value else min(conf, UNSURE)


def _underflow_fix(f: Facts, dead: Dead) -> list[str]:
    """fp16 without a working loss scale flushes small gradients to exact zeros too: unless a
    dead layer shows the zeros come from the forward pass, scaling is worth trying."""
    if f.low_precision != "fp16" or dead.layers:
        return []
    return ["add_grad_scaler"] if not f.has_scaler else ["raise_init_scale"]


def _conclusion(f: Facts, answer: Evidence) -> str:
    if f.low_precision is None:
        return "The run computes in fp32: precision plays no part."
    if answer.value:
        return "Not a precision problem: fp32 would do the same."
    return "Whether fp32 would do the same cannot be told (see the evidence)."
