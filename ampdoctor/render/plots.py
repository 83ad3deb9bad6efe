"""matplotlib figures of a run: loss, loss scale, grad norm, LR, per-layer range, fp32 parity.

matplotlib's only owner. Only the commands that draw (``ampdoctor report``) import this
module, so ``import ampdoctor`` and ``diagnose`` never load matplotlib. Figures are built on
``matplotlib.figure.Figure`` with the Agg canvas, never through ``pyplot``: no global figure
registry to leak into a notebook, no GUI backend chosen, and they render on a headless machine.

Every function takes data objects (a ``store.Run``, a ``Diagnosis``, a ``Readiness``, a
``Comparison``) and returns a ``Figure``, or None when the run holds nothing to draw (no
GradScaler: no scale curve; no sampled step: no per-layer figures).

Example::

    from ampdoctor.render import plots
    with ampdoctor.load("run.h5") as run:
        figs = plots.figures(run, ampdoctor.diagnose(run))
        open("scale.png", "wb").write(plots.png(figs["scale"]))
"""

from __future__ import annotations

import heapq
import io
import os
import warnings
from typing import Any, Optional

import numpy as np

from .. import safe
from ..diagnosis import layers as _layers
from ..diagnosis import objectives
from ..numfmt import fmt
from ..release.curves import Thinned, extremes
from ..runfile.run import one_line
from ..runfile.schema import FP16_MAX, FP16_NEAR, FP16_SUBNORMAL_MIN, FP16_TINY, Event, flag

MAX_POINTS = 4000  # per line; longer series keep each bin's min and max (spikes survive)
LR_BLOCK = 1 << 20  # /groups rows read at a time for the LR figure
WIDTH, HEIGHT = 8.0, 3.0  # inches; at 100 dpi an 800x300 image
TOP_LAYERS = 8
TOP_GRAD_LAYERS = 15

CAPTIONS = {
    "loss": "Loss per step (the mean of every loss backwarded, and each loss by the line that "
            "backwarded it where there are several); skipped steps and non-finite losses "
            "marked.",
    "scale": "GradScaler's loss scale (log2) before each update; skipped steps marked.",
    "grad_norm": "Global gradient norm (unscaled, before clipping), and each optimizer's own "
                 "where there are several; the largest marked.",
    "lr": "Learning rate per parameter group.",
    "activations": "Largest |value| per layer on the sampled steps, against fp16's limits; a "
                   "dashed line extends a layer the early warning names to its limit.",
    "grad_underflow": "Share of each layer's non-zero gradient values below fp16's normal "
                      "range, at the worst sampled step.",
    "fp8_headroom": "fp8 early warning, per Linear ever at risk: its headroom under a delayed "
                    "scale (binades from its operands' amax to the fp8 top; below 0 the cast "
                    "clamps) and its input's kurtosis (3: Gaussian), on the sampled steps; "
                    "a dot marks where it was at risk.",
    "parity": "Loss of both runs compared: for fp32 parity, the baseline's and the "
              "mixed-precision run's, with their relative difference; for a run and its fix, "
              "each run's non-finite steps marked.",
}

_BAD = "#d62728"
_SKIP = "#ff7f0e"
_MAIN = "#1f77b4"
_BASE = "#7f7f7f"
# each loss or optimizer of a run that has several (none of the colours above)
_PARTS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def figures(run: Any, diagnosis: Any = None, readiness: Any = None,
            comparison: Any = None) -> dict[str, Any]:
    """Every figure the run supports, in reading order: name -> ``Figure``."""
    made = {
        "loss": loss_figure(run, diagnosis),
        "scale": scale_figure(run),
        "grad_norm": grad_norm_figure(run),
        "lr": lr_figure(run),
        "activations": activation_range_figure(
            run, forecast=getattr(diagnosis, "forecast", None), readiness=readiness),
        "grad_underflow": grad_underflow_figure(run, readiness),
        "fp8_headroom": fp8_headroom_figure(run),
        "parity": parity_figure(comparison) if comparison is not None else None,
    }
    return {name: fig for name, fig in made.items() if fig is not None}


def png(fig: Any, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (Agg canvas: no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig)  # attaches itself to the figure
    _shown_as_text(fig)
    with warnings.catch_warnings():
        # a glyph the font lacks is drawn as a box; matplotlib's warning would repeat the name
        warnings.filterwarnings("ignore", message="Glyph .* missing from")
        # "Software: ampdoctor", not matplotlib's default (its web site: a report has no
        # links): how report --force knows a PNG it may replace (render/files.py's is_figure).
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": "ampdoctor"})
    return buf.getvalue()


def _shown_as_text(fig: Any) -> None:
    """Every text of the figure (labels, legends, ticks: names from the run file among them)
    with its controls written out and read as plain text: a name's ``$`` starts no mathtext
    (whose parser raises on what it cannot read)."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_text(safe.terminal(text.get_text()))
        text.set_parse_math(False)


# ---------------------------------------------------------------------------------------------
# Sentinel-tier curves


def loss_figure(run: Any, diagnosis: Any = None) -> Optional[Any]:
    s = run.steps
    if not len(s):
        return None
    fig, ax = _axes("loss")
    steps, loss = s["step"], s["loss"]  # as stored: what is drawn is widened (``_line``)
    ok = np.isfinite(loss)
    several = _losses(run)
    _line(ax, steps, loss, color=_MAIN, label="mean of the losses" if several else "loss")
    for k, (label, x, y) in enumerate(several):
        _line(ax, x, y, lw=0.8, color=_PARTS[k % len(_PARTS)], label=label)
    skipped = (s["skipped"] == 1) & ok
    if skipped.any():
        ax.plot(*_wide(thin(steps[skipped], loss[skipped])), "o", ms=3, color=_SKIP,
                label=f"skipped step ({int(skipped.sum())})")
    _rug(ax, steps[(s["flags"] & flag(Event.NONFINITE_LOSS)) != 0], "non-finite loss")
    _first_bad(ax, diagnosis)
    _log_if_wide(ax, loss, *[y for _, _, y in several])
    ax.set_xlabel("step")
    _legend(ax)
    return fig


def _losses(run: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(label, steps, values) of each loss of a run that backwarded several (/losses)."""
    return [(f"loss at {one_line(o.site)}", o.steps, o.loss) for o in objectives.read(run)]


def _optimizer_norms(run: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(label, steps, grad norms) of each optimizer of a run that had several."""
    rows = getattr(run, "optimizer_steps", None)
    if rows is None or not len(rows):
        return []
    opts = run.optimizers
    out = []
    for index in np.unique(rows["optimizer"]):
        mine = rows[rows["optimizer"] == index]
        norm = mine["grad_norm"].astype(np.float64)
        keep = np.isfinite(norm)
        if keep.any():
            name = opts[int(index)].name or "?" if int(index) < len(opts) else "?"
            out.append((f"{one_line(str(name))} #{int(index)}", mine["step"][keep], norm[keep]))
    return out


def scale_figure(run: Any) -> Optional[Any]:
    s = run.steps
    scale = s["scale"] if len(s) else np.zeros(0)  # as stored: what is drawn is widened
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(scale) & (scale > 0)
    if not ok.any():
        return None
    fig, ax = _axes("loss scale")
    steps = s["step"]
    ax.plot(*_wide(thin(steps[ok], scale[ok])), drawstyle="steps-post", color=_MAIN,
            label="scale")
    skipped = (s["skipped"] == 1) & ok
    if skipped.any():
        ax.plot(*_wide(thin(steps[skipped], scale[skipped])), "x", ms=4, color=_BAD,
                label=f"skipped step ({int(skipped.sum())})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    _legend(ax)
    return fig


def grad_norm_figure(run: Any) -> Optional[Any]:
    s = run.steps
    norm = s["grad_norm"] if len(s) else np.zeros(0)  # as stored: what is drawn is widened
    ok = np.isfinite(norm)
    if not ok.any():
        return None
    fig, ax = _axes("gradient norm")
    steps = s["step"]
    clip = s["clip_norm"]
    shown = np.isfinite(clip)
    # clip_grad_norm_ returns the norm it saw: the grad norm, unless it ran on scaled
    # gradients (before unscale_), which is worth a line of its own.
    both = shown & ok
    same = not shown.any() or np.allclose(clip[both].astype(np.float64),
                                          norm[both].astype(np.float64), rtol=1e-3)
    del both
    _line(ax, steps, norm, color=_MAIN, label="grad norm" + (
        " (= what clip_grad_norm_ saw)" if shown.any() and same else ""))
    if not same:
        _line(ax, steps[shown], clip[shown], color=_SKIP, lw=0.8,
              label="norm clip_grad_norm_ saw")
    for k, (label, x, y) in enumerate(_optimizer_norms(run)):
        _line(ax, x, y, lw=0.8, color=_PARTS[k % len(_PARTS)], label=label)
    i = int(np.argmax(np.where(ok, norm, -np.inf)))
    peak = float(norm[i])
    ax.plot([steps[i]], [peak], "v", color=_BAD, label=f"peak {fmt(peak)} (step "
            f"{int(steps[i])})")
    _rug(ax, steps[(s["flags"] & flag(Event.NONFINITE_GRAD)) != 0], "non-finite grad")
    _log_if_wide(ax, norm)
    ax.set_xlabel("step")
    _legend(ax)
    return fig


def lr_figure(run: Any) -> Optional[Any]:
    by_group = _finite_lrs(run.groups)
    series = []
    if len(by_group) > 1:
        series = [(f"group {group}", x, y) for group, (x, y) in by_group.items()]
    elif len(run.steps):
        lr = run.steps["lr"]  # as stored: ``_line`` widens only the points it draws
        ok = np.isfinite(lr)
        series.append(("lr", run.steps["step"][ok], lr[ok]))
    series = [item for item in series if len(item[1])]
    if not series:
        return None
    fig, ax = _axes("learning rate")
    for name, x, y in series:
        _line(ax, x, y, label=name)
    ax.set_xlabel("step")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    _legend(ax)
    return fig


def _finite_lrs(groups: Any) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each param group's (steps, LRs) where its LR is finite, by group (every group seen,
    finite or not), /groups read a block at a time and each group's curve thinned as it is
    read (``curves.Thinned``, at four times the points a line draws: ``_line`` thins it
    again): a month-long run's /groups is 20 M rows, 240 MB held whole."""
    if not len(groups):
        return {}
    blocks = groups.chunks(LR_BLOCK, names=("step", "group", "lr")) \
        if hasattr(groups, "chunks") else [groups]
    parts: dict[int, Thinned] = {}
    for part in blocks:
        ok = np.isfinite(part["lr"])
        for group in _distinct_small(part["group"]):
            mine = ok & (part["group"] == group)
            parts.setdefault(int(group), Thinned(len(groups), 4 * MAX_POINTS)).add(
                part["step"][mine], part["lr"][mine])
    return {group: got.result() for group, got in sorted(parts.items())}


def _distinct_small(values: np.ndarray) -> np.ndarray:
    """``np.unique`` of integers, counted rather than sorted where they span little (param
    groups: a few numbers in each million /groups rows)."""
    if not len(values):
        return values
    lo, hi = int(values.min()), int(values.max())
    if hi - lo > 1 << 16:
        return np.unique(values)
    return (lo + np.flatnonzero(np.bincount(values.astype(np.int64) - lo))).astype(values.dtype)


# ---------------------------------------------------------------------------------------------
# Sampled tier: per-layer range


def activation_range_figure(run: Any, top: int = TOP_LAYERS, forecast: Any = None,
                            readiness: Any = None) -> Optional[Any]:
    """Abs max per step of the layers that come closest to fp16's max, with its limits; the
    fitted growth of a layer ``forecast`` (a ``forecast.Forecast``) expects to overflow,
    extended to its limit. ``readiness``: the run's, whose ``peaks`` are those layers."""
    from ..release.readiness import PEAKS

    if readiness is not None and top <= PEAKS:
        chosen = readiness.peaks[:top]
        if not chosen and all(x.is_grad for x in readiness.layers):  # no value sampled
            return None
    else:
        chosen = _peaks(run, top)
        if chosen is None:
            return None
    fig, ax = _axes("largest |value| per layer (sampled steps)")
    for layer, steps, absmax in chosen:
        steps, values = _per_step_max(steps, absmax)
        finite = np.isfinite(values)
        # thinned (each bin's extremes) like every line: markers past a few per pixel only
        # cost time (10^5 sampled steps: half a second of PNG)
        lines = ax.plot(*thin(steps[finite], values[finite], MAX_POINTS), ".-", ms=3, lw=1,
                        label=f"{layer.name} ({layer.label})")
        if (~finite).any():
            ax.plot(steps[~finite], np.full(int((~finite).sum()), FP16_MAX * 4), "x",
                    color=lines[0].get_color())
    ax.axhline(FP16_MAX, color=_BAD, lw=1, label="fp16 max 65504")
    ax.axhline(FP16_NEAR, color=_SKIP, lw=1, ls="--", label="2**15")
    _forecast_line(ax, forecast)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    _legend(ax, outside=True)
    return fig


def _peaks(run: Any, top: int) -> Optional[list]:
    """``Readiness.peaks``, read from the run (None: no sampled rows)."""
    rows, found = _layers.sampled(run, _layers.VALUE_KINDS, ("absmax",))
    if not len(rows):
        return None
    absmax = rows["absmax"].astype(np.float64)
    peak = np.full(len(found), -1.0)
    np.maximum.at(peak, rows["layer"], np.where(np.isnan(absmax), -1.0, absmax))
    chosen = [int(i) for i in np.argsort(-peak, kind="stable")[:top] if peak[i] >= 0]
    return [(found[i], rows["step"][rows["layer"] == i], absmax[rows["layer"] == i])
            for i in chosen]


def _forecast_line(ax: Any, fc: Any) -> None:
    """The named layer's fitted line, from its window to the limit, and the crossing's range."""
    if fc is None or fc.status != "overflow_expected" or not fc.layers:
        return
    x = fc.layers[0]  # the named layer comes first
    per_step = x.doublings_per_100_steps / 100
    steps = np.linspace(x.window[0], max(fc.step, x.last), 50)
    ax.plot(steps, 2.0 ** (x.level_log2 + per_step * (steps - x.last)), "--", color=_BAD,
            lw=1.2, label=f"forecast: {x.name} passes {fmt(x.limit)} ~ step {fc.step}")
    hi = fc.range[1] if fc.range[1] is not None else fc.step
    ax.axvspan(fc.range[0], hi, color=_BAD, alpha=0.08)
    if x.limit != FP16_MAX:
        ax.axhline(x.limit, color=_BAD, lw=1, ls=":", label=f"{x.dtype} max {fmt(x.limit)}")


def grad_underflow_figure(run: Any, readiness: Any = None,
                          top: int = TOP_GRAD_LAYERS) -> Optional[Any]:
    """Per gradient layer: the share that flushes to zero in fp16 and the share that is
    subnormal (precision lost), at the worst sampled step."""
    from ..release.readiness import fp16_readiness

    r = readiness if readiness is not None else fp16_readiness(run)
    grads = [x for x in r.layers if x.is_grad]
    if not grads:
        return None
    # (sorted(...)[:top], without sorting 10^5 modules' 200 000 gradient layers)
    grads = heapq.nsmallest(top, grads, key=lambda x: (-x.flush, -x.sub, x.name))
    space = "at the run's loss scale" if r.scaled else "unscaled (no GradScaler)"
    fig, ax = _axes(f"gradients below fp16's normal range, {space}",
                    height=max(HEIGHT, 0.8 + 0.28 * len(grads)))
    y = np.arange(len(grads))[::-1]
    ax.barh(y + 0.2, [100 * x.sub for x in grads], height=0.4, color=_SKIP,
            label=f"subnormal (< 2**-14 = {FP16_TINY:.2g})")
    ax.barh(y - 0.2, [100 * x.flush for x in grads], height=0.4, color=_BAD,
            label=f"flushes to zero (< 2**-24 = {FP16_SUBNORMAL_MIN:.2g})")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{x.name} ({x.kind})" for x in grads], fontsize=7)
    ax.set_xlabel("% of non-zero values")
    ax.set_xlim(0, max(1.0, max(100 * x.sub for x in grads) * 1.1))
    if not any(x.sub for x in grads):
        ax.text(0.5, 0.5, "no gradient value below 2**-14 on any sampled step",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    _legend(ax)
    return fig


def fp8_headroom_figure(run: Any, watch: Any = None) -> Optional[Any]:
    """The Linears ever at risk in fp8 (``diagnosis.fp8watch``, the most at risk first): their
    headroom and their input's kurtosis per sampled step, the thresholds drawn; None when no
    layer ever was."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from ..diagnosis import fp8watch

    w = watch if watch is not None else fp8watch.read(run)
    shown = sorted((x for x in w.layers.values() if x.first_warned is not None),
                   key=lambda x: (x.first_warned, x.severity()))[:fp8watch.SHOWN]
    if not shown:
        return None
    fig = Figure(figsize=(WIDTH, 2 * HEIGHT), layout="constrained")
    room, kurt = fig.subplots(2, 1, sharex=True)
    room.set_title("fp8 headroom of the Linears at risk (sampled steps)", fontsize=10, loc="left")
    for ax in (room, kurt):
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
    for x in shown:
        lines = room.plot(x.steps, x.headroom, ".-", ms=3, lw=1,
                          label=f"{x.name} (from step {x.first_warned})")
        risky = np.array([bool(r) for r in x.risk])
        room.plot(x.steps[risky], x.headroom[risky], "o", ms=5, color=lines[0].get_color())
        kurt.plot(x.steps, x.kurtosis, ".-", ms=3, lw=1, color=lines[0].get_color())
    room.axhline(0, color=_BASE, lw=1, label="0: a delayed cast clamps below")
    room.axhline(fp8watch.HEADROOM_RISK, color=_BAD, lw=1, ls="--",
                 label=f"{fp8watch.HEADROOM_RISK:g}: at risk (twice in a row)")
    room.set_ylabel("binades", fontsize=8)
    kurt.axhline(fp8watch.KURTOSIS_RISK, color=_BAD, lw=1, ls="--",
                 label=f"kurtosis {fp8watch.KURTOSIS_RISK:g}: at risk")
    kurt.axhline(3, color=_BASE, lw=1, ls=":", label="3: Gaussian")
    kurt.set_ylabel("input kurtosis", fontsize=8)
    kurt.set_yscale("log")
    # plain numbers: a log axis' default labels are mathtext, which figures here never parse
    kurt.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    kurt.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    kurt.set_xlabel("step")
    _legend(room, outside=True)
    _legend(kurt, outside=True)
    return fig


# ---------------------------------------------------------------------------------------------
# fp32 parity


def parity_figure(c: Any) -> Optional[Any]:
    curve = c.curve
    if not curve or not len(curve.get("step", ())):
        return None
    if c.kind == "fix":
        return fix_figure(c)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH, HEIGHT * 1.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    steps = curve["step"]
    for name, color, lw in (("base", _BASE, 1.6), ("amp", _MAIN, 1.0)):
        _line(top, steps, curve[name], color=color, lw=lw,
              label=f"{c.base['dtype'] if name == 'base' else c.amp['dtype']} ({name})")
    _rug(top, steps[np.isfinite(curve["base"]) & ~np.isfinite(curve["amp"])],
         "non-finite (amp only)")
    top.set_title(f"fp32 parity: {c.verdict}", fontsize=10, loc="left")
    top.set_ylabel("loss")
    _legend(top)
    w = c.tolerance["window"]
    _line(bottom, steps, np.maximum(curve["rel"], 1e-7), color=_MAIN, lw=1,
          label="relative difference" + (f" (trailing mean of {w} steps)" if w > 1 else ""))
    bottom.axhline(c.tolerance["rtol"], color=_SKIP, ls="--", lw=1,
                   label=f"match tolerance {c.tolerance['rtol']:g}")
    bottom.axhline(c.tolerance["diverge"], color=_BAD, ls="--", lw=1,
                   label=f"divergence {c.tolerance['diverge']:g}")
    if c.divergence_step is not None:
        for ax in (top, bottom):
            ax.axvline(c.divergence_step, color=_BAD, lw=1)
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    _legend(bottom)
    return fig


def fix_figure(c: Any) -> Any:
    """A run and its fix (``Comparison.kind == "fix"``): both losses, each run's non-finite
    steps marked."""
    fig, ax = _axes(f"what the fix changed: {c.verdict}")
    steps = c.curve["step"]
    for name, color, lw in (("base", _BASE, 1.6), ("amp", _MAIN, 1.0)):
        loss = c.curve[name]
        applied = ", ".join(c.treatment[name]["applied"]) or "untreated"
        file = os.path.basename(c.treatment[name]["path"])
        _line(ax, steps, loss, color=color, lw=lw, label=f"{file} ({applied})")
        _rug(ax, steps[~np.isfinite(loss)], f"non-finite loss, {file}")
    ax.set_ylabel("loss")
    ax.set_xlabel("step")
    _legend(ax)
    return fig


# ---------------------------------------------------------------------------------------------
# helpers


def _axes(title: str, height: float = HEIGHT) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH, height), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    return fig, ax


def thin(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS
         ) -> tuple[np.ndarray, np.ndarray]:
    """At most about ``max_points`` points: each bin keeps its smallest and largest value, so a
    one-step spike in a million steps still shows."""
    if len(x) <= max_points:
        return x, y
    idx = extremes(y, max_points)
    return x[idx], y[idx]


def _line(ax: Any, x: np.ndarray, y: np.ndarray, **kw: Any) -> None:
    """A line that breaks where the value is NaN or inf (those steps get a ``_rug``)."""
    x = np.asarray(x)
    if len(x) > MAX_POINTS:  # thinned first: a long curve is never copied whole
        idx = extremes(y, MAX_POINTS, finite_only=True)
        x, y = x[idx], y[idx]
    y = np.asarray(y, np.float64)
    ax.plot(x, np.where(np.isfinite(y), y, np.nan), lw=kw.pop("lw", 1.2), **kw)


def _rug(ax: Any, steps: np.ndarray, label: str) -> None:
    """Ticks along the top edge at steps whose value cannot be drawn (NaN, inf)."""
    if not len(steps):
        return
    shown = thin(steps, np.zeros(len(steps)))[0]  # a tick per bin is as much as shows
    ax.plot(shown, np.full(len(shown), 0.97), "|", ms=10, mew=1.5, color=_BAD,
            transform=ax.get_xaxis_transform(), label=f"{label} ({len(steps)})")


def _first_bad(ax: Any, diagnosis: Any) -> None:
    if diagnosis is None or diagnosis.healthy or not diagnosis.first_bad:
        return
    step = diagnosis.first_bad.get("step")
    if step is not None:
        ax.axvline(step, color=_BAD, ls="--", lw=1,
                   label=f"{diagnosis.verdict}: first bad step {step}")


def _log_if_wide(ax: Any, *curves: np.ndarray) -> None:
    """A log scale where the finite values of ``curves`` are positive and span more than
    100x: their least and largest found in place (a month-long curve is never copied)."""
    lows, highs = [], []
    for y in curves:
        finite = np.isfinite(y)
        if finite.any():
            lows.append(float(np.min(y, where=finite, initial=np.inf)))
            highs.append(float(np.max(y, where=finite, initial=-np.inf)))
    if lows and min(lows) > 0 and max(highs) / min(lows) > 100:
        ax.set_yscale("log")


def _wide(xy: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Points to draw, their values widened to float64 (as matplotlib draws them)."""
    return xy[0], np.asarray(xy[1], np.float64)


def _per_step_max(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Largest value per step (a module called twice, or with several outputs); inf/NaN
    win, so an overflow is never hidden by a finite sibling."""
    uniq, inv = np.unique(steps, return_inverse=True)
    key = np.where(np.isnan(values), np.inf, values)
    out = np.full(len(uniq), -np.inf)
    np.maximum.at(out, inv, key)
    return uniq, out


def _legend(ax: Any, outside: bool = False) -> None:
    if not ax.get_legend_handles_labels()[0]:
        return
    if outside:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend(fontsize=7, loc="best", framealpha=0.8)
