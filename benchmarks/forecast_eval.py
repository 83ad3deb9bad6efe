"""Evaluation of the early warning (``ampdoctor.forecast``) on recorded runs.

The forecast (see ``ampdoctor/forecast.py``) fits, per layer, ``log2(absmax)`` of the sampled
steps against the step over its last ``WINDOW`` samples and forecasts where the line passes
the layer's dtype limit when its gates pass; else an instability warning (weight norm x2,
update ratio >= 2e-2, a falling loss scale: two of three) or "no trend: headroom stable".
This script judges both on runs that later overflow and on runs that stay healthy.

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

import ampdoctor
from ampdoctor.diagnosis import crossing
from ampdoctor.diagnosis import forecast as F


def read_series(run) -> F.Series:
    """Every sampled row of the run (the evaluation judges many cuts of one read)."""
    s = F.read(run)
    s.last_step = int(run.steps["step"][-1]) if len(run.steps) else 0
    return s


def failing(series: F.Series, cut: int) -> Optional[F.Forecast]:
    """The forecast at ``cut`` if it expects an overflow, else None."""
    fc = series.at(cut)
    return fc if fc.status == "overflow_expected" else None


def text(fc: F.Forecast) -> str:
    return f"cut {fc.until}: {fc.text}"


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
    status: str = ""  # the forecast's status at the cut (unstable counts as a warning too)


@dataclass
class WarnResult:
    """The instability warning scanned at every sampled step: when it first fired."""

    run: str
    truth: Optional[int]  # first bad step of a positive, None for a negative
    first_warning: Optional[int]
    signals: list = field(default_factory=list)
    first_forecast: Optional[int] = None  # first sampled step whose crossing forecast hit
    warned_from: Optional[int] = None  # diagnose's forecast.warned_from (positives)


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
    """Both warnings at every sampled step before the failure (or the end), and the step
    ``diagnose`` says the warning would have held from."""
    d = ampdoctor.diagnose(path)
    with ampdoctor.load(path) as run:
        series = read_series(run)
    fb = d.first_bad or {}
    truth = fb.get("step") if d.verdict in OVERFLOWS and fb.get("module") else None
    end = int(truth) if truth is not None else series.last_step + 1
    r = WarnResult(path, truth, None)
    if truth is not None and d.forecast is not None:
        r.warned_from = d.forecast.warned_from
    for cut in [int(x) + 1 for x in series.grid if x < end]:
        fc = series.at(cut)
        if len(fc.signals) >= F.SIGNALS and r.first_warning is None:
            r.first_warning, r.signals = cut, fc.signals
        if fc.status == "overflow_expected" and r.first_forecast is None:
            r.first_forecast = cut
    return r


def _called(r: CutResult, fc: Optional[F.Forecast]) -> None:
    if fc is not None:
        r.layer, r.crossing = fc.layer, fc.step
        r.earliest, r.latest = fc.range


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
            x = failing(series, cut)
            fc = series.at(cut)
            r = CutResult(path, cut, int(truth_step) - cut, x is not None, text=text(fc),
                          status=fc.status)
            _called(r, x)
            if x is not None:
                r.layer_right = _same_module(x.layer, truth_module)
                hi = math.inf if r.latest is None else r.latest
                r.step_in_range = r.earliest <= truth_step <= hi
            out.append(r)
        return out
    for cut in range(50, series.last_step + 2, 25):
        x = failing(series, cut)
        fc = series.at(cut)
        r = CutResult(path, cut, None, x is not None, text=text(fc), status=fc.status)
        _called(r, x)
        if x is not None:
            r.within_run = r.latest is not None and r.latest <= series.last_step
        out.append(r)
    return out


WARNS = ("overflow_expected", "unstable")


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
        # either warning (overflow expected, or unstable) at the cut
        "positive_cuts_warned": sum(r.status in WARNS for r in pos),
        "negative_cuts_warned": sum(r.status in WARNS for r in neg),
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
    g = vars(crossing)  # the crossing forecast's knobs, read at each call
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
                f = F.forecast(run, until=args.at)
            print(path, f.status, text(f))
            for t in f.layers:
                slope = "-" if t.doublings_per_100_steps is None else \
                    f"{t.doublings_per_100_steps:6.2f}"
                tval = "-" if t.t is None else f"{t.t:6.1f}"
                print(f"   {t.label:<32} level 2^{t.level_log2:5.1f} headroom "
                      f"{t.headroom:5.1f} slope {slope}/100 t={tval}  "
                      f"{'; '.join(t.gates) or 'FORECAST'}")
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
        "diagnose_warned_from_leads": [w.truth - w.warned_from for w in scans
                                       if w.truth is not None and w.warned_from is not None],
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
