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
* ``mean``: that sum over the number of elements;
* ``weighted``: each element times the gradient the step sent into it, over the loss scale
  (``d loss / d element``: a loss divided by the micro-batches, or weighted by hand).

Each is linear in the calls' results (``weighted`` holds for a loss of degree one in them;
one of another degree gives back another value there, and fails), so the gradients the trial
sends into them (the ones the real step did, ``trial._loss_pairs``) are those of the
combination at any weights. None verifies (a term written by hand added to the calls):
``Combined.why`` says so, and the trial does not run.

Event only (host reads). Example::

    combined = combination(captures)
    combined.name, combined.ways       # ('sum / targets', [Way(divisor=376.0)])
    combined.ways[0].loss(recomputed)  # the trial's loss of micro-batch 0, in the run's units
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .losscall import CLASS_INDEX, LossCall, bound
from .trial import recorded_scale

RTOL = 1e-4  # of a loss computed in fp32: the order of summation is all that differs


@dataclass(frozen=True)
class Way:
    """How one micro-batch's recomputed calls give its loss: their elements summed over
    ``divisor``, or (``weights``, one per call) each element times the gradient the step sent
    into it, unscaled."""

    divisor: float = 1.0
    weights: Optional[list] = None

    def loss(self, values: list) -> float:
        """The loss of the recomputed calls' ``values`` (in the calls' order)."""
        if self.weights is None:
            return sum(float(v.detach().double().sum()) for v in values) / self.divisor
        return sum(float((w.double() * v.detach().double()).sum())
                   for w, v in zip(self.weights, values))


@dataclass
class Combined:
    """The verified combination (``name``, ``ways``: one per micro-batch), or ``why`` none
    verifies."""

    name: str = ""
    ways: list = field(default_factory=list)
    why: str = ""
    described: str = ""  # the combination in words, with its numbers


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
        rows.append((cap, list(cap.loss_calls), recorded[0], _tolerance(cap)))
    for name in ("sum", "mean of the calls", "sum / targets", "mean", "weighted"):
        ways = [_way(name, cap, calls) for cap, calls, _, _ in rows]
        if all(w is not None and abs(w.loss([c.value for c in calls]) - loss)
               <= tol * max(abs(loss), 1e-12) for w, (_, calls, loss, tol) in zip(ways, rows)):
            return Combined(name=name, ways=ways, described=_describe(
                name, rows[0][1], ways[0] or Way(), rows[0][2]))
    _, calls, loss, _ = rows[0]
    total = sum(float(c.value.detach().double().sum()) for c in calls)
    return Combined(why=f"no combination of the step's {len(calls)} loss calls verified: the "
                    f"loss the step backwarded ({loss:.6g}) is not their sum ({total:.6g}), "
                    "their mean, their sum over the targets not ignored, nor their sum weighted "
                    "by the gradient the step sent into each (the loss adds a term written by "
                    "hand)")


def _unchecked(captures: list) -> Combined:
    """A failing step whose loss is non-finite checks no combination: one loss call per
    micro-batch, with one value, is the loss itself (as a trial always took it); several,
    or one per element, are not known to be."""
    calls = [c for cap in captures for c in cap.loss_calls]
    if len(calls) == len(captures) and all(c.value.numel() == 1 for c in calls):
        return Combined(name="sum", ways=[Way()] * len(captures),
                        described=f"the {calls[0].name} call's result (not checked: the "
                                  "loss the step recorded is non-finite)")
    return Combined(why=f"the loss the step recorded is non-finite, so no combination of its "
                    f"{len(calls)} loss calls could be checked against it")


def _way(name: str, cap: Any, calls: list) -> Optional[Way]:
    if name == "weighted":
        return _weighted(cap, calls)
    if name == "sum":
        d: Optional[float] = 1.0
    elif name == "mean of the calls":
        d = float(len(calls)) if all(c.value.numel() == 1 for c in calls) else None
    elif name == "mean":
        d = float(sum(c.value.numel() for c in calls))
    else:
        counted = [_targets(c) for c in calls]
        d = float(sum(n for n in counted if n is not None)) \
            if all(n is not None for n in counted) else None
    return Way(divisor=d) if d else None


def _weighted(cap: Any, calls: list) -> Optional[Way]:
    """Each call's elements times the gradient the step sent into it, over the loss scale:
    d(loss)/d(call) for a loss linear in the calls (a loss divided by the micro-batches)."""
    if not all(0 in c.grads for c in calls):
        return None
    scale = recorded_scale(cap) or 1.0
    weights = []
    for c in calls:
        g = c.grads[0].detach().double() / scale
        if g.shape != c.value.shape:
            if g.numel() != c.value.numel() and g.numel() != 1:
                return None
            g = g.expand(c.value.shape) if g.numel() == 1 else g.reshape(c.value.shape)
        weights.append(g)
    return Way(weights=weights) if all(bool(torch.isfinite(w).all()) for w in weights) \
        else None


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


def _describe(name: str, calls: list, way: Way, loss: float) -> str:
    n = len(calls)
    whose = (f"the {n} {calls[0].name} calls'" if n > 1 else f"the {calls[0].name} call's")
    text = {"sum": f"the sum of {whose} elements" if n > 1 else f"{whose} result",
            "mean of the calls": f"the mean of the {n} {calls[0].name} calls",
            "sum / targets": f"the sum of {whose} elements over the {way.divisor:g} targets "
                             "not ignore_index",
            "mean": f"the mean of {whose} elements",
            "weighted": f"the sum of {whose} elements, each times the gradient the step sent "
                        "into it (unscaled)"}[name]
    return f"{text}: {loss:.6g} at the captured step, as the run recorded it"
