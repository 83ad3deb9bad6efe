"""Per-tensor numeric statistics, computed on the tensor's device without a host sync.

What a row holds is ``schema.STATS``'s statistic columns: element counts by fp16/bf16 range
class, NaN and inf counts, exact zeros, abs max, smallest non-zero magnitude and rms.

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
from typing import Callable, Optional

import numpy as np
import torch

from ..runfile import schema
from .readback import HostRead
from .sharding import local

SAMPLE = 1024  # elements gathered per tensor in sampled mode (see docs/performance.md)
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
_ZERO, _NAN, _POSINF, _NEGINF = 8, 9, 10, 11
_NCODES = 12

_DTYPES = {
    torch.float32: schema.DType.FLOAT32,
    torch.float16: schema.DType.FLOAT16,
    torch.bfloat16: schema.DType.BFLOAT16,
    torch.float64: schema.DType.FLOAT64,
}


def dtype_code(dtype: torch.dtype) -> int:
    return int(_DTYPES.get(dtype, schema.DType.OTHER))


def measurable(t: object) -> bool:
    """True for a dense, real floating-point tensor with elements (what stats can describe).

    A DTensor is judged by the shard this rank holds, which is what gets measured."""
    if type(t) is not torch.Tensor:  # (a plain tensor, the common case, is its own shard)
        t = local(t)
        if not isinstance(t, torch.Tensor):
            return False
    return (t.layout == torch.strided and t.is_floating_point() and t.numel() > 0
            and t.device.type != "meta")


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients, accumulated in fp32, batched per (device, dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:  # (a gradient with a graph of its own, create_graph=True: detached)
        groups.setdefault((g.device, g.dtype), []).append(g.detach() if g.requires_grad else g)
    parts = []
    dev = grads[0].device
    for members in groups.values():
        norms = torch._foreach_norm(members, 2.0, dtype=torch.float32)
        parts.append(torch.linalg.vector_norm(torch.stack(norms)).to(dev))
    return torch.linalg.vector_norm(torch.stack(parts)) if len(parts) > 1 else parts[0]


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


def _classify(values: torch.Tensor, rows: torch.Tensor, n: int):
    """Per-row counts by range class, smallest non-zero magnitude, finite max, sum of squares.

    ``values``: flat float32/float64 elements of many tensors; ``rows``: the row (tensor) each
    element belongs to; ``n``: the number of rows. Returns counts [n, _NCODES] int64, absmin
    [n], finite max [n] and the sum of (a / finite max)**2 over finite values [n] (scaled so
    that squares of values near fp32's top do not overflow). No host sync.
    """
    a = values.abs()
    bounds = torch.tensor(_BOUNDS, dtype=values.dtype, device=values.device)
    codes = torch.bucketize(a, bounds, right=True)
    codes.masked_fill_(a == 0, _ZERO)
    codes.masked_fill_(values == math.inf, _POSINF)
    codes.masked_fill_(values == -math.inf, _NEGINF)
    codes.masked_fill_(torch.isnan(values), _NAN)
    counts = torch.bincount(codes + rows * _NCODES, minlength=n * _NCODES).view(n, _NCODES)
    other = codes >= _ZERO  # zero, NaN or inf: not a finite non-zero magnitude
    finite_a = a.masked_fill(other, 0)
    fmax = torch.zeros(n, dtype=a.dtype, device=a.device).scatter_reduce_(
        0, rows, finite_a, "amax", include_self=True)
    absmin = torch.full((n,), math.inf, dtype=a.dtype, device=a.device).scatter_reduce_(
        0, rows, a.masked_fill(other, math.inf), "amin", include_self=True)
    scale = torch.where(fmax > 0, fmax, 1)
    scaled = finite_a / scale[rows]
    sumsq = torch.zeros(n, dtype=a.dtype, device=a.device).index_add_(0, rows, scaled * scaled)
    return counts, absmin, fmax, sumsq


def _stage(read: HostRead, counts: torch.Tensor,
           *columns: torch.Tensor) -> Callable[[], list[np.ndarray]]:
    """The per-row results of one device, queued in ``read`` as one tensor; once it has run,
    the returned function gives ``[counts (int64), *columns (float64)]``. The counts travel
    as float64, exact below 2**53."""
    k = counts.shape[1]
    both = read.add(torch.cat([counts.double(), torch.stack([c.double() for c in columns], 1)],
                              1))

    def host() -> list[np.ndarray]:
        values = both.value
        return [values[:, :k].astype(np.int64)] + [values[:, k + i] for i in range(len(columns))]
    return host


def _pack(counts, absmin, fmax, sumsq, numel, sample_n, minmax=None) -> np.ndarray:
    """Host rows (schema.STATS columns) from the per-row results of _classify (host arrays)."""
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
        lo, hi = minmax
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

    ``stage(read)`` instead of ``drain`` queues the device results in a ``readback.HostRead``
    that other owners share (a sampled step's one copy per device) and returns the function
    that gives the rows once the read has run.

    ``exact=True`` counts every element (forensic replay); otherwise each tensor contributes
    one aminmax pass and a ``sample``-element gather, and the counting of all tensors of a
    drain happens together, in a fixed number of kernels.
    """

    def __init__(self, sample: int = SAMPLE, exact: bool = False):
        self.sample = sample
        self.exact = exact
        self._slots: list[tuple[torch.device, int]] = []  # slot -> (device, row on that device)
        self._dtype: list[int] = []
        self._dev: dict[torch.device, _DeviceBuffer] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, t: torch.Tensor) -> Optional[int]:
        """Queue statistics of ``t``; its slot, or None for a tensor stats cannot describe."""
        t = local(t)  # a DTensor's shard: mixing it with plain tensors would raise
        if not measurable(t):
            return None
        t = t.detach()
        buf = self._dev.get(t.device)
        if buf is None:
            buf = self._dev[t.device] = _DeviceBuffer(t.device, self.sample, self.exact)
        self._slots.append((t.device, buf.add(t)))
        self._dtype.append(dtype_code(t.dtype))
        return len(self._slots) - 1

    def drain(self) -> np.ndarray:
        """Rows for every slot, in slot order (``schema.STATS`` dtype); resets the collector."""
        read = HostRead()
        rows = self.stage(read)
        read.run()
        return rows()

    def stage(self, read: HostRead) -> Callable[[], np.ndarray]:
        """``drain`` in two halves: the device results queued in ``read`` now (the collector
        is reset), the rows from the returned function once ``read`` has run."""
        slots, dtypes = list(self._slots), list(self._dtype)
        per_dev = {dev: buf.stage(read) for dev, buf in self._dev.items() if buf.items}
        self.reset()

        def rows() -> np.ndarray:
            out = schema.empty("stats", len(slots))
            if slots:
                for dev, host in per_dev.items():
                    out[[i for i, (d, _) in enumerate(slots) if d == dev]] = host()
                out["dtype"] = dtypes
            return out
        return rows

    def reset(self) -> None:
        self._slots.clear()
        self._dtype.clear()
        for buf in self._dev.values():
            buf.reset()


class _DeviceBuffer:
    """One drain's worth of tensors on one device: references to small device results only."""

    def __init__(self, device: torch.device, sample: int, exact: bool):
        self.device = device
        self.sample = sample
        self.exact = exact
        self.items: list[tuple] = []

    def add(self, t: torch.Tensor) -> int:
        if self.exact:
            self.items.append((_exact_device(t), t.numel()))
        else:
            lo, hi = torch.aminmax(t)
            sample = torch.take(t, _INDEX.get(t.numel(), self.sample, t.device))
            self.items.append((t.dtype, lo, hi, sample, t.numel()))
        return len(self.items) - 1

    def stage(self, read: HostRead) -> Callable[[], np.ndarray]:
        """This device's results queued in ``read``; its rows once the read has run."""
        if self.exact:
            exact = [(_stage(read, *parts), n) for parts, n in self.items]
            return lambda: np.concatenate([_pack(*host(), numel=n, sample_n=n)
                                           for host, n in exact])
        n = len(self.items)
        groups: dict[torch.dtype, list[int]] = {}
        for i, item in enumerate(self.items):
            groups.setdefault(item[0], []).append(i)
        lo = torch.empty(n, dtype=torch.float32, device=self.device)
        hi = torch.empty(n, dtype=torch.float32, device=self.device)
        values, rows = [], []
        for dtype, members in groups.items():
            index = torch.tensor(members, device=self.device)
            lo[index] = torch.stack([self.items[i][1] for i in members]).float()
            hi[index] = torch.stack([self.items[i][2] for i in members]).float()
            samples = [self.items[i][3] for i in members]
            work = torch.float64 if dtype == torch.float64 else torch.float32
            values.append(torch.cat(samples).to(work))
            lengths = torch.tensor([s.numel() for s in samples], device=self.device)
            rows.append(torch.repeat_interleave(index, lengths))
        work = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
        values = torch.cat([v.to(work) for v in values])
        counts, absmin, fmax, sumsq = _classify(values, torch.cat(rows), n)
        sample_n = np.array([item[3].numel() for item in self.items])
        numel = np.array([item[4] for item in self.items])
        host = _stage(read, counts, absmin, fmax, sumsq, lo, hi)

        def packed() -> np.ndarray:
            counts, absmin, fmax, sumsq, lo_host, hi_host = host()
            return _pack(counts, absmin, fmax, sumsq, numel=numel, sample_n=sample_n,
                         minmax=(lo_host, hi_host))
        return packed

    def reset(self) -> None:
        self.items = []


def _exact_device(t: torch.Tensor):
    """Full-tensor classification, chunked so temporaries stay bounded; no host sync."""
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    flat = t.reshape(-1)
    total = None
    for start in range(0, flat.numel(), EXACT_CHUNK):
        part = flat[start:start + EXACT_CHUNK].to(work)
        rows = torch.zeros(part.numel(), dtype=torch.int64, device=part.device)
        counts, absmin, fmax, sumsq = _classify(part, rows, 1)
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
