"""One frame of the live view: what a run being written looks like now, as plain data.

numpy only. ``build`` takes the followed files' states (``follow.RankState``) and answers
from the same functions the reports use, so that the live view and ``ampdoctor report`` never
disagree: skipped steps, GradScaler's calibration and its probing allowance, peak grad norm and
lowest scale from ``release.summarize`` (which reads ``diagnosis.scale.scale_story``); the layers'
range against fp16's limits from ``readiness.fp16_readiness``, on the latest sampled step;
which rank went non-finite first from ``ranks.outline`` and ``ranks.first_rank``; the Linears
at risk in fp8 from ``diagnosis.fp8watch``, as ``report`` draws them.
``top`` draws a frame; ``frame.to_dict()`` is the same data for a script.

Example::

    with follow.Follower("run.h5") as f:
        f.poll()
        fr = frame.build(f.states)
    fr.step, fr.status, fr.steps_per_s, fr.summary.skip_rate, fr.layers[0].headroom
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..diagnosis import fp8watch, objectives, ranks
from ..release.readiness import fp16_readiness, plain, precision
from ..release.report import Summary, summarize
from ..runfile import paths
from ..runfile.payloads import SnapshotDetail
from ..runfile.run import one_line
from ..runfile.schema import FP16_MAX, Event

# Layers shown: the nearest to fp16's max, then the gradients most underflowing.
NEAREST_MAX = 3
MOST_UNDERFLOW = 2
# A gradient layer with fewer of its non-zero values subnormal or flushed than this is not
# worth a line of its own.
UNDERFLOW_SHOWN = 0.01
# Steps per second is measured over this many recent steps.
RATE_STEPS = 100


@dataclass(eq=False)
class LayerLine:
    """One layer's values on the latest sampled step, against fp16's limits."""

    name: str
    kind: str  # 'activation', 'activation grad', 'weight grad', 'input'
    absmax: float  # as recorded: gradients in the (scaled) space fp16 held
    headroom: float  # powers of two between absmax and 65504; <= 0: overflows; nan: non-finite
    underflow: float  # share of its non-zero values subnormal or flushed in fp16 (gradients)
    scaled: bool = False  # a gradient recorded under a GradScaler
    trend: Optional[float] = None  # doublings per 100 steps over the forecast's window


@dataclass
class Fp8Line:
    """A Linear at risk in fp8 on the latest sampled step (``diagnosis.fp8watch``)."""

    name: str
    headroom: Optional[float]  # binades below the top under a delayed scale; < 0: clamps
    growth: Optional[float]  # doublings per 100 steps of its fastest-growing operand's amax
    kurtosis: Optional[float]  # its input's
    why: str  # the thresholds crossed, in words
    since: Optional[int]  # the first sampled step it was at risk (of those the view keeps)


@dataclass
class EventLine:
    """The latest forensic replay: which step, what triggered it, the culprit, fp32's answer."""

    step: int
    trigger: str  # 'skipped step', 'non-finite loss', ...
    module: Optional[str]
    module_type: Optional[str]
    phase: str  # 'forward', 'backward', 'input', 'loss', 'optimizer', 'none'
    fp32: Optional[bool]  # the culprit alone in fp32 was finite (None: not run)
    fp32_absmax: float
    how: str  # what the replay saw ('matmul produced +inf, -inf ...'), may be ''
    replays: int  # forensic replays in the run so far

    @property
    def text(self) -> str:
        """``step 17 (skipped step): blocks.0.attn (Attention), forward; fp32: finite``."""
        head = f"step {self.step} ({self.trigger}): "
        if self.phase == "none":
            return head + "the replay was finite (the event did not reproduce)"
        where = self.where
        fp32 = {True: "finite in fp32 (an fp32 island fixes it)",
                False: "non-finite in fp32 too (the values are too large)",
                None: ""}[self.fp32]
        return head + where + (f": {self.how}" if self.how else "") + \
            (f"; {fp32}" if fp32 else "")


    @property
    def where(self) -> str:
        """The culprit in words: ``blocks.0.attn (Attention) in forward``."""
        name = f"{self.module} ({self.module_type})" if self.module and self.module_type \
            else self.module
        if self.phase in ("forward", "backward") and name:
            return f"{name} in {self.phase}"
        if self.phase == "input":
            return f"the batch given to {name}" if name else "the input batch"
        if self.phase in ("loss", "optimizer"):
            return "the loss" if self.phase == "loss" else "the optimizer step"
        return name or "no culprit found"


@dataclass
class RankLine:
    rank: int
    step: Optional[int]
    status: str
    skipped: int
    first_bad: Optional[int]


@dataclass
class Frame:
    """What the live view shows (see the module docstring)."""

    path: str  # the run, as the user named it
    status: str  # 'running', 'finished', 'exception:<Type>', 'signal:<NAME>', 'gone'
    final: bool  # nothing more will be written
    reason: Optional[str] = None  # why the writer is taken as gone, or a read failure
    rank: int = 0
    world_size: int = 1
    ranks: list = field(default_factory=list)  # RankLine per rank file (more than one)
    summarized: Optional[float] = None  # other ranks from their summaries, the oldest read then
    steps: int = 0
    step: Optional[int] = None  # the last recorded step
    last_time: Optional[float] = None  # unix time of that step's boundary
    steps_per_s: Optional[float] = None
    precision: str = ""  # 'float16 autocast + GradScaler'
    loss: float = math.nan
    scale: float = math.nan  # after the last update
    grad_norm: float = math.nan
    lr: list = field(default_factory=list)  # per param group
    summary: Summary = field(default_factory=lambda: Summary(steps=0))
    layers: list = field(default_factory=list)  # LayerLine, nearest to fp16's limits first
    layer_step: Optional[int] = None  # the sampled step they come from
    nonfinite_layers: int = 0  # layers holding NaN/inf on that step (the first is shown)
    forecast: Optional[str] = None  # the early warning when it warns (forecast.Forecast.text)
    fp8: list = field(default_factory=list)  # Fp8Line per Linear at risk, most at risk first
    fp8_at_risk: int = 0  # how many are (``fp8`` shows fp8watch.SHOWN at most)
    every: Optional[int] = None  # the sampling interval (0: never)
    event: Optional[EventLine] = None
    series: dict = field(default_factory=dict, repr=False)  # 'step', 'loss', 'scale' arrays
    built: float = field(default_factory=time.time)

    @property
    def next_sampled(self) -> Optional[int]:
        """The next step whose per-layer statistics will be recorded."""
        if not self.every or self.step is None:
            return None
        return (self.step // self.every + 1) * self.every

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("series")
        out["event"] = dict(out["event"], text=self.event.text) if self.event else None
        return plain(out)


def build(states: Sequence[Any], *, rank: Optional[int] = None,
          path: Optional[str] = None, final: Optional[bool] = None,
          summaries: Optional[Any] = None) -> Frame:
    """The frame of a run from its followed files' states (``follow.Follower.states``).

    ``rank``: the rank to show; by default the one that went non-finite first, else the
    lowest. ``final``: whether the run as a whole is over (``Follower.final``); by default,
    whether the shown rank is. ``summaries``: the other ranks of a large job, known from
    their summaries (``follow.Summaries``; the followed states are then the shown rank's).
    """
    if not states:
        raise ValueError("build() needs the state of at least one followed file")
    runs = [s.run() for s in states]
    outlines = [ranks.outline(r) for r in runs]
    ranks.read_own_flags(outlines, lambda o, step: ranks.own_flag(
        runs[outlines.index(o)].steps, step))
    shown = _shown(states, outlines, rank)
    state, run = states[shown], runs[shown]
    others = list(summaries.known.values()) if summaries is not None else []
    fr = Frame(path=path or state.path, status=state.status,
               final=state.final if final is None else final,
               reason=state.gone or state.error, rank=state.rank,
               world_size=max([s.world_size for s in states]
                              + [int(o.outline["world_size"]) for o in others]))
    if summaries is not None and others:
        fr.ranks = _summarized_lines(states, outlines, others)
        fr.summarized = summaries.oldest
    elif len(states) > 1:
        fr.ranks = [RankLine(o["rank"], int(s.steps["step"][-1]) if len(s.steps) else None,
                             s.status, o["skipped"], o["first_bad"])
                    for s, o in zip(states, outlines)]
    _steps(fr, run)
    _layers(fr, state, run)
    _fp8(fr, state)
    fr.event = latest_event(run)
    return fr


def _summarized_lines(states: Sequence[Any], outlines: list[dict],
                      others: list[Any]) -> list[RankLine]:
    """A line per rank: the followed ones from their states, the rest from their summaries."""
    followed = {o["rank"] for o in outlines}
    lines = [RankLine(o["rank"], int(s.steps["step"][-1]) if len(s.steps) else None,
                      s.status, o["skipped"], o["first_bad"])
             for s, o in zip(states, outlines)]
    lines += [RankLine(x.rank, x.last_step, _live_status(x.outline["status"]),
                       x.outline["skipped"], x.outline["first_bad"])
              for x in others if x.rank not in followed]
    return sorted(lines, key=lambda x: x.rank)


def _live_status(status: str) -> str:
    """A summary's status in the live view's words (a killed writer is 'gone')."""
    return "gone" if status == "interrupted" else status


def _shown(states: Sequence[Any], outlines: list[dict], rank: Optional[int]) -> int:
    by_rank = {o["rank"]: i for i, o in enumerate(outlines)}
    if rank is not None and rank in by_rank:
        return by_rank[rank]
    origin = ranks.first_rank(outlines)
    return by_rank.get(origin, 0) if origin is not None else 0


def _steps(fr: Frame, run: Any) -> None:
    s = run.steps
    fr.steps = len(s)
    fr.precision = _precision(run)
    fr.lr = [lr for _, lr in sorted(_group_lrs(run).items())]
    recorder = run.recorder_settings
    fr.every = recorder.get("every") if recorder is not None else None
    if not len(s):
        return
    fr.summary = summarize(run)
    fr.step, fr.last_time = int(s["step"][-1]), float(s["time"][-1])
    fr.loss, fr.grad_norm = float(s["loss"][-1]), float(s["grad_norm"][-1])
    after = float(s["scale_after"][-1])
    fr.scale = after if math.isfinite(after) else float(s["scale"][-1])
    fr.steps_per_s = steps_per_second(s["time"])
    fr.series = {"step": s["step"], "loss": s["loss"], "scale": s["scale"],
                 "losses": _each_loss(run)}


def _each_loss(run: Any) -> list[tuple[str, np.ndarray]]:
    """(site, values) of each loss of a run that backwards several (/losses), in step order."""
    return [(one_line(o.site), o.loss) for o in objectives.read(run)]


def _group_lrs(run: Any) -> dict[int, float]:
    groups = run.groups.rows()
    return {int(g): float(lr) for g, lr in zip(groups["group"], groups["lr"])}


def _precision(run: Any) -> str:
    dtype = precision(run)
    autocast = bool((run.autocast or {}).get("enabled"))
    scaler = run.scaler is not None and run.scaler.enabled
    words = dtype + (" autocast" if autocast else "" if dtype == "float32" else " weights")
    return words + (" + GradScaler" if scaler else "")


def steps_per_second(times: np.ndarray) -> Optional[float]:
    """Steps per second over the last ``RATE_STEPS`` step boundaries (unix times)."""
    k = min(len(times) - 1, RATE_STEPS)
    if k < 1:
        return None
    span = float(times[-1]) - float(times[-1 - k])
    return k / span if span > 0 else None


def _layers(fr: Frame, state: Any, run: Any) -> None:
    if state.layer_step is None or not len(run.stats):
        return
    # The rows change only when a sampled step arrives: judge them once per sampled step.
    key = (state.layer_step, len(state.layer_rows))
    cached = getattr(state, "_frame_layers", None)
    if cached is None or cached[0] != key:
        lines, bad = _layer_lines(run)
        cached = state._frame_layers = (key, lines, bad, _trends(
            _with_stats(run, getattr(state, "trend_rows", None)), lines))
    fr.layers, fr.nonfinite_layers, fr.layer_step = cached[1], cached[2], state.layer_step
    fr.forecast = cached[3]


def _fp8(fr: Frame, state: Any) -> None:
    """The Linears at risk in fp8, from the follower's /fp8 rows; judged once per read."""
    rows = getattr(state, "fp8_rows", None)
    if rows is None or not len(rows):
        return
    key = (len(rows), int(rows["step"][-1]), len(state.tensors))
    cached = getattr(state, "_frame_fp8", None)
    if cached is None or cached[0] != key:
        names = {int(t): str(n) for t, n in zip(state.tensors["id"], state.tensors["name"])}
        steps = state.steps
        w = fp8watch.watch(rows, names, steps["step"][steps["skipped"] == 1])
        risky = w.at_risk
        lines = [Fp8Line(x.name, **{k: x.at()[k] for k in ("headroom", "growth", "kurtosis")},
                         why=x.why(), since=x.first_warned) for x in risky[:fp8watch.SHOWN]]
        cached = state._frame_fp8 = (key, lines, len(risky))
    fr.fp8, fr.fp8_at_risk = cached[1], cached[2]


def _layer_lines(run: Any) -> tuple[list[LayerLine], int]:
    r = fp16_readiness(run)
    lines = [LayerLine(x.name, x.kind, x.absmax if x.absmax >= 0 else math.nan,
                       math.nan if x.nonfinite_steps else _headroom(x.absmax),
                       x.sub if x.is_grad else 0.0, x.is_grad and x.scale != 1.0)
             for x in r.layers]
    # The first non-finite layer (a value before a gradient: a NaN in a forward spreads to
    # every gradient behind it; else the first the run met), then the finite ones nearest
    # 65504, then the gradients most underflowing.
    order = {x: i for i, x in enumerate(lines)}
    bad = sorted((x for x in lines if math.isnan(x.headroom)),
                 key=lambda x: (x.kind.endswith("grad"), order[x]))
    finite = sorted((x for x in lines if not math.isnan(x.headroom)),
                    key=lambda x: (x.headroom, order[x]))
    nearest = bad[:1] + finite[:NEAREST_MAX]
    under = sorted((x for x in lines if x.underflow >= UNDERFLOW_SHOWN and x not in nearest),
                   key=lambda x: -x.underflow)[:MOST_UNDERFLOW]
    return nearest + under, len(bad)


def _with_stats(run: Any, rows: Optional[np.ndarray]) -> Any:
    """``run`` whose statistics are ``rows`` (the follower's last sampled steps)."""
    if rows is None:
        return run
    from ..runfile.store import Table

    run = copy.copy(run)
    run.stats = Table(rows)
    return run


def _trends(run: Any, lines: list) -> Optional[str]:
    """Each shown layer's trend (doublings per 100 steps over the forecast's window), and the
    early warning's text when it warns (``forecast``, the same judgement as ``diagnose``)."""
    from ..diagnosis import forecast

    series = forecast.read(run, None, forecast.NEEDED)
    trends = series.trends()
    for x in lines:
        x.trend = trends.get((x.name, x.kind))
    fc = series.at(None)
    return fc.text if fc.warns else None


def _headroom(absmax: float) -> float:
    """Powers of two from ``absmax`` up to fp16's max (65504): 0 or less overflows."""
    if math.isnan(absmax) or absmax < 0:  # (no absolute maximum is below 0: not measured)
        return math.nan
    if absmax == 0:
        return math.inf
    if math.isinf(absmax):  # past any float: overflowed
        return -math.inf
    return math.log2(FP16_MAX / absmax)


TRIGGERS = {Event.SKIPPED: "skipped step", Event.NONFINITE_LOSS: "non-finite loss",
            Event.NONFINITE_GRAD: "non-finite gradient",
            Event.NONFINITE_INPUT: "non-finite batch"}


def latest_event(run: Any) -> Optional[EventLine]:
    """The latest forensic replay of a run, or None."""
    found = events(run)
    return found[-1] if found else None


def events(run: Any) -> list[EventLine]:
    """Every forensic replay of a run (its /snapshots), oldest first."""
    from ..diagnosis.facts import Facts

    snaps = Facts(run).snapshots
    return [_event_line(s, len(snaps)) for s in snaps]


def _event_line(s: dict, replays: int) -> EventLine:
    try:
        trigger = TRIGGERS.get(Event(s["trigger"]), Event(s["trigger"]).name.lower())
    except ValueError:
        trigger = "event"
    fp32 = {1: True, 0: False}.get(s["fp32_finite"])
    how = SnapshotDetail.from_json(s["detail"]).how
    return EventLine(s["step"], trigger, s["module"], s["module_type"], s["phase"], fp32,
                     s["fp32_absmax"], str(how or ""), replays)


def buckets(values: np.ndarray, width: int, how: str = "mean", of: Any = None) -> np.ndarray:
    """``values`` squeezed into at most ``width`` columns for a sparkline: each column the
    mean (or min, max) of its finite values, NaN where a value in it was non-finite. ``of``:
    a function of the values (in float64) taken first. Each column's values are widened to
    float64 on their own: a month-long curve is never copied whole.

    Example::

        buckets(np.arange(10.0), 5)           # array([0.5, 2.5, 4.5, 6.5, 8.5])
    """
    v = np.asarray(values)
    if width <= 0 or not len(v):
        return np.zeros(0)
    reduce = {"mean": np.mean, "min": np.min, "max": np.max}[how]
    out = []
    for p in np.array_split(v, min(width, len(v))):
        p = np.asarray(p, np.float64)
        p = p if of is None else of(p)
        out.append(reduce(p) if np.isfinite(p).all() else math.nan)
    return np.array(out)


def run_name(path: str) -> str:
    """The name a user gave the recording, for a rank file too (``out/run.h5``)."""
    return paths.run_name(os.fspath(path))
