"""The sampled tier as the forecast reads it (numpy only): per layer and sampled step the log2
of the largest finite abs max and the layer's dtype limit, per sampled step the weight norm and
update ratio, and what the fix snippets may name; on a long run only the /stats rows near the
cut (a bisection over blocks of rows, not the whole compressed table).

``forecast.read`` assembles these into a ``forecast.Series``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..runfile.meta import OptimizerInfo
from ..runfile.schema import BF16_MAX, FP16_MAX, DType, Kind
from . import fixes as _fixes

FP32_MAX = 3.4028234663852886e38
LIMITS = {int(DType.FLOAT16): FP16_MAX, int(DType.BFLOAT16): BF16_MAX,
          int(DType.FLOAT32): FP32_MAX, int(DType.FLOAT64): 1.7976931348623157e308}
DTYPE_NAMES = {int(DType.FLOAT16): "float16", int(DType.BFLOAT16): "bfloat16",
               int(DType.FLOAT32): "float32", int(DType.FLOAT64): "float64"}

# /stats rows are appended in step order, in HDF5 chunks of a few thousand rows: a window of
# steps is found by bisecting over blocks of this many rows, one block of margin each side.
BLOCK = 4096
WHOLE = 16  # blocks


class _Rows:
    """Rows ``start:stop`` of a stats ``Table``, with the ``chunks`` and ``dtype`` that
    ``layers.sampled`` reads."""

    def __init__(self, table: Any, start: int, stop: int):
        self.table, self.start, self.stop, self.dtype = table, start, stop, table.dtype

    def __len__(self) -> int:
        return self.stop - self.start

    def chunks(self, size: int = 1 << 16, names: Optional[tuple] = None):
        for a in range(self.start, self.stop, size):
            yield self.table.columns(names, a, min(a + size, self.stop))


@dataclass
class _Window:
    """A run seen through a window of its /stats rows."""

    tensors: Any
    stats: _Rows


def rows_near(run: Any, until: Optional[int], samples: Optional[int]) -> Any:
    """``run``, or a view of it holding only the rows of its last ``samples`` sampled steps
    before ``until`` (the sentinel's ``sampled`` flags say which steps those are)."""
    table, steps = run.stats, run.steps
    # A small table is read whole: it costs little, and a run built by hand (tests, a merge of
    # ranks) need not be in step order.
    if samples is None or len(table) <= WHOLE * BLOCK or not len(steps):
        return run
    lo = _window_start(run, until, samples)
    start = 0 if lo is None else max(0, _first_block(table, lo) - BLOCK)
    stop = len(table) if until is None else min(len(table),
                                                 _first_block(table, int(until)) + 2 * BLOCK)
    return _Window(run.tensors, _Rows(table, start, stop))


def _window_start(run: Any, until: Optional[int], samples: int) -> Optional[int]:
    """The first step of the last ``samples`` sampled steps before ``until`` (None: from the
    start): from the sentinel's ``sampled`` flags, else from the sampling interval."""
    steps = run.steps
    flagged = steps["step"][steps["sampled"] == 1]
    if until is not None:
        flagged = flagged[flagged < until]
    if len(flagged):
        return int(flagged[-samples]) if len(flagged) > samples else None
    every = (run.recorder_settings or {}).get("every")
    if not isinstance(every, int) or every <= 0:
        return None
    end = int(steps["step"][-1]) + 1 if until is None else int(until)
    return max(0, end - (samples + 1) * every)


def _first_block(table: Any, step: int) -> int:
    """The start of the block of rows where ``step`` begins (a bisection: a few chunk reads)."""
    lo, hi = 0, (len(table) - 1) // BLOCK + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if int(table.column("step", mid * BLOCK, mid * BLOCK + 1)[0]) < step:
            lo = mid + 1
        else:
            hi = mid
    return max(0, lo - 1) * BLOCK


def layer_series(rows: np.ndarray, found: list) -> tuple:
    """Per layer and sampled step: log2 of the largest finite abs max (NaN: none, or the step
    held NaN/inf), and the layer's limit (the smallest over its rows' dtypes)."""
    used = np.unique(rows["layer"]) if len(rows) else np.zeros(0, np.int64)
    grid = np.unique(rows["step"]) if len(rows) else np.zeros(0, np.int64)
    li = np.searchsorted(used, rows["layer"])
    si = np.searchsorted(grid, rows["step"])
    absmax = rows["absmax"].astype(np.float64)
    good = np.isfinite(absmax) & (absmax > 0) & (rows["nonfinite"] == 0)
    peak = np.zeros((len(used), len(grid)))
    np.maximum.at(peak, (li[good], si[good]), absmax[good])
    bad = np.zeros((len(used), len(grid)), bool)
    bad[li[~good & ~(absmax == 0)], si[~good & ~(absmax == 0)]] = True
    with np.errstate(divide="ignore"):
        log2 = np.where((peak > 0) & ~bad, np.log2(np.where(peak > 0, peak, 1.0)), np.nan)
    lim_of = np.array([LIMITS.get(c, math.inf) for c in range(256)])
    limit = np.full(len(used), math.inf)
    np.minimum.at(limit, li, lim_of[rows["dtype"].astype(np.int64) & 0xFF])
    code = {v: k for k, v in LIMITS.items()}
    return (grid.astype(np.int64), log2, [found[i].name for i in used],
            [found[i].kind for i in used], limit,
            [DTYPE_NAMES.get(code.get(x), "") for x in limit])


def param_series(rows: np.ndarray) -> tuple:
    """Per sampled step: the total weight norm and the size-weighted mean update ratio (in
    log10: one layer's huge ratio does not drown the rest; capped at 10, x10 in a step)."""
    steps = np.unique(rows["step"]) if len(rows) else np.zeros(0, np.int64)
    si = np.searchsorted(steps, rows["step"])
    norm = rows["norm"].astype(np.float64)
    sq = np.zeros(len(steps))
    ok = np.isfinite(norm)
    np.add.at(sq, si[ok], norm[ok] ** 2)
    upd = rows["update"].astype(np.float64)
    numel = rows["numel"].astype(np.float64)
    # A (nearly) zero weight's ratio says nothing.
    use = np.isfinite(upd) & (upd > 0) & ok & (norm > 1e-6)
    num, den = np.zeros(len(steps)), np.zeros(len(steps))
    np.add.at(num, si[use], np.log10(np.minimum(upd[use], 10.0)) * numel[use])
    np.add.at(den, si[use], numel[use])
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(den > 0, 10 ** (num / np.where(den > 0, den, 1)), np.nan)
    return steps.astype(np.int64), np.sqrt(sq), mean


def fix_context(run: Any) -> _fixes.Context:
    """What the fix snippets may name, from the run's configuration."""
    autocast = run.autocast or {}
    dtype = autocast.get("dtype") if autocast.get("enabled") else None
    opt = run.optimizers[0] if run.optimizers else OptimizerInfo()
    device = run.device or {}
    return _fixes.Context(
        device=str(autocast.get("device_type") or device.get("type") or "cuda"),
        optimizer=opt.name or "AdamW", lr=opt.lr,
        autocast=dtype, low={"float16": "fp16", "bfloat16": "bf16"}.get(dtype),
        scaler=run.scaler is not None)


def module_types(run: Any) -> dict:
    t = run.tensors
    if not len(t) or "type" not in t.dtype.names:
        return {}
    mine = t["kind"] == int(Kind.OUTPUT)
    return {str(n): str(c) for n, c in zip(t["name"][mine].tolist(), t["type"][mine].tolist())
            if c}
