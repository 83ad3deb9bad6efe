"""C3 (backward): one op whose derivative is too large for fp16, in a run that still trains.

GradScaler answers a gradient overflow by halving the scale, so an op whose backward
multiplies the incoming gradient by ~1e6 (a norm's 1/sqrt(var + eps) on all-zero padded rows
with BERT's eps=1e-12, a division by a value near 0) does not make a loss NaN: the scale
falls until the amplified gradient fits, the loss goes on falling, and ``overflow``'s rule
reads each replayed skip as the scale's calibration (the unscaled gradient fits fp16). What
tells it apart is the ratio the replay measured across that one module's backward, in fp32:
its grad_input's abs max over its grad_output's. A sound op keeps it within a few hundred; a
ratio of ``AMPLIFIED`` or more, with skips that recur after the calibration and a scale
driven down ``FALL`` x or more, is the op's doing, not probing: ``unstable_op``, at a
confidence below a located overflow's (the run is not broken yet; at so low a scale small
gradients underflow).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...numfmt import count, fmt
from .. import culprit, fixes
from ..facts import Facts
from ..verdict import PRIORITY, Evidence, Finding, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("scale",),
         "stats": ()}

AMPLIFIED = 1e4  # a backward's fp32 grad_input abs max over its grad_output's
FALL = 1024.0  # the scale's fall from its first value (ten halvings)
CONFIDENCE = 0.6


def rule_amplified_backward(f: Facts) -> Optional[Finding]:
    """A replayed backward culprit that amplifies its gradient ``AMPLIFIED`` x in fp32, in a
    run whose skips recur after calibration while the scale fell ``FALL`` x: the op, named."""
    story = f.story
    if not f.has_scaler or story.benign or story.post_skips < 3 or \
            f.low_precision != "fp16" or culprit.failure_replay(f) is not None:
        return None  # (a replay that locates the failure is overflow.rule_culprit's)
    first = float(f.steps["scale"][0]) if f.n else math.nan
    low = min(story.min_scale, story.final_scale)
    if not (first > 0 and low > 0 and first / low >= FALL):
        return None
    snap, ratio = _amplifier(f)
    if snap is None:
        return None
    module, cls = snap["module"], snap["module_type"]
    unscaled = float(snap["fp32_absmax"]) / float(snap["scale"])
    norm = "norm" in str(cls).lower()
    why = ("a norm's 1/sqrt(var + eps) on rows of zero variance (all-zero padded frames) with "
           "an eps too small for fp16: use eps >= 1e-5" if norm else
           "a division by a value near 0, the derivative of log/sqrt near 0")
    ev = [Evidence(f"replay of step {snap['step']}: the backward of {module} ({cls}) made "
                   f"inf/NaN from a finite grad_output; re-run in fp32 it multiplies its "
                   f"incoming gradient by ~{fmt(ratio)} ({fmt(float(snap['in_absmax']))} in, "
                   f"{fmt(float(snap['fp32_absmax']))} out)", "amplified_backward", ratio,
                   int(snap["step"]), module),
          Evidence(f"GradScaler skipped {count(story.post_skips, 'step')} after calibration, "
                   f"each with a finite loss: the scale fell from {fmt(first)} to {fmt(low)}",
                   "scale_fall", first / low)]
    text = (f"The backward of {module} ({cls}) multiplies its gradient by ~{fmt(ratio)} ({why}), "
            f"which overflows fp16 at any loss scale above ~{fmt(65504.0 / unscaled)}: "
            "GradScaler skips the batches that reach it and halves the scale each time. The "
            "loss still falls, but at so low a scale small gradients underflow fp16; run that "
            "op in fp32 (or remove the tiny denominator).")
    step = int(snap["step"])
    ctx = f.fix_context(module, cls, step)
    ctx.root = f.is_the_model(module)
    return Finding("unstable_op", CONFIDENCE, text, ev,
                   fixes.make(["fp32_island", "use_bf16"], ctx),
                   first_bad(step, module, "backward"), priority=PRIORITY["unstable_op"])


def _amplifier(f: Facts) -> tuple[Optional[dict], float]:
    """The replayed backward culprit, finite in fp32, with the largest ratio of its fp32
    grad_input's abs max to its grad_output's (``AMPLIFIED`` or more), and that ratio."""
    best, top = None, 0.0
    for s in f.snapshots:
        if s["phase"] != "backward" or s["fp32_finite"] != 1 or not s["scale"] > 0:
            continue
        into, out = float(s["in_absmax"]), float(s["fp32_absmax"])
        if not (np.isfinite(into) and into > 0 and np.isfinite(out)):
            continue
        if out / into >= max(AMPLIFIED, top):
            best, top = s, out / into
    return best, top
