"""The step's loss as its torch loss calls combine into it, verified at the captured step.

A trial recomputes each torch loss function the step called (``losscall``); the loss the
step backwarded from may be their combination by hand: litgpt's ``chunked_cross_entropy``
calls ``cross_entropy(chunk, t, ignore_index=-100, reduction="none")`` once per chunk of the
logits, then ``torch.cat(...).sum() / (targets != -100).sum()``. A trial's loss is in the
run's own units only if it combines the recomputed calls the same way. ``combination`` tries
the combinations below, in order, on the captured results of the calls (what they returned
in the real step) against the loss the run backwarded (``Capture.losses``), micro-batch by
micro-batch, and keeps the first one that reproduces it within ``RTOL`` on every one (where
the step's loss is non-finite, nothing can be checked: one scalar call per micro-batch is
taken as the loss, as it is; several are not combined):

* ``sum``: every element of every call, summed (one call with a mean reduction: its value);
* ``mean of the calls``: that sum over the number of calls (each a scalar);
* ``sum / targets``: that sum over the class targets that are not ``ignore_index``
  (``cross_entropy``/``nll_loss`` with ``reduction="none"`` or ``"sum"``);
* ``mean``: that sum over the number of elements.

Each is linear in the calls' results, so the gradients the trial sends into them (the ones
the real step did, ``trial._loss_pairs``) are those of the combination at any weights. None
verifies (a loss added to a term written by hand, a weighted sum): ``Combined.why`` says so,
and the trial does not run.

Event only (host reads). Example::

    combined = combination(captures)
    combined.name, combined.divisors   # ('sum / targets', [376.0])
    combined.of(0, recomputed_sum)     # the trial's loss of micro-batch 0, in the run's units
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .losscall import CLASS_INDEX, LossCall, bound

RTOL = 1e-4  # of a loss computed in fp32: the order of summation is all that differs


@dataclass
class Combined:
    """The verified combination (``name``, ``divisors``: one per micro-batch), or ``why``
    none verifies."""

    name: str = ""
    divisors: list = field(default_factory=list)
    why: str = ""
    described: str = ""  # the combination in words, with its numbers

    def of(self, micro: int, total: float) -> float:
        """A micro-batch's loss from the sum of every element of its recomputed calls."""
        return total / self.divisors[micro]


def combination(captures: list) -> Combined:
    """The first combination (see the module docstring) that gives each capture's recorded
    loss from its calls' captured results."""
    rows = []
    for cap in captures:
        recorded = [float(loss.detach().float().sum()) for loss, _ in cap.losses]
        if len(recorded) != 1:
            return Combined(why=f"the step backwarded {len(recorded)} losses from one model "
                            "call, not one: which the calls combine into is not known")
        if not math.isfinite(recorded[0]):
            return _unchecked(captures)
        calls = list(cap.loss_calls)
        total = sum(float(c.value.detach().double().sum()) for c in calls)
        rows.append((calls, total, recorded[0], _tolerance(cap)))
    for name in ("sum", "mean of the calls", "sum / targets", "mean"):
        divisors = [_divisor(name, calls) for calls, _, _, _ in rows]
        if all(d is not None and d > 0 and
               abs(total / d - loss) <= tol * max(abs(loss), 1e-12)
               for d, (_, total, loss, tol) in zip(divisors, rows)):
            return Combined(name=name, divisors=[float(d) for d in divisors if d],
                            described=_describe(name, rows[0][0], divisors[0], rows[0][2]))
    calls, total, loss, _ = rows[0]
    return Combined(why=f"no combination of the step's {len(calls)} loss calls verified: the "
                    f"loss the step backwarded ({loss:.6g}) is not their sum ({total:.6g}), "
                    "their mean, nor their sum over the targets not ignored (the loss adds "
                    "a term written by hand, or weighs them)")


def _unchecked(captures: list) -> Combined:
    """A failing step whose loss is non-finite checks no combination: one loss call per
    micro-batch, with one value, is the loss itself (as a trial always took it); several,
    or one per element, are not known to be."""
    calls = [c for cap in captures for c in cap.loss_calls]
    if len(calls) == len(captures) and all(c.value.numel() == 1 for c in calls):
        return Combined(name="sum", divisors=[1.0] * len(captures),
                        described=f"the {calls[0].name} call's result (not checked: the "
                                  "loss the step recorded is non-finite)")
    return Combined(why=f"the loss the step recorded is non-finite, so no combination of its "
                    f"{len(calls)} loss calls could be checked against it")


def _divisor(name: str, calls: list) -> Optional[float]:
    if name == "sum":
        return 1.0
    if name == "mean of the calls":
        return float(len(calls)) if all(c.value.numel() == 1 for c in calls) else None
    if name == "mean":
        return float(sum(c.value.numel() for c in calls))
    counted = [_targets(c) for c in calls]
    return float(sum(counted)) if all(n is not None for n in counted) else None  # type: ignore


def _targets(call: LossCall) -> Optional[int]:
    """The class targets of a call that reduces by ``none``/``sum``, less the ignored."""
    if call.name not in CLASS_INDEX:
        return None
    a = bound(call, call.args, call.kwargs)
    target = a.get("target")
    if a.get("reduction", "mean") not in ("none", "sum") or not isinstance(
            target, torch.Tensor) or target.is_floating_point():
        return None
    ignore = a.get("ignore_index", -100)
    return int((target != (ignore if isinstance(ignore, int) else -100)).sum())


def _tolerance(cap: Any) -> float:
    """``RTOL``, or a half loss's own rounding (its dtype's epsilon, twice)."""
    loss = cap.losses[0][0]
    if loss.is_floating_point() and loss.element_size() < 4:
        return max(RTOL, 2.0 * torch.finfo(loss.dtype).eps)
    return RTOL


def _describe(name: str, calls: list, divisor: Optional[float], loss: float) -> str:
    n = len(calls)
    whose = (f"the {n} {calls[0].name} calls'" if n > 1 else f"the {calls[0].name} call's")
    text = {"sum": f"the sum of {whose} elements" if n > 1 else f"{whose} result",
            "mean of the calls": f"the mean of the {n} {calls[0].name} calls",
            "sum / targets": f"the sum of {whose} elements over the {divisor:g} targets "
                             "not ignore_index",
            "mean": f"the mean of {whose} elements"}[name]
    return f"{text}: {loss:.6g} at the captured step, as the run recorded it"
