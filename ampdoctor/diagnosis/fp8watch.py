"""The early warning in fp8 terms: which Linears are leaving an fp8 recipe's range, and how fast.

numpy only. From the /fp8 rows of the sampled steps (``record/fp8.py``), per Linear and
sampled step, three figures a user planning (or running) fp8 watches:

- **headroom**: binades between each operand's amax and the top of its format under the
  scale delayed scaling would have kept from the earlier sampled amaxes
  (``fp8.headroom`` of the ``DELAYED`` rows), the least over input, weight and output
  gradient. About 0 for a steady tensor; below 0 the amax outgrew the history and a delayed
  cast clamps; -1 is an amax twice the largest the scale was set for.
- **growth**: how fast the fastest operand's amax grows, in binades (doublings) per 100
  steps, a least-squares slope of log2(amax) over the last ``GROWTH_WINDOW`` sampled steps.
  Current scaling follows any amax, but what grows is usually one channel: the rest of the
  tensor is pushed down towards e4m3's subnormals by as many binades. Shown, not a threshold:
  a healthy run's amaxes grow too early in training (on the fixture without its outlier, up
  to 8 doublings per 100 steps over its first 40), and what a rate means depends on the run's
  length; headroom is that growth measured against the recipe's scale.
- **kurtosis** of the input (the activations), E[(x - mean)^4] / E[(x - mean)^2]^2 over the
  sampled values: 3 for a Gaussian, about C when one channel in C holds the energy (an outlier
  feature, arXiv 2409.12517, 2505.20524). A per-tensor scale set by that channel leaves the
  others a few binades of the format.

A layer is **at risk** on a sampled step when its headroom is below ``HEADROOM_RISK`` on it
and on the sampled step before (a scale that falls behind twice in a row, not one jump), or
its input's kurtosis is above ``KURTOSIS_RISK`` (the thresholds below, each with its
reason). ``Fp8Watch.at_risk`` lists those of the latest sampled step, most at risk first,
and ``first_warned`` the first sampled step each was. ``ampdoctor top`` shows them (a line per
layer at risk, nothing when none is), ``ampdoctor report`` draws their curves and ``ampdoctor
export`` writes the three figures per layer.

Example::

    w = read(ampdoctor.load("run.h5"))
    [x.name for x in w.at_risk], w.first_warned["fc2"]      # (['fc2', 'fc1'], 10)
    w.layers["fc2"].headroom, w.layers["fc2"].kurtosis      # per sampled step
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..runfile.schema import Recipe, Role, columns
from .fp8 import ROLES, headroom

# The thresholds, each with its reason.
# Headroom: an amax more than twice the largest of the history its delayed scale was set
# from; the top binade of the tensor clamps. (0 to -1 is an amax a little above the history,
# which a weight slowly growing between two sampled steps reads, and clamps a few values; a
# gradient early in training doubles once between two sampled steps too, hence twice in a
# row: on the fixture without its outlier the lowest headroom read -0.997, once.)
HEADROOM_RISK = -1.0
# Kurtosis: Gaussian activations read about 3 and a ReLU's or GELU's up to about 10; past 50
# one channel in 50 or fewer holds the tensor's energy, a per-tensor scale is that channel's.
KURTOSIS_RISK = 50.0
GROWTH_WINDOW = 4  # sampled steps the growth is fitted over (at least 3)
SHOWN = 5  # layers ``top`` and the report's curves show, most at risk first

WATCH_COLUMNS = columns("fp8", "step", "tensor", "role", "recipe", "format", "amax", "scale",
                        "kurtosis")
REASONS = {"saturates": "headroom {value:+.1f} binades: a delayed scale would clamp",
           "outlier": "input kurtosis {value:.0f}: one channel holds the tensor"}


@dataclass
class LayerWatch:
    """One Linear over the sampled steps (arrays aligned with ``steps``)."""

    name: str
    steps: np.ndarray
    headroom: np.ndarray  # binades, the least over its operands; NaN: a non-finite amax
    kurtosis: np.ndarray  # the input's; NaN where not measured (a file before format 5)
    growth: np.ndarray  # binades per 100 steps, the fastest operand's; NaN: too few steps
    growing: list = field(default_factory=list)  # the operand whose growth it is, per step
    risk: list = field(default_factory=list)  # per step: the thresholds crossed (REASONS)

    def at(self, i: int = -1) -> dict:
        """The figures of the ``i``-th sampled step (default the latest), with the reasons."""
        return {"step": int(self.steps[i]), "headroom": _num(self.headroom[i]),
                "growth": _num(self.growth[i]), "growing": self.growing[i],
                "kurtosis": _num(self.kurtosis[i]), "risk": list(self.risk[i]),
                "why": self.why(i)}

    def why(self, i: int = -1) -> str:
        """The thresholds crossed on the ``i``-th sampled step, in words."""
        out = []
        for r in self.risk[i]:
            value = {"saturates": self.headroom[i], "outlier": self.kurtosis[i]}[r]
            out.append("a non-finite amax" if r == "saturates" and math.isnan(value) else
                       REASONS[r].format(value=value))
        g = float(self.growth[i])
        if out and g > 0:
            out.append(f"{self.growing[i]} amax x2 every {100 / g:.0f} steps")
        return "; ".join(out)

    @property
    def first_warned(self) -> Optional[int]:
        for s, r in zip(self.steps, self.risk):
            if r:
                return int(s)
        return None

    def severity(self) -> tuple:
        """Sort key, most at risk first: thresholds crossed, then the lowest headroom."""
        room = float(self.headroom[-1])
        return (-len(self.risk[-1]), room if math.isfinite(room) else -math.inf,
                -float(np.nan_to_num(self.kurtosis[-1])), self.name)


@dataclass
class Fp8Watch:
    """Every Linear's ``LayerWatch``; ``step`` the latest sampled step read."""

    layers: dict[str, LayerWatch] = field(default_factory=dict)
    step: Optional[int] = None

    @property
    def at_risk(self) -> list[LayerWatch]:
        """The layers at risk on the latest sampled step, most at risk first."""
        found = [x for x in self.layers.values() if x.risk and x.risk[-1]
                 and int(x.steps[-1]) == self.step]
        return sorted(found, key=LayerWatch.severity)

    @property
    def first_warned(self) -> dict[str, int]:
        """Layer -> the first sampled step it was at risk (every layer ever at risk)."""
        return {n: x.first_warned for n, x in self.layers.items() if x.first_warned is not None}

    def to_dict(self) -> dict:
        return {"step": self.step, "thresholds": {"headroom": HEADROOM_RISK,
                                                  "kurtosis": KURTOSIS_RISK},
                "at_risk": [dict(x.at(), layer=x.name) for x in self.at_risk],
                "first_warned": self.first_warned}


def read(run: Any) -> Fp8Watch:
    """``watch`` over a loaded ``Run``'s /fp8 rows (a run without them: no layer)."""
    if not len(run.fp8):
        return Fp8Watch()
    names = {int(i): str(n) for i, n in zip(run.tensors["id"], run.tensors["name"])}
    skipped = run.steps["step"][run.steps["skipped"] == 1] if len(run.steps) else ()
    return watch(run.fp8.columns(WATCH_COLUMNS), names, skipped)


def watch(rows: np.ndarray, names: dict[int, str], skipped: Sequence[int] = ()) -> Fp8Watch:
    """Per Linear of /fp8 ``rows`` (``WATCH_COLUMNS`` at least; ``names``: tensor id -> layer)
    its figures per sampled step. ``skipped``: steps GradScaler skipped, whose gradients (inf
    by design) are left out."""
    rows = rows[rows["recipe"] == int(Recipe.DELAYED)]
    rows = rows[np.isin(rows["role"], [int(r) for r in ROLES])]
    if len(skipped):
        rows = rows[~((rows["role"] == int(Role.GRAD_OUTPUT)) & np.isin(rows["step"], skipped))]
    if not len(rows):
        return Fp8Watch()
    order = np.argsort(rows["tensor"], kind="stable")  # one pass: a slice per tensor
    rows = rows[order]
    room = headroom(rows["amax"], rows["scale"], rows["format"])
    out = Fp8Watch(step=int(rows["step"].max()))
    tids, starts = np.unique(rows["tensor"], return_index=True)
    for tid, a, b in zip(tids, starts, np.r_[starts[1:], len(rows)]):
        name = names.get(int(tid))
        if name is not None:
            out.layers[name] = _layer(name, rows[a:b], room[a:b])
    return out


def _layer(name: str, rows: np.ndarray, room: np.ndarray) -> LayerWatch:
    steps = np.unique(rows["step"])
    at = np.searchsorted(steps, rows["step"])
    least = np.full(len(steps), np.inf)
    np.minimum.at(least, at, np.where(np.isnan(room), -np.inf, room))
    least[np.isneginf(least)] = np.nan  # a non-finite amax: no scale covers it
    amax = {role: _per_step(at, rows["amax"], rows["role"] == int(role), len(steps), np.inf)
            for role in ROLES}
    kurt = _per_step(at, rows["kurtosis"], (rows["role"] == int(Role.INPUT))
                     & np.isfinite(rows["kurtosis"]), len(steps), np.nan)
    growth, growing = _growth(steps, amax)
    below = least < HEADROOM_RISK
    saturates = np.isnan(least) | (below & np.r_[False, below[:-1]])
    outlier = kurt > KURTOSIS_RISK
    risk = [["saturates"] * bool(a) + ["outlier"] * bool(b) for a, b in zip(saturates, outlier)]
    return LayerWatch(name, steps, least, kurt, growth, growing, risk)


def _per_step(at: np.ndarray, values: np.ndarray, mine: np.ndarray, n: int,
              nan_as: float) -> np.ndarray:
    """The largest of ``values[mine]`` per sampled step (``at``: each row's step index), a NaN
    value read as ``nan_as``; NaN for a step with none."""
    out = np.full(n, -np.inf)
    v = values[mine].astype(np.float64)
    np.maximum.at(out, at[mine], np.where(np.isnan(v), nan_as, v))
    out[np.isneginf(out)] = np.nan
    return out


def _growth(steps: np.ndarray, amax: dict) -> tuple[np.ndarray, list]:
    """Per sampled step, the fastest-growing operand's slope of log2(amax) over the last
    ``GROWTH_WINDOW`` sampled steps (binades per 100 steps; NaN with fewer than 3 finite)."""
    slopes = np.stack([_slopes(steps.astype(np.float64), a) for a in amax.values()])
    found = ~np.isnan(slopes).all(0)
    best = np.argmax(np.where(np.isnan(slopes), -np.inf, slopes), 0)
    growth = np.where(found, slopes[best, np.arange(len(steps))], np.nan)
    names = [ROLES[r] for r in amax]
    return growth, [names[b] if f else "" for b, f in zip(best, found)]


def _slopes(x: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Least-squares slope of log2(amax) against the step over each window of
    ``GROWTH_WINDOW`` sampled steps ending at each one, x 100; NaN where fewer than 3 of its
    amaxes are finite and above 0."""
    from numpy.lib.stride_tricks import sliding_window_view

    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(np.isfinite(amax) & (amax > 0), np.log2(amax), np.nan)
    pad = np.full(GROWTH_WINDOW - 1, np.nan)
    xs = sliding_window_view(np.r_[pad, x], GROWTH_WINDOW)
    ys = sliding_window_view(np.r_[pad, y], GROWTH_WINDOW)
    ok = np.isfinite(xs) & np.isfinite(ys)
    n = np.maximum(ok.sum(1), 1)
    dx = np.where(ok, xs - (np.where(ok, xs, 0).sum(1) / n)[:, None], 0.0)
    dy = np.where(ok, ys - (np.where(ok, ys, 0).sum(1) / n)[:, None], 0.0)
    den = (dx * dx).sum(1)
    fit = (ok.sum(1) >= 3) & (den > 0)
    return np.where(fit, (dx * dy).sum(1) / np.where(fit, den, 1.0), np.nan) * 100


def _num(x: Any) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None
