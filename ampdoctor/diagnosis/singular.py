"""Is the loss's backward singular in fp32 too? What the forensic tier measured, as a fact.

Where the loss's backward sends inf/NaN into the model's output while the loss is finite
(``fp16_loss`` of kind ``loss_backward``), the recorder checks the loss's derivative at the
failing values in fp32 (``record/forensic/singular.py``):

* a loss written by hand: the op of its autograd graph whose derivative is infinite at a point
  (a power below 1, sqrt, log at 0; acos, asin at +-1), its input read before a later failing
  step's backward, an ``Event.LOSS_SINGULAR`` row: how many values sit exactly at the point,
  the op's derivative there in fp32, the ``eps`` a clamp needs (the nearest any value came to
  the point with a finite derivative in the run's dtype) and that clamp tried on the values;
* a torch loss function: the replay's snapshot (``loss_singular_fp32``): the loss recomputed
  in fp32 on the replayed outputs and differentiated there.

Singular in fp32 too means the singular point is in the loss's formula, not in fp16's range:
neither precision nor a loss scale fixes it, and the first fix is a clamp of the op's input
(``clamp_loss_input``). Finite in fp32 means fp16's range is what the derivative passed.

Example::

    s = measured(Facts(run), since=12)
    s.op, s.fp32_singular, s.eps          # ('pow', True, 0.00049)
    evidence(s).text                      # 'at step 25 the input of pow(x, 0.5) in the loss ...'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..numfmt import fmt
from ..runfile.detail import TriedFix
from ..runfile.payloads import LossSingular, SnapshotDetail
from ..runfile.schema import Event
from .verdict import Evidence

# The derivative of each op, as the evidence writes it.
DERIVATIVES = {"pow": "its derivative {e} * x ** {e1}", "sqrt": "its derivative 0.5 / sqrt(x)",
               "log": "its derivative 1 / x", "log2": "its derivative 1 / (x ln 2)",
               "log10": "its derivative 1 / (x ln 10)", "log1p": "its derivative 1 / (1 + x)",
               "acos": "its derivative -1 / sqrt(1 - x**2)",
               "asin": "its derivative 1 / sqrt(1 - x**2)"}


@dataclass
class Singular:
    """What one check of the loss's derivative at the failing values found."""

    step: int
    source: str  # "graph" (a hand-written loss's op) or "torch_loss"
    op: str  # "pow", "sqrt", "log", ... or the torch loss function's name
    fp32_nonfinite: int
    fp32_largest: Optional[float] = None
    numel: int = 0
    exponent: Optional[float] = None
    points: tuple = (0.0,)
    dtype: str = ""
    at_point: int = 0
    nearest: Optional[float] = None
    eps: Optional[float] = None
    clamped_nonfinite: Optional[int] = None
    clamped_largest: Optional[float] = None

    @property
    def fp32_singular(self) -> bool:
        return self.fp32_nonfinite > 0

    @property
    def name(self) -> str:
        """The op as the texts name it: ``pow(x, 0.5)``, ``sqrt``, ``binary_cross_entropy``."""
        if self.op == "pow" and self.exponent is not None:
            return f"pow(x, {self.exponent:g})"
        return self.op

    def context(self) -> dict:
        """What the clamp's snippet needs (``fixes.Context.singular``)."""
        return {"op": self.op, "exponent": self.exponent, "eps": self.eps, "step": self.step,
                "dtype": self.dtype, "points": list(self.points), "source": self.source}


def measured(f: Any, since: Optional[int]) -> Optional[Singular]:
    """The first check at or after step ``since``: a hand-written loss's op (the most singular
    of those its graph held), else a torch loss function's fp32 derivative."""
    start = since if since is not None else -1
    for row in f.events(Event.LOSS_SINGULAR):
        if int(row["step"]) < start:
            continue
        found = _from_event(int(row["step"]), str(row["text"]))
        if found is not None:
            return found
    for s in f.snapshots:
        d = SnapshotDetail.from_json(s["detail"]).loss_singular_fp32
        if s["step"] >= start and d is not None:
            fns = d.loss_fns or ["the loss"]
            return Singular(s["step"], "torch_loss", fns[0], d.nonfinite, d.largest, d.numel)
    return None


def _from_event(step: int, text: str) -> Optional[Singular]:
    for m in LossSingular.from_text(text).ops:
        if m.fp32 is None or m.op == "div":  # (a division's denominator: ``zero_count``'s)
            continue
        clamped = m.clamped
        return Singular(step, "graph", m.op, m.fp32.nonfinite, m.fp32.largest, m.numel or 0,
                        m.exponent, tuple(m.points) or (0.0,), m.dtype or "", m.at_point or 0,
                        m.nearest, m.eps, clamped.nonfinite if clamped else None,
                        clamped.largest if clamped else None)
    return None


def zero_count(f: Any, since: Optional[int]) -> Optional[tuple[int, int]]:
    """(step, denominators at 0) of the first check at or after ``since`` that found a
    division in a hand-written loss by a denominator exactly 0 that no gradient reaches from
    the model: a count taken from the batch (a mask's sum, the labelled tokens), 0 on that
    batch, so the loss is 0/0 (or x/0) in fp32 as in fp16 (record/forensic/singular.py,
    armed where the loss itself went non-finite on finite outputs)."""
    start = since if since is not None else -1
    for row in f.events(Event.LOSS_SINGULAR):
        if int(row["step"]) < start:
            continue
        for m in LossSingular.from_text(str(row["text"])).ops:
            if m.op == "div" and m.constant and (m.at_point or 0) > 0:
                return int(row["step"]), int(m.at_point or 0)
    return None


def _point(s: Singular) -> str:
    return " or ".join(fmt(p) for p in s.points)


def evidence(s: Singular) -> Evidence:
    """The check in one line: singular in fp32 too (the formula), or finite there (fp16)."""
    if s.source == "torch_loss":
        if s.fp32_singular:
            text = (f"replay of step {s.step}: {s.op} recomputed in fp32 at the replayed outputs "
                    f"has a non-finite derivative at {s.fp32_nonfinite} of {s.numel} values: "
                    "singular in fp32 too, the singular point is in the loss's formula")
        else:
            text = (f"replay of step {s.step}: {s.op} recomputed in fp32 at the replayed outputs "
                    f"has a finite derivative everywhere (at most {fmt(s.fp32_largest)}): "
                    "fp16's range is what it passed, not a singular point")
        return Evidence(text, "loss_singular_fp32", float(s.fp32_nonfinite), s.step)
    where = (f"at step {s.step} the input of {s.name} in the loss (written by hand: read from "
             "its autograd graph before that step's backward)")
    e = s.exponent if s.exponent is not None else 0.5
    derivative = DERIVATIVES.get(s.op, "its derivative").format(e=f"{e:g}", e1=f"{e - 1:g}")
    if s.fp32_singular:
        text = (f"{where} is exactly {_point(s)} at {s.at_point} of {s.numel} values, where "
                f"{derivative} is infinite: non-finite at {s.fp32_nonfinite} of them in fp32 "
                "too. The singular point is in the loss's formula, not in fp16's range")
    else:
        near = f"comes within {fmt(s.nearest)} of {_point(s)}" if s.nearest is not None \
            else f"stays away from {_point(s)}"
        text = (f"{where} {near} and its derivative is finite there in fp32 (at most "
                f"{fmt(s.fp32_largest)}): not singular in fp32, fp16's range is what it passed")
    return Evidence(text, "loss_singular_fp32", float(s.fp32_nonfinite), s.step)


@dataclass(frozen=True)
class Clamped(TriedFix):
    """The clamp of a singular loss's op tried on its held values: a trial the diagnosis
    makes itself (never written to the file), its outcome already in words."""

    text: str = ""


def clamp_trial(s: Singular) -> Optional[Clamped]:
    """The clamp at ``eps`` tried on the held values (a trial of ``clamp_loss_input``, in the
    form ``proofs`` reads), or None when it was not measured."""
    if s.source != "graph" or s.eps is None or s.clamped_nonfinite is None:
        return None
    finite = s.clamped_nonfinite == 0
    clamp = f"{s.op}'s input clamped at eps={fmt(s.eps)}"
    if finite:
        outcome = (f"with this fix ({clamp}), {s.op}'s derivative at every value of step "
                   f"{s.step} is finite in {s.dtype} (at most {fmt(s.clamped_largest)}); the "
                   "rest of that step was not re-run (the loss is written by hand)")
    else:
        outcome = (f"still non-finite at step {s.step}: with {clamp}, its derivative is "
                   f"non-finite at {s.clamped_nonfinite} values: not enough on its own")
    return Clamped(tried=True, finite=finite, step=s.step, text=outcome)
