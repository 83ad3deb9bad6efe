"""Per-tensor numeric statistics, computed on the tensor's device without a host sync.

What a row holds is ``schema.STAT_FIELDS``: element counts by fp16/bf16 range class, NaN and
inf counts, exact zeros, abs max, smallest non-zero magnitude and rms.

Cost is the design constraint (``shared/notes/overhead-measurements.md``): every extra full
pass over an activation costs about as much as the whole step budget. So a ``Collector`` in
sampled mode does exactly one full pass per tensor, ``torch.aminmax`` (exact abs max, exact
NaN/inf presence), plus a gather of ``sample`` elements at fixed, well-spread positions into a
preallocated buffer. Counting happens once per drain, for all tensors of the step together,
in a handful of batched kernels; the drain is the one host sync. Counts are then out of
``sample_n`` elements (an estimate of a fraction); a tensor no larger than the sample is
counted exactly. In exact mode (forensic replay, tests) every element is counted.

Everything is computed in float32 (float64 for float64 tensors): fp16 and bf16 convert to
float32 exactly, and the range thresholds are exact float32 numbers, so a bf16 value of 65280
is never misread against a threshold rounded to bf16.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from . import schema

SAMPLE = 4096  # elements gathered per tensor in sampled mode
EXACT_CHUNK = 1 << 24  # elements classified at once in exact mode (bounds temporary memory)

# Buckets of a finite, non-zero magnitude a (bucketize with right=True counts bounds <= a):
#   0: a < 2**-133            (flushes in bf16)
#   1: 2**-133 <= a < 2**-126 (bf16 subnormal)
#   2: 2**-126 <= a < 2**-24  (flushes in fp16)
#   3: 2**-24 <= a < 2**-14   (fp16 subnormal)
#   4: normal in both
#   5: 2**15 <= a <= 65504    (near fp16 overflow)
#   6: 65504 < a <= bf16 max  (overflows fp16)
#   7: a > bf16 max           (overflows bf16 too)
_BOUNDS = (
    schema.BF16_SUBNORMAL_MIN,
    schema.BF16_TINY,
    schema.FP16_SUBNORMAL_MIN,
    schema.FP16_TINY,
    schema.FP16_NEAR,
    float(np.nextafter(np.float32(schema.FP16_MAX), np.float32(np.inf))),
    float(np.nextafter(np.float32(schema.BF16_MAX), np.float32(np.inf))),
)
_ZERO, _NAN, _POSINF, _NEGINF, _PAD = 8, 9, 10, 11, 12
_NCODES = 13

_DTYPES = {
    torch.float32: schema.DType.FLOAT32,
    torch.float16: schema.DType.FLOAT16,
    torch.bfloat16: schema.DType.BFLOAT16,
    torch.float64: schema.DType.FLOAT64,
}


def dtype_code(dtype: torch.dtype) -> int:
    return int(_DTYPES.get(dtype, schema.DType.OTHER))


def measurable(t: object) -> bool:
    """True for a dense, real floating-point tensor with elements (what stats can describe)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.is_floating_point()
            and t.numel() > 0 and t.device.type != "meta")


def sample_index(numel: int, sample: int, device: torch.device) -> torch.Tensor:
    """Positions to gather from a flattened tensor of ``numel`` elements.

    A golden-ratio stride, coprime with ``numel``, walks the tensor in a low-discrepancy
    order, so the sample does not lock onto one column of a matrix the way a plain stride
    whose period divides the row length would. Deterministic: no RNG is touched.
    """
    if numel <= sample:
        return torch.arange(numel, device=device)
    stride = int(numel * 0.6180339887498949) | 1
    while math.gcd(stride, numel) != 1:
        stride += 2
    return (torch.arange(sample, dtype=torch.int64, device=device) * stride) % numel


class _IndexCache:
    def __init__(self, limit: int = 512):
        self._cache: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._limit = limit

    def get(self, numel: int, sample: int, device: torch.device) -> torch.Tensor:
        key = (numel, sample, device)
        idx = self._cache.get(key)
        if idx is None:
            if len(self._cache) >= self._limit:
                self._cache.clear()
            idx = self._cache[key] = sample_index(numel, sample, device)
        return idx


_INDEX = _IndexCache()


def _codes(values: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Range class of every element (see _BOUNDS), as int64 codes."""
    a = values.abs()
    bounds = torch.tensor(_BOUNDS, dtype=values.dtype, device=values.device)
    codes = torch.bucketize(a, bounds, right=True)
    codes = torch.where(a == 0, _ZERO, codes)
    codes = torch.where(values == math.inf, _POSINF, codes)
    codes = torch.where(values == -math.inf, _NEGINF, codes)
    codes = torch.where(torch.isnan(values), _NAN, codes)
    if valid is not None:
        codes = torch.where(valid, codes, _PAD)
    return codes


def _classify(values: torch.Tensor, valid: Optional[torch.Tensor] = None):
    """Per-row counts, smallest non-zero magnitude and (scaled) sum of squares.

    ``values``: [rows, m] float32/float64; ``valid``: [rows, m] bool or None.
    Returns counts [rows, _NCODES] int64, absmin [rows], finite_max [rows], sumsq [rows]
    where sumsq is the sum of (a / finite_max)**2 over finite values (no fp32 overflow).
    """
    rows = values.shape[0]
    codes = _codes(values, valid)
    offsets = torch.arange(rows, device=values.device).unsqueeze(1) * _NCODES
    counts = torch.bincount((codes + offsets).reshape(-1), minlength=rows * _NCODES)
    counts = counts.view(rows, _NCODES)
    a = values.abs()
    finite = (codes < _ZERO)  # finite and non-zero
    inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
    absmin = torch.where(finite, a, inf).amin(dim=1)
    fmax = torch.where(finite, a, torch.zeros((), dtype=values.dtype, device=values.device))
    fmax = fmax.amax(dim=1)
    scaled = torch.where(finite, a / torch.where(fmax > 0, fmax, 1).unsqueeze(1), 0)
    sumsq = (scaled * scaled).sum(dim=1)
    return counts, absmin, fmax, sumsq


def _pack(counts, absmin, fmax, sumsq, numel, sample_n, minmax=None) -> np.ndarray:
    """Host rows (schema.STATS columns) from the per-row results of _classify."""
    counts = counts.cpu().numpy().astype(np.int64)
    absmin = absmin.double().cpu().numpy()
    fmax = fmax.double().cpu().numpy()
    sumsq = sumsq.double().cpu().numpy()
    out = schema.empty("stats", len(counts))
    out["numel"] = numel
    out["sample_n"] = sample_n
    out["nan"] = counts[:, _NAN]
    out["posinf"] = counts[:, _POSINF]
    out["neginf"] = counts[:, _NEGINF]
    out["zeros"] = counts[:, _ZERO]
    out["flushbf16"] = counts[:, 0]
    out["subbf16"] = counts[:, :2].sum(1)
    out["flush16"] = counts[:, :3].sum(1)
    out["sub16"] = counts[:, :4].sum(1)
    out["near16"] = counts[:, 5:8].sum(1)
    out["over16"] = counts[:, 6:8].sum(1)
    out["overbf16"] = counts[:, 7]
    out["absmin"] = absmin
    nfinite = counts[:, :_ZERO].sum(1) + counts[:, _ZERO]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["rms"] = np.where(nfinite > 0, fmax * np.sqrt(sumsq / np.maximum(nfinite, 1)), np.nan)
    bits = ((counts[:, _NAN] > 0) * 1 + (counts[:, _POSINF] > 0) * 2
            + (counts[:, _NEGINF] > 0) * 4)
    absmax = np.where(counts[:, _POSINF] + counts[:, _NEGINF] > 0, np.inf, fmax)
    absmax = np.where(nfinite + counts[:, _POSINF] + counts[:, _NEGINF] > 0, absmax, np.nan)
    if minmax is not None:
        # Sampled rows: presence bits and abs max come from the full-tensor aminmax.
        mm = minmax.double().cpu().numpy()
        lo, hi = mm[:, 0], mm[:, 1]
        has_nan = np.isnan(lo) | np.isnan(hi)
        full = ((has_nan * 1) | ((hi == np.inf) * 2) | ((lo == -np.inf) * 4)).astype(np.int64)
        bits = np.where(has_nan, bits | full, full)  # NaN hides infs from aminmax
        exact_max = np.maximum(np.abs(lo), np.abs(hi))
        absmax = np.where(has_nan, absmax, exact_max)
    out["nonfinite"] = bits
    out["absmax"] = absmax
    return out


class Collector:
    """Collects statistics of many tensors on their device; ``drain`` returns them as rows.

    Example::

        c = Collector()
        slot = c.add(activation)      # launches device work, no sync
        rows = c.drain()              # one host sync per device; rows[slot] describes it

    ``exact=True`` counts every element (forensic replay); otherwise each tensor contributes
    one aminmax pass and a ``sample``-element gather.
    """

    def __init__(self, sample: int = SAMPLE, exact: bool = False, capacity: int = 256):
        self.sample = sample
        self.exact = exact
        self._capacity = capacity
        self._slots: list[tuple[torch.device, int]] = []  # slot -> (device, row on that device)
        self._numel: list[int] = []
        self._dtype: list[int] = []
        self._dev: dict[torch.device, _DeviceBuffer] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, t: torch.Tensor) -> Optional[int]:
        """Queue statistics of ``t``; return its slot, or None for a tensor stats cannot describe."""
        if not measurable(t):
            return None
        t = t.detach()
        buf = self._dev.get(t.device)
        if buf is None:
            buf = self._dev[t.device] = _DeviceBuffer(t.device, self.sample, self._capacity,
                                                       self.exact)
        row = buf.add(t)
        self._slots.append((t.device, row))
        self._numel.append(t.numel())
        self._dtype.append(dtype_code(t.dtype))
        return len(self._slots) - 1

    def drain(self) -> np.ndarray:
        """Rows for every slot, in slot order (``schema.STATS`` dtype); resets the collector."""
        out = schema.empty("stats", len(self._slots))
        if self._slots:
            per_dev = {dev: buf.finish() for dev, buf in self._dev.items()}
            for i, (dev, row) in enumerate(self._slots):
                out[i] = per_dev[dev][row]
            out["dtype"] = self._dtype
        self.reset()
        return out

    def reset(self) -> None:
        self._slots.clear()
        self._numel.clear()
        self._dtype.clear()
        for buf in self._dev.values():
            buf.reset()


class _DeviceBuffer:
    """Preallocated per-device storage for one drain's worth of tensors."""

    def __init__(self, device: torch.device, sample: int, capacity: int, exact: bool):
        self.device = device
        self.sample = sample
        self.exact = exact
        self.n = 0
        self.numel: list[int] = []
        self.valid: list[int] = []
        self._exact_rows: list[tuple] = []
        self.capacity = 0 if exact else capacity
        if not exact:
            self.values = torch.zeros((capacity, sample), dtype=torch.float32, device=device)
            self.minmax = torch.zeros((capacity, 2), dtype=torch.float32, device=device)

    def _grow(self) -> None:
        values = torch.zeros((2 * self.capacity, self.sample), dtype=torch.float32,
                             device=self.device)
        minmax = torch.zeros((2 * self.capacity, 2), dtype=torch.float32, device=self.device)
        values[: self.n].copy_(self.values[: self.n])
        minmax[: self.n].copy_(self.minmax[: self.n])
        self.values, self.minmax, self.capacity = values, minmax, 2 * self.capacity

    def add(self, t: torch.Tensor) -> int:
        row = self.n
        numel = t.numel()
        if self.exact:
            self._exact_rows.append(_exact_device(t))
        else:
            if row >= self.capacity:
                self._grow()
            lo, hi = torch.aminmax(t)
            self.minmax[row, 0] = lo
            self.minmax[row, 1] = hi
            idx = _INDEX.get(numel, self.sample, t.device)
            n = idx.numel()
            self.values[row, :n] = torch.take(t, idx)
            self.valid.append(n)
        self.numel.append(numel)
        self.n += 1
        return row

    def finish(self) -> np.ndarray:
        if self.exact:
            rows = [_pack(*parts, numel=n, sample_n=n) for parts, n in
                    zip(self._exact_rows, self.numel)]
            return np.concatenate(rows) if rows else schema.empty("stats")
        n = self.n
        values = self.values[:n]
        valid = torch.tensor(self.valid, device=self.device).unsqueeze(1)
        mask = torch.arange(self.sample, device=self.device).unsqueeze(0) < valid
        counts, absmin, fmax, sumsq = _classify(values, mask)
        return _pack(counts, absmin, fmax, sumsq, numel=np.array(self.numel),
                     sample_n=np.array(self.valid), minmax=self.minmax[:n])

    def reset(self) -> None:
        self.n = 0
        self.numel.clear()
        self.valid.clear()
        self._exact_rows.clear()


def _exact_device(t: torch.Tensor):
    """Full-tensor classification, chunked so temporaries stay bounded; no host sync."""
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    flat = t.reshape(-1)
    total = None
    for start in range(0, flat.numel(), EXACT_CHUNK):
        part = flat[start:start + EXACT_CHUNK].to(work).unsqueeze(0)
        counts, absmin, fmax, sumsq = _classify(part)
        if total is None:
            total = [counts, absmin, fmax, sumsq]
            continue
        # Merge: sums of squares were scaled by each chunk's own max; rescale to the larger.
        c0, m0, f0, s0 = total
        f = torch.maximum(f0, fmax)
        safe = torch.where(f > 0, f, 1)
        s = s0 * (f0 / safe) ** 2 + sumsq * (fmax / safe) ** 2
        total = [c0 + counts, torch.minimum(m0, absmin), f, s]
    return tuple(total)


def exact(t: torch.Tensor) -> Optional[np.ndarray]:
    """Statistics of one tensor counted over every element, as a ``schema.STATS`` row.

    Syncs (it returns host values). None for integer, bool, complex, sparse or empty tensors.
    """
    c = Collector(exact=True)
    if c.add(t) is None:
        return None
    return c.drain()[0]
