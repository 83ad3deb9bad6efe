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

from dataclasses import dataclass
from typing import Any, Iterable

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
    tensors = run.tensors
    layers: list[Layer] = []
    # tensor id -> layer index (-1: a kind not asked for)
    max_id = int(tensors["id"].max()) + 1 if len(tensors) else 0
    layer_of = np.full(max_id, -1, np.int64)
    index_of = np.zeros(max_id, np.int16)
    # (a layer per distinct kind and name, in the order first met: one dict lookup per tensor
    # and one Layer per layer, not per tensor, for the 466 664 tensors of 10^5 modules)
    chosen = np.isin(tensors["kind"], [int(k) for k in kinds])
    first: dict[tuple[int, str], int] = {}
    at = [first.setdefault((k, str(n)), len(first))
          for k, n in zip(tensors["kind"][chosen].tolist(), tensors["name"][chosen].tolist())]
    layers += [Layer(Kind(k), n) for k, n in first]
    layer_of[tensors["id"][chosen]] = np.array(at, np.int64)
    index_of[tensors["id"][chosen]] = tensors["index"][chosen]
    columns = [c for c in dict.fromkeys(columns) if c not in ("step", "tensor", "call")]
    read = ("step", "tensor", "call", "source", *columns)
    out_dtype = np.dtype([("step", "<i8"), ("tensor", "<i4"), ("call", "<i2"),
                          ("index", "<i2"), ("layer", "<i8")]
                         + [(c, run.stats.dtype[c]) for c in columns])
    parts = []
    for rows in run.stats.chunks(chunk, names=read):
        tid = rows["tensor"]
        known = (tid >= 0) & (tid < max_id)
        keep = np.zeros(len(rows), bool)
        keep[known] = layer_of[tid[known]] >= 0
        keep &= rows["source"] == Source.SAMPLED
        if not keep.any():
            continue
        rows = rows[keep]
        part = np.zeros(len(rows), out_dtype)
        for c in ("step", "tensor", "call", *columns):
            part[c] = rows[c]
        part["layer"] = layer_of[rows["tensor"]]
        part["index"] = index_of[rows["tensor"]]
        parts.append(part)
    rows = np.concatenate(parts) if parts else np.zeros(0, out_dtype)
    return rows, layers


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
