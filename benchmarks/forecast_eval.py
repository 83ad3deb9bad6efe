"""Prototype of issue 16's early warning, and its evaluation on recorded runs.

The forecast reads only what the sentinel and sampled tiers already record: per sampled step,
each module output's exact abs max and dtype (``/stats`` rows of kind OUTPUT, source SAMPLED).
Per layer it fits ``log2(absmax)`` against the step over the last ``WINDOW`` sampled steps
(ordinary least squares, with the residual spread and the slope's standard error) and says:

* **headroom**: doublings left between the layer's current level (the fitted line at the last
  sample, or the largest recent sample if that is higher) and its dtype's limit (fp16 65504,
  bf16 3.39e38, fp32 3.40e38);
* **forecast**: where the line crosses the limit, ``step S``, with a range from the slope's
  +-2 standard errors and the level's +-2 residual spreads; or "no trend: headroom stable".

A forecast of failure is made only when the growth is unmistakable (the gates below): a
noisy but healthy run must never get one. The earliest-crossing layer is the one named.

A divergence that goes from healthy to inf within a couple of sampling intervals has no such
trend. For those an **instability warning** (no step, no layer) reads the C2 signals of the
parameters and the scale: two of weight norm x2, median update ratio >= 2e-2, and a loss scale
3+ halvings below its calibrated level with every loss finite, over the last 8 sampled steps.

Evaluation. Runs that later overflow are cut at several points before their first bad step
(``ampdoctor.diagnose``'s ``first_bad``: step and module), and only rows before the cut are
used: a hit names the module that did overflow and holds the real first bad step inside the
predicted range. Runs that stay healthy are cut every 25 steps: any forecast of failure there
is a false alarm.

    python benchmarks/forecast_eval.py --record /tmp/fc        # record the set below, evaluate
    python benchmarks/forecast_eval.py RUN.h5 ...              # evaluate, one line per cut
    python benchmarks/forecast_eval.py --json RUN.h5 ...       # the same, as JSON
    python benchmarks/forecast_eval.py --at 120 RUN.h5         # the forecast at one cut
    python benchmarks/forecast_eval.py --sweep RUN.h5 ...      # hits/false alarms per knob

Runs diagnosed ``lr_overflow``/``unstable_op``/``mask_overflow`` with a module are positives;
every other run is a negative (no value passed its limit). Record them with a small sampling
interval, e.g.::

    ampdoctor record -o lr_ramp.h5 --every 5 -- python fixtures/forecast/lr_ramp.py

No torch needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

import ampdoctor
from ampdoctor.runfile.schema import BF16_MAX, FP16_MAX, DType, Kind, Source

FP32_MAX = 3.4028234663852886e38
LIMITS = {int(DType.FLOAT16): FP16_MAX, int(DType.BFLOAT16): BF16_MAX,
          int(DType.FLOAT32): FP32_MAX, int(DType.FLOAT64): 1.7976931348623157e308}

# -- the forecast's knobs (the gates are what keeps healthy runs free of false alarms) -------
WINDOW = 12  # sampled steps fitted per layer (the latest ones before the cut)
MIN_POINTS = 6  # fewer sampled steps than this: no forecast at all
MIN_T = 6.0  # slope / its standard error: the trend must be far outside the noise
MIN_RISE = 2.0  # doublings the fitted line rose over the window: a real change
FLATTENING = 0.5  # the slope over the latest half window must keep this share of the full one
HORIZON = 1.0  # extrapolate at most this many window spans beyond the last sample
MIN_LEVEL = 2.0 ** 4  # a layer whose abs max is below 16 is not on its way to 65504 yet
SPREAD = 2.0  # range: +-2 standard errors of the slope, +-2 residual spreads of the level


@dataclass
class LayerTrend:
    """One layer's fit: level, headroom and (when the gates pass) its forecast crossing."""

    name: str
    limit: float
    points: int
    level: float  # log2 abs max now (fitted, or the largest recent sample if higher)
    headroom: float  # doublings left before the limit
    slope: float  # doublings per step
    slope_se: float
    resid: float  # residual spread of the fit, in doublings
    span: int  # steps covered by the fit
    t: float  # slope / slope_se
    rise: float  # slope * span
    recent_slope: float  # fitted on the latest half window
    crossing: Optional[float] = None  # predicted step of the crossing
    earliest: Optional[float] = None
    latest: Optional[float] = None  # None: open-ended (the slope could be ~0)
    gates: list = field(default_factory=list)  # which gates failed ([] = a forecast)

    @property
    def forecast(self) -> bool:
        return not self.gates and self.crossing is not None


@dataclass
class Forecast:
    cut: int  # only steps < cut were read
    layers: list  # LayerTrend, earliest crossing first for those that forecast
    every: Optional[int] = None

    @property
    def failing(self) -> Optional[LayerTrend]:
        hits = [x for x in self.layers if x.forecast]
        return min(hits, key=lambda x: x.crossing) if hits else None

    def text(self) -> str:
        x = self.failing
        if x is None:
            low = min(self.layers, key=lambda y: y.headroom, default=None)
            if low is None:
                return f"cut {self.cut}: too few sampled steps to judge"
            return (f"cut {self.cut}: no trend: headroom stable (lowest: {low.name}, "
                    f"{low.headroom:.1f} doublings below its limit)")
        hi = "?" if x.latest is None else f"{x.latest:.0f}"
        return (f"cut {self.cut}: at the growth of the last {x.points} sampled steps, "
                f"{x.name}'s output passes {x.limit:.6g} around step {x.crossing:.0f} "
                f"(range {x.earliest:.0f}..{hi}; headroom {x.headroom:.1f} doublings, "
                f"{x.slope * 100:.2f} doublings per 100 steps)")


# ---------------------------------------------------------------------------------------------
# reading a run


@dataclass
class Series:
    """Per layer: sampled steps, log2 abs max, the dtype limit; first non-finite step."""

    steps: dict  # name -> np.ndarray of steps
    log2: dict  # name -> np.ndarray
    limit: dict  # name -> float
    first_bad_sample: dict  # name -> step of its first non-finite sample (or absent)
    every: Optional[int]
    last_step: int


def read_series(run) -> Series:
    """Module outputs of the sampled tier, the max over a module's outputs and calls."""
    t = run.tensors
    out_ids = {int(i): str(n) for i, k, n in zip(t["id"], t["kind"], t["name"])
               if int(k) == int(Kind.OUTPUT)}
    roots = set(run.meta.get("roots") or [])
    cols = ("step", "tensor", "source", "absmax", "nonfinite", "dtype")
    per: dict[str, dict[int, float]] = {}
    limit: dict[str, float] = {}
    bad: dict[str, int] = {}
    for rows in run.stats.chunks(1 << 16, names=cols):
        rows = rows[rows["source"] == Source.SAMPLED]
        for step, tid, absmax, nonfinite, dtype in zip(rows["step"], rows["tensor"],
                                                       rows["absmax"], rows["nonfinite"],
                                                       rows["dtype"]):
            name = out_ids.get(int(tid))
            if name is None or name in roots:
                continue  # the root's output is its last child's: counted there
            step = int(step)
            if nonfinite:
                bad[name] = min(bad.get(name, step), step)
                continue
            lim = LIMITS.get(int(dtype))
            if lim is None or not absmax > 0:
                continue
            limit[name] = min(limit.get(name, lim), lim)
            d = per.setdefault(name, {})
            d[step] = max(d.get(step, 0.0), float(absmax))
    steps = {n: np.array(sorted(d), np.int64) for n, d in per.items()}
    log2 = {n: np.log2(np.array([per[n][s] for s in steps[n]])) for n in per}
    rec = run.meta.get("recorder")
    every = rec.get("every") if isinstance(rec, dict) else None
    last = int(run.steps["step"][-1]) if len(run.steps) else 0
    return Series(steps, log2, limit, bad, every, last)


@dataclass
class Params:
    """Per sampled step: total weight norm and size-weighted mean log10 update ratio; and the
    sentinel's per-step scale, skip flag, loss and LR."""

    steps: np.ndarray
    wnorm: np.ndarray
    upd: np.ndarray  # 10 ** (size-weighted mean of log10 |dW|/|W|)
    s_step: np.ndarray
    s_scale: np.ndarray
    s_skipped: np.ndarray
    s_loss: np.ndarray
    s_lr: np.ndarray


def read_params(run) -> Params:
    t = run.tensors
    params = {int(i) for i, k in zip(t["id"], t["kind"]) if int(k) == int(Kind.PARAM)}
    acc: dict[int, list] = {}
    for rows in run.stats.chunks(1 << 16, names=("step", "tensor", "source", "norm", "update",
                                                 "numel")):
        rows = rows[rows["source"] == Source.SAMPLED]
        for step, tid, norm, upd, numel in zip(rows["step"], rows["tensor"], rows["norm"],
                                               rows["update"], rows["numel"]):
            if int(tid) not in params:
                continue
            a = acc.setdefault(int(step), [0.0, 0.0, 0.0])
            if np.isfinite(norm):
                a[0] += float(norm) ** 2
            # A (nearly) zero weight's ratio says nothing; ratios are capped at 10 (x10 a step).
            if np.isfinite(upd) and upd > 0 and np.isfinite(norm) and norm > 1e-6:
                a[1] += math.log10(min(float(upd), 10.0)) * float(numel)
                a[2] += float(numel)
    steps = np.array(sorted(acc), np.int64)
    wnorm = np.array([math.sqrt(acc[x][0]) for x in steps])
    upd = np.array([10 ** (acc[x][1] / acc[x][2]) if acc[x][2] else math.nan for x in steps])
    s = run.steps
    return Params(steps, wnorm, upd, s["step"].astype(np.int64), s["scale"].astype(float),
                  s["skipped"] == 1, s["loss"].astype(float), s["lr"].astype(float))


# -- the instability warning: no step, no layer, the C2 signals before any failure -----------
W_SAMPLES = 8  # sampled steps looked back over
WEIGHT_GROWTH = 2.0  # taxonomy C2 (rules.WEIGHT_GROWTH): the weight norm doubled ...
UPDATE_HIGH = 2e-2  # ... or |dW|/|W| twice the taxonomy's "too large" (1e-2), median ...
SCALE_FALL = 3  # ... or the loss scale fell 3 halvings below its post-calibration level
SIGNALS = 2  # ... and at least two of the three


def instability(p: Params, cut: int) -> list[str]:
    """The growth signals present before ``cut`` (two or more: warn)."""
    keep = np.flatnonzero(p.steps < cut)[-W_SAMPLES:]
    found = []
    if len(keep) >= 4:
        w0, w1 = p.wnorm[keep[0]], p.wnorm[keep[-1]]
        if w0 > 0 and w1 / w0 >= WEIGHT_GROWTH:
            found.append(f"weight norm x{w1 / w0:.1f} over steps {p.steps[keep[0]]}.."
                         f"{p.steps[keep[-1]]}")
        upd = p.upd[keep[-6:]]
        upd = upd[np.isfinite(upd)]
        if len(upd) >= 3 and np.median(upd) >= UPDATE_HIGH:
            found.append(f"update ratio ~{np.median(upd):.2g} per step (median)")
    sel = p.s_step < cut
    scale, skipped, loss = p.s_scale[sel], p.s_skipped[sel], p.s_loss[sel]
    fin = np.isfinite(scale)
    if fin.any() and np.isfinite(loss).all():
        applied = np.flatnonzero(~skipped & fin)
        if len(applied):
            ref = scale[applied[0]:][np.isfinite(scale[applied[0]:])]
            fall = math.log2(ref.max() / ref[-1]) if ref[-1] > 0 else math.inf
            if fall >= SCALE_FALL:
                found.append(f"loss scale {fall:.0f} halvings below its calibrated level, "
                             "every loss finite")
    return found


# ---------------------------------------------------------------------------------------------
# the forecast


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """OLS of y on x: slope, intercept, residual spread, slope standard error."""
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    if sxx <= 0:
        return 0.0, float(ym), 0.0, math.inf
    b = float(((x - xm) * (y - ym)).sum() / sxx)
    a = float(ym - b * xm)
    r = y - (a + b * x)
    dof = max(len(x) - 2, 1)
    s = math.sqrt(float((r ** 2).sum()) / dof)
    return b, a, s, (s / math.sqrt(sxx)) if s > 0 else 1e-12


def layer_trend(name: str, steps: np.ndarray, log2: np.ndarray, limit: float,
                cut: int, every: int = 1) -> Optional[LayerTrend]:
    keep = steps < cut
    x, y = steps[keep][-WINDOW:].astype(np.float64), log2[keep][-WINDOW:]
    if len(x) < MIN_POINTS:
        return None
    b, a, s, se = _fit(x, y)
    half = len(x) // 2
    rb = _fit(x[half:], y[half:])[0] if len(x) - half >= 3 else b
    last = float(x[-1])
    level = max(a + b * last, float(y[-3:].max()))
    top = math.log2(limit)
    span = int(x[-1] - x[0])
    tr = LayerTrend(name, limit, len(x), level, top - level, b, se, s, span,
                    b / se if se > 0 else math.inf, b * span, rb)
    if b > 0:
        tr.crossing = last + tr.headroom / b
        fast, slow = b + SPREAD * se, b - SPREAD * se
        # The sampled tier sees one step in ``every``: the first step whose batch passes the
        # limit can come up to one interval before the sampled envelope shows it.
        tr.earliest = max(last, last + (tr.headroom - SPREAD * s) / fast - every)
        tr.latest = last + (tr.headroom + SPREAD * s) / slow if slow > 0 else None
    tr.gates = _gates(tr, last, cut)
    return tr


def _gates(tr: LayerTrend, last: float, cut: int) -> list[str]:
    """Why no failure is forecast for this layer ([]: one is)."""
    failed = []
    if tr.slope <= 0 or tr.crossing is None:
        return ["no growth"]
    if tr.t < MIN_T:
        failed.append(f"trend within the noise (t={tr.t:.1f})")
    if tr.rise < MIN_RISE:
        failed.append(f"rose {tr.rise:.1f} doublings only")
    if tr.recent_slope < FLATTENING * tr.slope:
        failed.append("levelling off")
    if tr.level < math.log2(MIN_LEVEL):
        failed.append("still small")
    if tr.crossing - last > HORIZON * max(tr.span, 1):
        failed.append(f"crossing {tr.crossing - last:.0f} steps out, beyond the horizon")
    return failed


def forecast(series: Series, cut: int) -> Forecast:
    every = int(series.every or 1)
    trends = [layer_trend(n, series.steps[n], series.log2[n], series.limit[n], cut, every)
              for n in series.steps]
    trends = [t for t in trends if t is not None]
    trends.sort(key=lambda t: (not t.forecast, t.crossing if t.forecast else t.headroom))
    return Forecast(cut, trends, series.every)


# ---------------------------------------------------------------------------------------------
# evaluation


@dataclass
class CutResult:
    run: str
    cut: int
    lead: Optional[int]  # steps between the cut and the real first bad step
    called: bool
    layer: Optional[str] = None
    crossing: Optional[float] = None
    earliest: Optional[float] = None
    latest: Optional[float] = None
    layer_right: Optional[bool] = None
    step_in_range: Optional[bool] = None
    within_run: Optional[bool] = None  # negatives: the predicted range ends inside the run
    text: str = ""


@dataclass
class WarnResult:
    """The instability warning scanned at every sampled step: when it first fired."""

    run: str
    truth: Optional[int]  # first bad step of a positive, None for a negative
    first_warning: Optional[int]
    signals: list = field(default_factory=list)
    first_forecast: Optional[int] = None  # first sampled step whose crossing forecast hit


def _same_module(named: str, truth: Optional[str]) -> bool:
    return truth is not None and (named == truth or named.startswith(truth + ".")
                                  or truth.startswith(named + "."))


# Verdicts whose first bad step is a value passing its dtype's limit in a located module: the
# runs the forecast must see coming. Every other run (healthy, dead units, a false alarm of the
# diagnosis itself) is a negative: no overflow happened in it.
OVERFLOWS = ("lr_overflow", "unstable_op", "mask_overflow")


def positive_cuts(first_bad: int, every: int) -> list[int]:
    """Cuts before the failure: 1, 2, 3, 4, 6, 8 sampling intervals ahead of it."""
    return [first_bad - k * every for k in (1, 2, 3, 4, 6, 8) if first_bad - k * every > 0]


def scan(path: str) -> WarnResult:
    """Both warnings at every sampled step before the failure (or the end)."""
    d = ampdoctor.diagnose(path)
    with ampdoctor.load(path) as run:
        series, p = read_series(run), read_params(run)
    fb = d.first_bad or {}
    truth = fb.get("step") if d.verdict in OVERFLOWS and fb.get("module") else None
    end = int(truth) if truth is not None else series.last_step + 1
    r = WarnResult(path, truth, None)
    for cut in [int(x) + 1 for x in p.steps if x < end]:
        found = instability(p, cut)
        if len(found) >= SIGNALS and r.first_warning is None:
            r.first_warning, r.signals = cut, found
        x = forecast(series, cut).failing
        if x is not None and r.first_forecast is None:
            r.first_forecast = cut
    return r


def evaluate(path: str) -> list[CutResult]:
    d = ampdoctor.diagnose(path)
    with ampdoctor.load(path) as run:
        series = read_series(run)
    every = int(series.every or 1)
    fb = d.first_bad or {}
    truth_step, truth_module = fb.get("step"), fb.get("module")
    out = []
    if d.verdict in OVERFLOWS and truth_step is not None and truth_module:
        for cut in positive_cuts(int(truth_step), every):
            f = forecast(series, cut)
            x = f.failing
            r = CutResult(path, cut, int(truth_step) - cut, x is not None, text=f.text())
            if x is not None:
                r.layer, r.crossing, r.earliest, r.latest = x.name, x.crossing, x.earliest, \
                    x.latest
                r.layer_right = _same_module(x.name, truth_module)
                hi = math.inf if x.latest is None else x.latest
                r.step_in_range = x.earliest <= truth_step <= hi
            out.append(r)
        return out
    for cut in range(50, series.last_step + 2, 25):
        f = forecast(series, cut)
        x = f.failing
        r = CutResult(path, cut, None, x is not None, text=f.text())
        if x is not None:
            r.layer, r.crossing, r.earliest, r.latest = x.name, x.crossing, x.earliest, x.latest
            r.within_run = x.latest is not None and x.latest <= series.last_step
        out.append(r)
    return out


def _hit(r: CutResult) -> bool:
    return bool(r.called and r.layer_right and r.step_in_range)


def summarize(results: list[CutResult]) -> dict:
    pos = [r for r in results if r.lead is not None]
    neg = [r for r in results if r.lead is None]
    hit = [r for r in pos if _hit(r)]
    s = {
        "positive_cuts": len(pos),
        "called": sum(r.called for r in pos),
        "layer_right": sum(bool(r.layer_right) for r in pos),
        "hits": len(hit),
        "wrong_layer": sum(r.called and not r.layer_right for r in pos),
        "step_outside_range": sum(r.called and r.layer_right and not r.step_in_range
                                  for r in pos),
        "negative_cuts": len(neg),
        "false_alarms": sum(r.called for r in neg),
        "false_alarms_within_run": sum(bool(r.within_run) for r in neg),
        "negative_runs": len({r.run for r in neg}),
        "negative_runs_alarmed": len({r.run for r in neg if r.called}),
    }
    by_lead: dict[int, list] = {}
    for r in pos:
        by_lead.setdefault(r.lead, []).append(r)
    s["hits_by_lead"] = {k: f"{sum(_hit(r) for r in v)}/{len(v)}"
                         for k, v in sorted(by_lead.items())}
    return s


# The evaluation set: (name, fixture, args), recorded with --every 5. Positives overflow
# (attention logits at 4 annealing rates, LR ramps at 5 seeds); negatives stay healthy (long
# noisy runs, sane LR ramps, logits that level off, the verdict fixtures' healthy runs) or
# fail without an overflow (q/k growth within 200 steps, a ReLU net that dies).
RUNS = [(f"lr_ramp_s{i}", "forecast/lr_ramp.py", ["--seed", str(i)]) for i in range(6)] + [
    ("attn_s0", "forecast/attn_logits.py", ["--seed", "0"]),
    ("attn_s1", "forecast/attn_logits.py", ["--seed", "1"]),
    ("attn_d93", "forecast/attn_logits.py", ["--seed", "2", "--decay", "0.93"]),
    ("attn_d95", "forecast/attn_logits.py", ["--seed", "3", "--decay", "0.95", "--steps", "250"]),
    ("attn_d96", "forecast/attn_logits.py", ["--seed", "4", "--decay", "0.96", "--steps", "300"]),
    ("attn_qk", "forecast/attn_logits.py", ["--qk"]),
    ("attn_floor", "forecast/attn_logits.py", ["--floor"]),
    ("attn_floor_s1", "forecast/attn_logits.py", ["--floor", "--seed", "1", "--steps", "300"]),
] + [(f"healthy_long_s{i}", "forecast/healthy_long.py", ["--seed", str(i)]) for i in range(3)] + [
    ("healthy_long_nd", "forecast/healthy_long.py", ["--no-decay"]),
] + [(f"lr_sane_s{i}", "forecast/lr_ramp.py", ["--peak-lr", "0.02", "--seed", str(i)])
     for i in range(3)] + [
    ("hw_healthy", "verdicts/handwritten_fp16_loss_healthy.py", []),
    ("healthy_fp16", "verdicts/healthy_fp16.py", []),
    ("healthy_bf16", "verdicts/healthy_bf16.py", []),
]


def record_all(out_dir: str, every: int = 5, parallel: int = 2) -> list[str]:
    """Record RUNS into ``out_dir`` (single-threaded children, ``parallel`` at a time)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pending, running, paths = list(RUNS), [], []
    while pending or running:
        while pending and len(running) < parallel:
            name, script, args = pending.pop(0)
            path = os.path.join(out_dir, f"{name}.h5")
            cmd = [sys.executable, "-m", "ampdoctor", "record", "-o", path, "--every",
                   str(every), "--force", "-q", "--", sys.executable,
                   os.path.join(root, "fixtures", script), *args]
            running.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
            paths.append(path)
        running[0].wait()
        running = [p for p in running if p.poll() is None]
    return paths


def sweep(paths: list[str]) -> None:
    """How sensitive the crossing forecast is to its knobs (one changed at a time)."""
    g = globals()
    base = {k: g[k] for k in ("WINDOW", "MIN_T", "MIN_RISE", "HORIZON", "FLATTENING")}
    trials = [{}] + [{"WINDOW": w} for w in (8, 16)] + [{"MIN_T": t} for t in (3.0, 4.0, 8.0)] \
        + [{"MIN_RISE": r} for r in (1.0, 3.0)] + [{"HORIZON": h} for h in (0.5, 2.0, 4.0)] \
        + [{"FLATTENING": f} for f in (0.0, 0.8)]
    for trial in trials:
        g.update(base)
        g.update(trial)
        s = summarize([r for path in paths for r in evaluate(path)])
        print(f"{json.dumps(trial) or 'defaults':<22} hits {s['hits']}/{s['positive_cuts']}  "
              f"wrong layer {s['wrong_layer']}  outside range {s['step_outside_range']}  "
              f"false alarms {s['false_alarms']}/{s['negative_cuts']} cuts "
              f"({s['negative_runs_alarmed']}/{s['negative_runs']} runs)")
    g.update(base)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="*")
    parser.add_argument("--record", metavar="DIR", help="record the evaluation set into DIR first")
    parser.add_argument("--at", type=int, help="print the forecast of one cut and stop")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="the summary only")
    parser.add_argument("--sweep", action="store_true",
                        help="hits and false alarms of the crossing forecast around its knobs")
    args = parser.parse_args()
    if args.record:
        args.runs = record_all(args.record) + list(args.runs)
    if not args.runs:
        parser.error("give run files, or --record DIR")
    if args.sweep:
        sweep(args.runs)
        return
    if args.at is not None:
        for path in args.runs:
            with ampdoctor.load(path) as run:
                f = forecast(read_series(run), args.at)
            print(path, f.text())
            for t in f.layers[:6]:
                print(f"   {t.name:<24} level 2^{t.level:5.1f} headroom {t.headroom:5.1f} "
                      f"slope {t.slope * 100:6.2f}/100 t={t.t:6.1f} rise {t.rise:5.1f} "
                      f"recent {t.recent_slope * 100:6.2f}  {'; '.join(t.gates) or 'FORECAST'}")
        return
    results = [r for path in args.runs for r in evaluate(path)]
    summary = summarize(results)
    scans = [scan(path) for path in args.runs]
    summary["warnings"] = {
        "positives": sum(w.truth is not None for w in scans),
        "warned_before_failure": sum(w.truth is not None and (
            w.first_warning is not None or w.first_forecast is not None) for w in scans),
        "instability_leads": [w.truth - w.first_warning for w in scans
                              if w.truth is not None and w.first_warning is not None],
        "forecast_leads": [w.truth - w.first_forecast for w in scans
                           if w.truth is not None and w.first_forecast is not None],
        "negatives": sum(w.truth is None for w in scans),
        "negatives_warned": [w.run.split("/")[-1] for w in scans if w.truth is None and (
            w.first_warning is not None or w.first_forecast is not None)],
    }
    if args.json:
        json.dump({"results": [asdict(r) for r in results], "scans": [asdict(w) for w in scans],
               "summary": summary}, sys.stdout,
                  indent=1, default=str)
        print()
        return
    if not args.quiet:
        for r in results:
            tag = ("HIT " if _hit(r) else
                   "MISS" if r.lead is not None else "FA  " if r.called else "ok  ")
            lead = f"lead {r.lead:3d}" if r.lead is not None else "healthy "
            print(f"{tag} {r.run.split('/')[-1]:<24} {lead}  {r.text}")
        for w in scans:
            what = (f"instability warning from step {w.first_warning} ({'; '.join(w.signals)})"
                    if w.first_warning is not None else "no instability warning")
            fc = f"crossing forecast from step {w.first_forecast}" if w.first_forecast \
                is not None else "no crossing forecast"
            truth = f"first bad {w.truth}" if w.truth is not None else "healthy"
            print(f"SCAN {w.run.split('/')[-1]:<24} {truth:<14} {fc}; {what}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
