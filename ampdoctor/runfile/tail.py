"""Following a run file while it is written: ``Tail`` hands out the rows added since its last read.

``ampdoctor top`` and ``ampdoctor export --follow`` (``live.follow``) read through it. It opens
the file as ``reader`` does and decodes rows as ``run`` does, so a followed run and a loaded one
read alike (``/steps`` column by column, as ``columns.Columns``, read a block at a time: the
first read of a month-long run never holds its rows whole); what it adds is a cursor per
table, a ``/blob`` read by range only (``_Ranged``), and the questions a follower asks of the
writer: still alive, or replaced by a new recording.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

from ..errors import RunFileError
from . import inflate, liveness, migrations, schema, values
from .attributes import check_format, root_attrs
from .columns import Columns
from .hdf5 import H5_ERRORS, reason
from .reader import (
    READ_ORDER,
    check_values,
    dataset,
    open_file,
    retrying,
    without_unwritten_tail,
    written_rows,
)
from .run import TEXTS, Blob, Table, decoded_rows, meta_dict, tensor_view


class Tail:
    """A run file kept open, read again and again: each ``read`` returns only the rows added
    since the last one (``ampdoctor top``, ``ampdoctor export --follow``).

    A file still being written is opened as a SWMR reader, which takes no lock and writes
    nothing: the writer never waits for it. Each ``read`` refreshes every table and reads its
    new rows, in the same order as ``load`` (rows that point into ``/blob`` or ``/tensors``
    before what they point at), so every reference read has its target. A read that fails
    half-way (the writer mid-flush) raises ``RunFileError`` and moves no cursor: the next read
    tries the same rows again. ``/stats`` is not read here: ``stats`` is a ``Table`` over the
    rows written so far, to read by range.

    Example::

        tail = store.Tail("run.h5")
        new = tail.read()      # {'steps': rows, 'events': decoded rows, 'meta': {...}, ...}
        new["steps"]["loss"], tail.stats.column("absmax", start, len(tail.stats))
        tail.close()
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file, self.live = retrying(self.path, lambda: open_file(self.path))
        try:
            self.attrs = root_attrs(self._file)
            self.version = check_format(self.path, self.attrs)
        except BaseException:
            self._file.close()
            raise
        self.live = self.live or bool(self._file.swmr_mode)
        self.identity = liveness.identity(self.path)
        self.done = {name: 0 for name in schema.TABLES}  # rows handed out so far, per table
        self.stats = Table(schema.empty("stats"), name="stats")
        self._datasets: dict[str, Any] = {}  # opened and checked once, refreshed at each read
        self._stats_shape = -1  # /stats length at the last read, all of it written
        self._last_step: int | None = None  # the step of the last /steps row handed out

    def read(self) -> dict[str, Any]:
        """New rows of every table but ``/stats`` (``meta``: the keys written since, decoded;
        ``steps``: a ``columns.Columns``; ``groups``: a ``run.Table`` of its new rows, read by
        range)."""
        if self._file is None:
            raise RunFileError(f"{self.path} is no longer open")
        try:
            rows, stats = self._new_rows()
            blob = self._blob()
            check_values(self.path, rows, blob.size, self.done, self._last_step)
            # a writer numbers tensors 0, 1, 2... in row order: an id past that would size the
            # live view's id -> tensor maps (a 2**31 id: 16 GiB)
            values.check_ids(self.path, "tensors", rows["tensors"]["id"],
                             self.done["tensors"] + len(rows["tensors"]), self.done["tensors"])
            stats.tensors = self.done["tensors"] + len(rows["tensors"])
            out = {"steps": rows["steps"], "groups": rows["groups"],
                   "losses": rows["losses"], "optimizers": rows["optimizers"],
                   "fp8": rows["fp8"],
                   "meta": meta_dict(rows["meta"], blob, self.path, self.done["meta"]),
                   "tensors": tensor_view(rows["tensors"], blob)}
            out.update({name: decoded_rows(name, rows[name], blob) for name in TEXTS})
        except H5_ERRORS as exc:
            raise RunFileError(f"{self.path} could not be read ({reason(exc)})") from None
        for name, new in rows.items():
            self.done[name] += len(new)
        if len(rows["steps"]):
            self._last_step = int(rows["steps"]["step"][-1])
        self.stats = stats
        # Known for good only once every row of it is written (a flush may be half-way).
        self._stats_shape = len(stats) if len(stats) == len(stats._data) else -1
        return out

    def _new_rows(self) -> tuple[dict[str, Any], Table]:
        rows: dict[str, Any] = {}
        stats = self.stats
        for name in READ_ORDER:  # referring tables first, as ``load`` reads them
            if name == schema.BLOB:
                continue
            if name not in schema.tables_of(self.version):  # added by a later format
                rows[name] = schema.empty(name)
                continue
            ds = self._table(name)
            if name == "stats":
                if ds.shape[0] != self._stats_shape:  # finding the written end reads rows
                    stats = Table(ds, nrows=written_rows(ds), path=self.path, name="stats",
                                  lift=migrations.find(name, self.version, ds.dtype),
                                  threads=not self.live)
                continue
            start = self.done[name]
            if name == "steps":
                rows[name] = self._steps_from(ds, start)
                continue
            if name == "groups":  # a month-long run's first read: 20 M rows, read by range
                rows[name] = Table(ds, nrows=max(start, written_rows(ds)), path=self.path,
                                   name=name, lift=migrations.find(name, self.version, ds.dtype),
                                   first=start, threads=not self.live)
                continue
            rows[name] = migrations.lift(name, self.version, without_unwritten_tail(
                name, ds[start:])) if ds.shape[0] > start else schema.empty(name)
        return rows, stats

    def _steps_from(self, ds: Any, start: int) -> Columns:
        """/steps from row ``start`` to its written end, column by column, read a block at a
        time (``columns``): never the rows whole. A file no longer written: by its stored
        chunks, on two threads (``inflate``)."""
        stored = None if self.live else inflate.Stored.of(ds)

        def rows_of(a: int, b: int) -> np.ndarray:
            rows = None if stored is None else stored.rows(start + a, start + b)
            return migrations.lift("steps", self.version,
                                   ds[start + a:start + b] if rows is None else rows)

        return Columns.read(rows_of, max(0, written_rows(ds) - start), schema.STEPS)

    def _blob(self) -> "_Ranged":
        return _Ranged(self._table(schema.BLOB), self.path)

    def _table(self, name: str) -> Any:
        ds = self._datasets.get(name)
        if ds is None:
            ds = self._datasets[name] = dataset(self.path, self._file, name, self.version)
        if self.live:
            ds.refresh()
        return ds

    def writer_alive(self) -> bool | None:
        """Is the writer still running with the file open? None where this cannot be told
        from here (another host: a live writer and a killed one look alike)."""
        if self.attrs.get("host") != socket.gethostname():
            return None
        return liveness.writer_alive(self.attrs, self.path)

    def replaced(self) -> bool:
        """Is ``path`` now another file (a new recording with ``--force``), or gone?"""
        return liveness.identity(self.path) != self.identity

    def close(self) -> None:
        self._datasets.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "Tail":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Ranged(Blob):
    """/blob read by range only: a follower decodes a few new references per read and never
    loads the heap (nor the arrays saved in it) whole."""

    def __init__(self, ds: Any, path: str):
        super().__init__(None, path)
        self._ds = ds
        self.size = int(ds.shape[0])
