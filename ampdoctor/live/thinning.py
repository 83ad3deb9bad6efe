"""Which points of a month-long run ``export`` writes (``tensorboard``): the /steps rows, the
LR rows of /groups and the per-layer values of one read, each curve thinned to its bins'
extremes (``curves.extremes``: a one-step spike survives) with every skipped or non-finite
step kept, once a read holds more than ``MAX_STEPS`` steps; and the per-layer summaries of a
run with more layer curves than TensorBoard shows. numpy only, no file written here.

Example::

    keep = thinning.thinned(rows)            # positions of a read's /steps rows to write
    lr = thinning.lr_rows(table, rows["step"])
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..release.curves import extremes

GROUP_BLOCK = 1 << 20  # /groups rows read at a time (a month-long run's: 20 M)
MAX_STEPS = 20_000  # steps of one read written in full; a longer read is thinned
POINTS = 4_000  # about the points a thinned read keeps of each steps' and LR curve


def summaries(step: np.ndarray, group: np.ndarray, value: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per (step, group): the largest value (NaN first, as ``largest``) and the median
    (NaN counted as the largest)."""
    mine = group >= 0
    step, group, value = step[mine], group[mine], value[mine]
    if not len(step):
        return step, group, value, value
    order = np.lexsort((value, group, step))
    step, group, value = step[order], group[order], value[order]
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (group[1:] != group[:-1])])
    length = np.diff(np.r_[starts, len(step)])
    median = value[starts + length // 2].copy()
    even = length % 2 == 0
    median[even] = (value[starts[even] + length[even] // 2 - 1] + median[even]) / 2
    return step[starts], group[starts], np.maximum.reduceat(value, starts), median


def thinned(rows: Any) -> np.ndarray:
    """Which /steps rows of one read are written: all, up to ``MAX_STEPS``; else each
    curve's bin extremes (about ``POINTS`` each) and every skipped or non-finite step (at most
    ``MAX_STEPS`` of those; module docstring)."""
    if len(rows) <= MAX_STEPS:
        return np.arange(len(rows))
    # (as stored: ``extremes`` widens a block at a time, the same positions)
    keep = [extremes(rows[c], POINTS) for c in ("loss", "grad_norm", "scale")]
    special = np.flatnonzero((rows["skipped"] == 1) | ~np.isfinite(rows["loss"]) |
                             ~np.isfinite(rows["grad_norm"]))
    if len(special) > MAX_STEPS:
        special = special[::int(np.ceil(len(special) / MAX_STEPS))]
    return np.unique(np.concatenate(keep + [special]))


def lr_rows(table: Any, read: np.ndarray) -> np.ndarray:
    """The (step, group, lr) rows of a read's /groups that are written, in one pass over it a
    block at a time (a month-long run's is 20 M rows): every row where the rows hold at most
    ``MAX_STEPS`` steps, else those at ``POINTS`` evenly spaced steps of the read's /steps
    (``read``; an LR curve has no spikes to keep). Rows of a read no longer than that are
    held until that is known (at most ``MAX_STEPS`` steps of rows)."""
    names = ("step", "group", "lr")
    shown = read[thinned_steps(read)]
    whole: Optional[list] = []
    seen = np.zeros(0, np.int64)  # the distinct steps of ``whole``, while it is held
    picked = []
    for part in table.chunks(GROUP_BLOCK, names=names):
        if whole is not None:
            seen = distinct(np.concatenate([seen, distinct(part["step"])]))
            whole = whole + [part] if len(seen) <= MAX_STEPS else None
        steps = part["step"]  # (the shown steps within the block's: a tenth of the work)
        near = shown[(shown >= steps.min()) & (shown <= steps.max())]
        picked.append(part[np.isin(steps, near)])
    if whole is not None:
        return np.concatenate(whole)
    if not len(shown):  # a read with no /steps rows (never written so): its own steps
        steps = distinct(np.concatenate([distinct(p["step"]) for p in
                                          table.chunks(GROUP_BLOCK, names=("step",))]))
        shown = steps[thinned_steps(steps)]
        picked = [p[np.isin(p["step"], shown)] for p in table.chunks(GROUP_BLOCK, names=names)]
    return np.concatenate(picked)


def distinct(steps: np.ndarray) -> np.ndarray:
    """``np.unique(steps)``, without sorting or hashing them where they are in order already
    (a writer appends a step's rows together, step after step)."""
    if not len(steps):
        return steps
    firsts = steps[np.r_[True, steps[1:] != steps[:-1]]]
    return firsts if bool(np.all(firsts[1:] > firsts[:-1])) else np.unique(steps)


def thinned_steps(steps: np.ndarray) -> np.ndarray:
    """Positions of ``POINTS`` evenly spaced steps (every one, up to ``MAX_STEPS``)."""
    if len(steps) <= MAX_STEPS:
        return np.arange(len(steps))
    return np.unique(np.linspace(0, len(steps) - 1, POINTS).astype(np.int64))


def largest(step: np.ndarray, curve: np.ndarray,
             value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One value per (step, curve), the largest, NaN first (``np.maximum`` keeps a NaN),
    ordered by step, then curve."""
    if not len(step):
        return step, curve, value
    order = np.lexsort((curve, step))
    step, curve, value = step[order], curve[order], value[order]
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (curve[1:] != curve[:-1])])
    return step[starts], curve[starts], np.maximum.reduceat(value, starts)


def thinned_layers(step: np.ndarray, curve: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Which (step, curve) values of one read are written: all, up to ``MAX_STEPS`` sampled
    steps; else every value at the steps that hold a bin's smallest or largest value of some
    curve (``MAX_STEPS`` points shared among the curves, at least a bin's two each) and at
    every step with a non-finite value (at most ``MAX_STEPS`` of those)."""
    steps = np.unique(step)
    if len(steps) <= MAX_STEPS:
        return np.arange(len(step))
    order = np.lexsort((step, curve))  # each curve's values in step order
    by_curve = np.split(order, np.flatnonzero(np.diff(curve[order])) + 1)
    points = max(2, MAX_STEPS // len(by_curve))
    keep = [step[rows[extremes(value[rows], points)]] for rows in by_curve]
    special = np.unique(step[~np.isfinite(value)])
    if len(special) > MAX_STEPS:
        special = special[::int(np.ceil(len(special) / MAX_STEPS))]
    return np.flatnonzero(np.isin(step, np.concatenate(keep + [special])))
