"""Who went non-finite first, decided over a replay's ``Trace``: the ``Culprit``.

``decide`` names, in this order: the first module in execution order whose output is
non-finite while its inputs are finite, preferring the innermost one that explains it (a
module that turns a SOFT -inf into NaN/+inf hands the blame to the module that produced the
-inf from finite inputs); else the first module in backward order whose grad_input (or own
parameter gradient) is non-finite while its grad_output is finite; else the batch (phase
input) or the loss; else nothing (the replay stayed finite). ``bad_batch`` is the finding for
a batch that already held NaN/inf; ``describe`` adds the culprit's statistics to a finding.

Example::

    finding = decide(trace, soft_inputs=[])
    finding.phase, finding.module, finding.summary
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Union

import numpy as np
import torch

from ...runfile.detail import LossInfo, OutputGrad, Rows
from ...runfile.payloads import SnapshotDetail
from ...runfile.schema import Phase
from .. import stats
from .trace import CLEAN, HARD, ROOT_INPUT, SOFT, UNKNOWN, Call, Capture, Trace


@dataclass
class Culprit:
    """What a replay concluded; forensics turns it into a snapshot and a ReplayResult."""

    phase: Phase
    call: Optional[Call] = None
    module: str = ""
    module_type: str = ""
    culprit_slot: Optional[int] = None  # the slot named in the snapshot's culprit column
    summary: str = ""
    detail: SnapshotDetail = field(default_factory=SnapshotDetail)
    fp32_finite: Optional[bool] = None
    fp32_absmax: float = math.nan
    in_absmax: float = math.nan
    out_absmax: float = math.nan
    fp32_rows: list = field(default_factory=list)  # (Slot, stats row) of the fp32 re-run
    culprit_inputs: list = field(default_factory=list)  # (label, tensor) it was given


def bad_batch(trace: Trace, bad: list) -> Culprit:
    labels = [label for label, _, _ in bad]
    first = bad[0][1]
    f = Culprit(Phase.INPUT, module=trace.root_name, module_type=type(trace.root).__name__,
                culprit_slot=first)
    f.in_absmax = float(np.nanmax(trace.rows["absmax"][[s for _, s, _ in bad]]))
    f.detail.bad_inputs = [trace.summary(s) for _, s, _ in bad]
    f.summary = (f"the batch given to {trace.root_name} already held NaN/inf "
                 f"({', '.join(labels[:4])}): the data, not the model")
    return f


def decide(trace: Trace, soft_inputs: list) -> Culprit:
    if trace.error is not None and not trace.calls:
        failed = Culprit(Phase.UNKNOWN, summary=f"the replay failed: {trace.error}")
        failed.detail.replay_error = trace.error
        return failed
    f = _forward_culprit(trace) or _backward_culprit(trace)
    if f is None and soft_inputs and trace.out_level(trace.calls[0]) != CLEAN:
        f = bad_batch(trace, soft_inputs)
    if f is None and trace.error is not None:
        f = Culprit(Phase.UNKNOWN, summary=f"the replay failed: {trace.error}")
    if f is None:
        f = _loss_or_nothing(trace)
    f.detail.chain = trace.chain()
    if trace.error is not None:
        f.detail.replay_error = trace.error
    if trace.backward_note:
        f.detail.backward_not_replayed = trace.backward_note
    return f


def _innermost_first(trace: Trace, producers: set[int]) -> Optional[Call]:
    """First producer in execution order that no descendant producer explains."""
    for call in trace.calls:
        if call.index not in producers:
            continue
        if any(i in producers for i in range(call.index + 1, max(call.end, call.index + 1))):
            continue
        return call
    return None


def _forward_culprit(trace: Trace) -> Optional[Culprit]:
    hard = {c.index for c in trace.calls
            if trace.out_level(c) == HARD and trace.in_level(c) < HARD}
    call = _innermost_first(trace, hard)
    how = "its output holds NaN/inf while its inputs are finite"
    if call is not None and trace.in_level(call) == SOFT:
        producer = _soft_origin(trace, call)
        if producer == ROOT_INPUT:
            bad = [(lab, s, SOFT) for lab, s, src in call.inputs
                   if trace.level(s) == SOFT and src == ROOT_INPUT]
            return bad_batch(trace, bad)
        if isinstance(producer, Call) and producer.index < call.index < producer.end:
            how = (f"its own code (between its submodules) made -inf from finite inputs; "
                   f"{call.name} turned it into NaN/inf")
            call = producer
        elif isinstance(producer, Call):
            how = (f"its output holds -inf (its inputs are finite), which "
                   f"{call.name} turned into NaN/inf")
            call = producer
        else:
            how = "it turned -inf in its inputs into NaN/inf"
    if call is None:
        soft = {c.index for c in trace.calls
                if trace.out_level(c) == SOFT and trace.in_level(c) == CLEAN}
        call = _innermost_first(trace, soft)
        how = "its output holds -inf while its inputs are finite"
    if call is None:
        return None
    f = _blame(trace, call, Phase.FORWARD)
    if call.end > call.index + 1 and how.startswith("its output holds NaN"):
        how += " (in its own code: no submodule of it went non-finite from finite inputs)"
    f.detail.how = how
    out_slots = [s for _, s in call.outputs if trace.level(s) != CLEAN]
    f.culprit_slot = out_slots[0] if out_slots else None
    return f


def _soft_origin(trace: Trace, call: Call, depth: int = 0) -> Union[Call, int, None]:
    """The module that produced the -inf a call received, from finite inputs of its own
    (``ROOT_INPUT``: the batch itself)."""
    for _, slot, src in call.inputs:
        if trace.level(slot) != SOFT:
            continue
        if src == ROOT_INPUT:
            return ROOT_INPUT
        if src == UNKNOWN:  # no module returned it: made by the code of a module around it
            found = _made_around(trace, call)
            if found is not None:
                return found
        if src < 0 or depth > len(trace.calls):
            continue
        producer = trace.calls[src]
        level = trace.in_level(producer)
        if level == CLEAN:
            return producer
        if level == SOFT:
            origin = _soft_origin(trace, producer, depth + 1)
            if origin is not None:
                return origin
    return None


def _made_around(trace: Trace, call: Call) -> Optional[Call]:
    """Who made the -inf a call received from no module's output (``h = x + mlp(ln1(x))`` in
    the parent's own forward): an earlier sibling whose output holds -inf from finite inputs
    (the parent's code passed it on), else the innermost enclosing call whose inputs are
    finite (its own code made it)."""
    for sib in trace.calls[call.parent + 1:call.index]:
        if sib.parent == call.parent and trace.out_level(sib) == SOFT and \
                trace.in_level(sib) == CLEAN:
            return sib
    up = call.parent
    while up >= 0:
        parent = trace.calls[up]
        if trace.in_level(parent) == CLEAN:
            return parent
        up = parent.parent
    return None


def _backward_culprit(trace: Trace) -> Optional[Culprit]:
    ranked = []
    for call in trace.calls:
        fired = [f for s, f in call.grad_in if trace.bad(s)]
        if fired:
            ranked.append((min(fired), -call.index, call))
    for _, _, call in sorted(ranked, key=lambda r: (r[0], r[1])):
        if any(trace.bad(s) for s, _ in call.grad_out):
            continue
        f = _blame(trace, call, Phase.BACKWARD)
        bad = [s for s, _ in sorted(call.grad_in, key=lambda x: x[1]) if trace.bad(s)]
        f.culprit_slot = bad[0]
        f.detail.how = ("its backward made NaN/inf gradients "
                           f"({', '.join(sorted({trace.slots[s].label for s in bad})[:4])}) "
                           "from a finite grad_output")
        return f
    return None


def _blame(trace: Trace, call: Call, phase: Phase) -> Culprit:
    f = Culprit(phase, call=call, module=call.name, module_type=type(call.module).__name__)
    f.detail.weights_nonfinite = _nonfinite_weights(call)
    return f


def _culprit_slots(call: Call, phase: Phase) -> tuple[list, list]:
    """Slots of what goes into and out of the culprit: its forward, or its backward (whose
    input is grad_output and outputs are grad_input and its own parameters' gradients)."""
    if phase == Phase.FORWARD:
        return [s for _, s, _ in call.inputs], [s for _, s in call.outputs]
    return [s for s, _ in call.grad_out], [s for s, _ in call.grad_in]


def describe(trace: Trace, f: Culprit) -> None:
    """The culprit's abs max in and out, and a summary of each tensor (run precision)."""
    if f.call is None:
        return
    ins, outs = _culprit_slots(f.call, f.phase)
    f.in_absmax = _max_abs(trace.rows, ins)
    f.out_absmax = _max_abs(trace.rows, outs, finite_only=False)
    f.detail.run = Rows(inputs=[trace.summary(s) for s in ins][:16],
                           outputs=[trace.summary(s) for s in outs][:16])


def _max_abs(rows: np.ndarray, slots: list, finite_only: bool = True) -> float:
    """Largest abs max over slots; with finite_only, of the finite ones when there are any."""
    if not slots:
        return math.nan
    values = rows["absmax"][slots].astype(np.float64)
    finite = values[np.isfinite(values)]
    if finite_only and len(finite):
        return float(finite.max())
    return float(np.nanmax(values)) if not np.isnan(values).all() else math.nan


def _nonfinite_weights(call: Call) -> list[str]:
    """The culprit's own parameters and buffers that already hold NaN/inf (poisoned state)."""
    named = list(call.module.named_parameters()) + list(call.module.named_buffers())
    return [n for n, t in named if stats.measurable(t) and not bool(torch.isfinite(t).all())]


def _loss_or_nothing(trace: Trace) -> Culprit:
    cap = trace.cap
    grads_bad = [i for i, g in cap.grads.items() if stats.measurable(g)
                 and not bool(torch.isfinite(g).all())]
    loss_bad = any(not bool(torch.isfinite(loss).all()) for loss, _ in cap.losses)
    if not grads_bad and not loss_bad:
        return Culprit(Phase.NONE, summary="the replay of this micro-batch stayed finite")
    f = Culprit(Phase.LOSS)
    f.detail.output_grad_nonfinite = bool(grads_bad)
    f.detail.loss_nonfinite = loss_bad
    if grads_bad:
        f.detail.output_grad = _output_grad_detail(trace, grads_bad)
    loss_info = _loss_info(cap)
    f.detail.loss = loss_info
    f.in_absmax = _max_abs(trace.rows, [s for _, s in trace.calls[0].outputs]) \
        if trace.calls else math.nan
    dtype = loss_info.dtype
    scale = loss_info.grad_fp32
    if loss_bad:
        f.summary = (f"the model output is finite but the loss ({dtype}) is not: the loss "
                     "computation outside the model (or its targets) made the NaN/inf")
    elif loss_info.grad_nonfinite and dtype in ("float16", "bfloat16") and scale:
        f.summary = (f"the loss is finite but the gradient arriving at it, {scale:g} (the "
                     f"loss scale), overflows {dtype}: compute the loss in float32")
        f.fp32_finite = math.isfinite(scale)
        f.fp32_absmax = scale
    else:
        f.summary = ("the model output is finite but the gradient of the loss with respect "
                     "to it is not: the loss's backward, outside the model, overflowed")
    return f


# Model output values listed where the loss's gradient is non-finite (the values its derivative
# is infinite at: a sigmoid saturated to exactly 1.0 in fp16 shows as [1.0]).
OUTPUT_VALUES_SHOWN = 4


def _output_grad_detail(trace: Trace, bad: list[int]) -> OutputGrad:
    """The gradient the loss's backward sent into the model's first bad output: how many
    elements are non-finite, the largest finite magnitude (far below 65504 beside inf says a
    singularity, not a scale too high) and the output's values where it is non-finite.
    Runs on the event only (host reads are fine here)."""
    i = bad[0]
    grad = trace.cap.grads[i]
    finite = torch.isfinite(grad)
    kept = grad[finite]
    out = OutputGrad(index=i, nonfinite=int((~finite).sum()), numel=int(grad.numel()),
                     dtype=str(grad.dtype).replace("torch.", ""),
                     finite_absmax=float(kept.abs().max().float()) if kept.numel() else 0.0)
    value = trace.outputs[i] if i < len(trace.outputs) else None
    if isinstance(value, torch.Tensor) and value.shape == grad.shape:
        at = value.detach()[~finite].float().unique()
        out = replace(out, output_values=[float(v) for v in at[:OUTPUT_VALUES_SHOWN]],
                      output_values_n=int(at.numel()))
    return out


def _loss_info(cap: Capture) -> LossInfo:
    """dtype and value of this micro-batch's loss, and the gradient that reached it."""
    if not cap.losses:
        return LossInfo()
    # The first loss that went wrong (a step may add several), else the first.
    loss, holder = next((x for x in cap.losses if not bool(torch.isfinite(x[0]).all())),
                        cap.losses[0])
    info = LossInfo(dtype=str(loss.dtype).replace("torch.", ""),
                    value=float(loss.float().sum()))
    scale = holder.get("scale")
    if scale is None:
        return info
    # GradScaler multiplies the loss by S in fp32, so the gradient reaching the loss is S
    # itself, cast to the loss's dtype: it overflows an fp16 loss once S > 65504.
    grad = float(torch.tensor(scale, dtype=torch.float32).to(loss.dtype))
    return replace(info, grad_fp32=float(scale), grad=grad, grad_nonfinite=not math.isfinite(grad))
