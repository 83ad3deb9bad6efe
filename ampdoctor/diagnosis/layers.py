"""Per-layer views of the sampled tier: the ``/stats`` rows of chosen kinds, grouped by layer.

numpy only. ``fp16 readiness``, ``compare`` and the report's plots all read the same rows: the
sampled tier's (forensic replays describe one failing step, not the run), of a few tensor kinds,
with a handful of columns. ``sampled`` streams the table in chunks and keeps only those, so
memory follows what is asked, not the length of the run.

Gradients are recorded in the space the run used: multiplied by GradScaler's scale when there
is one (what fp16 actually held). ``unscale`` divides them by the step's scale where a caller
needs their true size.

Example::

    with ampdoctor.load("run.h5") as run:
        rows, layers = sampled(run, (Kind.OUTPUT,), ("absmax",))
        layers[rows["layer"][0]]      # Layer(kind=<Kind.OUTPUT: 0>, name='blocks.0.attn')
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from ..runfile.schema import Kind, Source

# Kinds whose values pass through the autocast dtype, and what a reader calls them.
KIND_LABELS = {
    Kind.INPUT: "input",
    Kind.OUTPUT: "activation",
    Kind.GRAD_OUTPUT: "activation grad",
    Kind.PARAM_GRAD: "weight grad",
}
GRAD_KINDS = (Kind.GRAD_OUTPUT, Kind.PARAM_GRAD)
VALUE_KINDS = (Kind.INPUT, Kind.OUTPUT)


@dataclass(frozen=True)
class Layer:
    """One module output (or parameter gradient) of the run, whatever its tensor index."""

    kind: Kind
    name: str

    @property
    def label(self) -> str:
        return KIND_LABELS.get(self.kind, self.kind.name.lower())


def sampled(run: Any, kinds: Iterable[Kind], columns: Iterable[str], *,
            chunk: int = 1 << 16) -> tuple[np.ndarray, list[Layer]]:
    """Sampled-tier rows of ``kinds``: ``step``, ``tensor``, ``call``, ``index``, ``layer``
    (an index into the returned list of ``Layer``) and the requested ``columns``."""
    kinds = tuple(Kind(k) for k in kinds)
    layers, layer_of, index_of = _found(run.tensors, kinds)
    max_id = len(layer_of)
    columns = [c for c in dict.fromkeys(columns) if c not in ("step", "tensor", "call")]
    read = ("step", "tensor", "call", "source", *columns)
    out_dtype = np.dtype([("step", "<i8"), ("tensor", "<i4"), ("call", "<i2"),
                          ("index", "<i2"), ("layer", "<i8")]
                         + [(c, run.stats.dtype[c]) for c in columns])
    # Filled in place, column by column: no copy of the kept rows per chunk and none to join
    # them (1.7 million rows of 10^5 modules); the pages past what is kept are never touched.
    out = np.empty(len(run.stats), out_dtype)
    filled = 0
    for rows in run.stats.chunks(chunk, names=read):
        tid = rows["tensor"]
        known = (tid >= 0) & (tid < max_id)
        keep = np.zeros(len(rows), bool)
        keep[known] = layer_of[tid[known]] >= 0
        keep &= rows["source"] == Source.SAMPLED
        kept = np.flatnonzero(keep)
        if not len(kept):
            continue
        end = filled + len(kept)
        if end > len(out):  # (a table that grew while read)
            out = np.concatenate([out[:filled], np.empty(end - filled, out_dtype)])
        whole = len(kept) == len(rows)  # (every row kept: copied as they are, no gather)
        for c in ("step", "tensor", "call", *columns):
            out[c][filled:end] = rows[c] if whole else rows[c][kept]
        tid = tid if whole else tid[kept]
        out["layer"][filled:end] = layer_of[tid]
        out["index"][filled:end] = index_of[tid]
        filled = end
    return out[:filled], list(layers)


# The layers of the last few /tensors tables met, by kinds: ``_found`` of one run is asked
# for again by each reader of a command (the diagnosis's forecast, readiness, comparison),
# and 10^5 modules' 466 664 tensors took half a second each time. Held by the table itself
# (a weak reference: a table freed takes its entry with it).
_FOUND: dict[int, tuple[Any, dict]] = {}
_FOUND_TABLES = 4


def _found(tensors: np.ndarray, kinds: tuple[Kind, ...]
           ) -> tuple[list[Layer], np.ndarray, np.ndarray]:
    """The layers of ``kinds`` in ``tensors`` (one per distinct kind and name, in the order
    first met), and per tensor id its layer (-1: a kind not asked for) and output index."""
    table = id(tensors)
    entry = _FOUND.get(table)
    if entry is None or entry[0]() is not tensors:
        try:
            ref = weakref.ref(tensors, lambda _: _FOUND.pop(table, None))
        except TypeError:  # (not an ndarray: nothing to hold it by)
            return _discover(tensors, kinds)
        while len(_FOUND) >= _FOUND_TABLES:
            _FOUND.pop(next(iter(_FOUND)))
        entry = _FOUND[table] = (ref, {})
    by_kinds = entry[1]
    key = (len(tensors), kinds)
    if key not in by_kinds:
        by_kinds[key] = _discover(tensors, kinds)
    return by_kinds[key]


def _discover(tensors: np.ndarray, kinds: tuple[Kind, ...]
              ) -> tuple[list[Layer], np.ndarray, np.ndarray]:
    max_id = int(tensors["id"].max()) + 1 if len(tensors) else 0
    layer_of = np.full(max_id, -1, np.int64)
    index_of = np.zeros(max_id, np.int16)
    # (a layer per distinct kind and name, in the order first met: one dict lookup per tensor
    # and one Layer per layer, not per tensor, for the 466 664 tensors of 10^5 modules)
    chosen = np.isin(tensors["kind"], [int(k) for k in kinds])
    first: dict[tuple[int, str], int] = {}
    at = [first.setdefault((k, str(n)), len(first))
          for k, n in zip(tensors["kind"][chosen].tolist(), tensors["name"][chosen].tolist())]
    members = {int(k): k for k in kinds}
    layers = [Layer(members[k], n) for k, n in first]
    layer_of[tensors["id"][chosen]] = np.array(at, np.int64)
    index_of[tensors["id"][chosen]] = tensors["index"][chosen]
    return layers, layer_of, index_of


def step_scale(run: Any, steps: np.ndarray) -> np.ndarray:
    """The loss scale each of ``steps`` ran its backward at (1.0 without a GradScaler)."""
    s = run.steps
    scale = np.ones(len(steps))
    if not len(s) or not len(steps):
        return scale
    known, scales = s["step"], s["scale"]
    if not np.all(known[1:] >= known[:-1]):  # /steps is in order: no 10^7-row sort
        order = np.argsort(known, kind="stable")
        known, scales = known[order], scales[order]
    pos = np.clip(np.searchsorted(known, steps), 0, len(known) - 1)
    found = known[pos] == steps
    values = scales[pos].astype(np.float64)
    usable = found & np.isfinite(values) & (values > 0)
    scale[usable] = values[usable]
    return scale


def unscale(run: Any, rows: np.ndarray, layers: list[Layer], column: str) -> np.ndarray:
    """``rows[column]`` as float64, gradients divided by their step's loss scale."""
    values = rows[column].astype(np.float64)
    grad = np.isin(np.array([int(x.kind) for x in layers], np.int64)[rows["layer"]],
                   [int(k) for k in GRAD_KINDS]) if len(rows) else np.zeros(0, bool)
    if grad.any():
        values[grad] /= step_scale(run, rows["step"][grad])
    return values


class Groups:
    """Rows sorted by layer (``of``: a group index per row, over the layers that have rows):
    a figure for every layer at once, each what the layer's own rows would give (a
    maximum's row: its first, in row order). ``release.readiness`` and ``release.comparison``
    reduce the 1.7 million rows of 10^5 modules so, not a layer at a time."""

    def __init__(self, layer: np.ndarray, step: np.ndarray):
        self.starts = np.flatnonzero(np.r_[True, layer[1:] != layer[:-1]])
        self.ids = layer[self.starts]
        self.size = len(layer)
        self.of = np.repeat(np.arange(len(self.starts)), np.diff(np.r_[self.starts, len(layer)]))
        self.step = step
        self._by_step: Optional[np.ndarray] = None

    @property
    def by_step(self) -> np.ndarray:
        """The rows in (layer, step) order, for the distinct steps of a layer (as they come,
        where a writer's step order already is that)."""
        if self._by_step is None:
            of, step = self.of, self.step
            ordered = bool(np.all((of[1:] != of[:-1]) | (step[1:] >= step[:-1])))
            self._by_step = np.arange(self.size) if ordered else np.lexsort((step, of))
        return self._by_step

    def max(self, values: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(values, self.starts)

    def min(self, values: np.ndarray) -> np.ndarray:
        return np.minimum.reduceat(values, self.starts)

    def any(self, mask: np.ndarray) -> np.ndarray:
        return np.logical_or.reduceat(mask, self.starts)

    def first_max(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each layer's largest value (NaN first, as ``np.argmax``) and the row of its first
        occurrence."""
        top = self.max(values)
        mine = top[self.of]
        hit = (values == mine) | (np.isnan(values) & np.isnan(mine))
        return top, self.min(np.where(hit, np.arange(self.size), self.size))

    def first_step(self, mask: np.ndarray) -> list[Optional[int]]:
        first = self.min(np.where(mask, self.step, np.iinfo(np.int64).max))
        return when(first, self.any(mask))

    def distinct_steps(self, mask: Optional[np.ndarray]) -> np.ndarray:
        rows = self.by_step if mask is None else self.by_step[mask[self.by_step]]
        layer, step = self.of[rows], self.step[rows]
        new = np.r_[True, (layer[1:] != layer[:-1]) | (step[1:] != step[:-1])] \
            if len(rows) else np.zeros(0, bool)
        return np.bincount(layer[new], minlength=len(self.starts))

    def median(self, values: np.ndarray) -> np.ndarray:
        """Each layer's median (of an even count, the mean of the middle two, as
        ``np.median``)."""
        top = self.max(values)
        if np.array_equal(top, self.min(values)):  # one value in each (a steady loss scale)
            return top
        ordered = values[np.lexsort((values, self.of))]
        length = np.diff(np.r_[self.starts, self.size])
        upper = ordered[self.starts + length // 2]
        out = upper.copy()
        even = length % 2 == 0
        out[even] = (ordered[self.starts[even] + length[even] // 2 - 1] + upper[even]) / 2
        return out


def when(values: np.ndarray, present: np.ndarray) -> list[Optional[int]]:
    """``values`` as ints, None where not ``present``."""
    return [int(v) if ok else None for v, ok in zip(values.tolist(), present.tolist())]
