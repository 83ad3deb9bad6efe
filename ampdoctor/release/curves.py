"""Loss curves for people: a long series thinned to its shape (whole, or a block at a time),
and percentages as people read them (two curves' trailing means and relative differences:
``diagnosis/parity.py``, where the diagnosis decides an fp8 run's drift from its baseline on
them too).

numpy only.

Example::

    idx = extremes(loss, 2000)              # a million steps drawn in about 2000 points
    t = Thinned(total=len(run.groups), max_points=2000)    # a series read a block at a time
    for part in run.groups.chunks(names=("step", "lr")):
        t.add(part["step"], part["lr"])
    steps, lrs = t.result()
    percent(0.0019)                         # '0.19%'
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

BLOCK = 1 << 20  # values of a long series thinned at a time (``extremes``)


def extremes(y: np.ndarray, max_points: int, finite_only: bool = False) -> np.ndarray:
    """The positions that keep a long series' shape in about ``max_points`` points: each
    bin's smallest and largest value, so a one-step spike in a million steps survives; every
    position of a series no longer than that. NaN counts as neither (``finite_only``: nor
    does an infinity). Read ``BLOCK`` values at a time, in the series' own dtype where it is
    a float one (widening keeps the order): a float64 copy of a month-long curve is never
    made."""
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    k = int(np.ceil(n / max(1, max_points // 2)))
    step = max(1, BLOCK // k) * k  # whole bins per block
    found = []
    for start in range(0, n, step):
        part = np.asarray(y[start:start + step])
        if part.dtype.kind != "f":
            part = part.astype(np.float64)
        shown = np.isfinite(part) if finite_only else ~np.isnan(part)
        whole = len(part) // k * k  # the last block's last bin may be short
        base = start + np.arange(0, len(part), k)
        for fill, pick in ((np.inf, np.argmin), (-np.inf, np.argmax)):
            v = np.where(shown, part, part.dtype.type(fill))
            at = [pick(v[:whole].reshape(-1, k), axis=1)] if whole else []
            if whole < len(part):
                at.append(np.array([pick(v[whole:])]))
            found.append(base + np.concatenate(at))
    idx = np.unique(np.concatenate(found))
    return idx[idx < n]


class Thinned:
    """A long series thinned as it is read, a block at a time (``add``), never held whole:
    each block keeps the smallest and largest value of each bin of at most ``total /
    (max_points / 2)`` values, the width ``extremes`` gives a series of ``total`` values, so a
    one-step spike survives. ``total``: how many values all the blocks hold at most (a
    series of no more than ``max_points`` is kept whole). A caller that draws at most
    ``max_points`` thins ``result()`` again with ``extremes``: the extremes of bins' extremes
    are the extremes of the wider bins."""

    def __init__(self, total: int, max_points: int):
        self.width = max(1, int(np.ceil(total / max(1, max_points // 2))))
        self.x: list[np.ndarray] = []
        self.y: list[np.ndarray] = []

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """The next values (``y``) of the series, at ``x``, after those added before."""
        idx = extremes(y, 2 * int(np.ceil(len(y) / self.width)), finite_only=True)
        self.x.append(np.asarray(x)[idx])
        self.y.append(np.asarray(y)[idx])

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of the values kept, in the order added."""
        if not self.x:
            return np.zeros(0, np.int64), np.zeros(0)
        return np.concatenate(self.x), np.concatenate(self.y)


def percent(x: Optional[float], digits: int = 2) -> str:
    """A fraction as people read it: 0.00026 -> '0.026%', 3.4 -> '340%'."""
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return "non-finite"
    return f"{100 * x:.{digits}g}%" if 100 * x < 10 ** digits else f"{100 * x:.0f}%"
