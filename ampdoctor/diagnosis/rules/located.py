"""Located causes of the first non-finite value that are not an op's overflow (those are
``overflow.py``'s): the batch itself (``bad_input``, taxonomy C5), finite micro-batch gradients
summed past 65504 in an fp16 ``.grad`` (``accum_overflow``), module buffers poisoned while the
weights stay finite (``state_poisoning``, C10), an Adam eps that is 0 in fp16 (``adam_eps``,
C4), and the loss or its backward (``fp16_loss``, C7b). Each reads the forensic replays and the
sampled tier (``diagnosis/culprit.py``) for the signal its class is told by; what they say of
the batch is read in ``batches.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import fmt
from ...runfile.detail import LossInfo, OutputGrad
from ...runfile.meta import BuffersInfo
from ...runfile.payloads import SnapshotDetail
from ...runfile.schema import DType, Event, Kind
from .. import batches, fixes, singular
from ..culprit import root_grad_output, snapshot_at
from ..facts import ADAM_FAMILY, Facts, fp16_rounds_to_zero, module_of
from ..verdict import FAILED, HELD, NOT_MEASURED, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("grad_norm", "loss", "loss_dtype", "micro", "step"),
         "stats": ("buf_changed", "buf_finite_step", "buf_first_step", "first_bad_step",
                   "last_bad", "last_step", "param_bad")}

# ---------------------------------------------------------------------------------------------
# C5: the data


def rule_bad_input(f: Facts) -> Optional[Finding]:
    """C5: the batch itself holds NaN/inf, or values beyond fp16's range."""
    if not f.n:
        return None
    where, conf, ev, data = batches.from_replays(f)
    sampled_where, sampled_conf, sampled_ev, sampled_data = batches.from_samples(
        f, where is not None)
    ev += sampled_ev
    if where is None:
        where, conf, data = sampled_where, sampled_conf, sampled_data
    if where is None:
        where, conf, ev, data = batches.off_scale(f)
    if where is None:
        return None
    where["step"] = batches.run_start(f, where["step"])
    bad_losses = int(f.loss_bad.sum())
    if bad_losses:
        ev.append(Evidence(f"{bad_losses} of {f.n} steps had a non-finite loss"
                           + ("; the others trained normally" if bad_losses < f.n / 2 else ""),
                           "nonfinite_loss_steps", float(bad_losses)))
    skipped = int(f.skipped[f.loss_bad | f.grad_bad].sum()) if f.has_scaler else 0
    what = ("GradScaler skipped those steps; the model itself is fine." if skipped else
            "No GradScaler skipped those steps: what they did reached the weights.")
    ctx = f.fix_context(step=where["step"])
    ctx.data = data  # the step the check measured, which may be after the run of bad steps began
    held = ("values thousands of times those of the batches before it" if data and
            data.get("kind") == "off_scale" else "NaN/inf (or values beyond fp16's range)")
    found = Finding("bad_input", conf, f"The data is the cause: a batch held {held} before the "
                    f"model touched it. {what}", ev, fixes.make(["check_data"], ctx), where,
                    priority=PRIORITY["bad_input"])
    if data and data.get("kind") == "off_scale":  # what the model did with it follows from it
        found.explains = frozenset(int(t) for t in f.steps["step"][f.failure_index:])
    return found


# ---------------------------------------------------------------------------------------------
# Gradient accumulation in an fp16 .grad


def rule_accum_overflow(f: Facts) -> Optional[Finding]:
    """C6 (accumulation): every micro-batch's gradient is finite, but their sum in an fp16
    .grad passes 65504 (fp16 parameters, no fp32 master copy): the replay summed them in
    fp16, in order, and found where the running sum turned inf."""
    found = ((x, SnapshotDetail.from_json(x["detail"]).accum_overflow) for x in f.snapshots)
    snap, acc = next(((x, a) for x, a in found if a is not None), (None, None))
    if snap is None or acc is None:
        return None
    where = first_bad(snap["step"], snap["module"], "backward")
    ev = [Evidence(f"replay of step {snap['step']}: each of the {acc.micro_batches} "
                   f"micro-batches' gradients is finite, but their sum in {acc.dtype} .grad "
                   f"passes 65504 at micro-batch {acc.micro} ({acc.param}, "
                   f"{fmt(acc.fp32_absmax)} in fp32)", "accum_overflow",
                   acc.fp32_absmax, snap["step"], snap["module"]),
          Evidence(f"the parameters are {acc.dtype}: backward() adds every micro-batch into "
                   f"a {acc.dtype} .grad", "param_dtype", None)]
    rise = _micro_rise(f, snap["step"])
    if rise:
        ev.append(rise)
    return Finding("accum_overflow", 0.9, "Gradient accumulation overflows fp16 .grad: each "
                   "micro-batch's gradient is finite, but the parameters (and so .grad) are "
                   "fp16 and backward() sums the micro-batches there, past 65504. No op "
                   "overflowed; the accumulation buffer did.", ev,
                   fixes.make(["fp32_master_weights", "divide_loss_by_accum"],
                              f.fix_context(snap["module"], step=snap["step"])),
                   where, priority=PRIORITY["accum_overflow"])


def _micro_rise(f: Facts, step: int) -> Optional[Evidence]:
    """Micro-batches per step at the failure against the run's first steps (a batch-size
    warmup raises the sum in .grad step after step)."""
    micro = f.steps["micro"].astype(int)
    i = f.index_of(step)
    if not len(micro) or micro[i] <= micro[0]:
        return None
    return Evidence(f"micro-batches per step rose from {micro[0]} at step {f.step_at(0)} to "
                    f"{micro[i]} at step {step}", "micro_batches", float(micro[i]), step)


# ---------------------------------------------------------------------------------------------
# C10: module buffers


def rule_state_poisoning(f: Facts) -> Optional[Finding]:
    """C10: buffers (BatchNorm running stats, EMA) non-finite while the parameters are finite.

    Premise (``buffer_was_finite``): the buffer was seen finite earlier, or changed between
    samples. A buffer non-finite at its first sample, before any failure, that never changed is
    a constant (open_clip's causal attention mask is a buffer filled with -inf by design): its
    premise fails, and the finding is rejected."""
    if not f.n:
        return None
    bad = _poisoned_buffers(f)
    if not bad:
        return None
    checks = {name: _buffer_premise(f, name, first) for name, (first, _) in bad.items()}
    standing = {k: v for k, v in bad.items() if checks[k].status != FAILED}
    found = _poisoning(f, standing or bad)
    if found is None:
        return None
    if standing:
        found.premises = [checks[next(iter(standing))]]
        if found.premises[0].status == NOT_MEASURED:
            found.confidence = 0.7
    else:
        found.premises = [_constants(checks)]
    return found


def _poisoning(f: Facts, bad: dict[str, tuple[int, int]]) -> Optional[Finding]:
    buffers = list(bad)
    first_seen, last_seen = bad[buffers[0]][0], max(last for _, last in bad.values())
    if f.reduced.param_bad[f.index_of(last_seen)] > 0:
        return None  # the weights are gone too
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
        skipped_at = f.has_scaler and bool(f.skipped[f.index_of(trigger)])
        ev.append(Evidence(f"the buffers took the inf/NaN of step {trigger}"
                           + (", whose optimizer step GradScaler skipped" if skipped_at else ""),
                           "trigger_step", float(trigger), trigger))
    bad_batch = next((s for s in f.snapshots if s["phase"] == "input"), None)
    outgrown = _outgrown(f, buffers[0], trigger)
    if outgrown:
        ev.append(Evidence(f"{buffers[0]} is held in {outgrown}, and no step before it had a "
                           "non-finite loss or batch: the statistic itself outgrew its "
                           "buffer's range", "buffer_dtype", None, first_seen, module))
    ids = (["fp32_buffers"] if outgrown else ["guard_buffers"]) + \
        (["check_data"] if bad_batch is not None else [])
    ctx = f.fix_context(module, step=trigger)
    if bad_batch is not None:
        ctx.data = {"kind": "nonfinite", "step": bad_batch["step"]}
    skipped = f.has_scaler and bool(f.skipped[f.index_of(trigger)])
    how = (f"a running statistic outgrew its {outgrown} buffer (no bad batch reached it)"
           if outgrown else "GradScaler skipped the bad step but the forward pass had already "
           "updated the statistics" if skipped else "the forward pass of a bad step updated "
           "the statistics")
    return Finding("state_poisoning", 0.85, "Module buffers (BatchNorm running statistics) hold "
                   f"inf/NaN while the weights are finite: {how}. Training loss looks "
                   "fine (train mode uses batch statistics); every evaluation is NaN or "
                   "constant.", ev, fixes.make(ids, ctx),
                   first_bad(trigger, module, "forward"), priority=PRIORITY["state_poisoning"])


def _outgrown(f: Facts, name: str, first_seen: int) -> Optional[str]:
    """The buffer's low-precision dtype ("float16") where it went non-finite with no failing
    step before it (its own statistic overflowed the format), else None."""
    failure = f.failure_step
    if failure is not None and failure < first_seen:
        return None
    t = f.run.tensors
    rows = t["dtype"][(t["kind"] == Kind.BUFFER) &
                      np.isin(t["id"], [i for i, n in enumerate(f.tensor_names) if n == name])]
    return "float16" if len(rows) and int(rows[0]) == DType.FLOAT16 else None


def _buffer_premise(f: Facts, name: str, first_bad_step: int) -> Premise:
    """Was ``name`` a statistic that became non-finite (seen finite, or changing), or a
    constant that was non-finite from the start?"""
    st = f.reduced
    t = next((i for i, (n, k) in enumerate(zip(f.tensor_names, f.tensor_kinds))
              if n == name and k == Kind.BUFFER), None)
    seen, finite = (int(st.buf_first_step[t]), int(st.buf_finite_step[t])) if t is not None \
        else (-1, -1)
    if finite >= 0:
        return Premise("buffer_was_finite", HELD, f"{name} was finite at step {finite} and "
                       f"non-finite from step {first_bad_step}")
    start = _at_start(f, name)
    if start is not None:
        return start
    if t is not None and st.buf_changed[t]:
        return Premise("buffer_was_finite", HELD, f"{name} was non-finite from its first "
                       f"sample (step {seen}) but its statistics changed between samples: a "
                       "running statistic")
    failure = f.failure_step
    if seen < 0 or (failure is not None and seen > failure):
        when = "never sampled" if seen < 0 else f"first sampled at step {seen}, after the " \
            f"first failing step {failure}"
        return Premise("buffer_was_finite", NOT_MEASURED, f"{name} was {when}: whether it was "
                       "finite before is not known")
    return Premise("buffer_was_finite", FAILED, f"{name} was non-finite from its first sample "
                   f"(step {seen}) and never changed up to step {int(st.last_step[t])}: a "
                   "constant (such as an attention mask filled with -inf), not a poisoned "
                   "statistic")


def _at_start(f: Facts, name: str) -> Optional[Premise]:
    """What the recorder saw of ``name`` before the model's first forward (/meta
    ``buffers``), where it saw every buffer: None where it did not."""
    start: BuffersInfo | None = f.run.buffers  # (Facts.run is untyped: the record is not)
    if start is None or start.unchecked:
        return None
    if name in start.nonfinite_at_start:
        return Premise("buffer_was_finite", FAILED, f"{name} was already non-finite before "
                       "the first forward the recorder saw: a constant (such as an attention "
                       "mask filled with -inf), not a poisoned statistic")
    if start.more_nonfinite:
        return None
    return Premise("buffer_was_finite", HELD, f"{name} was finite before the first forward "
                   "the recorder saw, and became non-finite in the run")


def _constants(checks: dict[str, Premise]) -> Premise:
    """Every non-finite buffer is a constant: one failed premise that names them."""
    names = list(checks)
    first = checks[names[0]]
    if len(names) == 1:
        return first
    return Premise(first.name, FAILED, f"{first.fact}; so are the {len(names) - 1} other "
                   f"non-finite buffers ({', '.join(names[1:5])}"
                   + (" ..." if len(names) > 5 else "") + ")")


def _poisoned_buffers(f: Facts) -> dict[str, tuple[int, int]]:
    """Buffers that went non-finite and stayed so (first-poisoned first), each with the step
    it was first seen so and the last step it was seen so. Two sources: the sampled tier
    (still non-finite at the buffer's last sample) and the recorder's audit on failing steps
    (unless a later sample shows the buffer finite again)."""
    st, names, kinds = f.reduced, f.tensor_names, f.tensor_kinds
    bad: dict[str, tuple[int, int]] = {}
    for t in np.flatnonzero((kinds == Kind.BUFFER) & st.last_bad):
        bad[names[t]] = (int(st.first_bad_step[t]), int(st.last_step[t]))
    rows = f.events(Event.NONFINITE_BUFFER)
    for step, t in zip(rows["step"].tolist(), rows["tensor"].tolist()):
        if not 0 <= t < len(names) or (st.last_step[t] > step and not st.last_bad[t]):
            continue  # unknown, or finite again at a later sample
        first, last = bad.get(names[t], (step, step))
        bad[names[t]] = (min(first, step), max(last, step))
    order = sorted(bad, key=lambda name: (bad[name][0], name))
    return {name: bad[name] for name in order}


# ---------------------------------------------------------------------------------------------
# C4: Adam's eps in fp16


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
                   fixes.make(["adam_eps", "fp32_master_weights"], f.fix_context(
                       where["module"] if where else None, step=where["step"] if where else None)),
                   where if conf else None, priority=priority)


def _adam_eps_config(f: Facts) -> Optional[dict]:
    for o in f.optimizers:
        cls, eps = o.name, o.eps
        if not any(cls == a or cls.endswith(a) for a in ADAM_FAMILY) or eps is None:
            continue
        dtypes = o.param_dtypes
        total = sum(dtypes.values()) or 1
        fp16_params = dtypes.get("float16", 0) * 2 >= total
        fp16_state = "float16" in o.state_dtypes.values()
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
    culprit = snapshot_at(f, f.failure_step)
    poisoned = list(SnapshotDetail.from_json(culprit["detail"]).weights_nonfinite or []) \
        if culprit else []
    weights_bad = culprit is not None and (culprit["fp32_finite"] == 0 or bool(poisoned))
    module = culprit["module"] if culprit else None
    ev = []
    if prev_ok:
        ev.append(Evidence(f"step {f.step_at(fi - 1)} had a finite loss "
                           f"({fmt(float(s['loss'][fi - 1]))}) and finite gradients (norm "
                           f"{fmt(float(s['grad_norm'][fi - 1]))}); after its optimizer step, "
                           f"step {f.step_at(fi)}'s loss is NaN", "first_nan_after_step",
                           float(f.step_at(fi)), f.step_at(fi)))
    if weights_bad and culprit is not None:
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
    where = first_bad(f.step_at(fi - 1) if prev_ok else f.step_at(fi), module, "optimizer")
    return conf, where, ev


# ---------------------------------------------------------------------------------------------
# C7b: the loss, and the loss's backward


def rule_fp16_loss(f: Facts) -> Optional[Finding]:
    """C7b: the loss is computed in fp16 and is non-finite while the model's values are not."""
    if not f.n:
        return None
    s = f.steps
    seen = s["loss_dtype"] != DType.UNKNOWN
    if not seen.any() or np.mean(s["loss_dtype"][seen] == DType.FLOAT16) < 0.5:
        return _loss_in_the_step(f)
    alone = f.loss_bad & np.isfinite(s["grad_norm"]) & ~f.skipped
    # A calibration skip is healthy; an infinite derivative is rule_loss_backward's.
    loss_snaps = [x for x in f.snapshots if x["phase"] == "loss" and not _fp32_too(x)
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
                           f"loss {fmt(float(s['loss'][i]))}, "
                           f"grad norm {fmt(float(s['grad_norm'][i]))})", "loss_alone_steps",
                           float(alone.sum()), f.step_at(i)))
    if loss_snaps:
        x = loss_snaps[0]
        first = x["step"] if first is None else first
        ev.append(Evidence(_loss_snapshot_text(x), "replay_loss_phase", None, x["step"]))
    return Finding("fp16_loss", 0.9 if alone.any() else 0.75, "The loss is computed in fp16 and "
                   "overflows (a sum or reduction past 65504) although the model's outputs and "
                   "gradients are finite.", ev,
                   fixes.make(["loss_in_fp32"], f.fix_context(step=first)),
                   first_bad(first, None, "loss"), priority=PRIORITY["fp16_loss"])


def _loss_in_the_step(f: Facts) -> Optional[Finding]:
    """The loss ends in fp32, but a replay of the failing step found it non-finite while every
    module output was finite, in an fp16 or bf16 run: the training code's own ops between the
    model's outputs and the loss made it (p * log p on an fp16 softmax: 0 x -inf; log(1 - p)
    on a bf16 sigmoid rounded to 1.0). A loss written by hand is not recomputed: which op, and
    whether fp32 is finite, is not measured, and the confidence says so."""
    low = f.low_precision
    if f.failure_index is None or low not in ("fp16", "bf16"):
        return None
    snaps = [x for x in f.snapshots if x["phase"] == "loss" and x["step"] >= f.failure_step
             and SnapshotDetail.from_json(x["detail"]).loss_nonfinite and not _fp32_too(x)]
    if not snaps or (_value_minority(f) and any(_loss_backward_only(x) for x in f.snapshots)):
        return None  # the loss's backward failed on most steps: rule_loss_backward's
    if singular.zero_count(f, f.failure_step) is not None:
        return None  # a count of zero from the batch: 0/0 in fp32 too (rule_bad_targets')
    x = snaps[0]
    d = SnapshotDetail.from_json(x["detail"])
    ev = [Evidence(_loss_snapshot_text(x), "replay_loss_phase", None, x["step"])]
    ev += _output_grad_evidence(x, low)
    recomputed = d.loss_fp32 is not None and d.loss_fp32.loss_finite is True
    if recomputed:
        ev.append(Evidence(f"replay of step {x['step']}: the loss recomputed in fp32 is finite",
                           "loss_fp32_finite", None, x["step"]))
        text = (f"The loss is non-finite in {low} and finite in fp32, while every module "
                "output is finite: the loss's own computation fails in low precision.")
    else:
        text = ("The loss is non-finite while every module output is finite: the training "
                f"code's own ops between the model's outputs and the loss, run in {low} on the "
                f"model's {low} outputs (inside the autocast block or after it), made the "
                f"NaN/inf.{_BF16 if low == 'bf16' else ''} The loss is written by hand, so "
                "the replay could not recompute it to name the op or to say whether fp32 is "
                "finite.")
    return Finding("fp16_loss", 0.75 if recomputed else 0.6, text, ev,
                   fixes.make(["loss_in_fp32"], f.fix_context(step=x["step"])),
                   first_bad(x["step"], None, "loss"), priority=PRIORITY["fp16_loss"])


_BF16 = (" bf16 has fp32's range, not its precision: a probability within 0.002 of 1 is "
         "exactly 1.0, and log(1 - p) is -inf.")
# A sigmoid is exactly 1.0 past ln(511) in bf16, ln(4095) in fp16: 1 - s <= 2**-9 (2**-12).
SIGMOID_ONE = {"bf16": math.log(511), "fp16": math.log(4095)}


def _output_grad_evidence(snap: dict, low: str) -> list[Evidence]:
    """The few output elements whose gradient from the loss is NaN/inf, and their values."""
    grad = SnapshotDetail.from_json(snap["detail"]).output_grad or OutputGrad()
    values = grad.output_values or []
    if not values or not 0 < grad.nonfinite < grad.numel:
        return []
    text = ("the gradient the loss sent into the model's output is NaN/inf at "
            f"{grad.nonfinite} of {grad.numel} elements, where the output is "
            + " or ".join(fmt(v) for v in values))
    if min(values) >= SIGMOID_ONE[low]:
        text += f": a sigmoid of it is exactly 1.0 in {low}, and log(1 - p) = -inf"
    return [Evidence(text, "loss_output_grad", float(grad.nonfinite), snap["step"])]


def rule_loss_backward(f: Facts) -> Optional[Finding]:
    """C7b (backward): the loss and the model are finite, but the loss's backward sends inf into
    the model's output at any scale (BCELoss on an fp16 sigmoid saturated to 1.0, sqrt or log
    at 0): GradScaler skips step after step while every loss is finite."""
    if f.failure_index is None or not f.story.collapsed:
        return None  # one overflow at a high scale is calibration (taxonomy C0)
    snaps = [x for x in f.snapshots if x["phase"] == "loss" and x["step"] >= f.failure_step
             and _loss_backward_only(x) and not _calibration_artefact(f, x)]
    seen = snaps[0] if snaps else root_grad_output(f)  # a replay, else the sampled tier
    if seen is None:
        return None
    if any(x["phase"] in ("forward", "backward", "input") and x["step"] >= f.failure_step
           and x["step"] < seen["step"] for x in f.snapshots):
        return None  # a module failed first
    if snaps:
        ev = [Evidence(_loss_snapshot_text(snaps[0]), "replay_loss_backward", None,
                       snaps[0]["step"])]
    else:
        ev = [Evidence(f"sampled step {seen['step']}: the first non-finite value is the "
                       f"gradient arriving at the model's output ({seen['module']}), from the "
                       "loss's backward; every module output is finite",
                       "sampled_loss_backward", None, seen["step"], seen["module"])]
    ev.append(_skipping_text(f, f.failure_index))
    first = f.failure_step
    ctx = f.fix_context(step=first)
    sing = singular.measured(f, first)
    ids = ["loss_on_logits", "loss_in_fp32"]
    summary = ("The loss's backward overflows: the model's outputs and the loss are finite, "
               "but the loss's derivative is infinite where fp16 rounded the model's output to "
               "a value the loss is singular at (a sigmoid saturated to 1.0 under BCELoss, a "
               "sqrt or log at 0). No loss scale fixes it: GradScaler skips step after step.")
    if sing is not None:
        ev.insert(1, singular.evidence(sing))
        ctx.singular = sing.context()
        if sing.fp32_singular:  # the formula, not fp16: a clamp first, not precision
            ids = ["clamp_loss_input"] + ids
            summary = (f"The loss's backward is singular: the model's outputs and the loss "
                       f"are finite, but {sing.name} in the loss reaches the point where its "
                       "derivative is infinite, in fp32 too: the singular point is in the "
                       "loss's formula, not in fp16's range. No loss scale and no precision "
                       "fixes it (GradScaler skips step after step); a clamp of that op's "
                       "input does.")
    return Finding("fp16_loss", 0.85 if snaps else 0.7, summary, ev, fixes.make(ids, ctx),
                   first_bad(first, None, "loss"), priority=PRIORITY["fp16_loss"],
                   kind="loss_backward", premises=[losses_finite(f)])


def losses_finite(f: Facts) -> Premise:
    """The loss's-backward verdict's premise ``losses_finite``: the recorded losses of the
    failing steps are finite (it is the backward that fails, not the loss). Where they are
    not, what lies between the replayed model's output and the loss (another model, a GAN's
    discriminator after its generator) made the loss non-finite, and the replay did not
    recompute it (blind4: an attention overflow read as the loss's backward at 0.85)."""
    i = f.failure_index
    if i is None:
        return Premise("losses_finite", NOT_MEASURED, "no failing step")
    bad = f.loss_bad[i:]
    if bad.any() and _value_minority(f):
        return Premise("losses_finite", HELD, f"the recorded loss was non-finite on only "
                       f"{int(bad.sum())} of the {int(f.skipped[i:].sum())} skipped steps from "
                       f"step {f.step_at(i)}: on the rest it was finite and its backward failed")
    if bad.any():
        return Premise("losses_finite", FAILED, f"the recorded loss was non-finite on "
                       f"{int(bad.sum())} of the {len(bad)} steps from step {f.step_at(i)}: the "
                       "loss itself failed, not only its backward")
    return Premise("losses_finite", HELD, f"the recorded loss was finite on all {len(bad)} "
                   f"steps from step {f.step_at(i)}")


def _value_minority(f: Facts) -> bool:
    """The recorded loss was non-finite on fewer than a quarter of the skipped steps from the
    first failing one: on most of them the loss was finite and the step still failed (a focal
    loss whose log saw a 0 on 5 of 141 skipped steps, its power's derivative on the rest)."""
    i = f.failure_index
    if i is None:
        return False
    skipped = int(f.skipped[i:].sum())
    return skipped > 0 and int((f.loss_bad[i:] & f.skipped[i:]).sum()) * 4 < skipped


def _calibration_artefact(f: Facts, snap: dict) -> bool:
    """A replay of a skip that GradScaler's calibration or probing explains, with a finite loss:
    whichever phase overflowed at that scale (an fp16 loss always does at 65536), it is
    healthy."""
    if not f.n or SnapshotDetail.from_json(snap["detail"]).loss_nonfinite:
        return False
    i = f.index_of(snap["step"])
    return f.step_at(i) == snap["step"] and bool(f.story.benign_mask[i])


def _fp32_too(snap: dict) -> bool:
    """The replay recomputed the loss in fp32 and it was non-finite there too: not fp16's."""
    fp32 = SnapshotDetail.from_json(snap["detail"]).loss_fp32
    return fp32 is not None and fp32.loss_finite is False


def _loss_backward_only(snap: dict) -> bool:
    """A loss replay whose loss is finite, and whose loss scale fits the loss's dtype, but whose
    backward sent NaN/inf into the model's output: the loss's derivative, not its value."""
    d = SnapshotDetail.from_json(snap["detail"])
    return bool(d.output_grad_nonfinite) and not d.loss_nonfinite and \
        not (d.loss and d.loss.grad_nonfinite)


def _loss_snapshot_text(snap: dict) -> str:
    """What a loss replay saw, from its detail (never more than it saw)."""
    d = SnapshotDetail.from_json(snap["detail"])
    loss = d.loss or LossInfo()
    dtype = loss.dtype or "?"
    head = f"replay of step {snap['step']}: every module output is finite"
    if d.loss_nonfinite:
        return f"{head}; the loss ({dtype}) is not"
    if loss.grad_nonfinite:
        return (f"{head} and so is the loss ({fmt(loss.value)}, {dtype}), but the loss "
                f"scale {fmt(loss.grad_fp32)} does not fit the {dtype} loss: the "
                f"gradient reaching it is {fmt(loss.grad_fp32)} cast to {dtype} = inf")
    text = (f"{head} and so is the loss ({fmt(loss.value)}, {dtype}), but the gradient "
            "the loss's backward sends into the model's output is not")
    grad = d.output_grad or OutputGrad()
    if grad.numel:
        text += (f" ({grad.nonfinite} of {grad.numel} elements NaN/inf, the largest "
                 f"finite one {fmt(grad.finite_absmax)})")
    values = grad.output_values
    if values:
        shown = " or ".join(fmt(v) for v in values)
        saturated = all(v in (0.0, 1.0) for v in values)
        text += (f"; the model's output is exactly {shown} there (saturated in fp16)"
                 if saturated else f"; the model's output there is {shown}")
    return text


def _skipping_text(f: Facts, fi: int) -> Evidence:
    """The skipping from the failing step ``fi`` on, with every loss finite: no scale fits."""
    story = f.story
    skipped = int(f.skipped[fi:].sum())
    finite = not f.loss_bad[fi:].any()
    return Evidence(f"the skipping began at step {f.failure_step} and went on ({skipped} of "
                    f"{f.n - fi} steps skipped) while the scale fell from "
                    f"{fmt(story.calibrated_scale)} to {fmt(story.final_scale)}"
                    + (", every loss finite" if finite else "")
                    + ": no scale fits, the loss's derivative is infinite at these values "
                    "(a probability rounded to 1.0 or 0.0 in fp16 under BCELoss, a power "
                    "below 1, a log or a division at 0)", "loss_backward_skips",
                    float(skipped), f.failure_step)
