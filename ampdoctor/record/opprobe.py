"""Inside a culprit module: the first torch op whose result went non-finite, and how.

The forensic replay names the module whose output went non-finite from finite inputs. A
module's forward holds many ops (a projection, q @ k^T, a mask, a softmax), and which one
failed tells failure classes apart that look the same at the module's boundary: a product
that overflows (``matmul`` making +inf and -inf: an unstable op), a mask constant that fp16
cannot hold (``mul`` by -1e9 making only -inf), a softmax over rows that are -inf everywhere
(NaN from fully masked rows). So the culprit is run once more on its captured inputs, in the
step's own autocast state, under a ``TorchFunctionMode`` that looks at each op's result.

Recorder side (imports torch). Runs only on a forensic replay, never on a normal step: each op
costs one host sync there, which an event can afford.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from .sampler import tensors_in

_KINDS = ("nan", "posinf", "neginf")


def first_nonfinite_op(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None,
                       context: Any = None) -> Optional[dict]:
    """Re-run ``module(*args, **kwargs)`` inside ``context`` (the step's autocast state, as a
    context manager) and describe the first op that created a kind of non-finite value its
    inputs did not hold.

    Returns None when every op stayed finite. The dict holds: ``op`` (name), ``created`` (kinds
    among nan/posinf/neginf), ``dtype`` of the result, ``counts`` of each kind, ``numel``,
    ``in_absmax`` (largest finite input magnitude), ``big_scalar`` (largest finite Python
    constant passed to the op), ``in_nan``/``in_posinf``/``in_neginf`` (what the inputs held),
    ``index`` (how many ops ran before it), ``mask_operand`` (an input is an additive mask:
    one negative constant where it is not 0).
    """
    probe = _Probe()
    with torch.no_grad(), context if context is not None else contextlib.nullcontext(), probe:
        module(*args, **(kwargs or {}))
    return probe.found


class _Probe(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: Optional[dict] = None
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None:
            outs = [t for t in tensors_in(out) if _floating(t)]
            if outs:
                self.ops += 1
                self.found = _describe(func, args, kwargs, outs, self.ops - 1)
        return out


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and \
        t.layout == torch.strided and t.device.type != "meta"


def _presence(tensors: list) -> tuple[list[int], float]:
    """Counts of NaN, +inf, -inf over ``tensors`` and their largest finite magnitude."""
    counts = [0, 0, 0]
    biggest = math.nan
    for t in tensors:
        x = t.detach()
        stats = torch.stack([torch.isnan(x).sum(), (x == math.inf).sum(), (x == -math.inf).sum()])
        c = stats.tolist()
        counts = [a + int(b) for a, b in zip(counts, c)]
        fin = x[torch.isfinite(x)]
        if fin.numel():
            m = float(fin.abs().max())
            biggest = m if math.isnan(biggest) else max(biggest, m)
    return counts, biggest


def _scalars(value: Any, depth: int = 0) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if depth < 3 and isinstance(value, (tuple, list)):
        return [x for v in value for x in _scalars(v, depth + 1)]
    if depth < 3 and isinstance(value, dict):
        return [x for v in value.values() for x in _scalars(v, depth + 1)]
    return []


def _describe(func: Any, args: tuple, kwargs: dict, outs: list, index: int) -> Optional[dict]:
    out_counts, _ = _presence(outs)
    if not any(out_counts):
        return None
    inputs = [t for t in tensors_in((args, kwargs)) if _floating(t)]
    in_counts, in_absmax = _presence(inputs)
    consts = _scalars((args, kwargs))
    explicit = {"nan": any(math.isnan(c) for c in consts),
                "posinf": any(c == math.inf for c in consts),
                "neginf": any(c == -math.inf for c in consts)}
    created = [k for k, o, i in zip(_KINDS, out_counts, in_counts)
               if o and not i and not explicit[k]]
    if not created:
        return None  # the inputs (or an explicit inf constant) already held these values
    finite = [abs(c) for c in consts if math.isfinite(c)]
    name = getattr(func, "__name__", None) or str(func)
    return {"op": name.strip("_") or name, "created": created,
            "dtype": str(outs[0].dtype).replace("torch.", ""),
            "counts": dict(zip(_KINDS, out_counts)), "numel": int(sum(t.numel() for t in outs)),
            "in_absmax": None if math.isnan(in_absmax) else in_absmax,
            "big_scalar": max(finite) if finite else None,
            "in_nan": bool(in_counts[0]), "in_posinf": bool(in_counts[1]),
            "in_neginf": bool(in_counts[2]), "index": index,
            "mask_operand": any(_mask_like(t) for t in inputs)}


def _mask_like(t: torch.Tensor) -> bool:
    """An additive mask: every non-zero value one and the same negative constant (0 where a
    position is kept, -1e4 or -1e9 where it is masked). A dense activation is not."""
    x = t.detach()
    nonzero = x[x != 0]
    if not nonzero.numel():
        return False
    first = nonzero.reshape(-1)[0]
    return bool(first < 0) and bool((nonzero == first).all())
