"""Two loss curves lined up by step: trailing means, relative differences, and percentages as
people read them.

numpy only. fp32 parity (``comparison``) decides its verdict on these; a run against its fix
(``fix_outcome``) measures with them how far apart the two losses are where both are finite.

Example::

    rel = relative(trailing(base, 10), trailing(amp, 10), LOSS_FLOOR * np.nanmax(abs(base)))
    percent(float(np.nanmax(rel)))          # '0.19%'
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

LOSS_FLOOR = 1e-3  # of the baseline's largest loss: the smallest denominator


def extremes(y: np.ndarray, max_points: int) -> np.ndarray:
    """The positions that keep a long series' shape in about ``max_points`` points: each
    bin's smallest and largest value, so a one-step spike in a million steps survives; every
    position of a series no longer than that. NaN counts as neither."""
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    k = int(np.ceil(n / max(1, max_points // 2)))
    pad = (-n) % k
    yy = np.concatenate([np.asarray(y, np.float64), np.full(pad, np.nan)]).reshape(-1, k)
    base = np.arange(len(yy)) * k
    nan = np.isnan(yy)
    hi = base + np.argmax(np.where(nan, -np.inf, yy), axis=1)
    lo = base + np.argmin(np.where(nan, np.inf, yy), axis=1)
    idx = np.unique(np.concatenate([lo, hi]))
    return idx[idx < n]


def trailing(x: np.ndarray, w: int) -> np.ndarray:
    """Mean of the last ``w`` values at each position; non-finite if any of them is."""
    if w <= 1:
        return x.copy()
    finite = np.isfinite(x)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, x, 0.0))])
    cbad = np.concatenate([[0], np.cumsum(~finite)])
    idx = np.arange(len(x))
    lo = np.maximum(idx - w + 1, 0)
    mean = (csum[idx + 1] - csum[lo]) / (idx + 1 - lo)
    mean[(cbad[idx + 1] - cbad[lo]) > 0] = np.nan
    return mean


def relative(base: np.ndarray, amp: np.ndarray, floor: float) -> np.ndarray:
    """|amp - base| / max(|base|, floor); inf where only amp is non-finite, NaN where the
    baseline is (those steps decide nothing)."""
    with np.errstate(invalid="ignore", over="ignore"):
        rel = np.abs(amp - base) / np.maximum(np.abs(base), max(floor, 1e-30))
    rel[~np.isfinite(amp)] = np.inf
    rel[~np.isfinite(base)] = np.nan
    return rel


def percent(x: Optional[float], digits: int = 2) -> str:
    """A fraction as people read it: 0.00026 -> '0.026%', 3.4 -> '340%'."""
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return "non-finite"
    return f"{100 * x:.{digits}g}%" if 100 * x < 10 ** digits else f"{100 * x:.0f}%"
