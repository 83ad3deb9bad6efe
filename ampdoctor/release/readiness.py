"""fp16 readiness: which layers' values would overflow, or flush to zero, in fp16.

numpy only. The sampled tier counts, for every tensor whatever its dtype, the values above
65504 (they overflow to inf in fp16), at or above 2**15 (within a factor 2 of that), below
2**-14 (fp16 subnormals: precision lost) and below 2**-24 (they flush to zero). From an fp32
or bf16 run this says, before switching, what fp16 would do to each layer; from an fp16 run,
how close each layer lives to the limits.

Activations are judged as they are. Gradients are recorded in the space the run used: under
GradScaler, multiplied by its scale (what fp16 actually held), else at scale 1. fp16 spans about
40 powers of two (2**-24 to 65504); GradScaler slides that window up by its scale, which it
settles just below where the largest gradient overflows. So a run without a scaler tells
what flushes without one (then fp16 needs a GradScaler) and, from the gradients' smallest and
largest magnitudes, a hint of whether the scale GradScaler would settle on holds them all.

Example::

    with ampdoctor.load("fp32.h5") as run:
        r = readiness.fp16_readiness(run)
    r.status                      # 'overflow'
    r.advice                      # 'fp16 would overflow in 2 layers (blocks.3.attn ...'
    [x.name for x in r.overflowing]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np

from ..diagnosis import layers as _layers
from ..diagnosis.facts import low_precision
from ..diagnosis.layers import GRAD_KINDS, VALUE_KINDS
from ..diagnosis.thresholds import LAYER_UNDERFLOW, RUNAWAY_SCALE
from ..numfmt import fmt
from ..runfile.schema import DTYPE_NAMES, FP16_MAX, FP16_NEAR, FP16_SUBNORMAL_MIN, Kind, columns

_DTYPE_NAMES = {int(code): name for name, code in DTYPE_NAMES.items()}

KINDS = VALUE_KINDS + GRAD_KINDS
# the /stats columns the judgement reads (``fp16_readiness``'s ``sampled``: at least these)
COLUMNS = columns("stats", "dtype", "nonfinite", "sample_n", "zeros", "nan", "posinf",
                  "neginf", "absmax", "absmin", "over16", "near16", "sub16", "flush16")

STATUSES = {
    "unknown": "no sampled statistics to judge from",
    "overflow": "some values exceed fp16's max (65504)",
    "underflow": "some layers' gradients underflow in fp16 even under GradScaler",
    "nonfinite": "some values were already NaN or inf on sampled steps",
    "tight": "values within a factor 2 of fp16's max",
    "needs_scaler": "fp16 works only with a GradScaler (gradients underflow at scale 1)",
    "ready": "every recorded value fits fp16's range",
}


@dataclass
class LayerRange:
    """One layer's values against fp16's range, over the sampled steps.

    Fractions are of the sampled elements (``flush``/``sub``: of the non-zero ones) at the
    step where they were largest; ``absmax`` is exact, over whole tensors. ``sub`` includes
    ``flush``: subnormal or flushed.
    """

    name: str
    kind: str  # 'input', 'activation', 'activation grad', 'weight grad'
    steps: int  # sampled steps seen
    dtype: str = ""  # as recorded: 'float16' means what flushed is already zero
    absmax: float = math.nan  # as recorded (scaled for gradients under GradScaler)
    absmax_step: Optional[int] = None
    absmin: float = math.nan  # smallest non-zero magnitude in the samples, as recorded
    scale: float = 1.0  # median loss scale of the gradient rows (1 for values, no scaler)
    over: float = 0.0
    over_steps: int = 0  # sampled steps with a value above 65504 (or inf)
    first_over: Optional[int] = None
    near: float = 0.0
    near_steps: int = 0
    flush: float = 0.0
    flush_step: Optional[int] = None
    sub: float = 0.0
    sub_step: Optional[int] = None
    nonfinite_steps: int = 0  # sampled steps where it held NaN or inf
    first_nonfinite: Optional[int] = None

    @property
    def is_grad(self) -> bool:
        return self.kind.endswith("grad")


_LAYER_FIELDS = tuple(f.name for f in fields(LayerRange))
# Layers listed in full in the JSON form; a run with more (10^5 modules are 333 332 layers, a
# 193 MB report) lists the ones that matter and counts the rest (``Readiness.shown``).
JSON_LAYERS = 10_000


@dataclass
class Readiness:
    """What fp16 would do to a run's values, layer by layer, and what that means."""

    dtype: str  # what the run computed in (``precision``)
    scaled: bool  # gradients were recorded under a GradScaler
    sampled_steps: int
    status: str  # a key of STATUSES
    advice: str
    layers: list[LayerRange] = field(default_factory=list)
    grad_range: dict = field(default_factory=dict)  # unscaled max/min, powers of 2, scale
    # the value layers of the largest abs max (NaN aside), largest first, with their rows'
    # steps and abs max in the order recorded: what the report's activation figure draws,
    # without a second read of /stats (not in ``to_dict``)
    peaks: list = field(default_factory=list, repr=False, compare=False)

    # the four lists below, made in one pass over ``layers`` when first asked for (10^5
    # modules are 333 332 layers, each list asked for several times by the judgement, the
    # JSON form and the report); made again if ``layers`` is replaced or grows
    _lists: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def overflowing(self) -> list[LayerRange]:
        """Layers whose values (activations; gradients at any scale >= 1) overflow fp16,
        largest abs max first."""
        return list(self._classified()["overflowing"])

    @property
    def near(self) -> list[LayerRange]:
        """Value layers within a factor 2 of fp16's max that do not overflow, largest first."""
        return list(self._classified()["near"])

    @property
    def underflowing(self) -> list[LayerRange]:
        """Gradient layers at least half subnormal or flushed, at the recorded scale."""
        return list(self._classified()["underflowing"])

    @property
    def nonfinite(self) -> list[LayerRange]:
        """Layers that held NaN or inf on a sampled step (overflowing ones aside)."""
        return list(self._classified()["nonfinite"])

    def _classified(self) -> dict[str, list[LayerRange]]:
        stamp = (id(self.layers), len(self.layers))
        if self._lists.get("stamp") != stamp:
            over, near, under, bad = [], [], [], []
            for x in self.layers:
                grad = x.is_grad
                if _overflows(x):
                    over.append(x)
                else:
                    if x.near_steps and not grad:
                        near.append(x)
                    if x.nonfinite_steps:
                        bad.append(x)
                if grad and x.sub >= LAYER_UNDERFLOW:
                    under.append(x)
            over.sort(key=lambda x: -x.absmax)
            near.sort(key=lambda x: -x.absmax)
            under.sort(key=lambda x: (-x.sub, -x.flush))
            self._lists = {"stamp": stamp, "overflowing": over, "near": near,
                           "underflowing": under, "nonfinite": bad}
        return self._lists

    def shown(self, limit: int = JSON_LAYERS) -> list[LayerRange]:
        """Every layer, up to ``limit`` of them; past that the ``limit`` that matter most, in
        layer order: those overflowing, non-finite, underflowing or near the max first, then
        by turns the largest abs max (closest to overflow) and the largest subnormal or
        flushed share (closest to flushing)."""
        if len(self.layers) <= limit:
            return self.layers
        at = {id(x): i for i, x in enumerate(self.layers)}
        found = [at[id(x)] for x in self.overflowing + self.nonfinite + self.underflowing
                 + self.near]
        top = np.argsort([-x.absmax for x in self.layers], kind="stable")
        low = np.argsort([-x.sub for x in self.layers], kind="stable")
        ranked = np.concatenate([np.array(found, np.int64), np.ravel([top, low], order="F")])
        _, first = np.unique(ranked, return_index=True)
        keep = np.sort(ranked[np.sort(first)][:limit])
        return [self.layers[i] for i in keep.tolist()]

    def to_dict(self) -> dict:
        """The JSON form; past ``JSON_LAYERS`` layers, ``layers`` (and each list of names)
        bounded to the ones that matter (``shown``), and ``bounded`` counting them all."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("peaks", "_lists")}
        shown = self.shown()
        out["layers"] = [{f: getattr(x, f) for f in _LAYER_FIELDS} for x in shown]
        out["grad_range"] = dict(self.grad_range)
        lists = (("overflowing", self.overflowing), ("near", self.near),
                 ("underflowing", self.underflowing), ("nonfinite", self.nonfinite))
        for key, items in lists:
            out[key] = [x.name + f" ({x.kind})" for x in items[:JSON_LAYERS]]
        if len(shown) < len(self.layers):
            out["bounded"] = {"layers": len(self.layers), "shown": len(shown),
                              **{key: len(items) for key, items in lists}}
        return plain(out)


def _overflows(x: LayerRange) -> bool:
    if x.is_grad:
        # Under GradScaler a scaled gradient above 65504 is its cue to back off; only one
        # above 65504 unscaled overflows at every usable scale.
        return x.absmax / x.scale > FP16_MAX
    return x.over_steps > 0


def precision(run: Any) -> str:
    """What a run computed in, 'float16', 'bfloat16' or 'float32': the diagnosis' decision
    (``diagnosis.facts.low_precision``: autocast's dtype, else its weights' when they are
    mostly half, ``model.half()``, else an fp16 loss), named as a dtype."""
    return {"fp16": "float16", "bf16": "bfloat16"}.get(low_precision(run) or "", "float32")


def fp16_readiness(run: Any, sampled: Optional[tuple] = None) -> Readiness:
    """Judge a loaded ``Run``'s recorded values against fp16's range (see the module doc).

    ``sampled``: ``layers.sampled(run, KINDS, columns)`` (``columns`` holding ``COLUMNS``)
    where the caller read it already for its own use (``compare``: one pass over /stats,
    not two); kept by the caller, it stays in memory beside this judgement's sorted copy."""
    rows, found = sampled if sampled is not None else _layers.sampled(run, KINDS, COLUMNS)
    del sampled
    scale = _layers.step_scale(run, rows["step"])
    scaled = bool(np.any(scale != 1.0))
    # Under GradScaler a skipped step's gradients are inf by design (calibration, probing):
    # they say nothing about the range.
    skipped = run.steps["step"][run.steps["skipped"] == 1] if len(run.steps) else []
    kinds = np.array([int(x.kind) for x in found] or [0])
    keep = np.arange(len(rows))
    if len(skipped):
        grad = np.isin(kinds[rows["layer"]], [int(k) for k in GRAD_KINDS])
        keep = np.flatnonzero(~(grad & np.isin(rows["step"], skipped) & (scale != 1.0)))
        del grad
    steps = _distinct(rows["step"][keep])
    # (the rows kept, in layer order, in one copy: on a month-long run each is 120 MB)
    order = keep[np.argsort(rows["layer"][keep], kind="stable")]
    del keep
    rows, scale = rows[order], scale[order]
    del order
    peaks = _peaks(found, kinds, rows)
    ids, figures = _figures(rows, scale)
    del rows, scale  # (before the 333 332 objects of 10^5 modules are made)
    ranges = _ranges(found, ids, figures)
    r = Readiness(dtype=precision(run), scaled=scaled,
                  sampled_steps=steps, status="unknown", advice="",
                  layers=ranges, peaks=peaks)
    r.grad_range = _grad_range(ranges, scaled)
    r.status, r.advice = _judge(r)
    return r


def _distinct(steps: np.ndarray) -> int:
    """``len(np.unique(steps))``, without the sort where they are in order (as recorded)."""
    if bool(np.all(steps[1:] >= steps[:-1])):
        return int(np.count_nonzero(steps[1:] != steps[:-1])) + int(len(steps) > 0)
    return int(len(np.unique(steps)))


PEAKS = 16  # value layers kept in ``Readiness.peaks``


def _peaks(found: list[_layers.Layer], kinds: np.ndarray, rows: np.ndarray) -> list:
    """``Readiness.peaks``: (layer, steps, abs max) of the ``PEAKS`` value layers of the
    largest abs max, NaN counted as -1 (``rows``: sorted by layer, in the order recorded
    within one; every value row is kept); ties in layer order."""
    if not len(rows):
        return []
    value = np.isin(kinds[rows["layer"]], [int(k) for k in VALUE_KINDS])
    absmax = rows["absmax"].astype(np.float64)
    peak = np.full(len(found), -1.0)
    np.maximum.at(peak, rows["layer"][value], np.where(np.isnan(absmax[value]), -1.0,
                                                      absmax[value]))
    mine = np.flatnonzero(np.isin(kinds[:len(found)], [int(k) for k in VALUE_KINDS]))
    chosen = mine[np.argsort(-peak[mine], kind="stable")[:PEAKS]]
    bounds = np.searchsorted(rows["layer"], np.stack([chosen, chosen + 1]))
    return [(found[i], rows["step"][a:b].copy(), absmax[a:b].copy())
            for i, a, b in zip(chosen.tolist(), *bounds.tolist()) if peak[i] >= 0]


def nonzero_sampled(rows: np.ndarray) -> np.ndarray:
    """Per /stats row, the sampled elements that are finite and not zero (at least 1): what
    the underflow shares are shares of."""
    n = np.maximum(rows["sample_n"].astype(np.float64), 1)
    bad = (rows["nan"] + rows["posinf"] + rows["neginf"]).astype(np.float64)
    return np.maximum(n - rows["zeros"] - bad, 1)


def underflow_share(rows: np.ndarray) -> np.ndarray:
    """Per /stats row, the share of its non-zero values in fp16's subnormal band or flushed
    (below 2**-14): what ``LayerRange.sub`` takes the largest of."""
    return rows["sub16"] / nonzero_sampled(rows)


def layer_ranges(found: list[_layers.Layer], rows: np.ndarray,
                 scale: np.ndarray) -> list[LayerRange]:
    """Each layer's ``LayerRange``, in layer order, for the layers with rows: ``rows`` sorted
    by ``layer`` (in their order within one), ``scale`` each row's loss scale. All layers at
    once, a numpy reduction per figure: 10^5 modules are 333 332 layers."""
    return _ranges(found, *_figures(rows, scale))


def _ranges(found: list[_layers.Layer], ids: np.ndarray, figures: list) -> list[LayerRange]:
    """``LayerRange`` objects of ``_figures``' columns (the rows no longer needed)."""
    layers = [found[i] for i in ids.tolist()]
    codes = [int(x.kind) for x in layers]
    label_of = {c: _layers.Layer(Kind(c), "").label for c in set(codes)}
    grad = np.isin(codes, [int(k) for k in GRAD_KINDS])
    figures[5] = np.where(grad, figures[5], 1.0)  # the scale: gradients' only
    columns = [[x.name for x in layers], [label_of[c] for c in codes], *figures]
    return [LayerRange(*values) for values in zip(*(
        c if isinstance(c, list) else c.tolist() for c in columns))]


def _figures(rows: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, list]:
    """The layer ids with rows, and ``LayerRange``'s columns after ``kind`` for them (the
    scale of every layer): each per-row array dropped once reduced (10^5 modules: 1.7 million
    rows, 13 MB an array)."""
    if not len(rows):
        return np.zeros(0, np.int64), [[] for _ in range(17)]
    g = _layers.Groups(rows["layer"], rows["step"])
    step = rows["step"]
    absmax = rows["absmax"].astype(np.float64)
    # Presence bits and abs max are exact over the whole tensor; the counts are the sample's.
    inf = np.isinf(absmax) | ((rows["nonfinite"] & 6) != 0) | (rows["posinf"] + rows["neginf"]
                                                               > 0)
    # absmax is exact over the whole tensor: an outlier the sample missed still counts.
    over = (rows["over16"] > 0) | inf | (absmax > FP16_MAX)
    near = over | (rows["near16"] > 0) | (absmax >= FP16_NEAR)
    finite_max = np.where(np.isfinite(absmax), absmax, -1.0)
    del absmax
    top = np.where(g.any(inf), np.inf, g.max(finite_max))
    top_at = g.first_max(np.where(inf, np.inf, finite_max))[1]
    del inf, finite_max
    mins = rows["absmin"].astype(np.float64)
    least = g.min(np.where(np.isfinite(mins) & (mins > 0), mins, np.inf))
    del mins
    n = np.maximum(rows["sample_n"].astype(np.float64), 1)
    over_frac = g.max((rows["over16"] + rows["posinf"] + rows["neginf"]) / n)
    near_frac = g.max(rows["near16"] / n)
    del n
    flush, flush_at = g.first_max(rows["flush16"] / nonzero_sampled(rows))
    sub, sub_at = g.first_max(underflow_share(rows))
    bad = rows["nonfinite"] > 0
    return g.ids, [
        g.distinct_steps(None), _mode(g, rows["dtype"]), top, step[top_at],
        np.where(np.isinf(least), np.nan, least), g.median(scale),
        over_frac, g.distinct_steps(over), g.first_step(over),
        near_frac, g.distinct_steps(near),
        flush, _layers.when(step[flush_at], flush > 0),
        sub, _layers.when(step[sub_at], sub > 0),
        g.distinct_steps(bad), g.first_step(bad)]


def _mode(g: _layers.Groups, codes: np.ndarray) -> list[str]:
    """Each layer's most frequent dtype (the smallest code of a tie, as ``np.unique``)."""
    if np.all(codes == codes[0]):
        return [_DTYPE_NAMES.get(int(codes[0]), "")] * len(g.starts)
    order = np.lexsort((codes, g.of))
    layer, code = g.of[order], codes[order]
    runs = np.flatnonzero(np.r_[True, (layer[1:] != layer[:-1]) | (code[1:] != code[:-1])])
    length = np.diff(np.r_[runs, g.size])
    first = np.flatnonzero(np.r_[True, layer[runs][1:] != layer[runs][:-1]])
    longest = np.maximum.reduceat(length, first)
    owner = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(runs)]))
    pick = np.minimum.reduceat(np.where(length == longest[owner], np.arange(len(runs)),
                                        len(runs)), first)
    return [_DTYPE_NAMES.get(c, "") for c in code[runs][pick].tolist()]


def _grad_range(ranges: list[LayerRange], scaled: bool) -> dict:
    """The gradients' true magnitudes, and what GradScaler could make of them in fp16."""
    grads = [x for x in ranges if x.is_grad]
    top = [x.absmax / x.scale for x in grads if math.isfinite(x.absmax) and x.absmax > 0]
    low = [x.absmin / x.scale for x in grads if math.isfinite(x.absmin) and x.absmin > 0]
    if not top or not low:
        return {}
    gmax, gmin = max(top), min(low)
    # GradScaler settles on the largest power of two that keeps the largest gradient finite.
    fit = 2.0 ** math.floor(math.log2(FP16_MAX / gmax)) if gmax > 0 else RUNAWAY_SCALE
    settle = min(max(fit, 1.0), RUNAWAY_SCALE)
    return {"max": gmax, "min": gmin, "powers_of_2": math.log2(gmax / gmin),
            "scale": settle, "min_at_scale": gmin * settle,
            "flushes_at_scale": bool(gmin * settle < FP16_SUBNORMAL_MIN)}


def _judge(r: Readiness) -> tuple[str, str]:
    if not r.layers:
        return "unknown", ("No per-layer statistics were recorded (the sampled tier never ran: "
                           "record with --every N), so fp16's range cannot be judged.")
    over, under, bad, near = r.overflowing, r.underflowing, r.nonfinite, r.near
    if over:
        return "overflow", (f"fp16 would overflow in {_count(over)} ({_names(over)}): use bf16 "
                            "where the hardware has it, else keep these layers in fp32 "
                            "(autocast(enabled=False) around them).")
    if under and r.scaled:
        return "underflow", (f"Under GradScaler, {_count(under)} still underflow in fp16 "
                             f"({_under_names(under)}): bf16, whose exponent range is fp32's, "
                             "keeps their gradients.")
    if bad:
        return "nonfinite", (f"{_count(bad)} held NaN or inf on sampled steps "
                             f"({_bad_names(bad)}): something overflowed or went wrong before "
                             "them, which the diagnosis locates; there the recorded values "
                             "cannot tell fp16's headroom.")
    if near:
        return "tight", (f"{_count(near)} come within a factor 2 of fp16's max ({_names(near)}): "
                         "fp16 works today with little headroom; bf16 has room to spare.")
    if under:
        return "needs_scaler", (f"Without loss scaling, {_count(under)} underflow in fp16 "
                                f"({_under_names(under)}): fp16 needs a GradScaler. "
                                + _at_scale(r.grad_range, under))
    return "ready", ("Every recorded value fits fp16's range" + (
        " with a GradScaler" if r.scaled else "") + ": fp16 is safe by range (bf16 too).")


def _at_scale(g: dict, under: list[LayerRange]) -> str:
    """What GradScaler's settled scale would do for the smallest gradients recorded. Only a
    hint: the smallest magnitude comes from a sample, and one tiny value is not a pattern."""
    if any(x.dtype == "float16" for x in under):
        return ("In this fp16 run what fell below 2**-24 is already zero, so how small those "
                "gradients really are is not known.")
    if not g:
        return ""
    if g["flushes_at_scale"]:
        return (f"Even at the scale it would settle on (about {g['scale']:.0f}, set by the "
                f"largest gradient {fmt(g['max'])}), the smallest recorded ({fmt(g['min'])}) "
                "would still flush: if training needs them, prefer bf16.")
    return (f"At the scale it would settle on (about {g['scale']:.0f}) even the smallest "
            f"recorded ({fmt(g['min'])}) fits.")


def _count(items: list[LayerRange]) -> str:
    return f"{len(items)} layer" + ("s" if len(items) != 1 else "")


def _names(items: list[LayerRange], k: int = 3) -> str:
    shown = ", ".join(f"{x.name} {x.kind} abs max {fmt(x.absmax)} at step {x.absmax_step}"
                      for x in items[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def _under_names(items: list[LayerRange], k: int = 3) -> str:
    shown = ", ".join(f"{x.name} {x.kind} {100 * x.sub:.0f}% subnormal or flushed at step "
                      f"{x.sub_step}" for x in items[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def _bad_names(items: list[LayerRange], k: int = 3) -> str:
    shown = ", ".join(f"{x.name} {x.kind} from step {x.first_nonfinite}" for x in items[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def plain(value: Any) -> Any:
    """JSON-safe: NaN becomes None, infinities the strings 'inf'/'-inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, np.generic):
        return plain(value.item())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
