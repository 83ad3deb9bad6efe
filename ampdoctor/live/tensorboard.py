"""``ampdoctor export --tensorboard``: a run's curves as TensorBoard scalars, beside the user's.

Written with the ``tensorboard`` package's protocol buffers (``pip install
'ampdoctor[tensorboard]'``) into the event file ``EventFileWriter`` (the one
``torch.utils.tensorboard`` writes through) writes, framed and checksummed by ``tfrecord``
(its CRC-32C in numpy, a batch of events at a time: tensorboard's is pure Python, one byte at a
time). Not ``torch.utils.tensorboard.SummaryWriter``, which would import torch into the
analysis side and still need this package, nor ``tensorboardX``, a second writer to keep in
step with TensorBoard's reader. What is written, per recorded optimizer step (the ``step`` axis, so
the curves line up with a loop that logs by optimizer step):

====================================  =========================================================
``ampdoctor/loss``                    the loss (mean over micro-batches, unscaled)
``ampdoctor/loss_scale``              GradScaler's scale before its update (with a scaler)
``ampdoctor/skipped``                 1 on a step GradScaler skipped, else 0
``ampdoctor/grad_norm``               global gradient norm, unscaled, before clipping
``ampdoctor/lr/group{G}``             the learning rate of each param group
``ampdoctor-absmax/{kind}/{layer}``   abs max on sampled steps (gradients as fp16 held them,
                                      multiplied by the loss scale)
``ampdoctor-underflow/{kind}/{layer}`` share of a gradient's non-zero values subnormal or
                                      flushed in fp16 (``readiness.underflow_share``)
``ampdoctor-layers/{what}/{kind}``    past ``LAYER_CURVES`` layer curves (10^5 modules: 560 000),
                                      instead of each layer's: per kind, the largest and the
                                      median over its layers (``absmax_max``,
                                      ``absmax_median``, ``underflow_max``,
                                      ``underflow_median``), beside the per-layer curves of
                                      the ``SHOWN_CURVES`` layers closest to fp16's limits
``ampdoctor-fp8-headroom/{layer}``    sampled steps, every Linear: binades between its
                                      operands' amax and the fp8 format's top under the scale
                                      delayed scaling would have set (the least of input,
                                      weight, output gradient; <= 0 saturates)
``ampdoctor-fp8-flushed/{layer}``     a layer already in fp8: the largest share of an
                                      operand's non-zero values its own cast flushed
``ampdoctor-fp8-kurtosis/{layer}``    sampled steps, every Linear: its input's kurtosis (3 for
                                      a Gaussian; an outlier channel: tens to hundreds;
                                      ``diagnosis.fp8watch`` flags a layer past 50)
``ampdoctor/forensics`` (text)        each forensic replay: the step, the culprit, fp32's answer
``ampdoctor/diagnosis`` (text)        the diagnosis (Markdown), at the last step
====================================  =========================================================

A month-long run is thinned as its plots are (``thinning``): where one read brings more than
``MAX_STEPS`` steps, the loss, grad-norm and loss-scale curves keep each bin's smallest and
largest value in about ``POINTS`` points each (``curves.extremes``: a one-step spike
survives), with every skipped or non-finite step (at most ``MAX_STEPS`` of those), and each
group's LR ``POINTS`` evenly spaced steps. TensorBoard itself shows 1000 points of a scalar
by default (``--samples_per_plugin scalars=N`` for more), so the thinned curves lose nothing
it would draw. ``Exported.thinned`` counts the steps left out.

Each rank file of a torchrun job becomes its own run (``DIR/rank0``, ``DIR/rank1``...), so the
ranks' curves overlay in TensorBoard. ``follow=True`` keeps writing while the run is recorded
(a separate reader of the SWMR file: the training process does no extra work), until the run
ends; the diagnosis is written then.

Example::

    done = tensorboard.export("run.h5", "runs/exp1")
    done.scalars, done.runs      # 1830, ['runs/exp1']
"""

from __future__ import annotations

import math
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .. import safe
from ..diagnosis import fp8
from ..diagnosis.layers import GRAD_KINDS, KIND_LABELS
from ..errors import AmpDoctorError, MissingExtraError, OutputError, RunFileError
from ..release.readiness import underflow_share
from ..runfile.schema import Kind, Recipe, Role, Source, columns
from . import thinning
from .follow import STALE_SECONDS, Follower
from .tfrecord import EventFile

LAYER_KINDS = (Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD)
_STATS_COLUMNS = columns("stats", "step", "tensor", "source", "absmax", "sample_n", "zeros",
                         "nan", "posinf", "neginf", "sub16")
CHUNK = 1 << 16
# Layer curves written one by one, up to this many. Past it (10^5 modules are 560 000 curves:
# 2.8 million scalars for 500 steps, and no TensorBoard page shows so many) each kind gets a
# summary, and only the SHOWN_CURVES layer curves that come closest to fp16's limits are
# written: half the largest abs max (NaN and inf first), half the largest underflow share, as
# the first read past the bound saw them (kept for later reads of a followed run).
LAYER_CURVES = 5_000
SHOWN_CURVES = 500
# ampdoctor's event files end so (``events.out.tfevents.<time>.<host>.<pid>.<n>.<token>
# .ampdoctor``): a second export into a directory that holds one would show every point twice,
# so it refuses (or, with --force, removes that file first). The random token makes the name
# one nobody can have made before (and ``tfrecord.EventFile`` creates it with O_EXCL and
# O_NOFOLLOW: a link planted at a guessable name is refused, never written through).
SUFFIX = ".ampdoctor"


@dataclass
class Exported:
    """What ``export`` wrote."""

    runs: list = field(default_factory=list)  # the TensorBoard run directories
    steps: int = 0
    scalars: int = 0
    texts: int = 0
    interrupted: bool = False  # Ctrl-C ended a follow; everything up to then is written
    thinned: int = 0  # steps of a long run left out of the curves (each bin's extremes kept)


def _protos() -> Any:
    """tensorboard's writer and protocol buffers, or one sentence on how to install them."""
    try:
        from tensorboard.compat.proto import (
            event_pb2,
            summary_pb2,
            tensor_pb2,
            tensor_shape_pb2,
            types_pb2,
        )
    except ImportError:
        raise MissingExtraError(
            "ampdoctor export --tensorboard needs the tensorboard package, which is not "
            "installed: pip install 'ampdoctor[tensorboard]'") from None
    return event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2


class _RunWriter:
    """One TensorBoard run: the event file of one run file."""

    def __init__(self, logdir: str, protos: Any):
        self.event_pb2, self.summary_pb2, self.tensor_pb2, self.shape_pb2, \
            self.types_pb2 = protos
        self.logdir = logdir
        self.file = EventFile(logdir, f".{secrets.token_hex(8)}{SUFFIX}", self.event_pb2)
        # per tensor id, the index in ``tags`` of its abs max and underflow curves (-1: none)
        self.absmax_of = np.zeros(0, np.int64)
        self.under_of = np.zeros(0, np.int64)
        self.tags: list[str] = []
        self.tag_index: dict[str, int] = {}
        # per tag: its (what, kind) summary, an index into ``groups`` (-1: not a layer curve)
        self.group_of: list[int] = []
        self.groups: dict[tuple[str, str], int] = {}
        self.layer_curves = 0
        self.shown: Optional[np.ndarray] = None  # past LAYER_CURVES: the layer curves written
        self.last: Optional[tuple[int, float]] = None  # the last step written, and its time
        self.scalars = self.texts = self.thinned = 0

    def scalars_at(self, step: int, wall: float, values: list[tuple[str, float]]) -> None:
        if not values:
            return
        summary = self.summary_pb2.Summary(value=[
            self.summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values])
        self.file.add_event(self.event_pb2.Event(wall_time=wall, step=int(step),
                                                 summary=summary))
        self.scalars += len(values)

    def text_at(self, step: int, wall: float, tag: str, text: str) -> None:
        pb, shape = self.summary_pb2, self.shape_pb2
        meta = pb.SummaryMetadata(plugin_data=pb.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = self.tensor_pb2.TensorProto(
            dtype=self.types_pb2.DT_STRING, string_val=[text.encode("utf-8")],
            tensor_shape=shape.TensorShapeProto(dim=[shape.TensorShapeProto.Dim(size=1)]))
        summary = pb.Summary(value=[pb.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])
        self.file.add_event(self.event_pb2.Event(wall_time=wall, step=int(step),
                                                 summary=summary))
        self.texts += 1

    # -- what a poll brought -------------------------------------------------------------

    def write(self, delta: Any, state: Any) -> None:
        self._steps(delta.rows["steps"])
        self._groups(delta.rows["groups"], state, delta.rows["steps"])
        self._layers(delta, state)
        self._fp8(delta.rows.get("fp8"), state)
        self._forensics(delta.rows["snapshots"], state)
        if len(state.steps):
            self.last = int(state.steps["step"][-1]), float(state.steps["time"][-1])

    def _steps(self, rows: np.ndarray) -> None:
        kept = thinning.thinned(rows)
        self.thinned += len(rows) - len(kept)
        for r in rows[kept]:
            values = [("ampdoctor/loss", r["loss"]), ("ampdoctor/grad_norm", r["grad_norm"])]
            if np.isfinite(r["scale"]):  # with a GradScaler
                values += [("ampdoctor/loss_scale", r["scale"]),
                           ("ampdoctor/skipped", float(r["skipped"] == 1))]
            self.scalars_at(r["step"], float(r["time"]), values)

    def _groups(self, table: Any, state: Any, steps: Any) -> None:
        """Each param group's LR at the read's steps (thinned: ``thinning.lr_rows``)."""
        if not len(table):
            return
        rows = thinning.lr_rows(table, steps["step"] if len(steps) else np.zeros(0, np.int64))
        order = np.argsort(rows["step"], kind="stable")  # one pass over the steps' groups
        rows = rows[order]
        walls = _walls(state, rows["step"])
        starts = np.flatnonzero(np.r_[True, rows["step"][1:] != rows["step"][:-1]])
        for a, b in zip(starts, np.r_[starts[1:], len(rows)]):
            self.scalars_at(rows["step"][a], float(walls[a]),
                            [(f"ampdoctor/lr/group{int(g)}", lr)
                             for g, lr in zip(rows["group"][a:b], rows["lr"][a:b])])

    def _layers(self, delta: Any, state: Any) -> None:
        """One value per sampled step and layer curve: each block of /stats rows reduced to
        (step, curve, value) as it is read, then thinned like the steps' curves
        (``thinning.thinned_layers``), then written one event per step."""
        self._name_tensors(state.tensors)
        stop = len(delta.stats)
        found = []
        for start in range(delta.stats_start, stop, CHUNK):
            rows = delta.stats.columns(_STATS_COLUMNS, start, min(stop, start + CHUNK))
            rows = rows[rows["source"] == int(Source.SAMPLED)]
            if len(rows):
                found.append(self._layer_values(rows))
        if not found:
            return
        step, curve, value = (np.concatenate([f[i] for f in found]) for i in range(3))
        step, curve, value = thinning.largest(step, curve, value)  # a curve's step across blocks
        if self.layer_curves > LAYER_CURVES:
            step, curve, value = self._bounded(step, curve, value)
        keep = thinning.thinned_layers(step, curve, value)
        step, curve, value = step[keep], curve[keep], value[keep]
        starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
        walls = _walls(state, step[starts])
        tags = self.tags
        for a, b, wall in zip(starts, np.r_[starts[1:], len(step)], walls):
            here = zip(curve[a:b].tolist(), value[a:b].tolist())  # Python numbers, once
            self.scalars_at(int(step[a]), float(wall), [(tags[c], v) for c, v in here])

    def _name_tensors(self, tensors: np.ndarray) -> None:
        """Each new tensor's curves: the index in ``tags`` of its abs max curve and of its
        underflow curve (-1: none; not a layer's value, or not a gradient)."""
        new = slice(len(self.absmax_of), None)
        kinds, names = tensors["kind"][new], tensors["name"][new]
        absmax = np.full(len(kinds), -1, np.int64)
        under = np.full(len(kinds), -1, np.int64)
        labels = {int(k): KIND_LABELS[k].replace(" ", "_") for k in LAYER_KINDS}
        grads = {int(k) for k in GRAD_KINDS}
        for i, (kind, name) in enumerate(zip(kinds.tolist(), names.tolist())):
            if kind not in labels:
                continue
            label = labels[kind]
            absmax[i] = self._tag(f"ampdoctor-absmax/{label}/{name}", ("absmax", label))
            if kind in grads:
                under[i] = self._tag(f"ampdoctor-underflow/{label}/{name}",
                                     ("underflow", label))
        self.absmax_of = np.concatenate([self.absmax_of, absmax])
        self.under_of = np.concatenate([self.under_of, under])

    def _tag(self, tag: str, group: Optional[tuple[str, str]] = None) -> int:
        """The index of curve ``tag`` (one for the tensors a layer has of a kind); ``group``:
        the (what, kind) of a layer curve, summarised past ``LAYER_CURVES``."""
        if tag not in self.tag_index:
            self.tag_index[tag] = len(self.tags)
            self.tags.append(tag)
            self.group_of.append(-1 if group is None else
                                 self.groups.setdefault(group, len(self.groups)))
            self.layer_curves += group is not None
        return self.tag_index[tag]

    def _bounded(self, step: np.ndarray, curve: np.ndarray,
                 value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Past ``LAYER_CURVES``: the ``SHOWN_CURVES`` layer curves closest to fp16's limits
        and, per step, each (what, kind)'s largest and median value over its layers."""
        group = np.asarray(self.group_of, np.int64)
        if self.shown is None:
            peak = np.full(len(self.tags), -np.inf)
            np.maximum.at(peak, curve, np.where(np.isnan(value), np.inf, value))
            under = np.isin(group, [g for (what, _), g in self.groups.items()
                                    if what == "underflow"])
            self.shown = np.zeros(len(self.tags), bool)
            for mine in (~under & (group >= 0), under):
                ids = np.flatnonzero(mine & (peak > -np.inf))
                self.shown[ids[np.argsort(-peak[ids], kind="stable")[:SHOWN_CURVES // 2]]] = True
        shown = np.zeros(len(self.tags), bool)
        shown[:len(self.shown)] = self.shown
        summary = thinning.summaries(step, group[curve], value)
        tags = {g: (self._tag(f"ampdoctor-layers/{what}_max/{kind}"),
                    self._tag(f"ampdoctor-layers/{what}_median/{kind}"))
                for (what, kind), g in self.groups.items()}
        s_step, s_group, s_max, s_median = summary
        top = np.array([tags[g][0] for g in s_group.tolist()], np.int64)
        middle = np.array([tags[g][1] for g in s_group.tolist()], np.int64)
        keep = shown[curve]
        step = np.concatenate([step[keep], s_step, s_step])
        curve = np.concatenate([curve[keep], top, middle])
        value = np.concatenate([value[keep], s_max, s_median])
        order = np.lexsort((curve, step))
        return step[order], curve[order], value[order]

    def _layer_values(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step, curve, value) of a block of sampled rows: the largest over a layer's tensors
        and calls in a step (a module called twice in a step, or with several outputs, has
        several rows), NaN first (a non-finite value is the news)."""
        tid = rows["tensor"].astype(np.int64)
        known = (tid >= 0) & (tid < len(self.absmax_of))
        rows, tid = rows[known], tid[known]
        absmax, under = self.absmax_of[tid], self.under_of[tid]
        share = underflow_share(rows)
        curve = np.concatenate([absmax, under])
        step = np.concatenate([rows["step"], rows["step"]]).astype(np.int64)
        value = np.concatenate([rows["absmax"].astype(np.float64),
                                np.asarray(share, np.float64)])
        mine = curve >= 0
        return thinning.largest(step[mine], curve[mine], value[mine])

    def _fp8(self, rows: Optional[np.ndarray], state: Any) -> None:
        """fp8 headroom and the share flushed per sampled step and layer (``diagnosis.fp8``)."""
        if rows is None or not len(rows):
            return
        names = {int(t): str(n) for t, n in zip(state.tensors["id"], state.tensors["name"])}
        found = fp8.layer_headroom(rows, names, state.meta.get("fp8_layers") or {})
        kurtosis = _kurtosis(rows, names)
        steps = sorted({step for step, _ in found})
        walls = dict(zip(steps, _walls(state, np.array(steps, np.int64))))
        for step in steps:
            values = []
            for (s, name), (room, lost) in found.items():
                if s == step and math.isfinite(room):
                    values.append((f"ampdoctor-fp8-headroom/{name}", room))
                if s == step and not math.isnan(lost):
                    values.append((f"ampdoctor-fp8-flushed/{name}", lost))
            values += kurtosis.get(step, [])
            self.scalars_at(step, walls[step], values)

    def _forensics(self, snapshots: np.ndarray, state: Any) -> None:
        if not len(snapshots):
            return
        from ..runfile.store import Run
        from .frame import events

        lines = events(Run(snapshots=snapshots))
        walls = _walls(state, np.array([e.step for e in lines], np.int64))
        for line, wall in zip(lines, walls):
            # TensorBoard shows a text as Markdown: the line's names escaped for it
            self.text_at(line.step, float(wall), "ampdoctor/forensics", safe.md_text(line.text))

    def close(self) -> None:
        self.file.close()


def _kurtosis(rows: np.ndarray, names: dict[int, str]) -> dict[int, list]:
    """Step -> (tag, value) of each Linear's input kurtosis (its DELAYED row; the same on
    every recipe's), the largest over its calls; a file before format 5 has none."""
    if "kurtosis" not in (rows.dtype.names or ()):
        return {}
    mine = rows[(rows["recipe"] == int(Recipe.DELAYED)) & (rows["role"] == int(Role.INPUT))
                & np.isfinite(rows["kurtosis"])]
    best: dict[tuple[int, str], float] = {}
    for step, tid, k in zip(mine["step"], mine["tensor"], mine["kurtosis"]):
        name = names.get(int(tid))
        key = (int(step), f"ampdoctor-fp8-kurtosis/{name}")
        if name is not None and float(k) > best.get(key, -np.inf):  # (finite: filtered above)
            best[key] = float(k)
    out: dict[int, list] = {}
    for (step, tag), k in best.items():
        out.setdefault(step, []).append((tag, k))
    return out


def _walls(state: Any, steps: np.ndarray) -> np.ndarray:
    """Unix time of each step's boundary (now, for a step not in /steps yet)."""
    s = state.steps
    out = np.full(len(steps), time.time())
    if not len(s) or not len(steps):
        return out
    pos = np.clip(np.searchsorted(s["step"], steps), 0, len(s) - 1)
    found = s["step"][pos] == steps
    out[found] = s["time"][pos[found]]
    return out


def export(run: str, logdir: str, *, follow: bool = False, wait: float = 0.0,
           interval: float = 1.0, stale: float = STALE_SECONDS, force: bool = False) -> Exported:
    """Write the run at ``run`` into TensorBoard event files under ``logdir`` (see the module
    docstring); with ``follow``, until the run ends; with ``force``, in place of an earlier
    export's event files there (removed first; nothing else is). Raises
    ``MissingExtraError`` without the tensorboard package, ``RunFileError`` for a missing or
    unreadable run."""
    protos = _protos()
    follower = Follower(run, stale=stale, layers=False)
    done = Exported()
    writers: dict[str, _RunWriter] = {}
    try:
        if not follower.files() and not follow:
            raise RunFileError(f"{run}: no such file")
        _writable(logdir, force)
        follower.wait(wait)
        try:
            _loop(follower, logdir, protos, writers, done, follow, interval)
        except KeyboardInterrupt:
            done.interrupted = True
        paths = follower.files()
        read = {state.path: state.steps for state in follower.states}
        follower.close()
        _diagnosis(paths, writers, done, read)
        for w in writers.values():  # a failing flush (disk full) said here, as one sentence
            w.close()
    except OSError as exc:
        raise _unwritable(logdir, exc) from None
    finally:
        follower.close()
        for w in writers.values():
            try:
                w.close()
            except OSError:  # already said: the first failure is the sentence
                pass
    done.scalars = sum(w.scalars for w in writers.values())
    done.thinned = sum(w.thinned for w in writers.values())
    done.texts = sum(w.texts for w in writers.values())
    done.runs = [w.logdir for w in writers.values()]
    return done


def _writable(logdir: str, force: bool = False) -> None:
    """Make ``logdir`` (and refuse a place no file can be written, or one that already holds
    ampdoctor's events, unless ``force`` removes them) before any run is read."""
    os.makedirs(logdir, exist_ok=True)
    if not os.access(logdir, os.W_OK | os.X_OK):
        raise PermissionError(13, "Permission denied", logdir)
    earlier = _earlier_export(logdir)
    while earlier and force:
        os.unlink(os.path.join(logdir, earlier))  # a regular file of ours (_earlier_export)
        earlier = _earlier_export(logdir)
    if earlier:
        raise AmpDoctorError(
            f"{logdir} already holds ampdoctor's TensorBoard events ({earlier}): a second "
            "export there would show every point twice; remove that file, pass --force to "
            "replace it, or export into another directory")


def _own_directory(path: str) -> None:
    """A run directory under the log directory (``rank<R>``) is made here, never followed
    through a link or taken from a file of that name."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OutputError(f"cannot write TensorBoard events into {path}: it is not a "
                              "directory of its own (a link or a file); remove it or export "
                              "into another directory") from None


def _earlier_export(logdir: str) -> Optional[str]:
    """An event file an earlier export wrote into ``logdir`` or its ``rank<R>`` runs."""
    places = [logdir] + [os.path.join(logdir, d) for d in sorted(os.listdir(logdir))
                         if d.startswith("rank") and d[4:].isdigit()]
    for place in places:
        try:
            names = sorted(os.listdir(place))
        except OSError:
            continue
        found = next((n for n in names if n.startswith("events.out.tfevents.")
                      and n.endswith(SUFFIX) and _regular(os.path.join(place, n))), None)
        if found:
            return os.path.relpath(os.path.join(place, found), logdir)
    return None


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _unwritable(logdir: str, exc: OSError) -> AmpDoctorError:
    return AmpDoctorError(f"cannot write TensorBoard events into {logdir}: "
                          f"{exc.strerror or exc}")


def _loop(follower: Follower, logdir: str, protos: Any, writers: dict, done: Exported,
          follow: bool, interval: float) -> None:
    while True:
        for delta in follower.poll():
            state = next(s for s in follower.states if s.path == delta.path)
            w = writers.get(delta.path)
            if w is None:
                target = logdir
                if state.world_size > 1:
                    target = os.path.join(logdir, f"rank{state.rank}")
                    _own_directory(target)
                w = writers[delta.path] = _RunWriter(target, protos)
            w.write(delta, state)
            done.steps += len(delta.rows["steps"])
        for w in writers.values():
            w.file.flush()
        if not follow or follower.final:
            return
        time.sleep(interval)


def _diagnosis(paths: list[str], writers: dict, done: Exported, read: dict) -> None:
    """The diagnosis as Markdown text, at the last step of each run written. ``read``: each
    file's /steps as the follower read it, which a one-file run's diagnosis takes instead of
    reading it again (where the file has not grown since: ``store.load``'s ``steps``)."""
    if not paths or not writers or not done.steps:
        return
    from ..diagnosis import engine
    from ..render.diagnosis import render
    from ..runfile.store import load

    if len(paths) > 1:
        d = engine.diagnose(paths)
    else:
        with load(paths[0], engine.STEP_COLUMNS, steps=read.get(paths[0])) as run:
            d = engine.diagnose(run)
    text = render(d, "markdown")
    for w in writers.values():  # at the last step each wrote (the run is not read again)
        if w.last is not None:
            w.text_at(w.last[0], w.last[1], "ampdoctor/diagnosis", text)
