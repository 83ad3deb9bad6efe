"""Two loss curves of one training lined up by step: trailing means, relative differences and
where one departs from the other. ``ampdoctor compare`` decides fp32 parity on these
(``release/comparison.py``), and ``diagnose --baseline`` the drift of a run in fp8 from its
baseline (``rules/fp8.py``), so the two never disagree on what "drifts" means.

numpy only. The tolerances are ``thresholds.PARITY_RTOL`` and ``PARITY_DIVERGE``; the
trailing mean's window is a tenth of the common steps, 1 to ``MAX_WINDOW`` (one batch's loss
is noisy, a real difference persists).

Example::

    p = line_up(base.steps, fp8.steps)
    p.smooth.max() > PARITY_RTOL       # the fp8 run drifts from its baseline
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

LOSS_FLOOR = 1e-3  # of the baseline's largest loss: the smallest denominator
MAX_WINDOW = 100


@dataclass
class Lined:
    """Two loss curves on their common steps: the losses, their relative difference step by
    step (``raw``) and of their trailing means (``smooth``), and the window ``w``."""

    steps: np.ndarray
    base: np.ndarray
    other: np.ndarray
    raw: np.ndarray
    smooth: np.ndarray
    w: int


def window(common: int) -> int:
    """The trailing mean's width for ``common`` steps: a tenth, 1 to ``MAX_WINDOW``."""
    return int(np.clip(common // 10, 1, MAX_WINDOW))


def line_up(base_steps: np.ndarray, other_steps: np.ndarray,
            w: Optional[int] = None) -> Optional[Lined]:
    """Two /steps tables' losses on their common steps; None when they share none or the
    baseline has no finite loss there."""
    common, ib, ia = np.intersect1d(base_steps["step"], other_steps["step"],
                                    return_indices=True)
    lb = base_steps["loss"][ib].astype(np.float64)
    la = other_steps["loss"][ia].astype(np.float64)
    usable = np.isfinite(lb)
    if not len(common) or not usable.any():
        return None
    w = w or window(len(common))
    floor = LOSS_FLOOR * float(np.max(np.abs(lb[usable])))
    return Lined(common, lb, la, relative(lb, la, floor),
                 relative(trailing(lb, w), trailing(la, w), floor), w)


def trailing(x: np.ndarray, w: int) -> np.ndarray:
    """Mean of the last ``w`` values at each position; non-finite if any of them is."""
    if w <= 1:
        return x.copy()
    # (in place and by slices: on 10^7 steps each temporary is 80 MB)
    n = len(x)
    finite = np.isfinite(x)
    csum = np.zeros(n + 1)
    csum[1:] = x
    csum[1:][~finite] = 0.0
    np.cumsum(csum[1:], out=csum[1:])
    cbad: np.ndarray = np.zeros(n + 1, np.int32 if n < 2**31 else np.int64)  # non-finite so far
    np.cumsum(~finite, dtype=cbad.dtype, out=cbad[1:])
    del finite
    head = min(w - 1, n)  # positions whose window starts at 0: the mean of those so far
    mean = np.empty(n)
    mean[:head] = csum[1:head + 1] / np.arange(1, head + 1)
    mean[:head][cbad[1:head + 1] > 0] = np.nan
    if n >= w:
        tail = mean[head:]
        np.subtract(csum[w:], csum[:n - w + 1], out=tail)
        tail /= w
        tail[cbad[w:] != cbad[:n - w + 1]] = np.nan
    return mean


def relative(base: np.ndarray, amp: np.ndarray, floor: float) -> np.ndarray:
    """|amp - base| / max(|base|, floor); inf where only amp is non-finite, NaN where the
    baseline is (those steps decide nothing)."""
    with np.errstate(invalid="ignore", over="ignore"):
        rel = np.subtract(amp, base)  # (in place: each temporary of 10^7 steps is 80 MB)
        np.abs(rel, out=rel)
        below = np.abs(base)
        np.maximum(below, max(floor, 1e-30), out=below)
        rel /= below
        del below
    rel[~np.isfinite(amp)] = np.inf
    rel[~np.isfinite(base)] = np.nan
    return rel


def divergence_start(smooth: np.ndarray, decided: np.ndarray, rtol: float,
                     diverge: float) -> Optional[int]:
    """First position, after the smoothed difference was last within ``rtol``, where it is
    above ``diverge``: the two tolerances make a hysteresis, so a diverged run's noisy batches
    that come near the baseline again do not undo the verdict, and one excursion that came
    back within ``rtol`` is no divergence."""
    # (masks, not the decided positions and their values: on 10^7 steps each was 80 MB)
    with np.errstate(invalid="ignore"):
        within = decided & (smooth <= rtol)
        after = last_true(within) + 1
        del within
        out = decided[after:] & (smooth[after:] > diverge)
    return after + int(np.argmax(out)) if out.any() else None


def last_true(mask: np.ndarray) -> int:
    """The last position where ``mask`` holds, -1 where it holds nowhere (no index array)."""
    return len(mask) - 1 - int(np.argmax(mask[::-1])) if mask.any() else -1


def diverged_at(smooth: np.ndarray, raw: np.ndarray, w: int, rtol: float,
                diverge: float) -> Optional[int]:
    """Where the second curve diverged (``divergence_start``), or None: the trailing mean
    crosses late by up to w-1 steps, so the first step of its window whose own difference
    crosses is where it began."""
    start = divergence_start(smooth, ~np.isnan(smooth), rtol, diverge)
    if start is None:
        return None
    lo = max(start - w + 1, 0)
    crossing = np.flatnonzero(raw[lo:start + 1] > diverge)
    return lo + int(crossing[0]) if len(crossing) else start
