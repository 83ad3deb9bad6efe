"""A run in a few numbers: ``/summary``, kept current by the writer and read without the tables.

A job of 1024 ranks leaves 1024 run files. Diagnosing them together needs, of most ranks, only
what ``diagnosis.ranks.outline`` says of a rank (steps, skips, the first bad step and whether
the value was born there, status) and its loss scale history; reading every table of every
file for that took minutes and gigabytes. So the writer keeps those numbers as it appends
rows (``Tally``) and rewrites them at every flush into ``/summary``, one fixed row created
with the other tables (``schema.SUMMARY``: SWMR forbids creating a dataset later). Reading
it (``read``) opens the file, reads two attributes, that row and three table lengths, and
closes it: a few milliseconds (``benchmarks/scale_diagnose.py``).

A summary covers exactly the rows of the flush that wrote it. ``read`` checks its counts
against the tables (a writer killed half-way through a flush can leave them apart) and
answers None where they disagree, as for a file of format 1 (no ``/summary``): the caller
then reads that file in full. Names (the module of the first located replay, of the first
non-finite sampled tensor, the text of a recorder error) are read from their rows by index.

The loss scale is kept as its change points (a step where it differs from the step before):
a healthy run has few, one per growth or skip. Up to ``schema.SCALE_POINTS`` are kept; the
digest of all of them tells two ranks' histories apart without reading ``/steps``.

Example::

    s = summary.read("run.rank3.h5")    # RankSummary, or None: read the file in full
    s.first_bad, s.status, s.scale_points
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import h5py
import numpy as np

from ..errors import RunFileError
from . import liveness, schema
from .attributes import check_format, root_attrs, scalar_attrs
from .hdf5 import H5_ERRORS, reason
from .reader import dataset, open_file, retrying
from .run import Blob, meta_dict, one_line
from .schema import Event, Phase, Source, flag

BAD = flag(Event.SKIPPED) | flag(Event.NONFINITE_LOSS) | flag(Event.NONFINITE_GRAD)
LOSS_BAD = flag(Event.NONFINITE_LOSS)
LOCAL_NORM = flag(Event.GRAD_NORM_LOCAL)
_PHASES = frozenset(int(p) for p in Phase)
_UNLOCATED = (int(Phase.NONE), int(Phase.UNKNOWN))


# ---------------------------------------------------------------------------------------------
# The writer's side


class Tally:
    """What ``/summary`` says, updated from every row a ``Writer`` is given (``add``).

    Constant memory: a few counters, the first ``SCALE_POINTS`` scale change points, the
    kinds of the recorded tensors (hundreds), and a running digest.

    Example::

        t = Tally()
        t.add("steps", rows, first=0)
        t.row({"steps": 1, "events": 0, "snapshots": 0})   # the /summary row
    """

    def __init__(self) -> None:
        self.steps = 0
        self.first_step = self.last_step = -1
        self.contiguous = True
        self.skipped = self.bad_steps = self.loss_bad_steps = self.local_norm_steps = 0
        self.first_bad = self.first_loss_bad = -1
        self.located, self.located_step, self.located_phase = -1, -1, int(Phase.UNKNOWN)
        self.replays = self.replays_finite = 0
        self.sampled: Optional[tuple[int, int, int, int]] = None  # step, order, seq, tensor
        self.stopped = -1
        self.status = b""
        self.status_state = 0
        self.scaled = False
        self.scale_n = 0
        self.scale_points: list[tuple[int, float]] = []
        self._prev_scale: Optional[np.float32] = None
        self._digest = hashlib.blake2b(digest_size=16)
        self._kinds: dict[int, int] = {}

    def add(self, table: str, rows: np.ndarray, first: int) -> None:
        """Rows appended to ``table``, the first of them at row ``first``."""
        if not len(rows):
            return
        if table == "steps":
            self._steps(rows)
        elif table == "snapshots":
            self._snapshots(rows, first)
        elif table == "events":
            kinds = rows["kind"] == int(Event.RECORDER_ERROR)
            if self.stopped < 0 and kinds.any():
                self.stopped = first + int(np.argmax(kinds))
        elif table == "tensors":
            self._kinds.update(zip(rows["id"].tolist(), rows["kind"].tolist()))
        elif table == "stats":
            self._stats(rows)
        elif table == "meta" and (rows["key"] == b"status").any():
            self.status_state = 2  # a status not given through set_status: read /meta

    def set_status(self, value: Any) -> None:
        """The run's status as ``Writer.meta("status", value)`` records it."""
        text = value.encode("utf-8") if isinstance(value, str) else b""
        fits = isinstance(value, str) and len(text) <= schema.STATUS_BYTES and \
            not text.endswith(b"\0")
        self.status, self.status_state = (text, 1) if fits else (b"", 2)

    def _steps(self, rows: np.ndarray) -> None:
        steps = rows["step"].astype(np.int64)
        start = steps[0] if self.first_step < 0 else self.last_step + 1
        if self.first_step < 0:
            self.first_step = int(steps[0])
        if not np.array_equal(steps, np.arange(start, start + len(steps))):
            self.contiguous = False
        flags = rows["flags"].astype(np.int64)
        bad, loss = (flags & BAD) != 0, (flags & LOSS_BAD) != 0
        if self.first_bad < 0 and bad.any():
            self.first_bad = int(steps[np.argmax(bad)])
        if self.first_loss_bad < 0 and loss.any():
            self.first_loss_bad = int(steps[np.argmax(loss)])
        self.bad_steps += int(bad.sum())
        self.loss_bad_steps += int(loss.sum())
        self.local_norm_steps += int(((flags & LOCAL_NORM) != 0).sum())
        self.skipped += int((rows["skipped"] == 1).sum())
        self.last_step = int(steps[-1])
        self.steps += len(rows)
        self._scales(steps, rows["scale"].astype(np.float32))

    def _scales(self, steps: np.ndarray, scale: np.ndarray) -> None:
        """Change points of the loss scale: where it differs from the step before (NaN, no
        scale, equals NaN)."""
        nan = np.isnan(scale)
        self.scaled = self.scaled or not bool(nan.all())
        before = np.empty_like(scale)
        before[1:] = scale[:-1]
        before[0] = np.nan if self._prev_scale is None else self._prev_scale
        same = (scale == before) | (nan & np.isnan(before))
        if self._prev_scale is None:
            same[0] = False
        self._prev_scale = scale[-1]
        changed = np.flatnonzero(~same)
        if not len(changed):
            return
        points = np.zeros(len(changed), [("step", "<i8"), ("scale", "<f4")])
        points["step"] = steps[changed]
        points["scale"] = np.where(nan[changed], np.float32(np.nan), scale[changed])
        self._digest.update(points.tobytes())
        room = schema.SCALE_POINTS - len(self.scale_points)
        self.scale_points += [(int(s), float(v)) for s, v in points[:max(room, 0)].tolist()]
        self.scale_n += len(changed)

    def _snapshots(self, rows: np.ndarray, first: int) -> None:
        phases = [p if p in _PHASES else int(Phase.UNKNOWN) for p in rows["phase"].tolist()]
        self.replays += len(rows)
        self.replays_finite += sum(p == int(Phase.NONE) for p in phases)
        if self.located < 0:
            for i, p in enumerate(phases):
                if p not in _UNLOCATED:
                    self.located, self.located_step = first + i, int(rows["step"][i])
                    self.located_phase = p
                    break

    def _stats(self, rows: np.ndarray) -> None:
        bad = np.flatnonzero((rows["source"] == int(Source.SAMPLED)) & (rows["nonfinite"] > 0)
                             & (rows["tensor"] >= 0))
        if not len(bad):
            return
        tensors = rows["tensor"][bad].astype(np.int64)
        order = np.array([schema.KIND_ORDER.get(self._kinds.get(t, -1),
                                                schema.KIND_ORDER_UNKNOWN)
                          for t in tensors.tolist()], np.int64)
        steps, seqs = rows["step"][bad].astype(np.int64), rows["seq"][bad].astype(np.int64)
        i = int(np.lexsort((tensors, seqs, order, steps))[0])
        found = (int(steps[i]), int(order[i]), int(seqs[i]), int(tensors[i]))
        if self.sampled is None or found < self.sampled:
            self.sampled = found

    def row(self, placed: dict[str, int], rank: int = 0, world_size: int = 1) -> np.ndarray:
        """The ``/summary`` row for a file holding ``placed`` rows of each table."""
        out = np.zeros(1, schema.SUMMARY)
        r = out[0]
        r["written"], r["rank"], r["world_size"] = time.time(), rank, world_size
        r["steps"], r["events"], r["snapshots"] = (placed["steps"], placed["events"],
                                                   placed["snapshots"])
        for name in ("first_step", "last_step", "skipped", "bad_steps", "first_bad",
                     "loss_bad_steps", "first_loss_bad", "local_norm_steps", "located",
                     "located_step", "located_phase", "replays", "replays_finite", "stopped",
                     "status", "status_state", "scale_n"):
            r[name] = getattr(self, name)
        r["contiguous"], r["scaled"] = int(self.contiguous), int(self.scaled)
        r["sampled_step"], r["sampled_tensor"] = (self.sampled[0], self.sampled[3]) \
            if self.sampled is not None else (-1, -1)
        r["scale_step"] = -1
        r["scale_value"] = np.nan
        for i, (step, value) in enumerate(self.scale_points):
            r["scale_step"][i], r["scale_value"][i] = step, value
        r["scale_digest"] = self._digest.copy().digest()
        return out


def unwritten() -> np.ndarray:
    """The ``/summary`` row of a file just created: no summary yet (``read`` answers None)."""
    out = np.zeros(1, schema.SUMMARY)
    out["steps"] = -1
    return out


# ---------------------------------------------------------------------------------------------
# The reader's side


@dataclass
class RankSummary:
    """One rank file's ``/summary``, decoded (see ``schema.SUMMARY`` for each field).

    ``located``: the first replay that located a value, {"step", "phase" (a ``Phase``),
    "module"}; ``sampled``: the first non-finite tensor of the sampled tier, {"step",
    "kind" (a ``Kind``), "module"}; ``stopped``: {"step", "why"} of a recorder error;
    ``scale_points``: every change point of the loss scale as (step, scale), or None when the
    run has more than ``schema.SCALE_POINTS`` (then ``scale_digest`` still tells histories
    apart, and ``/steps`` holds them).
    """

    path: str
    rank: int
    world_size: int
    status: str
    steps: int
    first_step: Optional[int]
    last_step: Optional[int]
    contiguous: bool
    skipped: int
    bad_steps: int
    first_bad: Optional[int]
    loss_bad_steps: int
    first_loss_bad: Optional[int]
    local_norm_steps: int
    replays: int
    replays_finite: int
    scaled: bool
    scale_n: int
    scale_digest: str
    written: float
    located: Optional[dict] = None
    sampled: Optional[dict] = None
    stopped: Optional[dict] = None
    scale_points: Optional[list] = field(default=None, repr=False)
    # The writer's host, pid and creation time where the status depends on whether it still
    # runs ("running", "interrupted"): a node summary (``nodes.py``) asks again when read.
    writer: Optional[dict] = field(default=None, repr=False)


def read(path: str | os.PathLike) -> Optional[RankSummary]:
    """The summary of one run file, or None when it has none that can be trusted (format 1,
    or a summary that disagrees with the tables): read that file in full instead.

    Raises ``RunFileError`` as ``store.load`` does for a file that is not a readable run.
    """
    path = os.fspath(path)
    return retrying(path, lambda: _read_once(path))


def _read_once(path: str) -> Optional[RankSummary]:
    f, live = open_file(path)
    try:
        return _decode(path, f, live)
    except H5_ERRORS as exc:
        raise RunFileError(f"{path} is damaged and could not be read ({reason(exc)})") from None
    finally:
        f.close()


ATTRS = ("format", "format_version")
LIVENESS_ATTRS = ("host", "pid", "created")

# Every read below counts a thousand times over in a large job, so the summary is read with
# h5py's low-level calls (a tenth of the cost of the high-level objects): the file's two
# format attributes, the summary row, three table lengths, one /steps field of one row.
_TIME = np.dtype([("time", "<f8")])
_MODULE = np.dtype([("module_off", "<i8"), ("module_len", "<i4")])
_TENSOR = np.dtype([("id", "<i4"), ("kind", "i1"), ("name_off", "<i8"), ("name_len", "<i4")])
_EVENT = np.dtype([("step", "<i8"), ("text_off", "<i8"), ("text_len", "<i4")])


def _decode(path: str, f: h5py.File, live: bool) -> Optional[RankSummary]:
    check_format(path, scalar_attrs(f, ATTRS) or root_attrs(f, ATTRS))
    live = live or bool(f.swmr_mode)
    ds = _dataset(f, schema.SUMMARY_TABLE, live)
    if ds is None or _length(ds) != 1 or ds.get_type() != _file_type(schema.SUMMARY):
        return None
    r = _row(ds, 0, schema.SUMMARY)
    if int(r["steps"]) < 0 or not _covers(path, f, r, live):
        return None
    status = _status(path, f, r, live)
    n = int(r["scale_n"])
    out = RankSummary(
        path=path, rank=int(r["rank"]), world_size=int(r["world_size"]), status=status,
        steps=int(r["steps"]),
        first_step=_opt(r["first_step"]), last_step=_opt(r["last_step"]),
        contiguous=bool(r["contiguous"]), skipped=int(r["skipped"]),
        bad_steps=int(r["bad_steps"]), first_bad=_opt(r["first_bad"]),
        loss_bad_steps=int(r["loss_bad_steps"]), first_loss_bad=_opt(r["first_loss_bad"]),
        local_norm_steps=int(r["local_norm_steps"]), replays=int(r["replays"]),
        replays_finite=int(r["replays_finite"]), scaled=bool(r["scaled"]), scale_n=n,
        scale_digest=bytes(r["scale_digest"]).hex(), written=float(r["written"]),
        scale_points=[(int(s), float(v)) for s, v in zip(r["scale_step"][:n].tolist(),
                                                         r["scale_value"][:n].tolist())]
        if n <= schema.SCALE_POINTS else None)
    _names(path, f, r, out, live)
    if status in ("running", "interrupted"):
        out.writer = root_attrs(f, LIVENESS_ATTRS)
    return out


_STEP_FLAGS = np.dtype([("step", "<i8"), ("flags", "<i4")])


def step_flags(path: str | os.PathLike, row: int) -> Optional[tuple[int, int]]:
    """``(step, flags)`` of one /steps row, read as the summary is (one field pair of one
    row), or None past the table's end: a rank's own found_inf at its first bad step
    (``diagnosis.job.read_own_flags``) without reading its /steps."""
    path = os.fspath(path)
    return retrying(path, lambda: _step_flags_once(path, row))


def _step_flags_once(path: str, row: int) -> Optional[tuple[int, int]]:
    f, live = open_file(path)
    try:
        check_format(path, scalar_attrs(f, ATTRS) or root_attrs(f, ATTRS))
        ds = _table(path, f, "steps", live or bool(f.swmr_mode))
        if not 0 <= row < (_length(ds) or 0):
            return None
        r = _row(ds, row, _STEP_FLAGS)
        return int(r["step"]), int(r["flags"])
    except H5_ERRORS as exc:
        raise RunFileError(f"{path} is damaged and could not be read ({reason(exc)})") from None
    finally:
        f.close()


def _opt(value: Any) -> Optional[int]:
    return None if int(value) < 0 else int(value)


def _dataset(f: h5py.File, name: str, live: bool) -> Any:
    """The low-level dataset ``name`` (refreshed for a SWMR reader), or None without one."""
    try:
        ds = h5py.h5d.open(f.id, name.encode())
    except KeyError:
        return None
    if live:
        ds.refresh()
    return ds


def _table(path: str, f: h5py.File, name: str, live: bool) -> Any:
    ds = _dataset(f, name, live)
    if ds is None:
        raise RunFileError(f"{path} is damaged: table /{name} is missing")
    return ds


def _length(ds: Any) -> Optional[int]:
    shape = ds.get_space().shape
    return int(shape[0]) if len(shape) == 1 else None


@functools.lru_cache(maxsize=16)
def _file_type(dtype: np.dtype) -> Any:
    return h5py.h5t.py_create(dtype)


def _row(ds: Any, i: int, dtype: np.dtype) -> Any:
    """Row ``i`` of a table, the fields of ``dtype`` only (HDF5 converts by field name)."""
    space = ds.get_space()
    space.select_hyperslab((i,), (1,))
    out = np.zeros(1, dtype)
    ds.read(h5py.h5s.create_simple((1,)), space, out, _file_type(dtype))
    return out[0]


def _covers(path: str, f: h5py.File, r: Any, live: bool) -> bool:
    """Do the tables hold exactly the rows the summary covers, the last of each written?"""
    for name in ("steps", "events", "snapshots"):
        if _length(_table(path, f, name, live)) != int(r[name]):
            return False
    # HDF5 fills rows that never reached the file with 0: a step's time never is.
    n = int(r["steps"])
    return n == 0 or bool(_row(_table(path, f, "steps", live), n - 1, _TIME)["time"] != 0)


def _status(path: str, f: h5py.File, r: Any, live: bool) -> str:
    """As ``Run.status``: the last status written; 'running' or 'interrupted' without one."""
    state = int(r["status_state"])
    if state == 1:
        status: Any = bytes(r["status"]).decode("utf-8", errors="replace")
    elif state == 2:
        meta = dataset(path, f, "meta")
        blob = dataset(path, f, schema.BLOB)
        if live:
            meta.refresh()
            blob.refresh()
        status = meta_dict(meta[:], Blob(blob, path)).get("status", schema.STATUS_RUNNING)
    else:
        status = schema.STATUS_RUNNING
    if isinstance(status, str) and status != schema.STATUS_RUNNING:
        return status
    if not live:
        return "interrupted"
    attrs = root_attrs(f, ATTRS + LIVENESS_ATTRS)
    return "running" if liveness.writer_alive(attrs, path) else "interrupted"


def _names(path: str, f: h5py.File, r: Any, out: RankSummary, live: bool) -> None:
    """The located replay's module, the first non-finite sampled tensor, the recorder error:
    each read from its own row and its text from /blob, by range."""
    def row(name: str, i: int, dtype: np.dtype) -> Any:
        ds = _table(path, f, name, live)
        return _row(ds, i, dtype) if 0 <= i < (_length(ds) or 0) else None

    def text(off: Any, length: Any) -> str:
        off, length = int(off), int(length)
        blob = _table(path, f, schema.BLOB, live)
        if length <= 0 or off < 0 or off + length > (_length(blob) or 0):
            return ""
        space = blob.get_space()
        space.select_hyperslab((off,), (length,))
        data = np.zeros(length, np.uint8)
        blob.read(h5py.h5s.create_simple((length,)), space, data)
        return one_line(data.tobytes().decode("utf-8", errors="replace"))

    snap = row("snapshots", int(r["located"]), _MODULE) if int(r["located"]) >= 0 else None
    if snap is not None:
        out.located = {"step": int(r["located_step"]), "phase": Phase(int(r["located_phase"])),
                       "module": text(snap["module_off"], snap["module_len"])}
    tensor = int(r["sampled_tensor"])
    found = row("tensors", tensor, _TENSOR) if int(r["sampled_step"]) >= 0 else None
    if found is not None and int(found["id"]) == tensor:
        out.sampled = {"step": int(r["sampled_step"]), "kind": int(found["kind"]),
                       "module": text(found["name_off"], found["name_len"])}
    ev = row("events", int(r["stopped"]), _EVENT) if int(r["stopped"]) >= 0 else None
    if ev is not None:
        out.stopped = {"step": int(ev["step"]), "why": text(ev["text_off"], ev["text_len"])}
