"""Is the loss's backward singular at the failing values in fp32 too? The op, its input, its
derivative.

A loss's backward that sends inf/NaN into the model's output while the loss is finite has one
of two causes: a derivative that is large but finite at the values the step reached, which
fp16 cannot hold (fp32 would: compute the loss in fp32, from logits), or a derivative that is
infinite there, in any precision: ``x ** 0.5`` or ``sqrt(x)`` at x = 0, ``log(x)`` at 0,
``acos(x)`` at +-1. The second is in the loss's formula; fp16 only reaches the point sooner,
and the fix that holds is a clamp of that op's input, not precision.

**A torch loss function** (``losscall``): ``torch_loss`` recomputes it in fp32 on the replayed
outputs, as leaves, and takes its derivative with respect to them there (before any cast back
to the model's dtype): non-finite means singular in fp32 too.

**A loss written by hand** is not recomputable; its autograd graph is the only place its
formula shows. After a replay found the loss's backward non-finite with no torch loss
function (``Watch``, armed for ``WATCH_STEPS`` steps, event-driven: never on a run without
such an event), each later loss handed to backward is walked *before* its backward runs,
from ``loss.grad_fn`` to the model's outputs (Python metadata only, no host read), and the
input of each op of ``OPS`` found there is held by reference (``inputs``) until the step
ends, as autograd itself holds it until the backward frees it. At the next event of that
window ``measure`` reads them (host reads, event only): how many values sit exactly at the
op's singular point, the nearest any other came to it, the op's derivative at them in the
run's dtype and in fp32 (torch's own backward of the op on copies), and the clamp the fix
prescribes tried on them: ``eps`` is the nearest any value came to the point with a finite
derivative in the run's dtype (rounded up to the two digits the fix prints), and the
derivative at every value clamped to it is computed in that dtype.

Example (what ``Forensics`` does on a watched step and at its event)::

    cap.singular += singular.inputs(loss, cap.output_nodes)   # before backward
    singular.measure(cap.singular)[0]
    # {'op': 'pow', 'exponent': 0.5, 'at_point': 3, 'fp32': {'nonfinite': 3, ...},
    #  'eps': 0.00049, 'clamped': {'nonfinite': 0, 'largest': 22.6}, ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from ...runfile.detail import Derivative, LossDerivative, SingularOp

WATCH_STEPS = 16  # steps after a hand-written loss's backward event whose losses are walked
MAX_NODES = 256  # autograd nodes walked per loss (a hand-written loss has a handful)
HOLD_BYTES = 16 << 20  # an op's input held beyond this is not held (said so)
MAX_READS = 4  # ops held per step


@dataclass(frozen=True)
class Op:
    """An op whose derivative is infinite at a point of its domain (where its value is finite,
    so that the loss stays finite and only the backward fails)."""

    name: str
    saved: str  # the node's saved tensor: its input, or its result (``from_result``)
    points: tuple  # the singular points
    call: Callable[[torch.Tensor, Optional[float]], torch.Tensor]  # the op, to differentiate
    from_result: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # input from result
    low: Optional[float] = None  # the domain's lower end (the clamp's min), None: two-sided


OPS = {
    "PowBackward0": Op("pow", "_saved_self", (0.0,), lambda x, e: torch.pow(x, e or 0.5),
                       low=0.0),
    "SqrtBackward0": Op("sqrt", "_saved_result", (0.0,), lambda x, e: torch.sqrt(x),
                        from_result=lambda r: r.float() * r.float(), low=0.0),
    "LogBackward0": Op("log", "_saved_self", (0.0,), lambda x, e: torch.log(x), low=0.0),
    "Log2Backward0": Op("log2", "_saved_self", (0.0,), lambda x, e: torch.log2(x), low=0.0),
    "Log10Backward0": Op("log10", "_saved_self", (0.0,), lambda x, e: torch.log10(x),
                         low=0.0),
    "Log1pBackward0": Op("log1p", "_saved_self", (-1.0,), lambda x, e: torch.log1p(x),
                         low=-1.0),
    "AcosBackward0": Op("acos", "_saved_self", (-1.0, 1.0), lambda x, e: torch.acos(x)),
    "AsinBackward0": Op("asin", "_saved_self", (-1.0, 1.0), lambda x, e: torch.asin(x)),
}
# Where the hand-written loss is itself non-finite on finite outputs, its divisions too: the
# denominator held (``x / d`` saves ``d`` for its backward), so that a count that is 0 on a
# batch (a masked mean over no labelled token: 0/0) is told from an op fp16 broke.
DIVISIONS = {**OPS, "DivBackward0": Op("div", "_saved_other", (0.0,),
                                        lambda x, e: torch.reciprocal(x), low=0.0)}


@dataclass
class Read:
    """One op of a watched step's loss, its input held by reference until the step ends."""

    node: str  # "PowBackward0"
    op: Op
    exponent: Optional[float]
    value: Optional[torch.Tensor]  # the op's input (for sqrt: its result); None: not held
    note: str = ""
    constant: bool = False  # no gradient reaches the input from the model (from the batch)


@dataclass
class Watch:
    """The steps whose losses are walked: after a hand-written loss's backward event (its
    singular ops), or after its non-finite value (``DIVISIONS``: its divisions too)."""

    since: int  # the step of the event
    until: int  # the last step walked
    ops: dict = field(default_factory=lambda: OPS)  # the nodes whose inputs are held

    def live(self, step: int) -> bool:
        return self.since < step <= self.until


# ---------------------------------------------------------------------------------------------
# on a watched step, before the backward: references only


def inputs(loss: torch.Tensor, stop: list, ops: Optional[dict] = None) -> list[Read]:
    """The ops of ``ops`` (``OPS``) between ``loss`` and the model's outputs (``stop``: their
    autograd
    nodes, the walk ends there), with their inputs held. Python metadata only: no host read.
    Nothing when no output node is known (the loss could not be told from the model) or the
    loss has no graph."""
    if loss.grad_fn is None or not stop:
        return []
    stop_ids = {id(n) for n in stop}
    found: list[Read] = []
    seen: set[int] = set()
    queue = [loss.grad_fn]
    while queue and len(seen) < MAX_NODES and len(found) < MAX_READS:
        node = queue.pop(0)
        if node is None or id(node) in seen or id(node) in stop_ids:
            continue
        seen.add(id(node))
        read = _read(node, OPS if ops is None else ops)
        if read is not None:
            found.append(read)
        queue += [n for n, _ in node.next_functions if n is not None]
    return found


def _read(node: Any, ops: dict) -> Optional[Read]:
    name = type(node).__name__
    op = ops.get(name)
    if op is None:
        return None
    exponent = None
    if name == "PowBackward0":
        exponent = _number(getattr(node, "_saved_exponent", None))
        if exponent is None or not 0.0 < exponent < 1.0:
            return None  # a power of 1 or more has a finite derivative; below 0 an infinite value
    try:
        t = getattr(node, op.saved)
    except RuntimeError:  # freed, or modified in place since (the backward will say so)
        return None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    if t.numel() * t.element_size() > HOLD_BYTES:
        return Read(name, op, exponent, None, f"its input ({t.numel()} values) was too large "
                    "to hold")
    return Read(name, op, exponent, t.detach(), constant=not t.requires_grad)


def _number(x: Any) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# at the event: host reads


def measure(reads: list[Read]) -> list[SingularOp]:
    """What each held op input says (see the module docstring), most singular first."""
    out = [_measure(r) for r in reads]
    return sorted(out, key=lambda m: (-(m.fp32.nonfinite if m.fp32 else 0),
                                      -(m.run.nonfinite if m.run else 0)))


def _measure(r: Read) -> SingularOp:
    op = SingularOp(op=r.op.name, node=r.node, exponent=r.exponent, points=list(r.op.points),
                    constant=r.constant if r.op.name == "div" else None)
    if r.value is None:
        return replace(op, note=r.note)
    x = r.op.from_result(r.value) if r.op.from_result is not None else r.value
    dtype = r.value.dtype
    with torch.autocast(x.device.type, enabled=False), torch.enable_grad():
        xf = x.detach().float()
        dist = _distance(xf, r.op.points)
        run = _derivative(r.op, xf.to(dtype), r.exponent)
        fine = (dist > 0) & torch.isfinite(run.float())
        nearest = float(dist[fine].min()) if bool(fine.any()) else None
        # Rounded up to the two digits a fix's snippet shows: what is tried is what it prints.
        eps = _two_digits_up(nearest)
        clamped = _summary(_derivative(r.op, _clamp(xf, r.op, eps).to(dtype), r.exponent)) \
            if eps is not None else None
        return replace(op, dtype=str(dtype).replace("torch.", ""), numel=int(x.numel()),
                       at_point=int((dist == 0).sum()), run=_summary(run),
                       fp32=_summary(_derivative(r.op, xf, r.exponent)),
                       nearest=float(dist[dist > 0].min()) if bool((dist > 0).any()) else None,
                       eps_nearest=nearest, eps=eps, clamped=clamped)


def _two_digits_up(x: Optional[float]) -> Optional[float]:
    """``x`` rounded up to two significant digits (4.8828e-4 -> 4.9e-4): farther from the
    singular point, so the derivative there is no larger."""
    if x is None or not x > 0 or not math.isfinite(x):
        return x
    scale = 10.0 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.ceil(x / scale - 1e-9) * scale:.2g}")


def _distance(x: torch.Tensor, points: tuple) -> torch.Tensor:
    d = (x - points[0]).abs()
    for p in points[1:]:
        d = torch.minimum(d, (x - p).abs())
    return d


def _clamp(x: torch.Tensor, op: Op, eps: float) -> torch.Tensor:
    if op.low is not None:
        return x.clamp(min=op.low + eps)
    return x.clamp(min(op.points) + eps, max(op.points) - eps)


def _derivative(op: Op, x: torch.Tensor, exponent: Optional[float]) -> torch.Tensor:
    """The op's derivative at each value of ``x``, in ``x``'s dtype, by torch's own backward."""
    leaf = x.detach().clone().requires_grad_(True)
    y = op.call(leaf, exponent)
    (grad,) = torch.autograd.grad(y, leaf, torch.ones_like(y))
    return grad.detach()


def _summary(d: torch.Tensor) -> Derivative:
    finite = torch.isfinite(d)
    kept = d[finite].float().abs()
    return Derivative(nonfinite=int((~finite).sum()),
                      largest=float(kept.max()) if kept.numel() else None)


def torch_loss(cap: Any, outputs: list) -> Optional[LossDerivative]:
    """The torch loss functions of a captured micro-batch recomputed in fp32 on ``outputs``
    (the replayed root outputs, detached), differentiated with respect to them in fp32: how
    many derivatives are non-finite there, and the largest finite one. None when no loss call
    could be recomputed. The caller owns the replay's guarantees."""
    from .losscall import Missing

    leaves = [o.detach().float().requires_grad_(True) if isinstance(o, torch.Tensor)
              and o.is_floating_point() else o for o in outputs]
    values = []
    for call in cap.loss_calls:
        try:
            args, kwargs = call.arguments(leaves)
        except Missing:
            continue
        args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)
        kwargs = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v for k, v in kwargs.items()}
        with torch.autocast(cap.autocast[0], enabled=False), torch.enable_grad():
            values.append(call.fn(*args, **kwargs))
    used = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    values = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    if not values or not used:
        return None
    grads = torch.autograd.grad(sum(v.float().sum() for v in values), used, allow_unused=True)
    got = [g for g in grads if g is not None]
    if not got:
        return None
    flat = torch.cat([g.reshape(-1) for g in got])
    found = _summary(flat)
    return LossDerivative(nonfinite=found.nonfinite, largest=found.largest,
                          numel=int(flat.numel()), loss_fns=[c.name for c in cap.loss_calls],
                          loss=float(sum(float(v.detach().sum()) for v in values)))
