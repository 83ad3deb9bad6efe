"""A root input that held NaN/inf but was computed in this step by autograd: not the data.

A step may call several root modules, the second on a value the code between them computed
from the first's output (``h = model.enc(x); model.head(pool(h))``). Such an input has a
``grad_fn``: whatever made it non-finite ran between the modules, outside any of them (a
custom ``autograd.Function`` that autocast does not look inside, an op in the training loop),
and no module's hook saw it. A built-in op counts only where the value was computed from a
recorded module's weights: data scaled by a trained tensor of its own is still the data.
``computed_input`` names that op from the graph (the input's node, past views and casts) and
makes it the culprit, in phase forward, instead of blaming the batch.

Example::

    finding = computed_input(trace, bad)   # bad: measure_batch's non-finite inputs
    finding.module, finding.detail.computed.function   # "LSEPool", True
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from ...runfile.detail import Computed
from ...runfile.schema import Phase
from .culprit import Culprit
from .trace import FEED_NODES, HARD, Trace, labeled

# Nodes that only move or cast values: the op that made a non-finite value sits behind them.
PASSING = ("View", "Reshape", "UnsafeView", "ToCopy", "Clone", "Expand", "Squeeze",
           "Unsqueeze", "Permute", "Transpose", "T", "Select", "Slice", "AsStrided", "Alias")
DEPTH = 8  # passing nodes walked back at most


def computed_input(trace: Trace, bad: list) -> Optional[Culprit]:
    """The op that computed a non-finite root input in this step (it has a ``grad_fn``), as
    a forward culprit outside any module; None when every bad input is plain data."""
    tensors = dict(labeled(trace.cap.args, trace.cap.kwargs))
    for label, slot, level in bad:
        t = tensors.get(label)
        if level != HARD or t is None or t.grad_fn is None:
            continue
        node = t.grad_fn
        op, function = _maker(node)
        if not function and not _from_weights(node, trace):
            continue  # data through a trained tensor of its own (a learnt input scale): data
        device, enabled, dtype = trace.cap.autocast[:3]
        under = f"in {dtype} under autocast" if enabled else f"in {str(t.dtype)[6:]}"
        what = "a custom autograd.Function" if function else "an op"
        f = Culprit(Phase.FORWARD, module=op,
                    module_type="autograd.Function" if function else "op", culprit_slot=slot)
        f.in_absmax = float(trace.rows["absmax"][slot])
        f.detail.bad_inputs = [trace.summary(slot)]
        f.detail.computed = Computed(op=op, function=function, into=trace.root_name,
                                        label=label, dtype=str(t.dtype)[6:], device=device,
                                        autocast=dtype if enabled else None)
        f.detail.how = (f"{op} ({what}) ran between modules, outside any module, {under}, "
                           f"and its output, given to {trace.root_name} as {label}, holds "
                           "NaN/inf")
        f.summary = (f"the input given to {trace.root_name} ({label}) was computed in this "
                     f"step by {op}, {what} outside any module that ran {under}: its output "
                     "holds NaN/inf, the op's doing, not the data's")
        return f
    return None


def _from_weights(node: Any, trace: Trace) -> bool:
    """Was the value computed from a recorded module's parameters (an earlier root's
    output)? Read from the graph: ``node`` walked back, at most ``FEED_NODES`` nodes, for the
    AccumulateGrad of one of them."""
    params = {id(p) for m in trace.names for p in m.parameters(recurse=False)}
    todo, seen = [node], set[int]()
    while todo and len(seen) < FEED_NODES:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if id(getattr(n, "variable", None)) in params:
            return True
        todo += [m for m, _ in getattr(n, "next_functions", ()) if m is not None]
    return False


def _maker(node: Any, depth: int = 0) -> tuple[str, bool]:
    """(the op's name, whether it is a custom autograd.Function) behind ``node``, past the
    nodes that only view or cast (``PASSING``)."""
    cls = getattr(node, "_forward_cls", None)  # a custom Function's backward node
    if isinstance(node, torch.autograd.function.BackwardCFunction) and cls is not None:
        return cls.__name__, True
    name = re.sub(r"Backward\d*$", "", type(node).__name__)
    nexts = [n for n, _ in getattr(node, "next_functions", ()) if n is not None]
    if name in PASSING and len(nexts) == 1 and depth < DEPTH:
        return _maker(nexts[0], depth + 1)
    return name, False
