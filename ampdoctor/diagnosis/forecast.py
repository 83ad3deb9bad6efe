"""Early warning: how far each layer is from its dtype's limit, and whether it is heading there.

numpy only. Reads what the sampled tier already records (per module output, and per gradient
where no GradScaler guards it: the exact abs max and the dtype of every sampled step) plus the
sentinel's loss scale, and says one of:

* ``overflow_expected``: a layer's abs max grows as a straight line in log2 (exponentially)
  and, at the growth of its last ``WINDOW`` sampled steps, passes its dtype's limit (fp16
  65504, bf16/fp32 ~3.4e38) around a step ``S``, with the range the fit allows;
* ``unstable``: no layer is on such a line, but two of the C2 signals of a diverging run hold
  over the last ``W_SAMPLES`` sampled steps (weight norm doubled, median update ratio
  >= 2e-2, loss scale 3+ halvings down with every loss finite): an overflow is likely;
* ``stable``: no trend, with the lowest headroom; ``unknown``: too few sampled steps, or an op
  inside a module already overflowed while the module's output stayed finite (the sampled
  step's op probe saw it), so no output's headroom says how far that module is from its limit.

**Headroom** is the number of doublings left between a layer's level now (the fitted line at
its last sample, or the largest of its last three samples if higher) and its limit.

The crossing forecast is made only when every gate passes (``GATES``): the trend stands far
outside the noise, rose by two doublings or more, is not levelling off, the values are no
longer small, and the crossing falls within one window span of the last sample: the forecast
never extrapolates further than the data reaches. The gates were chosen on recorded runs
(``benchmarks/forecast_eval.py``: runs that overflowed, cut before the failure, and runs that
stayed healthy); a healthy run must never get a forecast of failure.

Why one module: the series read once, the fit, its gates and the texts they decide belong
together (each gate's threshold is read beside the text that reports it), and reading and
judging call each other (``Series.at`` is ``judge``, which takes a ``Series``).

Example::

    with ampdoctor.load("run.h5") as run:
        fc = forecast(run)                  # the whole run
        fc.status, fc.layer, fc.step, fc.range, fc.text
        early = forecast(run, until=120)    # only steps before 120, as if the run stopped there
        series = read(run)                  # read once, judge at several cuts
        [series.at(cut).status for cut in (80, 100, 120)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..numfmt import fmt
from ..runfile.meta import OptimizerInfo
from ..runfile.schema import BF16_MAX, FP16_MAX, DType, Kind
from . import fixes as _fixes
from .events import hidden_nonfinite
from .layers import KIND_LABELS, sampled
from .opprobe import precision_hits

FP32_MAX = 3.4028234663852886e38
LIMITS = {int(DType.FLOAT16): FP16_MAX, int(DType.BFLOAT16): BF16_MAX,
          int(DType.FLOAT32): FP32_MAX, int(DType.FLOAT64): 1.7976931348623157e308}
DTYPE_NAMES = {int(DType.FLOAT16): "float16", int(DType.BFLOAT16): "bfloat16",
               int(DType.FLOAT32): "float32", int(DType.FLOAT64): "float64"}
STATUSES = ("overflow_expected", "unstable", "stable", "unknown")

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

# -- the instability warning (taxonomy C2; overflow.WEIGHT_GROWTH, 2x overflow.UPDATE_TOO_LARGE)
W_SAMPLES = 8  # sampled steps looked back over
WEIGHT_GROWTH = 2.0  # the weight norm doubled over them ...
UPDATE_HIGH = 2e-2  # ... or the median |dW|/|W| per step is at least this ...
SCALE_FALL = 3.0  # ... or the loss scale fell this many halvings, every loss finite ...
SIGNALS = 2  # ... and at least two of the three

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


@dataclass
class Forecast:
    """The early warning for a run (cut at ``until`` when given): see the module docstring.

    ``step`` and ``range`` are the predicted crossing of ``layer`` (overflow_expected only);
    ``layers`` the ``TOP`` layers with the least headroom (the named one first);
    ``warned_from`` and ``warned_status`` (set by ``for_diagnosis`` on a failed run): the
    earliest cut from which the warning held without a break up to the failure, and what it
    said there.
    """

    status: str
    text: str
    until: Optional[int] = None
    layer: Optional[str] = None
    kind: Optional[str] = None
    dtype: Optional[str] = None
    limit: Optional[float] = None
    headroom: Optional[float] = None
    doublings_per_100_steps: Optional[float] = None
    step: Optional[int] = None
    range: Optional[list] = None
    window: Optional[list] = None
    points: int = 0
    signals: list = field(default_factory=list)
    layers: list = field(default_factory=list)  # LayerTrend
    fixes: list = field(default_factory=list)  # fixes.Fix
    warned_from: Optional[int] = None
    warned_status: Optional[str] = None

    @property
    def warns(self) -> bool:
        """A warning of failure: an overflow expected, or the run unstable."""
        return self.status in ("overflow_expected", "unstable")


# ---------------------------------------------------------------------------------------------
# reading a run


@dataclass
class Series:
    """A run's sampled tier as the forecast needs it, read once: ``at(cut)`` judges it as if
    the run had stopped before ``cut``."""

    grid: np.ndarray  # sampled steps, ascending
    log2: np.ndarray  # [layer, grid] log2 of the per-step abs max; NaN: none or non-finite
    names: list  # per layer
    kinds: list  # per layer, Kind
    limit: np.ndarray  # per layer
    dtype: list  # per layer, name of the dtype whose limit applies
    every: int
    pstep: np.ndarray  # sampled steps with parameter rows
    wnorm: np.ndarray  # total weight norm per pstep
    upd: np.ndarray  # 10 ** size-weighted mean log10 update ratio per pstep
    s_step: np.ndarray  # the sentinel, per step (the columns as /steps holds them)
    s_scale: np.ndarray
    s_skipped: np.ndarray
    s_loss: np.ndarray
    context: _fixes.Context = field(default_factory=_fixes.Context)
    types: dict = field(default_factory=dict)  # module name -> class
    hidden: list = field(default_factory=list)  # overflows inside modules (op probe)

    def at(self, cut: Optional[int] = None) -> Forecast:
        """The forecast from the steps before ``cut`` (None: every step)."""
        return judge(self, cut)

    def trends(self, cut: Optional[int] = None) -> dict:
        """Doublings per 100 steps of every layer with enough samples for a fit, by
        ``(name, label)`` (``layers.KIND_LABELS``: ``("blocks.0.attn", "activation")``)."""
        k = len(self.grid) if cut is None else int(np.searchsorted(self.grid, cut))
        if not k or not len(self.names):
            return {}
        cols = np.arange(max(0, k - WINDOW), k)
        fit = _ols(self.grid[cols].astype(np.float64), self.log2[:, cols])
        ok = (fit["n"] >= MIN_POINTS) & np.isfinite(fit["b"])
        return {(self.names[i], KIND_LABELS.get(self.kinds[i], "")): float(fit["b"][i] * 100)
                for i in np.flatnonzero(ok)}


def read(run: Any, until: Optional[int] = None, samples: Optional[int] = None) -> Series:
    """Stream the run's sampled rows (``layers.sampled``): module outputs, gradients where no
    GradScaler guards them (fp16 ``.grad`` always), and the parameters' norm and update.

    ``samples``: read only the rows of the last ``samples`` sampled steps before ``until``
    (what ``at(until)`` and the cuts just before it need), not the whole table: on a long run
    that is a few HDF5 chunks instead of the whole compressed /stats.
    """
    kinds = (Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD, Kind.PARAM)
    rows, found = sampled(_rows_near(run, until, samples), kinds,
                          ("absmax", "nonfinite", "dtype", "norm", "update", "numel"))
    steps = run.steps
    scaler = bool(len(steps)) and bool(np.isfinite(steps["scale"]).any())
    roots = set(run.roots)
    kind_of = np.array([int(x.kind) for x in found], np.int64)
    lk = kind_of[rows["layer"]] if len(rows) else np.zeros(0, np.int64)
    half = rows["dtype"] == int(DType.FLOAT16)
    watched = (lk == int(Kind.OUTPUT)) | ((lk == int(Kind.PARAM_GRAD)) & half)
    if not scaler:
        watched |= (lk == int(Kind.GRAD_OUTPUT)) | (lk == int(Kind.PARAM_GRAD))
    # The root's output is its last child's, counted there.
    root_layer = np.array([x.kind == Kind.OUTPUT and x.name in roots for x in found], bool)
    if len(rows):
        watched &= ~root_layer[rows["layer"]]
    series = _values(rows[watched], found)
    params = _params(rows[lk == int(Kind.PARAM)])
    every = (run.recorder_settings or {}).get("every")
    if not every and len(series[0]) > 1:
        every = int(np.min(np.diff(series[0])))
    return Series(*series, every=int(every or 1), pstep=params[0], wnorm=params[1],
                  upd=params[2], s_step=np.asarray(steps["step"], np.int64),
                  s_scale=steps["scale"], s_skipped=steps["skipped"] == 1,
                  s_loss=steps["loss"], context=_context(run),
                  types=_module_types(run), hidden=precision_hits(hidden_nonfinite(run)))


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


def _rows_near(run: Any, until: Optional[int], samples: Optional[int]) -> Any:
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


def _values(rows: np.ndarray, found: list) -> tuple:
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


def _params(rows: np.ndarray) -> tuple:
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


def _context(run: Any) -> _fixes.Context:
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


def _module_types(run: Any) -> dict:
    t = run.tensors
    if not len(t) or "type" not in t.dtype.names:
        return {}
    return {str(n): str(c) for n, c, k in zip(t["name"], t["type"], t["kind"])
            if int(k) == int(Kind.OUTPUT) and c}


# ---------------------------------------------------------------------------------------------
# judging a cut


def forecast(run: Any, until: Optional[int] = None) -> Forecast:
    """The early warning for ``run`` (a loaded ``Run``), from the steps before ``until``."""
    return read(run, until, NEEDED).at(until)


def judge(s: Series, cut: Optional[int]) -> Forecast:
    """The forecast from the steps of ``s`` before ``cut``: see the module docstring."""
    k = len(s.grid) if cut is None else int(np.searchsorted(s.grid, cut))
    trends = _trends(s, k)
    hits = sorted((x for x in trends if x.forecast), key=lambda x: x.crossing)
    signals = instability(s, cut)
    lowest = sorted(trends, key=lambda x: x.headroom)
    fc = Forecast("stable", "", until=cut, signals=signals,
                  layers=(hits[:1] + [x for x in lowest if not hits or x is not hits[0]])[:TOP])
    if hits:
        _name_crossing(fc, hits[0], s)
    elif len(signals) >= SIGNALS:
        fc.status = "unstable"
        fc.text = ("the run is unstable: " + "; ".join(signals) + ": an overflow is likely; "
                   "lower the learning rate")
        fc.fixes = _fixes.make(["lower_lr"], s.context)
    elif k < MIN_POINTS or not any(x.doublings_per_100_steps is not None for x in trends):
        fc.status = "unknown"
        fc.text = (f"too few sampled steps to judge a trend ({k}; the forecast needs "
                   f"{MIN_POINTS}): record with a smaller --every")
    elif any(cut is None or h["step"] < cut for h in s.hidden):
        h = next(h for h in s.hidden if cut is None or h["step"] < cut)
        fc.status, fc.text = "unknown", (
            f"headroom unknown: inside {h['module']}, {h['op']} already overflowed {h['dtype']} "
            f"on sampled step {h['step']} although {h['module']}'s output stayed finite (an "
            "output's abs max cannot show an overflow inside the module)")
    else:
        low = lowest[0]
        fc.text = (f"no trend: headroom stable (lowest: {low.label}, {low.headroom:.1f} "
                   f"doublings below {fmt(low.limit)})")
    return fc


def _name_crossing(fc: Forecast, x: LayerTrend, s: Series) -> None:
    fc.status = "overflow_expected"
    fc.layer, fc.kind, fc.dtype, fc.limit = x.name, x.kind, x.dtype, x.limit
    fc.headroom, fc.doublings_per_100_steps = x.headroom, x.doublings_per_100_steps
    fc.step, fc.range, fc.window, fc.points = int(round(x.crossing)), x.range, x.window, \
        x.points
    hi = "?" if x.range[1] is None else str(x.range[1])
    fc.text = (f"at the growth of the last {x.points} sampled steps (steps {x.window[0]}.."
               f"{x.window[1]}), {x.label} passes {fmt(x.limit)} ({x.dtype}) around step "
               f"{fc.step} (range {x.range[0]}..{hi}); headroom {x.headroom:.1f} doublings, "
               f"+{x.doublings_per_100_steps:.2f} doublings per 100 steps")
    fc.fixes = _crossing_fixes(x, s)


def _crossing_fixes(x: LayerTrend, s: Series) -> list:
    """What keeps the named layer below its limit."""
    if x.dtype != "float16":  # bf16/fp32 at 3e38: the values themselves diverge
        return _fixes.make(["lower_lr"], s.context)
    if x.kind == "gradient":  # an fp16 .grad
        return _fixes.make(["fp32_master_weights"], s.context)
    if x.kind == "output gradient":
        return _fixes.make(["add_grad_scaler"], s.context)
    ctx = _fixes.Context(**{**s.context.__dict__, "module": x.name,
                            "module_type": s.types.get(x.name)})
    ids = ["fp32_island", "use_bf16"]
    if _fixes.is_attention(x.name, ctx.module_type):
        ids.insert(0, "scale_attention")
    return _fixes.make(ids, ctx)


def _trends(s: Series, k: int) -> list[LayerTrend]:
    """Every layer's fit over its window of the first ``k`` sampled steps (vectorized over
    layers: a masked OLS per row); only the layers worth naming become ``LayerTrend``s."""
    if k == 0 or not len(s.names):
        return []
    cols = np.arange(max(0, k - WINDOW), k)
    x = s.grid[cols].astype(np.float64)
    y = s.log2[:, cols]
    fit = _ols(x, y)
    half = len(cols) // 2
    recent = _ols(x[half:], y[:, half:])
    keep = np.flatnonzero(np.isfinite(s.limit) & np.isfinite(y).any(axis=1))
    out = []
    # Build objects for the candidates and the lowest headroom only (a 1000-layer model:
    # a handful of objects per cut).
    order = keep[np.argsort(np.log2(s.limit[keep]) - fit["level"][keep])][:TOP]
    cand = keep[fit["gate"][keep]]
    for i in dict.fromkeys([*cand.tolist(), *order.tolist()]):
        out.append(_trend(s, int(i), fit, recent))
    return out


def _ols(x: np.ndarray, y: np.ndarray) -> dict:
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


def _trend(s: Series, i: int, fit: dict, recent: dict) -> LayerTrend:
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


def instability(s: Series, cut: Optional[int]) -> list[str]:
    """The C2 growth signals present before ``cut`` (``SIGNALS`` or more: the run is
    unstable)."""
    end = len(s.pstep) if cut is None else int(np.searchsorted(s.pstep, cut))
    keep = np.arange(max(0, end - W_SAMPLES), end)
    found = []
    if len(keep) >= 4:
        w0, w1 = s.wnorm[keep[0]], s.wnorm[keep[-1]]
        if w0 > 0 and w1 / w0 >= WEIGHT_GROWTH:
            found.append(f"weight norm x{w1 / w0:.1f} over steps {s.pstep[keep[0]]}.."
                         f"{s.pstep[keep[-1]]}")
        upd = s.upd[keep[-6:]]
        upd = upd[np.isfinite(upd)]
        if len(upd) >= 3 and np.median(upd) >= UPDATE_HIGH:
            found.append(f"update ratio ~{np.median(upd):.2g} per step (median)")
    fall = _scale_fall(s, cut)
    if fall is not None and fall >= SCALE_FALL:
        found.append(f"loss scale {fall:.0f} halvings below its calibrated level, every loss "
                     "finite")
    return found


def _scale_fall(s: Series, cut: Optional[int]) -> Optional[float]:
    """Halvings of the loss scale since its post-calibration peak (None: no scaler, or a
    non-finite loss already: then the failure is here, not ahead)."""
    end = len(s.s_step) if cut is None else int(np.searchsorted(s.s_step, cut))  # (in order)
    scale, skipped, loss = s.s_scale[:end], s.s_skipped[:end], s.s_loss[:end]
    fin = np.isfinite(scale)
    if not fin.any() or not np.isfinite(loss).all():
        return None
    applied = np.flatnonzero(~skipped & fin)
    if not len(applied):
        return None
    ref = scale[applied[0]:][fin[applied[0]:]]
    top, last = float(ref.max()), float(ref[-1])  # (in float64, as the scale is stored)
    return math.log2(top / last) if last > 0 else math.inf


# ---------------------------------------------------------------------------------------------
# for a diagnosis

# At most this many sampled steps before a failure are re-judged for "would have warned from".
SCAN = 40
# Sampled steps one judgement reads: the fit's window and the instability's look-back.
NEEDED = max(WINDOW, W_SAMPLES) + 1


def for_diagnosis(run: Any, first_bad_step: Optional[int]) -> Forecast:
    """A healthy run: the forecast over the whole run. A failed one: the forecast from the
    steps before its first bad step, and ``warned_from``: the earliest of the last ``SCAN``
    sampled steps from which the warning held without a break up to the failure."""
    s = read(run, first_bad_step, NEEDED + (SCAN if first_bad_step is not None else 0))
    if first_bad_step is None:
        return s.at(None)
    fc = s.at(int(first_bad_step))
    if not fc.warns:
        return fc
    # A cut just after a sampled step is the first moment that step's numbers are known.
    cuts = s.grid[s.grid < first_bad_step][-SCAN:] + 1
    fc.warned_from, fc.warned_status = int(first_bad_step), fc.status
    for cut in cuts[::-1]:
        earlier = s.at(int(cut))
        if not earlier.warns:
            break
        fc.warned_from, fc.warned_status = int(cut), earlier.status
    return fc


def warning_lines(fc: Optional[Forecast], healthy: bool) -> list[str]:
    """The sentences a report prints for ``fc``: the warning under a healthy verdict, or from
    which step it would have warned on a failed run ([]: nothing to say)."""
    if fc is None or not fc.warns:
        return []
    if healthy:
        return [fc.text] + [f"[{fx.id}] {fx.text}" for fx in fc.fixes]
    what = ("an overflow would have been forecast" if fc.warned_status == "overflow_expected"
            else "the run would have been called unstable")
    ahead = f" ({fc.until - fc.warned_from} steps ahead)" if fc.until is not None else ""
    return [f"{what} from step {fc.warned_from} on{ahead}; just before step {fc.until}: "
            f"{fc.text}"]
