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

The crossing forecast (``crossing``: the fit, its gates and their knobs) is made only when
every gate passes: the trend stands far outside the noise, rose by two doublings or more, is
not levelling off, the values are no longer small, and the crossing falls within one window
span of the last sample: the forecast never extrapolates further than the data reaches. The
gates were chosen on recorded runs (``benchmarks/forecast_eval.py``: runs that overflowed, cut
before the failure, and runs that stayed healthy); a healthy run must never get a forecast of
failure. ``forecastrows`` reads the sampled rows the forecast judges.

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
from ..runfile.schema import DType, Kind
from . import fixes as _fixes
from .crossing import MIN_POINTS, TOP, WINDOW, LayerTrend, growth
from .crossing import trends as layer_trends
from .events import hidden_nonfinite
from .forecastrows import fix_context, layer_series, module_types, param_series, rows_near
from .layers import sampled
from .opprobe import precision_hits

STATUSES = ("overflow_expected", "unstable", "stable", "unknown")

# -- the instability warning (taxonomy C2; overflow.WEIGHT_GROWTH, 2x overflow.UPDATE_TOO_LARGE)
W_SAMPLES = 8  # sampled steps looked back over
WEIGHT_GROWTH = 2.0  # the weight norm doubled over them ...
UPDATE_HIGH = 2e-2  # ... or the median |dW|/|W| per step is at least this ...
SCALE_FALL = 3.0  # ... or the loss scale fell this many halvings, every loss finite ...
SIGNALS = 2  # ... and at least two of the three


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
        return growth(self, len(self.grid) if cut is None else
                      int(np.searchsorted(self.grid, cut)))


def read(run: Any, until: Optional[int] = None, samples: Optional[int] = None) -> Series:
    """Stream the run's sampled rows (``layers.sampled``): module outputs, gradients where no
    GradScaler guards them (fp16 ``.grad`` always), and the parameters' norm and update.

    ``samples``: read only the rows of the last ``samples`` sampled steps before ``until``
    (what ``at(until)`` and the cuts just before it need), not the whole table: on a long run
    that is a few HDF5 chunks instead of the whole compressed /stats.
    """
    kinds = (Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD, Kind.PARAM)
    rows, found = sampled(rows_near(run, until, samples), kinds,
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
    series = layer_series(rows[watched], found)
    params = param_series(rows[lk == int(Kind.PARAM)])
    every = (run.recorder_settings or {}).get("every")
    if not every and len(series[0]) > 1:
        every = int(np.min(np.diff(series[0])))
    return Series(*series, every=int(every or 1), pstep=params[0], wnorm=params[1],
                  upd=params[2], s_step=np.asarray(steps["step"], np.int64),
                  s_scale=steps["scale"], s_skipped=steps["skipped"] == 1,
                  s_loss=steps["loss"], context=fix_context(run),
                  types=module_types(run), hidden=precision_hits(hidden_nonfinite(run)))


# ---------------------------------------------------------------------------------------------
# judging a cut


def forecast(run: Any, until: Optional[int] = None) -> Forecast:
    """The early warning for ``run`` (a loaded ``Run``), from the steps before ``until``."""
    return read(run, until, NEEDED).at(until)


def judge(s: Series, cut: Optional[int]) -> Forecast:
    """The forecast from the steps of ``s`` before ``cut``: see the module docstring."""
    k = len(s.grid) if cut is None else int(np.searchsorted(s.grid, cut))
    trends = layer_trends(s, k)
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
    applied = ~skipped & fin
    if not applied.any():
        return None
    first = int(np.argmax(applied))  # the first applied step (no index array of every step)
    ref = scale[first:][fin[first:]]
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
