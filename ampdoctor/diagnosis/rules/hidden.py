"""An overflow hidden inside a module (``unstable_op``, found by the sampled step's op probe).

``rule_hidden_overflow`` finds the overflow that never becomes a failure: an op inside a module
made inf/NaN on sampled steps while the module's output stayed finite (the sampled step's op
probe, ``record/opprobe.StepProbe``), in a run that has no NaN anywhere and does not learn, or
whose module output comes back mostly zeros (a hand-written fp16 RMSNorm: ``x * x`` inf,
``x / sqrt(inf)`` exactly 0). Where the loss still falls it is only a note (``hidden_note``).
Read from ``record/opprobe.StepProbe``'s events by ``events.hidden_nonfinite``; the findings
that speak of the precision, which ``notes.py`` and ``forecast.py`` read too, and the note are
in ``diagnosis/opprobe.py``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...numfmt import count, fmt
from .. import fixes
from ..facts import Facts
from ..opprobe import hidden_overflows, kinds_made
from ..progress import loss_evidence
from ..verdict import PRIORITY, Evidence, Finding, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": (),
         "stats": ("layer_out_zeros", "sampled")}

# A module output whose sampled elements are at least half exactly 0 "comes out as zeros": with
# a hidden overflow inside, the verdict needs no flat loss (a run too short to judge).
ZEROED = 0.5
# ... and a norm whose square overflows (x * x inf, x / sqrt(inf) exactly 0) at this share of
# its output zeroed loses those rows, whether the loss still falls or not (a norm's output is
# exactly 0 only where its whole input row is): a share that grows as the stream does.
NORM_ZEROED = 0.05


def rule_hidden_overflow(f: Facts) -> Optional[Finding]:
    """An op inside a module overflows in fp16/bf16 on sampled steps while the module's output
    stays finite, with no failure anywhere, and the loss does not fall (or the output comes
    out mostly zeros)."""
    hits = hidden_overflows(f)
    if not hits or f.failure_index is not None or f.loss_bad.any():
        return None
    first = hits[0]
    module, c = first["module"], f.curve
    zeroed = _zeroed(f, first)
    flat = c.judged and not c.fell
    squared = _is_norm(module, first["type"]) and first["op"] in SQUARES
    if not flat and not zeroed >= ZEROED and not (squared and zeroed >= NORM_ZEROED):
        return None  # the model learns anyway: a note on the healthy verdict (hidden_note)
    ev = _hidden_evidence(f, hits, zeroed)
    if c.judged:
        ev.append(loss_evidence(f, c))
    skipped = int(f.skipped.sum())
    ev.append(Evidence("no inf/NaN in any loss" + (
        " or gradient, no step skipped" if not skipped else
        f"; {count(skipped, 'step')} skipped by GradScaler (inf/NaN in the scaled gradients "
        "there, a finite loss)") + (f", the loss scale at {fmt(f.story.final_scale)} at the "
                                    "end" if f.has_scaler else "")
        + f": {module}'s output is finite, so what follows it never sees the overflow as one",
        "hidden", None))
    norm = _is_norm(module, first["type"])
    ids = (["norm_in_fp32"] if norm else []) + ["fp32_island", "use_bf16"]
    ctx = f.fix_context(module, first["type"], first["step"])
    ctx.op = first["op"]
    # The island covers every module the same overflow was seen in (and their siblings in
    # each ModuleList): the one named first alone leaves the others to overflow.
    seen = list(dict.fromkeys(h["module"] for h in hits))
    ctx.siblings = list(dict.fromkeys(m for name in seen for m in f.siblings(name)))
    low = "fp16" if first["dtype"] == "float16" else "bf16"
    limit = "65504" if low == "fp16" else "3.4e38"
    what = (f" (x * x passes {limit}; its mean is inf and x / sqrt(inf) is exactly 0)"
            if norm and first["op"] in SQUARES else "")
    zeros = f", and {zeroed:.0%} of its output is exactly 0" if zeroed >= 0.01 else ""
    stalls = "; the loss does not fall" if flat else ""
    quiet = ("No NaN reaches the loss and no step was skipped" if not skipped else
             f"No NaN reaches the loss, and only {count(skipped, 'step')} "
             f"{'was' if skipped == 1 else 'were'} skipped")
    return Finding("unstable_op", 0.85 if flat and len({h["step"] for h in hits}) >= 2 else 0.7,
                   f"An op inside {module} {_verb(first['created'])} {low} although the "
                   "module's output stays "
                   f"finite: {first['op']} makes {kinds_made(first['created'])} from finite inputs"
                   f"{what}{zeros}. {quiet}: the "
                   f"{'NaN' if first['created'] == 1 else 'overflow'} is hidden inside the "
                   f"module{stalls}. Computing it in fp32 fixes it.", ev,
                   fixes.make(ids, ctx), first_bad(first["step"], module, "forward"),
                   priority=PRIORITY["sampled"], kind="hidden_overflow",
                   explains_modules=frozenset(seen))


def _hidden_evidence(f: Facts, hits: list[dict], zeroed: float) -> list[Evidence]:
    first = hits[0]
    module = first["module"]
    steps = sorted({h["step"] for h in hits if h["module"] == module})
    sampled = int(f.reduced.sampled.sum())
    inner = f" (in {first['inner']})" if first["inner"] and first["inner"] != module else ""
    kind = f" ({first['type']})" if first["type"] else ""
    ev = [Evidence(f"on sampled step {first['step']}, {first['op']}{inner} inside {module}{kind} "
                   f"made {kinds_made(first['created'])} in {first['dtype']} from finite inputs, "
                   f"and {module}'s output stayed finite; seen on {len(steps)} of {sampled} "
                   f"sampled steps ({_span(steps)}){_flat_probed(f, steps)}",
                   "hidden_overflow", float(len(steps)), first["step"], module)]
    others = list(dict.fromkeys(h["module"] for h in hits if h["module"] != module))
    if others:
        ev.append(Evidence(f"the same in {count(len(others), 'more module')}: "
                           + ", ".join(others[:4]) + (" ..." if len(others) > 4 else ""),
                           "hidden_elsewhere", float(len(others))))
    if zeroed >= 0.01:
        ev.append(Evidence(f"{zeroed:.0%} of {module}'s sampled output elements are exactly 0 "
                           "(mean over its sampled steps): what the overflow leaves behind",
                           "output_zeroed", zeroed, None, module))
    return ev


def _flat_probed(f: Facts, steps: list[int]) -> str:
    """What of ``steps`` the recorder probed only because the loss had stopped falling (the
    interval alone would not have looked there): a clause for the evidence, or ""."""
    probed = [s for s in steps if s in f.flat_probes]
    if not probed:
        return ""
    p = f.flat_probes[probed[0]]
    which = f"step {probed[0]} was" if len(probed) == 1 else \
        f"steps {', '.join(str(s) for s in probed[:-1])} and {probed[-1]} were"
    return (f"; {which} sampled because the loss had stopped falling (by step {probed[0]}, "
            f"{p['flat_steps']} steps in a row with the median of the last ten at "
            f"{fmt(p['recent'])}, against {fmt(p['start'])} at the start)")


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"{steps[0]}..{steps[-1]}"


def _zeroed(f: Facts, hit: dict) -> float:
    t = hit["tensor"]
    z = f.reduced.layer_out_zeros
    return float(z[t]) if 0 <= t < len(z) and np.isfinite(z[t]) else 0.0


# The ops a norm squares with.
SQUARES = ("mul", "pow", "square")


def _is_norm(module: Optional[str], module_type: Optional[str]) -> bool:
    text = f"{module_type or ''} {(module or '').rsplit('.', 1)[-1]}".lower()
    return "norm" in text


def _verb(bits: int) -> str:
    """An op that made only NaN did not overflow (a domain error: 0/0, sqrt of a negative)."""
    return "makes NaN without overflowing in" if bits == 1 else "overflows"
