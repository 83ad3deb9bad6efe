"""What fp8 would do to each matmul's operands, measured on the sampled step.

For every ``nn.Linear`` (and Hugging Face's ``Conv1D``, a Linear with its weight transposed)
called on a sampled step, the input, the weight and the gradient arriving at the output are
scaled and rounded to fp8 as four recipes would (``schema.Recipe``):

- ``TENSOR``: per-tensor current scaling, scale = fmt max / amax (e4m3 for input and weight,
  e5m2 for the output gradient), as torchao's ``amax_to_scale``;
- ``DELAYED``: the same, with the amax taken as the max of this tensor's previous
  ``schema.DELAYED_HISTORY`` *sampled* amaxes (the first sample falls back to current);
- ``ROWWISE``: one power-of-two scale per row along the last dimension, e4m3 (torchao's
  rowwise recipe, ``round_scales_to_power_of_2``);
- ``MX``: one E8M0 scale per block of 32 elements along the last dimension, e4m3 elements
  (the OCP MX rule, torchao's ``to_mx`` in its default FLOOR mode).

Each gives an /fp8 row: elements flushed to zero, subnormal, saturated, and the SQNR of the
dequantised tensor. The cast itself is emulated in float32 (``quantise``: round half to even
on the format's grid, saturating at its max), so it runs on any device, fp8 or not;
``tests/record/test_fp8.py`` checks it against ``Tensor.to(torch.float8_*)`` and torchao.

Cost, as for ``stats``: in the hook, one ``aminmax`` pass over the tensor (per 32-element
block; the row and tensor amaxes are reduced from the blocks), then a gather of ``sample``
elements at ``stats.sample_index``'s positions with each recipe's scale for them. The rounding
and counting of every tensor of the step happen at the drain, in a fixed number of kernels,
read with the sampled step's one copy per device (``readback.HostRead``). No host sync in a
hook. Counts are out of the sample (exact when ``sample`` is None or the tensor is smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..runfile import schema
from ..runfile.schema import Fp8Format, Kind, Recipe, Role
from . import stats
from .readback import HostRead
from .sharding import local

E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2
# torchao's floor under an amax (float8_utils.EPS): an all-zero tensor keeps a finite scale.
EPS = 1e-12
RECIPES = tuple(Recipe)
# (max, emin, mbits, saturated above) of each element format; see schema.E4M3_MAX.
FORMATS = {E4M3: (schema.E4M3_MAX, schema.E4M3_EMIN, schema.E4M3_MBITS, schema.E4M3_OVER),
           E5M2: (schema.E5M2_MAX, schema.E5M2_EMIN, schema.E5M2_MBITS, schema.E5M2_OVER)}
# float32's exponent bias: an E8M0 scale is a power of two within 2**-127 .. 2**127 (and the
# MX spec's clamp on the shared exponent, as torchao's to_mx applies it).
E8M0_MIN, E8M0_MAX = -127, 128


def element_format(recipe: Recipe, role: Role) -> Fp8Format:
    """e5m2 for the output gradient under per-tensor scaling (its range, not its precision,
    is what a gradient needs); e4m3 everywhere else, as the rowwise and MX recipes use."""
    if role == Role.GRAD_OUTPUT and recipe in (Recipe.TENSOR, Recipe.DELAYED):
        return E5M2
    return E4M3


def matmul_weight(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The weight of a matmul module as [out, in] (rows along the contracted dimension), or
    None for a module that is not one."""
    if isinstance(module, torch.nn.Linear):
        return module.weight
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and \
            weight.dim() == 2:  # transformers' GPT-2 Conv1D: x @ W, W is [in, out]
        return weight.t()
    return None


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for a > 0, exactly (frexp: a = m * 2**e, m in [0.5, 1)); log2 rounds
    just under a power of two up to it."""
    return torch.frexp(a).exponent - 1


def quantise(y: torch.Tensor, fmax: torch.Tensor, emin: torch.Tensor,
             mbits: torch.Tensor) -> torch.Tensor:
    """``y`` (float32, already scaled) rounded to an fp8 grid as a saturating cast does:
    round half to even on steps of 2**(e - mbits), where e is the value's exponent but never
    below the smallest normal's (subnormals share its steps), then clamped to +-fmax. The
    format's parameters broadcast against ``y`` (one per element, or scalars)."""
    a = y.abs()
    e = torch.maximum(floor_log2(a), emin)
    step = torch.ldexp(torch.ones_like(a), e - mbits)
    q = torch.minimum(torch.round(a / step) * step, fmax)  # exact: scaling by powers of two
    return q.copysign(y)


def _block_amax(flat: torch.Tensor) -> torch.Tensor:
    """abs max per block of ``schema.MX_BLOCK`` along the last dimension of ``flat`` [R, C]
    (the last block of a row may be shorter), float32 [R, ceil(C / 32)]: one aminmax pass."""
    rows, cols = flat.shape
    full = cols // schema.MX_BLOCK * schema.MX_BLOCK
    parts = []
    if full:
        lo, hi = torch.aminmax(flat[:, :full].unflatten(1, (-1, schema.MX_BLOCK)), dim=-1)
        parts.append(torch.maximum(-lo, hi))
    if cols > full:
        lo, hi = torch.aminmax(flat[:, full:], dim=-1)
        parts.append(torch.maximum(-lo, hi).unsqueeze(1))
    return (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).float()


def amax_to_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """fmax / amax as torchao computes it: in float64, then rounded once to float32 (a float
    divided by a tensor in torch is a reciprocal and a product, two roundings)."""
    return (fmax / amax.double().clamp(min=EPS)).float()


def _pow2_floor(s: torch.Tensor) -> torch.Tensor:
    """torchao's _round_scale_down_to_power_of_2, as it computes it (rowwise scales)."""
    return torch.exp2(torch.floor(torch.log2(s)))


def mx_scale(block_amax: torch.Tensor) -> torch.Tensor:
    """The multiplier of an MX block: 1 / 2**(floor(log2(amax)) - 8), the shared exponent
    clamped to E8M0's range; a zero block takes the smallest exponent, as to_mx does."""
    e = torch.where(block_amax > 0, floor_log2(block_amax), E8M0_MIN)
    shared = (e - schema.E4M3_MAX_POW2).clamp(E8M0_MIN, E8M0_MAX)
    return torch.ldexp(torch.ones_like(block_amax), -shared)


@dataclass
class Operand:
    """One tensor's device results from the hook: the gathered values, each recipe's scale
    for them [len(RECIPES), S], and [amax, the four recipes' scale columns]."""

    tensor: int
    call: int
    role: Role
    numel: int
    values: torch.Tensor
    scales: torch.Tensor
    summary: torch.Tensor


class _Positions:
    """Sampled positions of a flattened [R, C] tensor with the row and MX block of each."""

    def __init__(self, limit: int = 512):
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._limit = limit

    def get(self, numel: int, cols: int, sample: Optional[int], device: torch.device):
        key = (numel, cols, sample, device)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self._limit:
                self._cache.clear()
            idx = stats._INDEX.get(numel, sample, device) if sample else \
                torch.arange(numel, device=device)
            row = idx // cols
            blocks = -(-cols // schema.MX_BLOCK)
            hit = self._cache[key] = (idx, row, row * blocks + (idx % cols) // schema.MX_BLOCK)
        return hit


_POSITIONS = _Positions()


def measure(t: torch.Tensor, role: Role, *, tensor: int = -1, call: int = 0,
            sample: Optional[int] = stats.SAMPLE,
            history: Optional[torch.Tensor] = None) -> Operand:
    """Scales of every recipe for ``t`` and the values they apply to (device work, no sync).

    ``history``: the tensor's previous sampled amaxes (``DELAYED``; zeros where none yet),
    updated in place with this one. ``sample`` None counts every element."""
    t = t.detach()
    cols = t.shape[-1] if t.dim() else 1
    flat = t.reshape(-1, cols)
    blocks = _block_amax(flat)
    rows = blocks.amax(1)
    amax = rows.amax()
    idx, row, block = _POSITIONS.get(flat.numel(), cols, sample, t.device)
    values = torch.take(flat, idx).float()
    fmt = [FORMATS[element_format(r, role)][0] for r in (Recipe.TENSOR, Recipe.DELAYED)]
    current = amax_to_scale(amax, fmt[0])
    if history is not None:
        seen = history.amax()
        delayed = amax_to_scale(torch.where(seen > 0, seen, amax), fmt[1])
        # A non-finite amax is no scale to keep: it would poison every later max.
        history.copy_(torch.cat([torch.nan_to_num(amax, 0.0, 0.0, 0.0).view(1), history[:-1]]))
    else:
        delayed = amax_to_scale(amax, fmt[1])
    per_row = _pow2_floor(amax_to_scale(rows, schema.E4M3_MAX))
    per_block = mx_scale(blocks).reshape(-1)
    scales = torch.stack([current.expand_as(values), delayed.expand_as(values),
                          per_row[row], per_block[block]])
    summary = torch.stack([amax, current, delayed, per_row.amin(), per_block.amin()])
    return Operand(tensor, call, role, t.numel(), values, scales, summary)


def count(operands: list[Operand]) -> tuple[torch.Tensor, list[int]]:
    """The rows' counts of every operand on one device, computed together: [n * 4, 7]
    (counted, zeros, flushed, subnormal, saturated, sum (x/amax)^2, sum (err/amax)^2), row
    ``i * 4 + recipe``; and the element format of each row."""
    device = operands[0].values.device
    formats = [int(element_format(r, op.role)) for op in operands for r in RECIPES]
    params = torch.tensor([FORMATS[Fp8Format(f)] for f in formats], dtype=torch.float32,
                          device=device)  # [rows, 4]: max, emin, mbits, saturated above
    lengths = torch.tensor([op.values.numel() for op in operands], device=device)
    item = torch.repeat_interleave(torch.arange(len(operands), device=device), lengths)
    seg = item.unsqueeze(0) * len(RECIPES) + torch.arange(len(RECIPES), device=device)[:, None]
    x = torch.cat([op.values for op in operands]).unsqueeze(0)
    scale = torch.cat([op.scales for op in operands], 1)
    fmax, emin, mbits, over = (params[:, i][seg] for i in range(4))
    y = x * scale
    q = quantise(y, fmax, emin.int(), mbits.int())
    norm = torch.stack([op.summary[0] for op in operands]).clamp(min=EPS)[item]
    nonzero = x != 0
    parts = [torch.ones_like(y), (~nonzero).expand_as(y).float(), (nonzero & (q == 0)).float(),
             ((q != 0) & (q.abs() < torch.ldexp(torch.ones_like(y), emin.int()))).float(),
             (y.abs() > over).float(), (x / norm).square().expand_as(y),
             ((x - q / scale) / norm).square()]
    flat_seg = seg.reshape(-1)
    out = torch.zeros(len(formats), len(parts), dtype=torch.float32, device=device)
    return out.index_add_(0, flat_seg, torch.stack([p.reshape(-1) for p in parts], 1)), formats


def pack(operands: list[Operand], counts: np.ndarray, summaries: np.ndarray,
         formats: list[int]) -> np.ndarray:
    """Host /fp8 rows from ``count``'s results and the operands' summaries (host arrays)."""
    n = len(RECIPES)
    out = schema.empty("fp8", len(formats))
    out["tensor"] = np.repeat([op.tensor for op in operands], n)
    out["call"] = np.repeat([op.call for op in operands], n)
    out["role"] = np.repeat([int(op.role) for op in operands], n)
    out["recipe"] = np.tile([int(r) for r in RECIPES], len(operands))
    out["format"] = formats
    out["numel"] = np.repeat([op.numel for op in operands], n)
    counted = counts[:, 0].round().astype(np.int64)
    out["sample_n"] = counted
    for i, name in enumerate(("zeros", "flushed", "subnormal", "saturated"), start=1):
        out[name] = counts[:, i].round().astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        # no error at all: inf; NaN values (a NaN error sum): NaN
        out["sqnr_db"] = np.where(counts[:, 6] == 0, np.inf,
                                  10 * np.log10(counts[:, 5] / counts[:, 6]))
    out["amax"] = np.repeat(summaries[:, 0], n)
    out["scale"] = summaries[:, 1:].reshape(-1)
    return out


class Fp8Probe:
    """The /fp8 rows of one sampled step; the delayed recipe's amax history across steps.

    ``tensor_id(kind, name, index, t, owner_type)`` comes from the recorder (a row is keyed by
    the module's OUTPUT id); ``active()`` says whether the sampled step is still open (a
    gradient arriving after it ended is not measured); ``warn(what, exc)`` as the sampler's.

    Example::

        probe = Fp8Probe(journal.tensor_id, lambda: True, journal.warn_tensor)
        probe.on_module(linear, "fc1", 0, (x,), out)   # in a forward hook
        rows = probe.stage(step, read)                  # then read.run(); rows()
    """

    def __init__(self, tensor_id: Callable[..., int], active: Callable[[], bool],
                 warn: Callable[[str, BaseException], None],
                 sample: Optional[int] = stats.SAMPLE,
                 history: int = schema.DELAYED_HISTORY):
        self.tensor_id = tensor_id
        self.active = active
        self.warn = warn
        self.sample = sample
        self.history_len = history
        self.operands: list[Operand] = []
        self._history: dict[tuple[int, int], torch.Tensor] = {}

    def on_module(self, module: torch.nn.Module, name: str, call: int, args: tuple,
                  output: Any) -> None:
        """A forward hook's view of a module call: measure a matmul's input and weight, and
        hook its output for the gradient."""
        weight = matmul_weight(module)
        out = output if isinstance(output, torch.Tensor) else None
        if weight is None or out is None:
            return
        try:
            tid = self.tensor_id(Kind.OUTPUT, name, 0, out, type(module).__name__)
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is not None and stats.measurable(x):
                self._add(local(x), Role.INPUT, tid, call)
            if call == 0 and stats.measurable(weight):  # (the same weights on every call)
                self._add(local(weight), Role.WEIGHT, tid, call)
            if out.requires_grad and out.grad_fn is not None:
                out.register_hook(lambda g, tid=tid, call=call: self._on_grad(tid, call, g))
        except Exception as exc:  # noqa: BLE001 - one odd module must not stop the rest
            self.warn(f"fp8 counts of {name}", exc)

    def _on_grad(self, tid: int, call: int, grad: torch.Tensor) -> None:
        if grad is None or not self.active():
            return None
        try:
            if stats.measurable(grad):
                self._add(local(grad), Role.GRAD_OUTPUT, tid, call)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"fp8 counts of the gradient of tensor {tid}", exc)
        return None

    def _add(self, t: torch.Tensor, role: Role, tid: int, call: int) -> None:
        key = (tid, int(role))
        history = self._history.get(key)
        if history is None or history.device != t.device:
            history = self._history[key] = torch.zeros(self.history_len, device=t.device)
        self.operands.append(measure(t, role, tensor=tid, call=call, sample=self.sample,
                                     history=history))

    def stage(self, step: int, read: HostRead) -> Callable[[], np.ndarray]:
        """The step's counts queued in ``read`` (one copy per device with the rest of the
        sampled step); the /fp8 rows from the returned function once it has run. Resets."""
        per_dev: dict[torch.device, list[Operand]] = {}
        for op in self.operands:
            per_dev.setdefault(op.values.device, []).append(op)
        self.operands = []
        staged = []
        for ops in per_dev.values():
            counts, formats = count(ops)
            staged.append((ops, read.add(counts), read.add(torch.stack([o.summary
                                                                        for o in ops])),
                           formats))

        def rows() -> np.ndarray:
            parts = [pack(ops, c.value, s.value, f) for ops, c, s, f in staged]
            out = np.concatenate(parts) if parts else schema.empty("fp8")
            out["step"] = step
            return out
        return rows

    def reset(self) -> None:
        self.operands = []
