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
dequantised tensor; and the operand's kurtosis over the same sampled values (an outlier
emerging, the early warning's third figure, the same on its four rows). The cast itself is
emulated in float32 (``quantise``: round half to even on the format's grid, saturating at its
max), so it runs on any device, fp8 or not;
``tests/record/test_fp8.py`` checks it against ``Tensor.to(torch.float8_*)`` and torchao.

Cost, as for ``stats``: in the hook, one ``aminmax`` pass over the tensor (its abs max per
32-element block) and a gather of ``sample`` elements at ``stats.sample_index``'s positions:
device work, no host sync. At the drain, for every tensor of the step together, in a fixed
number of kernels: the row and tensor amaxes reduced from the blocks, each recipe's scales
(the delayed recipe's history kept on the device, ``History``), the rounding and the counts
over a zero-padded [recipe, tensor, sample] block, read with the sampled step's one copy per
device (``readback.HostRead``). Counts are out of the sample (exact when ``sample`` is None
or the tensor is smaller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..runfile import schema
from ..runfile.schema import Fp8Format, Kind, Recipe, Role
from . import fp8layers, stats
from .readback import HostRead
from .replicas import Replicas
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
    """floor(log2(a)) of float32 ``a`` > 0, exactly, from its exponent bits (int32); -127 for
    float32 subnormals and 0, 128 for inf and NaN. (log2 rounds a value just under a power of
    two up to it; frexp is exact too, but on a CPU 25x slower.)"""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32 for int32 ``k`` in [-126, 127], exactly, from the exponent bits (ldexp
    takes 40x longer on a CPU)."""
    return ((k.clamp(-126, 127) + 127) << 23).view(torch.float32)


def quantise(y: torch.Tensor, fmax: Any, emin: Any, mbits: Any) -> torch.Tensor:
    """``y`` (float32, already scaled) rounded to an fp8 grid as a saturating cast does:
    round half to even on steps of 2**(e - mbits), where e is the value's exponent but never
    below the smallest normal's (subnormals share its steps), then clamped to +-fmax. The
    format's parameters (int32 ``emin``, ``mbits``) broadcast against ``y``."""
    a = y.abs()
    e = torch.maximum(floor_log2(a), torch.as_tensor(emin, dtype=torch.int32, device=a.device))
    step = pow2(e - mbits)
    q = torch.minimum(torch.round(a / step) * step, torch.as_tensor(fmax, device=a.device))
    return q.copysign(y)  # (exact: a value scaled by powers of two)


def _block_amax(flat: torch.Tensor) -> torch.Tensor:
    """abs max per block of ``schema.MX_BLOCK`` along the last dimension of ``flat`` [R, C]
    (the last block of a row may be shorter), float32 [R, ceil(C / 32)]."""
    rows, cols = flat.shape
    full = cols // schema.MX_BLOCK * schema.MX_BLOCK
    parts = []
    # (amax and amin over a short last dimension: aminmax(dim=) is 5x slower on a CPU)
    if full:
        view = flat[:, :full].unflatten(1, (-1, schema.MX_BLOCK))
        parts.append(torch.maximum(-view.amin(-1), view.amax(-1)))
    if cols > full:
        tail = flat[:, full:]
        parts.append(torch.maximum(-tail.amin(-1), tail.amax(-1)).unsqueeze(1))
    return (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).float()


def amax_to_scale(amax: torch.Tensor, fmax: Any) -> torch.Tensor:
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
    return pow2(-shared)  # (a float32 amax's shared exponent is at most 120)


@dataclass
class Operand:
    """One tensor as the hook leaves it (device tensors, no sync): its abs max, and at the
    sampled positions its values with the abs max of each one's row and MX block, zero-padded
    to the sample's size (``length`` are real). The scales are the drain's work."""

    tensor: int
    call: int
    role: Role
    numel: int
    length: int
    amax: torch.Tensor
    values: torch.Tensor
    row_amax: torch.Tensor
    block_amax: torch.Tensor


class _Positions:
    """Sampled positions of a flattened [R, C] tensor: the flat index of each, its row and MX
    block (padded to ``sample``: a padded position's value is taken as 0), and, sampled, the
    flat indices of each one's block [S, 32] (a short last block repeats its last element)."""

    def __init__(self, limit: int = 512):
        self._cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
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
            start = idx - idx % cols % schema.MX_BLOCK  # flat index of the block's first
            end = row * cols + cols - 1  # the row's last
            members = torch.minimum(start[:, None] + torch.arange(schema.MX_BLOCK,
                                                                  device=device), end[:, None])
            block = row * -(-cols // schema.MX_BLOCK) + idx % cols // schema.MX_BLOCK
            pad = (sample or 0) - len(idx)
            if pad > 0:
                row, block = (torch.nn.functional.pad(x, (0, pad)) for x in (row, block))
                members = torch.nn.functional.pad(members, (0, 0, 0, pad))
            hit = self._cache[key] = (idx, row, block, members)
        return hit


_POSITIONS = _Positions()


def measure(t: torch.Tensor, role: Role, *, tensor: int = -1, call: int = 0,
            sample: Optional[int] = stats.SAMPLE) -> Operand:
    """The hook's part (device work, no sync): the abs max of each row (two passes, amax and
    amin), the sample's values and the abs max of each one's MX block, from a gather of its
    32 elements (exact: from every block, ``_block_amax``). ``sample`` None: every element."""
    t = t.detach()
    cols = t.shape[-1] if t.dim() else 1
    flat = t.reshape(-1, cols)
    idx, row, block, members = _POSITIONS.get(flat.numel(), cols, sample, t.device)
    if sample is None:
        blocks = _block_amax(flat)
        rows, at_block = blocks.amax(1), blocks.reshape(-1)[block]
    else:
        rows = torch.maximum(-flat.amin(1), flat.amax(1)).float()
        at_block = torch.take(flat, members).abs().amax(1).float()
    values = torch.take(flat, idx).float()
    if len(values) < len(row):
        values = torch.nn.functional.pad(values, (0, len(row) - len(values)))
    return Operand(tensor, call, role, t.numel(), len(idx), rows.amax(), values, rows[row],
                   at_block)


def _padded(ops: list[Operand], name: str) -> torch.Tensor:
    """The operands' ``name`` tensors as one [n, S] (zero-padded: exact mode's lengths vary)."""
    parts = [getattr(op, name) for op in ops]
    size = max(len(p) for p in parts)
    return torch.stack([p if len(p) == size else torch.nn.functional.pad(p, (0, size - len(p)))
                        for p in parts])


class History:
    """The delayed recipe's amax history on one device: per (tensor, role, call), its last
    ``length`` sampled amaxes, newest first (0: none yet)."""

    def __init__(self, device: torch.device, length: int = schema.DELAYED_HISTORY):
        self.index: dict[tuple, int] = {}
        self.table = torch.zeros(0, length, device=device)

    def delayed(self, keys: list[tuple], amax: torch.Tensor) -> torch.Tensor:
        """Each key's amax for delayed scaling, the max of its history (its current amax
        where it has none), pushing ``amax`` in; a key seen twice in one drain (a module whose
        output gradient arrives twice) sees its first amax at the second."""
        for key in keys:
            self.index.setdefault(key, len(self.index))
        grow = len(self.index) - self.table.shape[0]
        if grow:
            self.table = torch.cat([self.table, self.table.new_zeros(grow, self.table.shape[1])])
        rows = [self.index[k] for k in keys]
        out = torch.empty_like(amax)
        seen_at: dict[int, int] = {}
        occurrence = []  # 0 for a key's first operand in this drain, 1 for its second...
        for r in rows:
            seen_at[r] = seen_at.get(r, -1) + 1
            occurrence.append(seen_at[r])
        for o in range(max(occurrence, default=-1) + 1):
            sel = [i for i, x in enumerate(occurrence) if x == o]
            at = torch.tensor(sel, device=amax.device)
            k = torch.tensor([rows[i] for i in sel], device=amax.device)
            seen = self.table[k].amax(1)
            out[at] = torch.where(seen > 0, seen, amax[at])
            # A non-finite amax is no scale to keep: it would poison every later max.
            pushed = torch.nan_to_num(amax[at], 0.0, 0.0, 0.0).unsqueeze(1)
            self.table[k] = torch.cat([pushed, self.table[k][:, :-1]], 1)
        return out


def scales(ops: list[Operand], history: Optional[History] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every recipe's scale for the sampled values of ``ops`` (one device), in a fixed number
    of kernels: [len(RECIPES), n, S] scales and [n, 6] summaries (amax, then the scale
    columns of the four recipes: ROWWISE's and MX's smallest, the scale of the tensor's amax;
    then the operand's ``kurtosis``).
    ``history`` None: delayed scaling = current."""
    device = ops[0].values.device
    amax = torch.stack([op.amax for op in ops]).float()
    fmax = [[FORMATS[element_format(r, op.role)][0] for op in ops]
            for r in (Recipe.TENSOR, Recipe.DELAYED)]
    current = amax_to_scale(amax, torch.tensor(fmax[0], device=device))
    delayed_amax = amax if history is None else \
        history.delayed([(op.tensor, int(op.role), op.call) for op in ops], amax)
    delayed = amax_to_scale(delayed_amax, torch.tensor(fmax[1], device=device))
    per_row = _pow2_floor(amax_to_scale(_padded(ops, "row_amax"), schema.E4M3_MAX))
    per_block = mx_scale(_padded(ops, "block_amax"))
    out = torch.stack([current[:, None].expand_as(per_row), delayed[:, None].expand_as(per_row),
                       per_row, per_block])
    summary = torch.stack([amax, current, delayed,
                           _pow2_floor(amax_to_scale(amax, schema.E4M3_MAX)), mx_scale(amax),
                           kurtosis(ops, amax)], 1)
    return out, summary


def kurtosis(ops: list[Operand], amax: torch.Tensor) -> torch.Tensor:
    """Each operand's kurtosis over its sampled values (``length`` of them; the padding left
    out), E[(x - mean)^4] / E[(x - mean)^2]^2: 3 for a Gaussian, C to 3C where one channel
    in C holds the energy (an outlier feature). Divided by the amax first, so that the fourth
    power of a large float32 does not overflow; NaN for a constant or non-finite tensor."""
    x = _padded(ops, "values") / amax.clamp(min=EPS)[:, None]
    n = torch.tensor([max(op.length, 1) for op in ops], device=x.device, dtype=x.dtype)
    real = torch.arange(x.shape[1], device=x.device)[None, :] < n[:, None]
    mean = x.sum(1) / n  # (padding is 0)
    d = torch.where(real, x - mean[:, None], torch.zeros_like(x))
    m2, m4 = d.square().sum(1) / n, d.square().square().sum(1) / n
    return torch.where(m2 > 0, m4 / m2.square(), torch.full_like(m2, float("nan")))


def count(ops: list[Operand], scale: torch.Tensor, summary: torch.Tensor
          ) -> tuple[torch.Tensor, list[int]]:
    """The rows' counts of ``ops`` (one device) from ``scales``' results, computed together:
    [n * 4, 6] (zeros, flushed, subnormal, saturated, sum (x/amax)^2, sum (err/amax)^2) over
    each operand's padded sample (padding is 0: it counts only as a zero), row
    ``i * 4 + recipe``; and the element format of each row."""
    device = scale.device
    formats = [int(element_format(r, op.role)) for op in ops for r in RECIPES]
    # e5m2 where a per-tensor recipe casts an output gradient, e4m3 elsewhere: [4, n, 1]
    wide = torch.tensor(formats, device=device).view(len(ops), len(RECIPES)).T[..., None] == \
        int(E5M2)
    (fmax, emin, mbits, over), (fmax5, emin5, mbits5, over5) = FORMATS[E4M3], FORMATS[E5M2]
    fmax_, over_ = torch.where(wide, fmax5, fmax), torch.where(wide, over5, over)
    emin_ = torch.where(wide, emin5, emin).int()
    x = _padded(ops, "values").unsqueeze(0)
    y = x * scale
    q = quantise(y, fmax_, emin_, torch.where(wide, mbits5, mbits).int())
    norm = summary[:, 0].clamp(min=EPS)[None, :, None]
    nonzero = x != 0
    parts = [(~nonzero).expand_as(y), nonzero & (q == 0),
             (q != 0) & (q.abs() < pow2(emin_)), y.abs() > over_,
             (x / norm).square().expand_as(y), ((x - q / scale) / norm).square()]
    sums = torch.stack([p.sum(-1, dtype=torch.float32) for p in parts], -1)  # [4, n, 6]
    return sums.transpose(0, 1).reshape(len(formats), len(parts)), formats


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
    out["sample_n"] = np.repeat([op.length for op in operands], n)
    for i, name in enumerate(("zeros", "flushed", "subnormal", "saturated")):
        out[name] = counts[:, i].round().astype(np.int64)
    width = max(len(op.values) for op in operands)  # (``_padded``'s)
    padding = np.repeat([width - op.length for op in operands], n)
    out["zeros"] -= padding
    with np.errstate(divide="ignore", invalid="ignore"):
        # no error at all: inf; NaN values (a NaN error sum): NaN
        out["sqnr_db"] = np.where(counts[:, 5] == 0, np.inf,
                                  10 * np.log10(counts[:, 4] / counts[:, 5]))
    out["amax"] = np.repeat(summaries[:, 0], n)
    out["scale"] = summaries[:, 1:1 + n].reshape(-1)
    out["kurtosis"] = np.repeat(summaries[:, 1 + n], n)
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
        self._history: dict[torch.device, History] = {}
        # The layers already in fp8 (torchao's Float8Linear), by name: /meta fp8_layers, which
        # the recorder writes at the drain after ``layers_changed``.
        self.layers: dict[str, dict] = {}
        self.layers_changed = False
        # Which ranks hold an fp8 layer's operand whole (DDP, a replicated DTensor): the
        # recorder's ``replicas.Replicas``, kept in its /meta fp8_layers entry as ``replicas``.
        self.replicas: Optional[Replicas] = None

    def on_module(self, module: torch.nn.Module, name: str, call: int, args: tuple,
                  output: Any) -> None:
        """A forward hook's view of a module call: measure a matmul's input and weight, and
        hook its output for the gradient."""
        weight = matmul_weight(module)
        out = output if isinstance(output, torch.Tensor) else None
        if weight is None or out is None:
            return
        try:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if name not in self.layers and fp8layers.is_float8(module):
                self.layers[name] = self._describe(module, x)
                self.layers_changed = True
            tid = self.tensor_id(Kind.OUTPUT, name, 0, out, type(module).__name__)
            if x is not None and stats.measurable(x):
                self._add(local(x), Role.INPUT, tid, call)
            if call == 0 and stats.measurable(weight):  # (the same weights on every call)
                self._add(local(weight), Role.WEIGHT, tid, call)
            if out.requires_grad and out.grad_fn is not None:
                out.register_hook(lambda g, tid=tid, call=call, name=name:
                                  self._on_grad(tid, call, g, name))
        except Exception as exc:  # noqa: BLE001 - one odd module must not stop the rest
            self.warn(f"fp8 counts of {name}", exc)

    def _describe(self, module: torch.nn.Module, x: Optional[torch.Tensor]) -> dict:
        """/meta fp8_layers' entry of a layer in fp8: its casts, and the operands several
        ranks hold whole (``replicas``)."""
        out = fp8layers.describe(module) or {}
        found = self.replicas.describe(module, x) if self.replicas is not None else {}
        if found:
            out["replicas"] = found
        return out

    def _on_grad(self, tid: int, call: int, grad: torch.Tensor, name: str = "") -> None:
        if grad is None or not self.active():
            return None
        try:
            layer = self.layers.get(name)
            if layer is not None and self.replicas is not None and \
                    "grad_output" not in layer.get("replicas", {}):
                found = self.replicas.of("grad_output", grad)
                if found is not None:  # (a DTensor gradient: the output gradient is declared
                    layer.setdefault("replicas", {})["grad_output"] = found  # where it arrives)
                    self.layers_changed = True
            if stats.measurable(grad):
                self._add(local(grad), Role.GRAD_OUTPUT, tid, call)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"fp8 counts of the gradient of tensor {tid}", exc)
        return None

    def _add(self, t: torch.Tensor, role: Role, tid: int, call: int) -> None:
        self.operands.append(measure(t, role, tensor=tid, call=call, sample=self.sample))

    def stage(self, step: int, read: HostRead) -> Callable[[], np.ndarray]:
        """The step's counts queued in ``read`` (one copy per device with the rest of the
        sampled step); the /fp8 rows from the returned function once it has run. Resets."""
        per_dev: dict[torch.device, list[Operand]] = {}
        for op in self.operands:
            per_dev.setdefault(op.values.device, []).append(op)
        self.operands = []
        staged = []
        for device, ops in per_dev.items():
            history = self._history.get(device)
            if history is None:
                history = self._history[device] = History(device, self.history_len)
            scale, summary = scales(ops, history)
            counts, formats = count(ops, scale, summary)
            staged.append((ops, read.add(counts), read.add(summary), formats))

        def rows() -> np.ndarray:
            parts = [pack(ops, c.value, s.value, f) for ops, c, s, f in staged]
            out = np.concatenate(parts) if parts else schema.empty("fp8")
            out["step"] = step
            return out
        return rows

    def reset(self) -> None:
        self.operands = []


def cast(t: torch.Tensor, recipe: Recipe, fmt: Fp8Format) -> torch.Tensor:
    """``t`` cast to fp8 by ``recipe`` and scaled back, in float32, scales along the last
    dimension (the contracted one, for a matmul operand): what the matmul of an fp8 recipe
    reads instead of ``t``. The scales are the counts' (``scales``): per tensor, per row
    rounded down to a power of two, per 32-element block (E8M0); ``DELAYED`` is cast as
    ``TENSOR`` (one step holds no amax history). The forensic trial's cast (``fp8trial``)."""
    x = t.float()
    fmax, emin, mbits, _ = FORMATS[fmt]
    a = x.abs()
    if recipe in (Recipe.TENSOR, Recipe.DELAYED):
        scale = amax_to_scale(a.amax(), fmax)
    elif recipe == Recipe.ROWWISE:
        scale = _pow2_floor(amax_to_scale(a.amax(-1, keepdim=True), fmax))
    else:
        cols = x.shape[-1]
        pad = -cols % schema.MX_BLOCK
        blocks = torch.nn.functional.pad(a, (0, pad)).unflatten(-1, (-1, schema.MX_BLOCK))
        scale = mx_scale(blocks.amax(-1)).repeat_interleave(schema.MX_BLOCK, -1)[..., :cols]
    return quantise(x * scale, fmax, emin, mbits) / scale
