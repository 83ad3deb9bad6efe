"""What the forensic tier reports: ``ForensicEvent`` (``rec.events``), ``ReplayResult``
(``rec.replay(step)``, and each event's ``result``) and its ``TraceRow``s.

Example::

    rec.events[0]          # ForensicEvent(step=12, trigger='skipped', phase='forward',
                           #               module='blocks.0.attn', fp32='finite')
    r = rec.replay(12)
    print(r)               # one paragraph: where, what, and whether fp32 fixes it
    r.trace[0]             # TraceRow(order=0, kind='input', module='blocks.0', ...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ...runfile import schema
from ...runfile.payloads import SnapshotDetail
from ...runfile.schema import Event, Phase
from .culprit import Culprit
from .trace import Trace

TRIGGERS = {Event.SKIPPED: "skipped", Event.NONFINITE_LOSS: "nonfinite_loss",
            Event.NONFINITE_GRAD: "nonfinite_grad"}
FP32 = {True: "finite", False: "non-finite", None: "not run"}


@dataclass
class TraceRow:
    """One tensor measured in a replay, in the order it was seen."""

    order: int
    kind: str  # "input", "output", "grad_output", "grad_input", "param_grad"
    module: str
    label: str
    dtype: str
    absmax: float
    rms: float
    zeros: int
    nonfinite: bool


@dataclass
class ReplayResult:
    """What a forensic replay found. ``str(result)`` is one paragraph for a person.

    ``phase``: "forward", "backward", "input" (the batch held NaN/inf), "loss" (the loss,
    outside the model), "none" (the replay stayed finite) or "unknown" (it failed).
    ``fp32_finite``: True when the culprit re-run alone in fp32 is finite (an fp32 island
    fixes the step), False when it is non-finite in fp32 too (the values are too large: LR or
    data), None when no fp32 re-run applies.
    """

    step: int
    micro: int
    trigger: str
    phase: str
    module: Optional[str] = None
    module_type: Optional[str] = None
    fp32_finite: Optional[bool] = None
    fp32_absmax: float = math.nan
    in_absmax: float = math.nan
    out_absmax: float = math.nan
    summary: str = ""
    detail: SnapshotDetail = field(default_factory=SnapshotDetail, repr=False)
    faithful: bool = True
    snapshot: Optional[int] = None
    trace: list = field(default_factory=list, repr=False)

    @property
    def fp32(self) -> str:
        return FP32[self.fp32_finite]

    def __str__(self) -> str:
        return self.summary


@dataclass
class ForensicEvent:
    """An event the forensic tier caught: a skipped step, or a non-finite loss or grad norm."""

    step: int
    trigger: str
    replayed: bool = False
    result: Optional[ReplayResult] = None
    note: str = ""

    @property
    def phase(self) -> Optional[str]:
        return self.result.phase if self.result else None

    @property
    def module(self) -> Optional[str]:
        return self.result.module if self.result else None

    @property
    def fp32(self) -> Optional[str]:
        return self.result.fp32 if self.result else None

    def __repr__(self) -> str:
        if not self.replayed:
            return f"ForensicEvent(step={self.step}, trigger={self.trigger!r}, {self.note})"
        return (f"ForensicEvent(step={self.step}, trigger={self.trigger!r}, "
                f"phase={self.phase!r}, module={self.module!r}, fp32={self.fp32!r})")


def result(step: int, trigger: str, trace: Optional[Trace], f: Culprit, micro: int,
           captures: list) -> ReplayResult:
    """The ``ReplayResult`` of a replay's finding ``f`` (``micro``: the micro-batch it names,
    an index into ``captures``); the finding's detail gets its summary."""
    # A micro-batch is a backward call; a step may call the model more than once per one.
    micro = captures[micro].micro if 0 <= micro < len(captures) else 0
    f.detail.micro_batches = max((c.micro for c in captures), default=0) + 1
    f.detail.model_calls = len(captures)
    r = ReplayResult(step=step, micro=micro, trigger=trigger,
                     phase=f.phase.name.lower(), module=f.module or None,
                     module_type=f.module_type or None, fp32_finite=f.fp32_finite,
                     fp32_absmax=f.fp32_absmax, in_absmax=f.in_absmax,
                     out_absmax=f.out_absmax, detail=f.detail,
                     faithful=not f.detail.input_modified)
    r.summary = summary(r, f)
    f.detail.summary = r.summary
    if trace is not None:
        r.trace = [TraceRow(i, s.kind.name.lower(), s.name, s.label,
                            schema.DType(int(row["dtype"])).name.lower(),
                            float(row["absmax"]), float(row["rms"]), int(row["zeros"]),
                            bool(row["nonfinite"]))
                   for i, (s, row) in enumerate(zip(trace.slots, trace.rows))]
    return r


def summary(r: ReplayResult, f: Culprit) -> str:
    """One paragraph for a person: where, what went non-finite, and what fp32 says."""
    where = f"step {r.step}" + (f", micro-batch {r.micro}" if f.detail.micro_batches > 1
                                else "")
    if f.phase in (Phase.FORWARD, Phase.BACKWARD):
        text = (f"{where}: {f.module} ({f.module_type}) went non-finite in {r.phase}: "
                f"{f.detail.how or ''}.")
        if f.detail.weights_nonfinite:
            text += (" Its weights already hold NaN/inf "
                     f"({', '.join(f.detail.weights_nonfinite[:3])}): poisoned earlier.")
        if f.fp32_finite is True:
            what = "output" if f.phase == Phase.FORWARD else "backward"
            text += (f" Re-run alone in fp32 its {what} is finite (abs max "
                     f"{f.fp32_absmax:.4g}): an fp32 island around {f.module} fixes this step.")
        elif f.fp32_finite is False:
            text += (" It is non-finite in fp32 too: the values themselves are too large "
                     "(weights grown by the learning rate, or the data).")
        elif f.detail.fp32_error is not None:
            text += f" The fp32 re-run could not be done ({f.detail.fp32_error})."
        return text
    return f"{where}: {f.summary}."
