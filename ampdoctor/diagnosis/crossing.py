"""The crossing forecast (numpy only): each layer's abs max fitted as a line in log2 over its
last ``WINDOW`` sampled steps (a masked least squares, vectorized over layers), where that line
passes the layer's dtype limit, with the range the fit allows, and the gates that must all pass
before a crossing is forecast (``forecast`` names the first; see its docstring).

The knobs are read at each call (``benchmarks/forecast_eval.py --sweep`` changes them here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..runfile.schema import Kind
from .layers import KIND_LABELS

# -- the crossing forecast's knobs (benchmarks/forecast_eval.py --sweep shows their effect) ---
WINDOW = 12  # sampled steps fitted per layer (the latest ones before the cut)
MIN_POINTS = 6  # fewer finite samples than this in the window: no trend for the layer
MIN_T = 6.0  # slope / its standard error: the trend must be far outside the noise
MIN_RISE = 2.0  # doublings the fitted line rose over the window: a real change
FLATTENING = 0.5  # the slope over the latest half window keeps this share of the full one
HORIZON = 1.0  # extrapolate at most this many window spans beyond the last sample
MIN_LEVEL = 4.0  # log2 of the level below which a layer is not on its way to any limit yet
SPREAD = 2.0  # range: +-2 standard errors of the slope, +-2 residual spreads of the level
TOP = 5  # layers listed by lowest headroom

# What a kind's values are called in a sentence.
KIND_WORDS = {Kind.OUTPUT: "output", Kind.GRAD_OUTPUT: "output gradient",
              Kind.PARAM_GRAD: "gradient"}


@dataclass
class LayerTrend:
    """One layer at a cut: its level, headroom and trend; ``gates`` lists why no crossing is
    forecast (empty when one is)."""

    name: str
    kind: str  # "output", "output gradient", "gradient"
    dtype: str
    limit: float
    headroom: float  # doublings left below the limit
    doublings_per_100_steps: Optional[float]  # None: too few samples for a trend
    level_log2: float  # log2 of the level the headroom is measured from
    last: int  # the layer's last sample before the cut
    window: Optional[list] = None  # [first, last] sampled steps fitted
    points: int = 0
    crossing: Optional[float] = None
    range: Optional[list] = None  # [earliest, latest]; latest None: open-ended
    t: Optional[float] = None  # slope / its standard error
    gates: list = field(default_factory=list)

    @property
    def forecast(self) -> bool:
        return not self.gates and self.crossing is not None

    @property
    def label(self) -> str:
        return f"{self.name}'s {self.kind}"


def growth(s: Any, k: int) -> dict:
    """Doublings per 100 steps of every layer of ``s`` (a ``forecast.Series``) with enough
    samples in its window of the first ``k`` sampled steps, by ``(name, label)``."""
    if not k or not len(s.names):
        return {}
    cols = np.arange(max(0, k - WINDOW), k)
    fit = ols(s.grid[cols].astype(np.float64), s.log2[:, cols])
    ok = (fit["n"] >= MIN_POINTS) & np.isfinite(fit["b"])
    return {(s.names[i], KIND_LABELS.get(s.kinds[i], "")): float(fit["b"][i] * 100)
            for i in np.flatnonzero(ok)}


def trends(s: Any, k: int) -> list[LayerTrend]:
    """Every layer's fit over its window of the first ``k`` sampled steps (vectorized over
    layers: a masked OLS per row); only the layers worth naming become ``LayerTrend``s."""
    if k == 0 or not len(s.names):
        return []
    cols = np.arange(max(0, k - WINDOW), k)
    x = s.grid[cols].astype(np.float64)
    y = s.log2[:, cols]
    fit = ols(x, y)
    half = len(cols) // 2
    recent = ols(x[half:], y[:, half:])
    keep = np.flatnonzero(np.isfinite(s.limit) & np.isfinite(y).any(axis=1))
    out = []
    # Build objects for the candidates and the lowest headroom only (a 1000-layer model:
    # a handful of objects per cut).
    order = keep[np.argsort(np.log2(s.limit[keep]) - fit["level"][keep])][:TOP]
    cand = keep[fit["gate"][keep]]
    for i in dict.fromkeys([*cand.tolist(), *order.tolist()]):
        out.append(_trend(s, int(i), fit, recent))
    return out


def ols(x: np.ndarray, y: np.ndarray) -> dict:
    """Masked least squares of each row of ``y`` (NaN: missing) on ``x``."""
    m = np.isfinite(y)
    n = m.sum(axis=1)
    yz = np.where(m, y, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        xm = (m * x).sum(axis=1) / n
        ym = yz.sum(axis=1) / n
        dx = np.where(m, x - xm[:, None], 0.0)
        sxx = (dx ** 2).sum(axis=1)
        b = (dx * (yz - ym[:, None])).sum(axis=1) / sxx
        a = ym - b * xm
        r = np.where(m, yz - (a[:, None] + b[:, None] * x), 0.0)
        s = np.sqrt((r ** 2).sum(axis=1) / np.maximum(n - 2, 1))
        se = np.where(s > 0, s / np.sqrt(sxx), 1e-12)
    idx = np.arange(len(x))
    last_i = np.where(m, idx, -1).max(axis=1) if len(x) else np.full(len(y), -1)
    first_i = np.where(m, idx, len(x)).min(axis=1) if len(x) else np.full(len(y), 0)
    last = x[np.maximum(last_i, 0)] if len(x) else np.zeros(len(y))
    first = x[np.minimum(first_i, max(len(x) - 1, 0))] if len(x) else np.zeros(len(y))
    recent = np.where(m[:, -3:], y[:, -3:], -np.inf).max(axis=1) if len(x) else \
        np.full(len(y), -np.inf)
    fitted = np.where(n >= MIN_POINTS, a + b * last, -np.inf)
    level = np.maximum(fitted, recent)
    ok = (n >= MIN_POINTS) & np.isfinite(b) & (b > 0)
    t = np.where(ok, b / se, 0.0)
    span = last - first
    gate = ok & (t >= MIN_T) & (b * span >= MIN_RISE) & (level >= MIN_LEVEL)
    return {"n": n, "b": b, "a": a, "s": s, "se": se, "last": last, "first": first,
            "level": level, "t": t, "span": span, "gate": gate, "ok": ok}


def _trend(s: Any, i: int, fit: dict, recent: dict) -> LayerTrend:
    n, b, se, sp = int(fit["n"][i]), float(fit["b"][i]), float(fit["se"][i]), float(fit["s"][i])
    last, level = float(fit["last"][i]), float(fit["level"][i])
    head = math.log2(s.limit[i]) - level
    trended = n >= MIN_POINTS and math.isfinite(b)
    tr = LayerTrend(s.names[i], KIND_WORDS.get(s.kinds[i], s.kinds[i].name.lower()),
                    s.dtype[i], float(s.limit[i]), head,
                    b * 100 if trended else None, level, int(last), points=n)
    if not trended:
        tr.gates = [f"{n} sampled steps only"]
        return tr
    tr.window, tr.t = [int(fit["first"][i]), int(last)], b / se if se > 0 else math.inf
    if b <= 0:
        tr.gates = ["no growth"]
        return tr
    tr.crossing = last + head / b
    # The sampled tier sees one step in ``every``: the first batch to pass the limit can come
    # up to one interval before the sampled envelope shows it.
    early = max(last, last + (head - SPREAD * sp) / (b + SPREAD * se) - s.every)
    slow = b - SPREAD * se
    tr.range = [int(math.floor(early)),
                int(math.ceil(last + (head + SPREAD * sp) / slow)) if slow > 0 else None]
    tr.gates = _gates(tr, b, float(fit["span"][i]), float(recent["b"][i]),
                      int(recent["n"][i]))
    return tr


def _gates(tr: LayerTrend, b: float, span: float, recent_b: float, recent_n: int) -> list:
    """Why no failure is forecast for this layer ([]: one is)."""
    failed = []
    if tr.t < MIN_T:
        failed.append(f"trend within the noise (t={tr.t:.1f})")
    if b * span < MIN_RISE:
        failed.append(f"rose {b * span:.1f} doublings only")
    if recent_n >= 3 and not recent_b >= FLATTENING * b:
        failed.append("levelling off")
    if tr.level_log2 < MIN_LEVEL:
        failed.append("still small")
    if tr.crossing - tr.last > HORIZON * max(span, 1.0):
        failed.append(f"crossing {tr.crossing - tr.last:.0f} steps out, beyond the horizon")
    return failed
