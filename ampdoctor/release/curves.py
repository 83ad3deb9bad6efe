"""Loss curves for people: a long series thinned to its shape, and percentages as people read
them (two curves' trailing means and relative differences: ``diagnosis/parity.py``, where the
diagnosis decides an fp8 run's drift from its baseline on them too).

numpy only.

Example::

    idx = extremes(loss, 2000)              # a million steps drawn in about 2000 points
    percent(0.0019)                         # '0.19%'
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np


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


def percent(x: Optional[float], digits: int = 2) -> str:
    """A fraction as people read it: 0.00026 -> '0.026%', 3.4 -> '340%'."""
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return "non-finite"
    return f"{100 * x:.{digits}g}%" if 100 * x < 10 ** digits else f"{100 * x:.0f}%"
