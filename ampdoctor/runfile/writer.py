"""The recording side of the run file: ``Writer`` appends rows and makes them crash-safe.

Writing follows the SWMR recipe (h5py ``docs/swmr.rst``): create every table up front, switch
SWMR on, then only append and flush. A writer killed at any moment leaves a file that opens,
holding every row up to its last flush. Rows are buffered in memory and written in one append
per table at each flush, so the cost of a flush does not grow with the number of steps.

What can go wrong, and what happens then (tests/integration/test_reliability.py shows each):

* the writer is killed: the file reads as it was at the last flush (status "interrupted");
* a write fails (disk full, file deleted): the writer stops for good, and the file is left as
  the last good flush left it, readable (``Writer.flush``, ``Writer.abandon``);
* creating the file fails: nothing is left at its path (``Writer.create``).

This module imports no torch: the recorder hands it numpy rows built from ``schema``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import h5py
import numpy as np

from ..version import __version__
from . import descriptor, liveness, records, schema, summary
from .hdf5 import errno_in, reason

_DISOWNED: list = []  # files inherited through fork: never closed in this process (Writer.disown)


class WriteError(OSError):
    """Writing the run file failed (disk full, file system gone, HDF5 error)."""


class Writer:
    """Append-only writer of one run file.

    Example::

        w = Writer("run.h5", rank=0, world_size=1)
        rows = schema.empty("steps", 1); rows["step"] = 0; rows["loss"] = 2.3
        w.append("steps", rows)
        w.flush()            # rows reach the file; a SIGKILL after this keeps them
        w.close("finished")

    Failure model: the first exception inside ``flush`` (disk full, file system gone, an
    interrupt between two writes) marks the writer ``failed``; it never writes again, and
    ``abandon`` leaves the file on disk exactly as the last good flush left it, which reads
    like the file of a killed writer.
    """

    def __init__(self, path: str, *, rank: int = 0, world_size: int = 1,
                 argv: list[str] | None = None, overwrite: bool = True, create: bool = True):
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self._attrs: dict[str, Any] = {
            "format": schema.FORMAT_NAME,
            "format_version": schema.FORMAT_VERSION,
            "ampdoctor_version": __version__,
            "created": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": rank,
            "world_size": world_size,
            "argv": json.dumps(list(sys.argv if argv is None else argv)),
        }
        self._file: h5py.File | None = None
        self._fd: int | None = None
        self._identity: liveness.Identity | None = None
        self._tables: dict[str, Any] = {}
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in schema.TABLES}
        self._placed = {name: 0 for name in schema.TABLES}  # rows given a place in the file
        self.committed = {name: 0 for name in schema.TABLES}  # rows on disk (last good flush)
        self._blob = bytearray()  # queued bytes of /blob, which start at self._blob_placed
        self._blob_placed = 0
        # /summary's numbers, kept as rows come; None once it failed (the summary then says
        # "read the tables": a bug in it must never stop the recording)
        self._tally: summary.Tally | None = summary.Tally()
        self.closed = False
        self.failed: BaseException | None = None
        if create:
            self.create()

    @property
    def created(self) -> bool:
        """Has the file been created? (A writer made with ``create=False`` waits for ``create``.)"""
        return self._file is not None

    def create(self, path: str | None = None, *, rank: int | None = None,
               world_size: int | None = None) -> None:
        """Create the file, under ``path`` if given; rows queued so far reach it at the next flush.

        A deferred writer (``create=False``) queues rows in memory and touches no file until
        this is called: ``ampdoctor record`` creates a process's file only once it trains.

        The file is built under a temporary name and renamed into place once every table
        exists and SWMR is on, so that a writer killed while creating never leaves a half-made
        file (or a half-overwritten old run) at ``path``.
        """
        if self._file is not None or self.closed:
            return
        if path is not None:
            self.path = os.fspath(path)
        if rank is not None:
            self._attrs["rank"] = rank
        if world_size is not None:
            self._attrs["world_size"] = world_size
        self._attrs["created"] = time.time()
        if not self.overwrite and os.path.exists(self.path):
            raise FileExistsError(self.path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"{self.path} is a directory")
        building = _partial_name(self.path) if os.name == "posix" else self.path
        try:
            self._file = h5py.File(building, "w", libver="latest")
        except OSError as exc:
            raise OSError(getattr(exc, "errno", None),
                          f"cannot create {self.path}: {reason(exc)}") from None
        self._fd = descriptor.of(self._file)
        self._identity = liveness.identity(building)
        liveness.writing(self._identity)
        try:
            self._create_tables()
            self._file.swmr_mode = True
            self._file.flush()
            if building != self.path:
                _put_in_place(building, self.path, self.overwrite)
        except BaseException as exc:
            self.abandon()
            _remove_quietly(building)
            if isinstance(exc, Exception) and not isinstance(exc, OSError):
                raise WriteError(errno_in(exc), f"cannot create {self.path}: "
                                              f"{reason(exc)}") from exc
            raise

    def _create_tables(self) -> None:
        assert self._file is not None, "create() opens the file first"
        self._tables = _new_tables(self._file, self._attrs)

    # -- buffering --------------------------------------------------------------------------

    def append(self, table: str, rows: np.ndarray) -> int:
        """Queue rows for ``table``; return the index of the first one."""
        first = self.rows(table)
        if len(rows):
            rows = np.asarray(rows, schema.TABLES[table])
            self._pending[table].append(rows)
            self._count(table, rows, first)
        return first

    def _count(self, table: str, rows: np.ndarray, first: int) -> None:
        if self._tally is None:
            return
        try:
            self._tally.add(table, rows, first)
        except Exception:  # noqa: BLE001 - readers fall back to the tables
            self._tally = None

    def text(self, value: str) -> tuple[int, int]:
        """Queue a UTF-8 string in /blob; return its (offset, length)."""
        return self.bytes(value.encode("utf-8"))

    def bytes(self, data: bytes) -> tuple[int, int]:
        # The offset is read off the buffer itself (not a separate counter), so that an
        # interrupt between two statements here can never hand out a wrong offset.
        off = self._blob_placed + len(self._blob)
        self._blob += data
        return off, len(data)

    def rows(self, table: str) -> int:
        """Rows of ``table`` written or queued so far."""
        return self._placed[table] + sum(len(chunk) for chunk in self._pending[table])

    def meta(self, key: str, value: Any, step: int = -1) -> None:
        """Record a configuration value (JSON; records as theirs: meta.py). A later row for
        the same key wins."""
        row = schema.empty("meta", 1)
        row["step"] = step
        row["key"] = key.encode()[:32]
        row["value_off"], row["value_len"] = self.text(json.dumps(records.plain(value),
                                                                    default=str))
        self.append("meta", row)
        if key == "status" and self._tally is not None:
            self._tally.set_status(value)

    # -- committing -------------------------------------------------------------------------

    def flush(self) -> None:
        """Write every queued row and make it visible to readers (the crash-safe point).

        Raises what the file system raised (``OSError``); after that the writer is
        ``failed`` and every later flush raises too, so nothing is written twice or out of
        order.
        """
        if self.closed or self._file is None:  # closed, or deferred: rows stay queued
            return
        if self.failed is not None:
            raise WriteError(None, f"no longer written after an earlier failure "
                                   f"({reason(self.failed)})")
        try:
            descriptor.check_still_there(self._fd, self.path)
            self._write_queued()
            self._file.flush()
        except BaseException as exc:
            # Whatever HDF5 still writes for this flush (when the objects of the failed call
            # are released, at close) must not reach the file: it stays as the last good
            # flush left it. Writes that keep failing inside HDF5 can also crash it later.
            self.failed = exc
            descriptor.fit_superblock(self._fd)
            self._retire_descriptor()
            if isinstance(exc, Exception) and not isinstance(exc, OSError):
                raise WriteError(errno_in(exc), reason(exc)) from exc
            raise
        self.committed = dict(self._placed)

    def _write_queued(self) -> None:
        # The blob goes first: a row that points into it must never reach the file before
        # the bytes it points at.
        if self._blob:
            data = np.frombuffer(bytes(self._blob), dtype="u1")
            self._blob_placed += len(data)
            self._blob = bytearray()
            _append_rows(self._tables[schema.BLOB], data)
        for name, chunks in self._pending.items():
            if not chunks:
                continue
            rows = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            self._pending[name] = []
            self._placed[name] += len(rows)
            _append_rows(self._tables[name], rows)
        # Last, so that a summary never counts rows the tables do not hold yet.
        self._tables[schema.SUMMARY_TABLE][0:1] = self._summary_row()

    def _summary_row(self) -> np.ndarray:
        try:
            if self._tally is not None:
                return self._tally.row(self._placed, self._attrs["rank"],
                                       self._attrs["world_size"])
        except Exception:  # noqa: BLE001 - readers fall back to the tables
            self._tally = None
        return summary.unwritten()

    def close(self, status: str | None = None) -> None:
        """Record the final status, flush and close. Safe to call twice.

        A deferred writer that was never created closes without writing anything.
        """
        if self.closed:
            return
        if self._file is None:
            self.closed = True
            return
        try:
            if status is not None:
                self.meta("status", status)
            self.flush()
        except BaseException:
            self.abandon()
            raise
        self.closed = True
        liveness.done_writing(self._identity)
        self._file.close()

    def abandon(self) -> None:
        """Stop writing and leave the file as the last good flush left it; never raises.

        HDF5 writes cached metadata when a file is closed; after a failed write that would
        mix a half-finished flush into the file. So the descriptor is first pointed at
        /dev/null: whatever the close still writes goes nowhere, and the file on disk reads
        like that of a killed writer (every row up to the last good flush).
        """
        self._retire_descriptor()
        self.closed = True
        f = getattr(self, "_file", None)
        if f is None:
            return
        try:
            f.close()
        except Exception:  # noqa: BLE001 - the file is already lost; nothing to report twice
            pass
        self._file = None

    def disown(self) -> None:
        """In a forked child: make this process's copy of the open file unable to write to it.

        The child holds a copy of HDF5's state for the parent's file; closing that copy (or the
        child exiting normally) would flush it into the file the parent is still writing. The
        descriptor is pointed at /dev/null, and the handle is kept alive, so nothing from the
        child ever reaches the parent's file. Plain OS calls only (the descriptor was noted
        when the file was created), so it is safe right after ``fork``.
        """
        self.closed = True
        self._retire_descriptor()
        if self._file is not None:
            _DISOWNED.append(self._file)

    def _retire_descriptor(self) -> None:
        """Point the file's descriptor at /dev/null: nothing this process's HDF5 still
        writes reaches the file (after a failed write, or in a forked child)."""
        liveness.done_writing(getattr(self, "_identity", None))
        if self._fd is not None:
            descriptor.retire(self._fd)
        self._fd = None


def _new_tables(f: h5py.File, attrs: dict[str, Any]) -> dict[str, Any]:
    """Write the root attributes and create every table up front (the SWMR recipe); return
    the tables by name."""
    tables: dict[str, Any] = {}
    for key, value in attrs.items():
        # Text as fixed-length bytes: a variable-length string lives in HDF5's global
        # heap, which has no checksum, and a damaged one can send HDF5 into a loop.
        f.attrs[key] = np.bytes_(value.encode()) if isinstance(value, str) \
            else value
    # The datasets stay open as long as the writer: closing one flushes its chunk cache,
    # and a write that fails there (disk full) is swallowed by h5py and leaves HDF5 in a
    # state that crashes the process at exit. Open, every failed write reaches flush().
    for name, dtype in schema.TABLES.items():
        tables[name] = f.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dtype,
            chunks=(schema.CHUNK_ROWS[name],), compression="gzip", compression_opts=4,
            shuffle=True)
    tables[schema.BLOB] = f.create_dataset(
        schema.BLOB, shape=(0,), maxshape=(None,), dtype="u1", chunks=(schema.BLOB_CHUNK,),
        compression="gzip", compression_opts=4)
    # One row, rewritten in place at each flush (``summary``); until the first flush it
    # says that there is no summary yet.
    tables[schema.SUMMARY_TABLE] = f.create_dataset(
        schema.SUMMARY_TABLE, data=summary.unwritten())
    return tables


def _append_rows(ds: Any, rows: np.ndarray) -> None:
    start = ds.shape[0]
    ds.resize((start + len(rows),))
    ds[start:] = rows


def _put_in_place(building: str, path: str, overwrite: bool) -> None:
    """Rename the finished new file to ``path``; without ``overwrite``, never replace a file
    another process created there in the meantime (a hard link fails if the name exists)."""
    if overwrite:
        os.replace(building, path)
        return
    os.link(building, path)
    os.remove(building)


def _partial_name(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.partial")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
