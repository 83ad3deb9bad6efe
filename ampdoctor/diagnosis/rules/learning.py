"""Did it learn? A run with no failure whose loss did not fall is not healthy: ``not_learning``.

numpy only (no torch). "No inf/NaN reached the weights" is not what healthy promises; a run
that trained is. ``rule_not_learning`` fires when the loss curve can be judged (``curve.read``:
20 finite positive losses or more, not too noisy), the run is long enough to expect learning
(``SHORT_RUN`` steps), nothing failed, and the loss did not fall (``Curve.fell``: below 90 % of
its start, by two standard errors of its own noise; or steadily, third after third, by five
times its step-to-step noise, however little). It is the honest answer when nothing
recorded explains the flat loss, so it ranks below every cause (``PRIORITY``): a run whose loss
is flat because its units died, its updates round away, an op inside a module overflows or a
layer's gradients flush is that cause's verdict, and ``not_learning`` is never listed beside
one (``engine._conclude``).

Its evidence says what was checked and found normal: the loss (start, end, noise), the updates
(applied, not rounded away), the gradients (reaching the weights), the loss scale and the
precision (``progress.precision_answer``). What it cannot tell: a run whose loss is not meant
to fall (a fine-tune that starts at its optimum, a GAN) looks the same, hence the low
confidence. Shorter runs are judged only as far as their length allows: under ``SHORT_RUN``
steps the verdict stays healthy, with a note saying so (``notes._coverage_notes``).

Example::

    d = ampdoctor.diagnose("run.h5")
    if d.verdict == "not_learning":
        [e.text for e in d.evidence]     # what was checked, with its numbers
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import count, fmt
from ...runfile.schema import Kind
from .. import curve, fixes, objectives, schedules
from ..facts import Facts
from ..progress import loss_evidence, precision_answer, untroubled
from ..thresholds import SHORT_RUN, UNCHANGED_HIGH
from ..verdict import FAILED, HELD, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("lr",),
         "stats": ("grad_zero_share", "layer_unchanged", "upd_log")}

# Sure of little: the numbers say the loss is flat and that nothing recorded explains it.
CONFIDENCE = 0.4
# ... and less when no sampled step looked at the gradients and updates.
UNMEASURED_CONFIDENCE = 0.3
# A scheduler stepped per micro-batch is a bug the run shows, named first; that it is why the
# loss is flat is likely, not shown.
SCHEDULER_CONFIDENCE = 0.5
# Several optimizers stepped: the recorded loss is the mean of every loss backwarded in a step
# (a GAN's generator and discriminator losses, which are not meant to fall, among them).
SEVERAL_CONFIDENCE = 0.2


def rule_not_learning(f: Facts) -> Optional[Finding]:
    """No failure, a judged curve over SHORT_RUN steps or more, and a loss that did not fall:
    each loss's own, where the run backwarded several (``_per_loss``)."""
    if not untroubled(f) or f.n < SHORT_RUN:
        return None
    objs = f.objectives
    if objs:
        return _per_loss(f, objs)
    c = f.curve
    if not c.judged or c.fell:
        return None
    ev = [loss_evidence(f, c)] + _spike_evidence(f, c) + _weights_evidence(f)
    ev += _scale_evidence(f) + _lr_evidence(f)
    several = _optimizers_evidence(f)
    ev += several
    answer = precision_answer(f)
    ev.append(answer)
    measured = f.sampled_steps >= 2
    clean = "no inf/NaN" + (", no skipped step beyond calibration" if f.has_scaler else "")
    checked = (f"{clean}, gradients reach the weights and the updates are applied" if measured
               else f"{clean} (no sampled step measured the gradients and updates: record with "
               "`--every N`)")
    why = " Not a precision problem: fp32 would do the same." if answer.value else ""
    sched = schedules.per_micro(f)
    if sched is not None:  # a cause the run shows, though not one that proves the flat loss
        ev.insert(0, sched)
        return Finding("not_learning", SCHEDULER_CONFIDENCE,
                       f"The loss did not fall over {f.n} steps ({fmt(c.start)} -> "
                       f"{fmt(c.end)}), and the LR scheduler stepped {int(sched.value or 0)} "
                       "times per optimizer step: its schedule ran that many times too fast (a "
                       "warm-up at its peak that many times too early, a decay as much too "
                       f"soon). {checked[0].upper() + checked[1:]}.{why} Step the scheduler "
                       "once per optimizer step first; if the loss still does not fall, the "
                       "usual causes are the data, the learning rate and the loss.", ev,
                       fixes.make(["scheduler_per_step", "overfit_one_batch"],
                                  f.fix_context(step=int(sched.step or 0))),
                       first_bad(sched.step, None, None), priority=PRIORITY["not_learning"])
    sure = SEVERAL_CONFIDENCE if several else CONFIDENCE if measured else UNMEASURED_CONFIDENCE
    text, ev, fixed_by, where = _flat_text(f, c, checked, why, ev)
    return Finding("not_learning", sure, text, ev, fixed_by, where,
                   priority=PRIORITY["not_learning"], premises=[one_objective(f)])


def _per_loss(f: Facts, objs: list[objectives.Objective]) -> Optional[Finding]:
    """Several losses, each judged on its own curve; a loss paired adversarially with another
    is not asked to fall. A loss that did not fall is ``not_learning``, named by its site; none
    (while the mean of them all is flat) is a finding whose premise failed, so that the
    diagnosis says why the flat mean is not judged."""
    judged = [o for o in objs if o.rival is None and o.curve.judged]
    flat = [o for o in judged if not o.fell]
    ev = objectives.evidence(f, objs)
    if not flat:
        c = f.curve
        if not c.judged or c.fell:
            return None
        paired = [o.site for o in objs if o.rival is not None]
        why = (f"the losses at {', '.join(paired)} are paired adversarially (each one's "
               "optimizers step against the other's loss), so their mean stays level while "
               "both learn; neither is asked to fall") if paired else ""
        if judged:
            why += ("; " if why else "") + "each loss judged on its own fell: " + \
                ", ".join(o.site for o in judged)
        unjudged = [o for o in objs if o.rival is None and not o.curve.judged]
        if unjudged and not judged:
            why += ("; " if why else "") + "; ".join(
                f"the loss at {o.site} could not be judged ({o.curve.why})" for o in unjudged)
        return Finding("not_learning", CONFIDENCE, "The mean of the run's losses did not fall.",
                       ev, [], None, priority=PRIORITY["not_learning"],
                       premises=[Premise("each_loss", FAILED, why)])
    ev += _weights_evidence(f) + _scale_evidence(f) + _lr_evidence(f)
    answer = precision_answer(f)
    ev.append(answer)
    measured = f.sampled_steps >= 2
    worst = flat[0]
    c = worst.curve
    others = [o for o in judged if o.fell]
    fell = (f"; the loss at {', '.join(o.site for o in others)} fell, so the run as a whole "
            "trains and this loss's own signal is what is missing") if others else ""
    why = " Not a precision problem: fp32 would do the same." if answer.value else ""
    text = (f"The loss backwarded at {worst.site} (stepping "
            f"{objectives.optimizer_names(f, worst.feeds)}) did not fall over {c.n} steps "
            f"({fmt(c.start)} -> {fmt(c.end)}), with no inf/NaN{fell}.{why} ampdoctor cannot "
            "tell why from the numbers it records; the usual causes are that loss's data or "
            "labels, its weight in the total, its learning rate, or parameters it does not "
            "reach.")
    return Finding("not_learning", CONFIDENCE if measured else UNMEASURED_CONFIDENCE, text, ev,
                   fixes.make(["overfit_one_batch"], f.fix_context(step=f.step_at(0))),
                   first_bad(int(worst.steps[0]), None, None), priority=PRIORITY["not_learning"],
                   premises=[Premise("each_loss", HELD, f"{len(objs)} losses recorded, each "
                                     f"judged on its own curve ({len(judged)} judged)")])


def one_objective(f: Facts) -> Premise:
    """not_learning's premise: the curve judged is one objective's. Several models each
    stepped by its own optimizer (a GAN's generator and discriminator, the AMP docs' several
    models and losses with one scaler) have their losses averaged into it, and an adversarial
    pair keeps that mean level while both learn: the premise fails there. (A run that
    backwarded them from separate lines has each loss's curve: ``_per_loss`` judges those; this
    is a run whose losses came from one line, or a file of format 2.)"""
    n_opt, n_roots = len(f.optimizers), len(f.run.roots)
    if n_opt >= 2 and n_roots >= 2:
        return Premise("one_objective", FAILED,
                       f"{n_roots} models stepped by {n_opt} optimizers: the loss recorded is "
                       "the mean of their losses, which an adversarial pair (a GAN) keeps level "
                       "while both learn; whether each model's own loss fell is not recorded (it "
                       "is where the losses are backwarded from separate lines)")
    return Premise("one_objective", HELD, f"{count(max(n_roots, 1), 'model')}, "
                   f"{count(max(n_opt, 1), 'optimizer')}: the loss judged is its objective")


def _flat_text(f: Facts, c: curve.Curve, checked: str, why: str, ev: list) -> tuple:
    """(summary, evidence, fixes, first bad) of a flat loss no cause explains."""
    return (f"The loss did not fall over {f.n} steps ({fmt(c.start)} -> {fmt(c.end)}) and no "
            f"cause was found: {checked}.{why} The numbers ampdoctor records cannot tell why; "
            "the usual causes are the data (labels not paired with their inputs), the learning "
            "rate and the loss (parameters it does not reach). A run whose loss is not meant "
            "to fall (a fine-tune at its optimum, a GAN) looks the same.", ev,
            fixes.make(["overfit_one_batch"], f.fix_context(step=f.step_at(0))),
            first_bad(f.step_at(0), None, None))


def _spike_evidence(f: Facts, c: curve.Curve) -> list[Evidence]:
    if not c.spikes:
        return []
    s = c.spikes[0]
    return [Evidence(f"the loss jumped {s.jump:.0f}x at step {f.step_at(s.index)} and came back "
                     "(no blow-up that stayed)", "loss_spike", s.jump, f.step_at(s.index))]


def _weights_evidence(f: Facts) -> list[Evidence]:
    """The updates and gradients the sampled tier measured: applied, and reaching the
    weights (or that nothing measured them)."""
    st = f.reduced
    upd = st.upd_log[np.isfinite(st.upd_log)]
    if not len(upd):
        return [Evidence("no sampled step measured the gradients and the updates, so a layer "
                         "that stopped learning could not be seen", "not_measured", None)]
    lay = st.layer_unchanged
    measured = np.isfinite(lay) & (f.tensor_kinds == Kind.PARAM)
    unchanged = float(np.median(lay[measured])) if measured.any() else math.nan
    applied = ("" if not math.isfinite(unchanged) else
               f"; {unchanged:.0%} of the sampled weight elements left unchanged by a step "
               "although their gradient was not 0" + (" (the updates are applied)"
                                                      if unchanged < UNCHANGED_HIGH else ""))
    ev = [Evidence(f"the weights move: median update ratio |dW|/|W| "
                   f"~{fmt(10 ** float(np.median(upd)))} per step over {len(upd)} sampled "
                   f"steps{applied}", "update_ratio", 10 ** float(np.median(upd)))]
    share = st.grad_zero_share
    idx = np.flatnonzero(np.isfinite(share))
    if len(idx):
        last = int(idx[-1])
        ev.append(Evidence(f"gradients reach the weights: {share[last]:.1%} of the trained "
                           f"parameters' gradient elements are exactly 0 at sampled step "
                           f"{f.step_at(last)}", "zero_gradient_share", float(share[last]),
                           f.step_at(last)))
    return ev


def _scale_evidence(f: Facts) -> list[Evidence]:
    if not f.has_scaler:
        return []
    st = f.story
    return [Evidence(f"the loss scale went {fmt(st.init_scale)} -> {fmt(st.final_scale)} "
                     f"(lowest {fmt(st.min_scale)}), {count(int(f.skipped.sum()), 'step')} skipped",
                     "loss_scale", st.final_scale)]


def _optimizers_evidence(f: Facts) -> list[Evidence]:
    """Several optimizers in /meta ``optimizer``: the one loss curve judged is their losses'
    mean, which a GAN's pair (each pulling against the other) keeps level while both learn."""
    opts = f.optimizers
    if len(opts) < 2:
        return []
    names = ", ".join(o.name or "?" for o in opts)
    return [Evidence(f"{len(opts)} optimizers stepped ({names}): the loss judged is the mean of "
                     "every loss backwarded in a step, not each optimizer's own; an adversarial "
                     "pair (a GAN's generator and discriminator) keeps that mean level while "
                     "both learn", "several_optimizers", float(len(opts)))]


def _lr_evidence(f: Facts) -> list[Evidence]:
    lr = f.steps["lr"].astype(float)
    lr = lr[np.isfinite(lr)]
    if not len(lr):
        return []
    lo, hi = float(lr.min()), float(lr.max())
    text = f"the LR was {fmt(hi)} throughout" if hi <= lo * 1.001 else \
        f"the LR ranged {fmt(lo)} to {fmt(hi)}"
    return [Evidence(text, "lr", hi)]
