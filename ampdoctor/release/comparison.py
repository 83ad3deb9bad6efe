"""Two runs of one training compared: fp32 parity (a baseline against a mixed-precision run), or a
run against its fix.

numpy only. ``compare(base, amp)`` lines the two loss curves up by step and says whether the
mixed-precision run matches the baseline, drifts from it, or diverges (and from which step);
then compares per-layer statistics on the steps both sampled, names the layers that sit close
to fp16's limits in the mixed-precision run, and measures the throughput and memory gain.

The loss verdict reads trailing means over a window of steps (a tenth of them, 1 to 100),
because one batch's loss is noisy while a real divergence persists:

- ``match``: the smoothed relative difference stays within ``rtol`` (2 %) at every step;
- ``diverged``: it rises above ``diverge`` (10 %), or the mixed-precision loss turns
  non-finite where the baseline's is not, and never comes back within ``rtol`` before the
  last common step (the two tolerances make a hysteresis: a diverged run's batches that
  happen to land near the baseline do not undo it);
- ``drift``: anything in between (a difference beyond ``rtol`` that came back, or stayed
  below ``diverge``; an isolated non-finite step the run recovered from).

Relative differences are taken against ``max(|base|, 1e-3 * max|base|)``, so that a loss
heading to zero does not turn noise into infinite ratios.

A run and its fix (``ampdoctor compare run.h5 fixed.h5``, the second recorded with ``record
--apply``, or a first run whose loss went non-finite) is no parity question: ``kind`` is then
``"fix"``, the verdict one of ``fix_outcome.VERDICTS`` and ``treatment`` holds what each run was
treated with and how it fared (``fix_outcome`` says when, and what).

Example::

    c = ampdoctor.compare("fp32.h5", "bf16.h5")
    c.verdict, c.divergence_step, c.speedup
    print(c)        # the text ``ampdoctor compare fp32.h5 bf16.h5`` prints
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ..diagnosis import layers as _layers
from ..diagnosis import parity
from ..diagnosis.curve import median
from ..diagnosis.layers import Kind
from ..diagnosis.parity import LOSS_FLOOR, diverged_at, relative, trailing
from ..diagnosis.thresholds import PARITY_DIVERGE, PARITY_RTOL
from ..display import Displayable
from ..errors import AmpDoctorError
from ..numfmt import count
from ..runfile.store import Run, opened
from . import fix_outcome, readiness
from .curves import extremes, percent
from .readiness import Readiness, fp16_readiness, plain

VERDICTS = {
    "match": "the loss curves agree within the tolerance at every step",
    "drift": "the loss differs beyond the tolerance somewhere, without diverging",
    "diverged": "the mixed-precision loss departs from the baseline and does not come back",
}
RTOL = PARITY_RTOL
DIVERGE = PARITY_DIVERGE
TOP_LAYERS = 10
COMPARED_KINDS = (Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD)
# The /steps columns a comparison reads (lined-up losses, non-finite flags, the loss scale,
# skips, step time, memory, precision): two month-long runs held whole were 2.4 GB.
STEP_COLUMNS = ("step", "loss", "loss_dtype", "flags", "skipped", "sampled", "scale", "dt",
                "peak_mem")
# What the layers' part reads of /steps (the loss scale at sampled steps, skips, precision):
# a run ``compare`` loaded itself holds only these once its losses are lined up.
LAYER_COLUMNS = ("step", "scale", "skipped", "loss_dtype")
CURVE_POINTS = 20_000  # about how many steps ``Comparison.curve`` keeps for the figures


@dataclass
class LayerDiff:
    """How one layer's rms differs between the runs on the steps both sampled.

    Ratios are mixed-precision over baseline, gradients unscaled (divided by each run's loss
    scale), so 1.0 is agreement; ``spread`` is the median of |log2 ratio| (1.0: a factor 2).
    """

    name: str
    kind: str
    steps: int
    ratio: float  # median rms ratio
    spread: float
    worst_ratio: float
    worst_step: int
    absmax_base: float
    absmax_amp: float


@dataclass
class Comparison(Displayable):
    """A baseline against a mixed-precision run. ``str(c)`` is the text the CLI prints."""

    verdict: str
    summary: str
    base: dict
    amp: dict
    tolerance: dict
    common_steps: int
    max_rel: float = math.nan  # smoothed, the verdict's basis
    max_rel_step: Optional[int] = None
    max_rel_raw: float = math.nan  # step by step
    final_rel: float = math.nan
    final_step: Optional[int] = None
    divergence_step: Optional[int] = None
    nonfinite_steps: list[int] = field(default_factory=list)  # amp only, first 20
    nonfinite_count: int = 0
    layers: list[LayerDiff] = field(default_factory=list)
    layer_steps: int = 0  # sampled steps both runs have
    amp_range: dict = field(default_factory=dict)  # readiness of the amp run: status, lists
    step_time: dict = field(default_factory=dict)  # median seconds: base, amp
    speedup: Optional[float] = None  # base step time / amp step time
    memory: dict = field(default_factory=dict)  # peak bytes: base, amp, what was measured
    memory_ratio: Optional[float] = None  # amp peak / base peak
    notes: list[str] = field(default_factory=list)
    # "parity", or "fix": the second run is the first treated or changed (fix_outcome.question)
    kind: str = "parity"
    # kind "fix": per run ("base": the first, "amp": the second) fix_outcome.outcome; "change",
    # "at_steps", "loss_difference". {} for parity
    treatment: dict = field(default_factory=dict)
    # arrays for plots, not in to_dict: a long run's thinned (``thinned``: each curve's bin
    # extremes, every step where either loss is non-finite, the first and last)
    curve: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("curve")
        return plain({"kind": out.pop("kind"), **out})



def compare(base: Any, amp: Any, *, rtol: float = RTOL, diverge: float = DIVERGE,
            window: Optional[int] = None) -> Comparison:
    """Compare a baseline run with a mixed-precision run: paths or loaded ``Run`` objects.

    ``window``: steps in the trailing mean the verdict reads (default: a tenth of the common
    steps, between 1 and 100).
    """
    if not 0 < rtol <= diverge:
        raise AmpDoctorError(f"the tolerances must satisfy 0 < rtol <= diverge (got rtol={rtol}, "
                             f"diverge={diverge})")
    with opened(base, "compare", STEP_COLUMNS) as b, opened(amp, "compare", STEP_COLUMNS) as a:
        return _compare(b, a, rtol, diverge, window,
                        ours=tuple(run for run, given in ((b, base), (a, amp))
                                   if not isinstance(given, Run)))


def _compare(b: Any, a: Any, rtol: float, diverge: float, window: Optional[int],
             ours: tuple = ()) -> Comparison:
    common, ib, ia = _common(b.steps["step"], a.steps["step"])
    kind = fix_outcome.question(b, a, common) if len(common) else "parity"
    usable = np.isfinite(b.steps["loss"][ib])
    if not len(common) or (kind == "parity" and not usable.any()):
        raise AmpDoctorError(_nothing_to_compare(b, a, len(common)))
    w = window or parity.window(len(common))
    c = Comparison(verdict="match", summary="", base=describe(b), amp=describe(a),
                   tolerance={"rtol": rtol, "diverge": diverge, "window": w},
                   common_steps=int(len(common)), kind=kind)
    c.step_time, c.speedup = _speed(b, a)
    c.memory, c.memory_ratio = _memory(b, a)
    lb = b.steps["loss"][ib].astype(np.float64)
    la = a.steps["loss"][ia].astype(np.float64)
    del ib, ia
    if kind == "fix":  # the losses' part first, their arrays gone before the diagnoses
        for run in ours:  # the columns read for the above are done with (each diagnosis
            run.steps = run.steps.narrowed(())  # reads its own: ``_diagnosed``)
        losses = _fix_losses(c, common, lb, la)
        del common, lb, la, usable
        return _fix(c, b, a, losses, ours)
    for run in ours:  # the columns read for the above are let go before the losses' arrays
        run.steps = run.steps.narrowed(LAYER_COLUMNS)
    floor = LOSS_FLOOR * float(np.max(np.abs(lb[usable])))
    raw = relative(lb, la, floor)
    smooth = relative(trailing(lb, w), trailing(la, w), floor)
    _loss_verdict(c, common, raw, smooth, rtol, diverge, w)
    c.curve = thinned({"step": common, "base": lb, "amp": la, "rel": smooth, "rel_raw": raw})
    del lb, la, raw, smooth  # 80 MB each on 10^7 steps: gone before the layers
    judged = c.amp["dtype"] != "float32"  # fp16 range: the question of a run in low precision
    # (then one pass over its /stats for both: the judgement's rows, the compared ones of them)
    held = [_layers.sampled(a, readiness.KINDS, (*readiness.COLUMNS, "rms"))] if judged else []
    c.layers, c.layer_steps = _layer_diffs(b, a, common, held[0] if held else None)
    if judged:  # (handed over, not kept here: the judgement's sorted copy replaces them)
        c.amp_range = _range_summary(fp16_readiness(a, held.pop()))
    c.notes = _notes(b, a, c)
    return c


def thinned(curve: dict[str, np.ndarray], points: int = CURVE_POINTS) -> dict[str, np.ndarray]:
    """The curves of ``curve`` (one ``"step"`` array and values beside it) at the steps that
    keep their shape in a figure: each curve's smallest and largest finite value in each of
    about ``points / 2`` bins, every step where a value is not finite, the first and the last.
    A curve no longer than ``points`` is kept whole."""
    n = len(curve["step"])
    if n <= points:
        return curve
    values = [v for k, v in curve.items() if k != "step"]
    keep = [extremes(v, points, finite_only=True) for v in values]
    keep += [np.flatnonzero(~np.isfinite(v)) for v in values]
    idx = np.unique(np.concatenate([[0, n - 1], *keep]))
    return {k: v[idx] for k, v in curve.items()}


def describe(run: Any) -> dict:
    """Path, precision, device and size of a run, as the comparison shows it."""
    dev = run.device or {}
    model = run.model or {}
    return {"path": run.path, "dtype": fix_outcome.label(run),
            "scaler": run.scaler is not None and run.scaler.enabled, "device": dev.get("type"),
            "device_name": dev.get("name"), "steps": int(len(run.steps)),
            "params": model.get("trainable"), "status": run.status,
            "applied": fix_outcome.applied(run)}


def _nothing_to_compare(b: Any, a: Any, common: int) -> str:
    if not len(b.steps):
        return f"{b.path} recorded no optimizer step: there is no baseline to compare with"
    if not len(a.steps):
        return f"{a.path} recorded no optimizer step: there is nothing to compare"
    if not common:
        return (f"{b.path} and {a.path} share no step numbers: they are not two runs of the "
                "same training")
    return (f"{b.path} has no finite loss on any of the {common} steps both runs recorded: "
            "the baseline must itself be sound")


def _loss_verdict(c: Comparison, steps: np.ndarray, raw: np.ndarray, smooth: np.ndarray,
                  rtol: float, diverge: float, w: int) -> None:
    decided = ~np.isnan(smooth)
    amp_bad = np.isinf(raw)
    c.nonfinite_count = int(amp_bad.sum())
    c.nonfinite_steps = [int(s) for s in steps[amp_bad][:20]]
    values = np.where(decided, smooth, -1.0)
    worst = int(np.argmax(values))
    c.max_rel, c.max_rel_step = float(smooth[worst]), int(steps[worst])
    c.max_rel_raw = float(np.nanmax(raw)) if (~np.isnan(raw)).any() else math.nan
    last = parity.last_true(decided)
    c.final_rel, c.final_step = float(smooth[last]), int(steps[last])
    first = diverged_at(smooth, raw, w, rtol, diverge)
    if first is not None:
        c.verdict, c.divergence_step = "diverged", int(steps[first])
    elif c.max_rel > rtol or c.nonfinite_count:
        c.verdict = "drift"
    c.summary = _loss_summary(c, rtol, diverge, w)


def _loss_summary(c: Comparison, rtol: float, diverge: float, w: int) -> str:
    a, b = c.amp, c.base
    who = f"The {a['dtype']} run's loss"
    ref = f"the {b['dtype']} baseline"
    mean = f" (trailing mean of {w} steps)" if w > 1 else ""
    if c.verdict == "diverged":
        return (f"{who} diverges from {ref} at step {c.divergence_step}: it goes more than "
                f"{percent(diverge)} away (or non-finite) and never comes back within "
                f"{percent(rtol)}{mean} up to step {c.final_step}; final difference "
                f"{percent(c.final_rel)}.")
    worst = (f"a non-finite loss at step {c.max_rel_step}" if math.isinf(c.max_rel) else
             f"largest difference {percent(c.max_rel)} at step {c.max_rel_step}")
    final = f"final {percent(c.final_rel)} at step {c.final_step}"
    if c.verdict == "match":
        return f"{who} matches {ref} within {percent(rtol)}{mean}: {worst}, {final}."
    extra = (f"; {count(c.nonfinite_count, 'non-finite step')}"
             + " the baseline did not have") if c.nonfinite_count else ""
    return (f"{who} drifts from {ref} beyond {percent(rtol)}{mean} without diverging: {worst}, "
            f"{final}{extra}.")


# ---------------------------------------------------------------------------------------------
# A run and its fix (kind "fix": see fix_outcome): what changed, not parity


def _fix_losses(c: Comparison, steps: np.ndarray, lb: np.ndarray, la: np.ndarray) -> dict:
    """What a run and its fix's lined-up losses say (the treatment's ``at_steps`` and
    ``loss_difference``), and the figure's thinned curve."""
    c.curve = thinned({"step": steps, "base": lb, "amp": la})
    return {"at_steps": fix_outcome.at_steps(steps, lb, la),
            "loss_difference": fix_outcome.loss_difference(steps, lb, la,
                                                           c.tolerance["window"])}


def _fix(c: Comparison, b: Any, a: Any, losses: dict, ours: tuple = ()) -> Comparison:
    (before, base), (after, amp) = (_diagnosed(r, any(r is o for o in ours)) for r in (b, a))
    c.treatment = {"base": base, "amp": amp, "change": fix_outcome.change(b, a), **losses}
    c.verdict = fix_outcome.verdict(before.healthy, after.healthy,
                                    (c.treatment["amp"]["levels"] or {}).get("learned"))
    c.summary = fix_outcome.summary(c.verdict, c.treatment, c.common_steps, c.tolerance)
    c.notes = (_model_note(c) + fix_outcome.notes(c.treatment, c.base["steps"],
                                                  c.amp["steps"], c.common_steps)
               + _device_note(c))
    return c


def _diagnosed(run: Any, ours: bool) -> tuple[Any, dict]:
    """The diagnosis of one of the two runs and its side of the outcome
    (``fix_outcome.outcome``). A run ``compare`` loaded gets the diagnosis's columns in one
    pass (none it does not read: the wall clock's 80 MB on 10^7 steps among them), let go
    after, before the other run's are read: one run's at a time (420 MB on 10^7 steps)."""
    from ..diagnosis.engine import STEP_COLUMNS as READ
    from ..diagnosis.engine import diagnose

    if ours:
        run.steps = run.steps.holding(READ)
    try:
        d = diagnose(run)
        if ours:  # what the outcome reads, the rest let go
            run.steps = run.steps.narrowed(fix_outcome.OUTCOME_COLUMNS)
        gc.collect()  # (the diagnosis's facts refer to themselves: their memos go now)
        return d, fix_outcome.outcome(run, d)
    finally:
        if ours:
            run.steps = run.steps.narrowed(())
            gc.collect()  # these columns gone before the other run's are read


# ---------------------------------------------------------------------------------------------
# Per-layer statistics on common sampled steps


def _layer_diffs(b: Any, a: Any, common: np.ndarray, sampled: Optional[tuple] = None
                 ) -> tuple[list[LayerDiff], int]:
    """The layers whose rms differs most between the runs, and how many steps both sampled.
    ``sampled``: ``a``'s sampled rows of more kinds and columns, read already."""
    matched, lb, nsteps = _matched_rows(b, a, common, sampled)
    if matched is None:
        return [], nsteps
    matched = matched[np.argsort(matched["layer"], kind="stable")]
    if not len(matched):
        return [], nsteps
    # every layer at once (10^5 modules: 333 332 layers), then the few shown
    g = _layers.Groups(matched["layer"], matched["step"])
    log = matched["log"]
    spread = g.median(np.abs(log))
    _, worst = g.first_max(np.abs(log))
    steps, typical = g.distinct_steps(None), g.median(log)
    # (fmax: NaN only where every one is)
    max_b, max_a = np.fmax.reduceat(matched["max_b"], g.starts), \
        np.fmax.reduceat(matched["max_a"], g.starts)
    diffs = []
    for i in np.argsort(-spread, kind="stable")[:TOP_LAYERS].tolist():
        layer, w = lb[int(g.ids[i])], int(worst[i])
        diffs.append(LayerDiff(layer.name, layer.label, int(steps[i]), float(2 ** typical[i]),
                               float(spread[i]), float(2 ** log[w]), int(matched["step"][w]),
                               float(max_b[i]), float(max_a[i])))
    return diffs, nsteps


_MATCHED = np.dtype([("layer", "<i8"), ("step", "<i8"), ("log", "<f8"), ("max_b", "<f8"),
                     ("max_a", "<f8")])


def common_steps(b: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.intersect1d(b, a, return_indices=True)`` (the values in both, sorted, and where each
    first is in ``b`` and in ``a``), found by bisection when both are in order, as /steps is:
    without the sorts and hashing of 10^7 steps that ``intersect1d`` does."""
    common, ib, ia = _common(b, a)
    return common, _positions(ib, len(b)), _positions(ia, len(a))


def _positions(where: Any, n: int) -> np.ndarray:
    return np.arange(n)[where] if isinstance(where, slice) else where


def _common(b: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, Any, Any]:
    """``common_steps``, where each first is as a slice when both count up by one (a run's
    steps 0, 1, 2...): no index arrays of 10^7 steps."""
    if _consecutive(b) and _consecutive(a):
        lo, hi = max(b[0], a[0]), min(b[-1], a[-1]) + 1
        hi = max(lo, hi)
        return b[lo - b[0]:hi - b[0]], slice(lo - b[0], hi - b[0]), slice(lo - a[0], hi - a[0])
    if not (_ordered(b) and _ordered(a)):
        return np.intersect1d(b, a, return_indices=True)
    ub, fb = _firsts(b)
    ua, fa = _firsts(a)
    pos = np.minimum(np.searchsorted(ua, ub), max(len(ua) - 1, 0))
    both = ua[pos] == ub if len(ua) else np.zeros(len(ub), bool)
    return ub[both], fb[both], fa[pos[both]]


def _consecutive(x: np.ndarray) -> bool:
    """Values each one more than the one before."""
    return bool(len(x)) and int(x[-1]) - int(x[0]) == len(x) - 1 and \
        bool(np.all(x[1:] > x[:-1]))


def _ordered(x: np.ndarray) -> bool:
    return bool(np.all(x[1:] >= x[:-1]))


def _firsts(ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a sorted array and where each first is."""
    if bool(np.all(ordered[1:] > ordered[:-1])):  # no repeats: every position a first
        return ordered, np.arange(len(ordered))
    first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1]))
                           if len(ordered) else np.zeros(0, bool))
    return ordered[first], first


def _distinct(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)``, without its sort and hashing when ``x`` is in order."""
    return _firsts(x)[0] if _ordered(x) else np.unique(x)


def _matched_rows(b: Any, a: Any, common: np.ndarray, sampled: Optional[tuple] = None
                  ) -> tuple[Optional[np.ndarray], list, int]:
    """Rows of the same tensor on the same step in both runs: layer (index into the baseline's
    layers), step, log2 of the rms ratio (amp over base, gradients unscaled), abs maxima."""
    rb, lb = _layers.sampled(b, COMPARED_KINDS, ("rms", "absmax"))
    ra, la = _layers.sampled(a, COMPARED_KINDS, ("rms", "absmax")) if sampled is None else \
        _compared(*sampled)
    steps = _within(np.intersect1d(_distinct(rb["step"]), _distinct(ra["step"]),
                                   assume_unique=True), common)
    if not len(steps):
        return None, lb, 0
    rb, ra = _at_steps(rb, steps), _at_steps(ra, steps)
    names: dict[tuple[int, str], int] = {}
    ib, ia = _matches(_keys(rb, lb, steps, names), _keys(ra, la, steps, names))
    rms_b = _layers.unscale(b, rb, lb, "rms")[ib]
    rms_a = _layers.unscale(a, ra, la, "rms")[ia]
    ok = np.isfinite(rms_b) & np.isfinite(rms_a) & (rms_b > 0) & (rms_a > 0)
    out = np.zeros(int(ok.sum()), _MATCHED)
    out["layer"], out["step"] = rb["layer"][ib][ok], rb["step"][ib][ok]
    out["log"] = np.log2(rms_a[ok] / rms_b[ok])
    out["max_b"] = _layers.unscale(b, rb, lb, "absmax")[ib][ok]
    out["max_a"] = _layers.unscale(a, ra, la, "absmax")[ia][ok]
    return out, lb, int(len(steps))


def _within(x: np.ndarray, common: np.ndarray) -> np.ndarray:
    """The values of ``x`` (sorted, distinct) that ``common`` (sorted, distinct) holds: a
    bisection per sampled step, not ``intersect1d``'s sort of a month's 10^7 steps."""
    if not len(x) or not len(common):
        return x[:0]
    pos = np.minimum(np.searchsorted(common, x), len(common) - 1)
    return x[common[pos] == x]


def _compared(rows: np.ndarray, found: list) -> tuple[np.ndarray, list]:
    """Of ``layers.sampled`` rows of more kinds and columns, what ``_matched_rows`` reads of
    the ``COMPARED_KINDS`` (the layers as they are: only their names and kinds are read)."""
    kind_of = np.array([int(x.kind) for x in found] or [0], np.int64)
    mine = np.isin(kind_of[rows["layer"]], [int(k) for k in COMPARED_KINDS])
    names = ("step", "tensor", "call", "index", "layer", "rms", "absmax")
    out = np.empty(int(mine.sum()), [(n, rows.dtype[n]) for n in names])
    for n in names:
        out[n] = rows[n][mine]
    return out, found


def _matches(kb: np.ndarray, ka: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each key found in both first is in ``kb`` and in ``ka``, in key order:
    ``np.intersect1d(kb, ka, return_indices=True)[1:]``. Two runs of one script sampled
    alike hold the same keys in the same order: then one sort of one of them, not the two
    sorts and the merge of 2 x 1.6 million keys of a month-long run."""
    if len(kb) != len(ka) or not np.array_equal(kb, ka):
        return np.intersect1d(kb, ka, return_indices=True)[1:]
    order = np.argsort(kb, kind="stable")
    ordered = kb[order]
    first = order[np.r_[True, ordered[1:] != ordered[:-1]]] if len(order) else order
    return first, first


def _at_steps(rows: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The rows at ``steps``: ``rows`` themselves where every one is (no copy of 10^5
    modules' rows)."""
    mine = np.isin(rows["step"], steps)
    return rows if bool(mine.all()) else rows[mine]


def _keys(rows: np.ndarray, found: list, steps: np.ndarray, names: dict) -> np.ndarray:
    """One int64 per (layer, output index, call, step), the same in both runs: layers by
    name through ``names``, steps by their position in ``steps``."""
    # (by kind code and name, not by Layer: its hash goes through the Kind enum's, in Python)
    gid = np.array([names.setdefault((int(x.kind), x.name), len(names)) for x in found] or [0],
                   np.int64)
    pos = np.searchsorted(steps, rows["step"]).astype(np.int64)
    index = np.clip(rows["index"], 0, 255).astype(np.int64)
    call = np.clip(rows["call"], 0, 255).astype(np.int64)
    return (((gid[rows["layer"]] << 8 | index) << 8 | call) << 27) | pos


def _range_summary(r: Readiness) -> dict:
    def entry(x: Any) -> dict:
        return {"name": x.name, "kind": x.kind, "absmax": x.absmax, "step": x.absmax_step,
                "sub": x.sub, "flush": x.flush, "sub_step": x.sub_step,
                "first_nonfinite": x.first_nonfinite, "scale": x.scale}

    return {"status": r.status, "advice": r.advice,
            "overflowing": [entry(x) for x in r.overflowing[:TOP_LAYERS]],
            "near": [entry(x) for x in r.near[:TOP_LAYERS]],
            "underflowing": [entry(x) for x in r.underflowing[:TOP_LAYERS]],
            "nonfinite": [entry(x) for x in r.nonfinite[:TOP_LAYERS]]}


# ---------------------------------------------------------------------------------------------
# Throughput and memory


def median_step_time(run: Any) -> Optional[float]:
    """Median seconds per step, leaving out the first (warm-up) and the sampled steps (they
    carry the statistics' cost) when enough others remain."""
    s = run.steps
    if len(s) < 2:
        return None
    dt = s["dt"][1:]
    plain_steps = dt[s["sampled"][1:] == 0]
    pick = plain_steps if len(plain_steps) >= 3 else dt
    pick = pick[np.isfinite(pick) & (pick > 0)]
    return median(pick) if len(pick) else None


def peak_memory(run: Any) -> tuple[Optional[int], str]:
    """Largest recorded peak memory in bytes, and what it measures on this run's device."""
    s = run.steps
    dev = (run.device or {}).get("type")
    what = "CUDA allocator peak" if dev == "cuda" else "process peak RSS"
    if not len(s) or int(s["peak_mem"].max()) <= 0:
        return None, what
    return int(s["peak_mem"].max()), what


def _speed(b: Any, a: Any) -> tuple[dict, Optional[float]]:
    tb, ta = median_step_time(b), median_step_time(a)
    speedup = tb / ta if tb and ta else None
    return {"base": tb, "amp": ta}, speedup


def _memory(b: Any, a: Any) -> tuple[dict, Optional[float]]:
    (mb, what_b), (ma, what_a) = peak_memory(b), peak_memory(a)
    what = what_b if what_b == what_a else f"{what_b} vs {what_a}"
    return {"base": mb, "amp": ma, "measure": what}, (ma / mb if mb and ma else None)


def _notes(b: Any, a: Any, c: Comparison) -> list[str]:
    notes = _model_note(c)
    if c.base["applied"] or c.amp["applied"]:
        notes.append(_treated_parity_note(c))
    if c.base["dtype"] == c.amp["dtype"]:
        notes.append(f"Both runs ran in {c.base['dtype']}: this compares two runs of one "
                     "precision (run to run noise, or a change other than the dtype).")
    elif c.base["dtype"] != "float32" and c.amp["dtype"] == "float32":
        notes.append("The baseline ran under autocast and the other run in fp32: were the "
                     "two files given in the wrong order (compare BASE AMP)?")
    if c.common_steps < max(c.base["steps"], c.amp["steps"]):
        notes.append(f"Compared on the {c.common_steps} steps both runs recorded (baseline "
                     f"{c.base['steps']}, mixed precision {c.amp['steps']}).")
    if not c.layer_steps:
        notes.append("No per-layer comparison: the runs have no sampled step in common "
                     "(record both with the same --every).")
    if _device_note(c):
        notes += _device_note(c)
    elif c.memory.get("measure") == "process peak RSS":
        notes.append("On CPU the peak memory is the process's peak RSS (interpreter and "
                     "libraries included), so its ratio understates the tensors' saving.")
    return notes


def _model_note(c: Comparison) -> list[str]:
    if c.base["params"] and c.amp["params"] and c.base["params"] != c.amp["params"]:
        return [f"The runs train different models ({c.base['params']} vs {c.amp['params']} "
                "trainable parameters): the comparison may mean little."]
    return []


def _device_note(c: Comparison) -> list[str]:
    if c.base["device"] != c.amp["device"] or c.base["device_name"] != c.amp["device_name"]:
        return [f"The runs ran on different devices ({c.base['device_name']} vs "
                f"{c.amp['device_name']}): the step time and memory compare them too."]
    return []


def _treated_parity_note(c: Comparison) -> str:
    """A parity comparison where a run was treated: both alike, or a treated run against a
    baseline of a higher precision (fix_outcome.question)."""
    if c.base["applied"] == c.amp["applied"]:
        return (f"Both runs were treated with {fix_outcome.applies(c.amp['applied'])} "
                "(ampdoctor record --apply): the comparison is of the treated training.")
    parts = [f"the {which} run with {fix_outcome.applies(args)}" for which, args in
             (("first", c.base["applied"]), ("second", c.amp["applied"])) if args]
    return (f"Treated with ampdoctor record --apply: {' and '.join(parts)}; the "
            f"{c.base['dtype']} run is the baseline for parity.")
