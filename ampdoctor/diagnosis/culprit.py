"""What the forensic replays and the sampled tier say about where the first non-finite value
was made: the replay that describes a failing step, the module and op that produced the value
(following a -inf that a later module turned into NaN back to its producer), the culprit's fp32
re-run, and the evidence lines that tell it. No verdict is decided here: the rules in
``rules/overflow.py``, ``rules/located.py`` and ``rules/fallbacks.py`` read these.

A replay snapshot is the dict ``Facts.snapshots`` makes of one ``/snapshots`` row (``phase``,
``module``, ``module_type``, ``fp32_finite`` 1/0/-1, ``fp32_absmax``, ``in_absmax``, ``scale``,
``detail``: what ``record/forensic/replay.py`` found, parsed from JSON).

Example::

    snap = snapshot_at(f, f.failure_step)   # the replay that located the failure, or None
    evidence(f, snap, op_of(snap))
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np

from ..numfmt import fmt
from ..runfile import schema
from ..runfile.detail import OpRecord
from ..runfile.payloads import SnapshotDetail
from .facts import Facts
from .fixes.premises import DOMAIN as DOMAIN
from .fixes.premises import FP32_MAX as FP32_MAX
from .fixes.premises import OPERAND as OPERAND
from .fixes.premises import OVERFLOW as OVERFLOW
from .fixes.premises import nonfinite_kind as nonfinite_kind
from .fixes.premises import squares_overflow as squares_overflow
from .verdict import Evidence

# -- which replay describes the failure ----------------------------------------------------


def replay_out_absmax(f: Facts) -> Optional[tuple[int, float]]:
    """The first replay at or after the failure, as a sample of the forward: its step and the
    largest finite module output it recorded in the run's own precision (None: no replay, or
    no finite output). A run shorter than the sampling interval has one sampled step; the
    replay of its failing step measures the same statistic there."""
    step = f.failure_step
    later = [s["step"] for s in f.snapshots if step is not None and s["step"] >= step]
    if not later:
        return None
    at, kinds, best = min(later), f.tensor_kinds, -1.0
    for rows in f.run.stats.chunks(f.chunk, names=("step", "tensor", "source", "absmax",
                                                    "nonfinite")):
        t = rows["tensor"]
        sel = ((rows["source"] == schema.Source.REPLAY) & (rows["step"] == at)
               & (rows["nonfinite"] == 0) & (t >= 0) & (t < len(kinds)))
        sel[sel] = kinds[t[sel]] == schema.Kind.OUTPUT
        absmax = rows["absmax"][sel].astype(float)
        absmax = absmax[np.isfinite(absmax)]
        best = max(best, float(absmax.max())) if len(absmax) else best
    return (int(at), best) if best > 0 else None



def snapshot_at(f: Facts, step: Optional[int]) -> Optional[dict]:
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


def _scale_explains(snap: dict) -> bool:
    """A backward overflow whose fp32 re-run is finite, beyond fp16 only by the loss scale: the
    unscaled gradient (fp32 abs max / S) fits fp16, so a lower scale fixes it, which GradScaler
    is there to find (taxonomy C0). A singularity (fp32 small, fp16 inf) is not this."""
    scale, absmax = snap["scale"], snap["fp32_absmax"]
    return snap["phase"] == "backward" and snap["fp32_finite"] == 1 and scale > 1 and \
        absmax > schema.FP16_MAX and absmax / scale <= schema.FP16_MAX


def failure_replay(f: Facts) -> Optional[dict]:
    """The replay that locates the failure: the first forward culprit from the failure on;
    else a backward one, but only when the skipping persists (an overflow of gradients alone,
    which GradScaler answers by lowering the scale, is its calibration at work: taxonomy C0)."""
    after = [s for s in f.snapshots if s["step"] >= f.failure_step]
    forward = [s for s in after if s["phase"] == "forward"]
    if forward:
        return forward[0]
    stale = any(SnapshotDetail.from_json(s["detail"]).stale_grads for s in f.snapshots)  # C6h
    if not stale and (f.story.collapsed or f.story.terminal_run >= 3):
        backward = [s for s in after if s["phase"] == "backward" and not _scale_explains(s)]
        return backward[0] if backward else None
    return None


def input_out_of_range(f: Facts, snap: dict) -> Optional[float]:
    """The batch's largest magnitude, when a forward culprit of an fp16 run was fed a batch
    beyond fp16's range (C5's range subtype); else None."""
    if snap["phase"] != "forward" or not snap["in_absmax"] > schema.FP16_MAX or \
            f.low_precision != "fp16":
        return None
    biggest, bad = f.batch_absmax(snap["id"])
    return biggest if biggest > schema.FP16_MAX or bad else None


# -- who made the value: module, producer, op ------------------------------------------------


def chain_origin(chain: list, roots: set) -> Optional[str]:
    """The first module in a replay's propagation chain (modules whose output went
    non-finite, in execution order) that is not a container of the next one."""
    names = [c for c in chain or [] if c not in roots]
    for i, name in enumerate(names):
        if i + 1 == len(names) or not names[i + 1].startswith(name + "."):
            return name
    return None


def producer(f: Facts, snap: dict) -> dict:
    """A culprit that only turned an incoming -inf into NaN (the replay could not follow the
    -inf back, e.g. through a residual add in the parent's own code) is not where the overflow
    happened: the first module of the propagation chain is. Returns the snapshot as seen from
    the producer (its fp32 verdict then unknown; ``passed_on_by``: the module that passed the
    -inf on, a key of the diagnosis's own, not of the file's detail)."""
    if "turned -inf in its inputs" not in str(SnapshotDetail.from_json(snap["detail"]).how or ""):
        return snap
    origin = chain_origin(SnapshotDetail.from_json(snap["detail"]).chain or [], f.root_names)
    if origin is None or origin == snap["module"]:
        return snap
    detail = replace(SnapshotDetail.from_json(snap["detail"]), op=None)  # the op was the passer's
    return dict(snap, module=origin, module_type=f.module_type(origin), fp32_finite=-1,
                in_absmax=math.nan, detail=detail, passed_on_by=snap["module"])


def op_of(snap: dict) -> Optional[OpRecord]:
    """The op the replay found inside ``snap``'s culprit (``detail.op``), or None."""
    return SnapshotDetail.from_json(snap["detail"]).op


def mask_pattern(op: Optional[OpRecord]) -> Optional[str]:
    """Does the first op that went non-finite look like an attention mask (C7a)? Returns the
    reason, or None.

    ``op`` is what the forensic replay recorded inside the culprit: the op's name, which kinds
    of non-finite value it created (``created``: a subset of nan/posinf/neginf) and the inputs
    it had. A mask overflows one-sidedly: a big negative constant becomes -inf (and only -inf);
    a row whose every entry is -inf then becomes NaN in softmax.
    """
    if op is None:
        return None
    created, name = set(op.created), op.op
    # A large operand is a mask only when one input is mask-like (one negative constant where
    # not 0): a dense residual add of two large activations making -inf is an overflow. Files
    # written before the probe recorded mask_operand keep the old reading.
    if created == {"neginf"} and (abs(op.big_scalar or 0) > schema.FP16_MAX or (
            op.mask_operand and (op.in_absmax or 0) >= schema.FP16_NEAR)):
        return (f"{name} turned a large negative constant "
                f"({fmt(-abs(op.big_scalar or op.in_absmax or 0))}) into -inf "
                f"in {op.dtype or 'fp16'}")
    if created == {"nan"} and "softmax" in name and op.in_neginf and \
            not op.in_posinf and not op.in_nan:
        return f"{name} of rows that are -inf everywhere (every key masked) gave NaN"
    return None


def evidence(f: Facts, snap: dict, op: Optional[OpRecord]) -> list[Evidence]:
    """What the replay of the failing step showed: the culprit, its first bad op, fp32."""
    module, phase = snap["module"], snap["phase"]
    passed = snap.get("passed_on_by")  # (producer)
    detail = SnapshotDetail.from_json(snap["detail"])
    poisoned = list(detail.weights_nonfinite or [])
    same = [s for s in f.snapshots if s["module"] == (passed or module) and s["phase"] == phase]
    made = detail.computed
    if made is not None:  # (record/forensic/computed.py)
        text = (f"replay of step {snap['step']}: the input given to {made.into} "
                f"({made.label}) held NaN/inf, but the step computed it: {detail.how}")
    elif passed:
        text = (f"replay of step {snap['step']}: {module} is the first module whose output "
                f"went non-finite (-inf); {passed} then turned it into NaN")
    elif poisoned:
        # A later step's replay (nanoGPT at LR 30: first bad step 4, the forward culprit step
        # 7's) finds weights an update already made non-finite: it shows no overflow.
        weights = ", ".join(f"{module}.{p}" for p in poisoned[:4])
        text = (f"replay of step {snap['step']}: the first non-finite value appears in the "
                f"{phase} of {module} ({snap['module_type']}), from finite inputs but with its "
                f"weights ({weights}) already non-finite: an earlier step's update wrote them, "
                "so this replay shows their poison, not where the failure began"
                + (f" (step {f.failure_step})" if f.failure_step < snap["step"] else ""))
    else:
        text = (f"replay of step {snap['step']}: the first non-finite value appears in the "
                f"{phase} of {module} ({snap['module_type']}) while its inputs are finite")
    ev = [Evidence(text + (f"; {len(same)} replays agree" if len(same) > 1 else ""),
                   "culprit", None, snap["step"], module)]
    if op is not None:
        ev.append(Evidence(_op_text(op, module), "first_nonfinite_op", op.in_absmax,
                           snap["step"], module))
        kind = nonfinite_kind(op)
        if kind is not None:
            ev.append(Evidence(kind_text(op, kind, snap["fp32_finite"]), "nonfinite_kind", None,
                               snap["step"], module))
    if snap["fp32_finite"] == 1:
        beyond = ", beyond fp16's 65504" if snap["fp32_absmax"] > schema.FP16_MAX else ""
        ev.append(Evidence(f"re-run in fp32, {module} is finite (output abs max "
                           f"{fmt(snap['fp32_absmax'])}{beyond})", "fp32_absmax",
                           snap["fp32_absmax"], snap["step"], module))
    elif snap["fp32_finite"] == 0:
        why = ("its weights are" if poisoned else
               "the values reaching it are themselves out of range")
        ev.append(Evidence(f"re-run in fp32, {module} is still non-finite: {why}",
                           "fp32_nonfinite", None, snap["step"], module))
    return ev


# -- the kind of non-finite value ------------------------------------------------------------

# The kinds (OVERFLOW, OPERAND, DOMAIN) and nonfinite_kind live beside the fixes' premises,
# which read them too (fixes/premises.py).


def kind_text(op: OpRecord, kind: str, fp32_finite: int) -> str:
    """The kind in one sentence, with what the same op did in fp32 (the culprit's re-run)."""
    name, dtype = op.op, op.dtype or "the run's precision"
    if kind == OVERFLOW:
        text = (f"{name} overflowed: finite inputs (up to {fmt(float(op.in_absmax or 0))})"
                f" and a result past {dtype}'s largest value")
    elif kind == OPERAND:
        text = (f"{name} made NaN from an inf among its inputs (0 x inf, or inf - inf): the inf "
                "was made earlier")
    elif squares_overflow(op):
        text = (f"{name} made NaN from finite inputs up to {fmt(float(op.in_absmax or 0))}, "
                f"whose squares pass fp32's largest value ({fmt(FP32_MAX)}): its variance "
                "overflowed inside the op and inf - inf is NaN (an overflow, not a domain "
                "error)")
    else:
        text = (f"{name} made NaN from finite inputs: no overflow, a domain error (sqrt or log of "
                "a negative, 0/0, an empty reduction, a fully masked softmax row)")
    fp32 = {1: "; in fp32 the same code is finite", 0: "; in fp32 it is non-finite too"}
    return text + fp32.get(fp32_finite, "; fp32 was not tried")


def _op_text(op: OpRecord, module: str) -> str:
    created = ", ".join({"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}.get(c, c)
                        for c in op.created)
    text = (f"inside {module}, the first op to produce {created or 'non-finite values'} is "
            f"{op.op} ({op.dtype or '?'}")
    if op.in_absmax is not None:
        text += f", inputs up to {fmt(float(op.in_absmax))}"
    return text + ")"


# -- the sampled tier ------------------------------------------------------------------------


def root_grad_output(f: Facts) -> Optional[dict]:
    """The sampled tier's first non-finite gradient, when it is the one arriving at the model's
    own output (it came from the loss's backward) and no module output was non-finite."""
    st = f.reduced
    x = st.first_backward
    if not x or x["module"] not in f.root_names or x["step"] < f.failure_step:
        return None
    return x if not (st.first_forward and st.first_forward["step"] <= x["step"]) else None
