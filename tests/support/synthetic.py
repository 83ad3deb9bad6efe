"""Runs built in memory, without torch: what a recorder would have written, table by table.

``Synth`` fills /steps like GradScaler would (a skipped step halves the scale), and adds
tensors, sampled statistics, forensic snapshots, events and configuration on request; ``run()``
returns a ``store.Run`` that ``ampdoctor.diagnose`` takes as is. ``growing`` and
``underflowing_grads`` add the sampled trends that more than one rule family's tests build.

Example::

    s = Synth(40, dtype="float16", scaler=True)
    s.skip(range(5, 40), loss_nan=True)
    s.snapshot(5, "forward", "blocks.0.attn", "Attention", fp32_finite=1)
    d = diagnose(s.run())
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Optional

import numpy as np

from ampdoctor.runfile import schema, store
from ampdoctor.runfile.schema import DType, Event, Kind, Phase, Source, flag

PHASE = {"forward": Phase.FORWARD, "backward": Phase.BACKWARD, "input": Phase.INPUT,
         "loss": Phase.LOSS, "none": Phase.NONE, "unknown": Phase.UNKNOWN}


class Synth:
    def __init__(self, n: int, *, dtype: Optional[str] = "float16", scaler: bool = True,
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000, lr: float = 1e-3,
                 optimizer: str = "AdamW", eps: float = 1e-8, params: str = "float32",
                 status: str = "finished", every: int = 10, device: str = "cuda"):
        self.n = n
        s = schema.empty("steps", n)
        s["step"] = np.arange(n)
        s["time"] = np.arange(n, dtype=float)
        s["dt"] = 0.1
        s["loss"] = 2.0 - np.arange(n) / max(n, 1)
        s["loss_dtype"] = DType.FLOAT32
        s["micro"] = 1
        s["grad_norm"] = 1.0
        s["lr"] = lr
        s["peak_mem"] = 1 << 20
        s["flags"] = 0
        s["found_inf"] = 0
        s["skipped"] = 0
        s["sampled"] = (np.arange(n) % every == 0) if every else 0
        self.steps = s
        self.skips = np.zeros(n, bool)
        self.scaler = scaler
        self.init_scale = init_scale
        self.growth_interval = growth_interval
        self._scale_override: Optional[np.ndarray] = None
        self.tensors: list[tuple] = []
        self.tensor_dtypes: dict[tuple, DType] = {}  # (kind, name) -> dtype (default fp32)
        self.stats: list[np.ndarray] = []
        self.events: list[tuple] = []
        self.snaps: list[dict] = []
        self.loss_rows = schema.empty("losses")
        self.meta = {
            "status": status,
            "recorder": {"every": every, "sample": 4096, "forensics": True, "max_replays": 4},
            "torch": {"version": "2.13.0"},
            "device": {"type": device, "name": device},
            "autocast": {"device_type": device, "enabled": dtype is not None, "dtype": dtype},
            "model": {"param_dtypes": {params: 1000}, "trainable": 1000, "modules": 5},
            "optimizer": [{"class": optimizer, "hyper": {"lr": lr, "eps": eps},
                           "groups": 1, "param_dtypes": {params: 1000},
                           "state_dtypes": {"exp_avg": params, "exp_avg_sq": params}}],
        }
        if scaler:
            self.meta["scaler"] = {"class": "GradScaler", "enabled": True,
                                   "init_scale": init_scale, "growth_factor": 2.0,
                                   "backoff_factor": 0.5, "growth_interval": growth_interval}

    # -- steps ------------------------------------------------------------------------------

    def skip(self, steps: Iterable[int], loss_nan: bool = False, grad_inf: bool = True) -> "Synth":
        """GradScaler found inf/NaN on these steps (optionally the loss was NaN too)."""
        for i in steps:
            self.skips[i] = True
            self.steps["found_inf"][i] = 1
            self.steps["flags"][i] |= flag(Event.SKIPPED)
            if grad_inf:
                self.steps["grad_norm"][i] = np.inf
                self.steps["flags"][i] |= flag(Event.NONFINITE_GRAD)
            if loss_nan:
                self.nan_loss([i])
        return self

    def nan_loss(self, steps: Iterable[int], value: float = np.nan) -> "Synth":
        for i in steps:
            self.steps["loss"][i] = value
            self.steps["flags"][i] |= flag(Event.NONFINITE_LOSS)
        return self

    def nan_grad(self, steps: Iterable[int]) -> "Synth":
        for i in steps:
            self.steps["grad_norm"][i] = np.nan
            self.steps["flags"][i] |= flag(Event.NONFINITE_GRAD)
        return self

    def losses(self, sites: list[dict], curves: list) -> "Synth":
        """Several losses: /meta ``losses`` (``sites``: one dict per slot, with site,
        optimizers and reaches) and their /losses rows (``curves``: each one's loss at every
        step); /steps' loss becomes their mean, as a recorder writes it."""
        self.meta["losses"] = sites
        rows = []
        for slot, values in enumerate(curves):
            r = schema.empty("losses", self.n)
            r["step"], r["slot"], r["loss"], r["micro"] = np.arange(self.n), slot, values, 1
            rows.append(r)
        self.loss_rows = np.concatenate(rows)
        self.steps["loss"] = np.mean(np.stack(curves), axis=0)
        return self

    def set(self, column: str, values, steps: Optional[Iterable[int]] = None) -> "Synth":
        idx = np.arange(self.n) if steps is None else np.asarray(list(steps))
        self.steps[column][idx] = values
        return self

    def scales(self, values: np.ndarray) -> "Synth":
        """Use these scales before update (scale_after follows from skips/next value)."""
        self._scale_override = np.asarray(values, float)
        return self

    def _fill_scale(self) -> None:
        s = self.steps
        if not self.scaler:
            s["scale"] = np.nan
            s["scale_after"] = np.nan
            s["found_inf"] = -1
            s["skipped"] = 0
            return
        if self._scale_override is not None:
            s["scale"] = self._scale_override
            s["scale_after"] = np.where(self.skips, self._scale_override / 2,
                                        self._scale_override)
            s["skipped"] = self.skips
            return
        scale, clean = self.init_scale, 0
        for i in range(self.n):
            s["scale"][i] = scale
            if self.skips[i]:
                scale, clean = scale / 2, 0
            else:
                clean += 1
                if clean == self.growth_interval:
                    scale, clean = scale * 2, 0
            s["scale_after"][i] = scale
        s["skipped"] = self.skips

    # -- tensors and statistics -------------------------------------------------------------

    def tensor(self, kind: Kind, name: str, type_: str = "Linear", numel: int = 4096) -> int:
        for tid, k, n, *_ in self.tensors:
            if k == kind and n == name:
                return tid
        tid = len(self.tensors)
        self.tensors.append((tid, int(kind), name, type_, numel))
        return tid

    def stat(self, step: int, kind: Kind, name: str, type_: str = "Linear",
             source: Source = Source.SAMPLED, **fields) -> "Synth":
        row = schema.empty("stats", 1)
        row["step"] = step
        row["tensor"] = self.tensor(kind, name, type_)
        row["source"] = int(source)
        row["seq"] = sum(len(r) for r in self.stats)
        row["numel"] = 4096
        row["sample_n"] = 4096
        for key in ("nonfinite", "nan", "posinf", "neginf", "zeros", "over16", "near16",
                    "sub16", "flush16", "overbf16", "subbf16", "flushbf16"):
            row[key] = 0
        row["absmax"], row["absmin"], row["rms"] = 1.0, 1e-3, 0.3
        for key, value in fields.items():
            row[key] = value
        self.stats.append(row)
        return self

    def sampled(self, steps: Iterable[int], kind: Kind, name: str, **fields) -> "Synth":
        """The same statistics on several sampled steps; callables get the step."""
        for i in steps:
            self.stat(i, kind, name, **{k: (v(i) if callable(v) else v)
                                        for k, v in fields.items()})
            self.steps["sampled"][i] = 1
        return self

    # -- snapshots, events, configuration ---------------------------------------------------

    def snapshot(self, step: int, phase: str, module: str = "", module_type: str = "",
                 fp32_finite: int = -1, fp32_absmax: float = np.nan, in_absmax: float = np.nan,
                 out_absmax: float = np.nan, **detail) -> "Synth":
        self.snaps.append({"step": step, "phase": PHASE[phase], "module": module,
                           "module_type": module_type, "fp32_finite": fp32_finite,
                           "fp32_absmax": fp32_absmax, "in_absmax": in_absmax,
                           "out_absmax": out_absmax, "detail": json.dumps(detail)})
        self.event(step, Event.FORENSICS, value=len(self.snaps) - 1)
        return self

    def event(self, step: int, kind: Event, text: str = "", value: float = np.nan,
              tensor: int = -1) -> "Synth":
        self.events.append((step, int(kind), tensor, value, text))
        if 0 <= step < self.n:
            self.steps["flags"][step] |= flag(kind)
        return self

    def exception(self, type_: str, message: str) -> "Synth":
        self.meta["status"] = schema.STATUS_EXCEPTION + type_
        return self.event(max(self.n - 1, 0), Event.EXCEPTION, f"{type_}: {message}")

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> store.Run:
        self._fill_scale()
        tensors = np.zeros(len(self.tensors), store.TENSOR_VIEW)
        for i, (tid, kind, name, type_, numel) in enumerate(self.tensors):
            tensors[i] = (tid, kind, 0, self.tensor_dtypes.get((kind, name), DType.FLOAT32),
                          numel, name, type_)
        stats = np.concatenate(self.stats) if self.stats else schema.empty("stats")
        events = store.decoded(schema.empty("events", len(self.events)), ["text"])
        for i, (step, kind, tensor, value, text) in enumerate(self.events):
            events[i] = (step, kind, tensor, value, text)
        snaps = store.decoded(schema.empty("snapshots", len(self.snaps)),
                               ["module", "module_type", "detail"])
        for i, s in enumerate(self.snaps):
            snaps["id"][i] = i
            for key, value in s.items():
                snaps[key][i] = value
            snaps["trigger"][i] = int(Event.SKIPPED)
            snaps["scale"][i] = self.steps["scale"][s["step"]] if s["step"] < self.n else np.nan
        groups = np.zeros(self.n, schema.GROUPS)
        groups["step"] = self.steps["step"]
        groups["lr"] = self.steps["lr"]
        return store.Run(path="synthetic.h5", attrs={"rank": 0, "world_size": 1, "argv": []},
                         meta=self.meta, steps=self.steps, groups=groups, tensors=tensors,
                         stats=store.Table(stats), events=events, snapshots=snaps,
                         losses=self.loss_rows)


def write(s: Synth, path: str, *, rank: int = 0, world_size: int = 1, flush_steps: int = 0,
          stop_after: Optional[int] = None) -> store.Writer:
    """Write a ``Synth`` run into a run file through ``store.Writer``, as a recorder would: the
    tables, then the steps ``flush_steps`` at a time (0: all at once), each batch flushed.
    ``stop_after``: flush only the first that many steps, queue the rest and return the writer
    without closing it (the caller kills the process, or closes it)."""
    run = s.run()
    w = store.Writer(path, rank=rank, world_size=world_size, argv=["train.py"])
    for key, value in run.meta.items():
        if key != "status":
            w.meta(key, value)
    w.meta("status", schema.STATUS_RUNNING)
    w.append("tensors", _text_rows(w, "tensors", run.tensors, ("name", "type")))
    w.append("stats", run.stats.rows())
    w.append("events", _text_rows(w, "events", run.events, ("text",)))
    w.append("snapshots", _text_rows(w, "snapshots", run.snapshots,
                                     ("module", "module_type", "detail")))
    w.append("losses", run.losses)
    steps = run.steps
    size = flush_steps or max(len(steps), 1)
    for first in range(0, len(steps), size):
        w.append("steps", steps[first:first + size])
        if stop_after is not None and first + size > stop_after:
            return w
        w.flush()
    if stop_after is None:
        w.close(str(run.meta.get("status", schema.STATUS_FINISHED)))
    return w


def _text_rows(w: store.Writer, table: str, rows: np.ndarray, texts: tuple) -> np.ndarray:
    out = schema.empty(table, len(rows))
    for name in out.dtype.names:
        if name in rows.dtype.names:
            out[name] = rows[name]
    for t in texts:
        for i, value in enumerate(rows[t]):
            out[f"{t}_off"][i], out[f"{t}_len"][i] = w.text(str(value))
    return out


def grow(start: float, factor: float, steps: int):
    """A value growing geometrically by ``factor`` over ``steps`` (for sampled trends)."""
    return lambda i: start * factor ** (i / max(steps, 1))


INF = math.inf


def growing(s: Synth, until: int) -> Synth:
    """Weights, updates and activations growing on sampled steps before ``until``."""
    for name in ("trunk.0", "trunk.2", "out"):
        s.sampled(range(10, until, 10), Kind.PARAM, f"{name}.weight",
                  norm=grow(5.0, 8.0, until), update=0.05)
        s.sampled(range(10, until, 10), Kind.OUTPUT, name, absmax=grow(2.0, 500.0, until))
    return s


def underflowing_grads(s: Synth, names, under: int, steps=range(10, 60, 10)):
    """Gradients of ``names`` underflowing fp16 on sampled ``steps``: ``under`` values in the
    subnormal band, a quarter of that count flushed to zero and as many exact zeros."""
    for name in names:
        s.sampled(steps, Kind.PARAM_GRAD, name, sub16=under, flush16=under // 4,
                  zeros=under // 4, absmax=1e-5, rms=1e-6)


def write_rank(path, rank, world, scales, bad_loss=(), bad_grad=(), skipped=()):
    w = store.Writer(path, rank=rank, world_size=world)
    n = len(scales)
    rows = schema.empty("steps", n)
    rows["step"] = np.arange(n)
    rows["loss"] = 1.0
    rows["scale"] = scales
    rows["skipped"] = [int(i in skipped) for i in range(n)]
    rows["flags"] = [(flag(Event.NONFINITE_LOSS) if i in bad_loss else 0)
                     | (flag(Event.NONFINITE_GRAD) if i in bad_grad else 0)
                     | (flag(Event.SKIPPED) if i in skipped else 0) for i in range(n)]
    w.append("steps", rows)
    w.close("finished")
