"""The HDF5 run file: ``Writer`` on the recording side, ``load`` → ``Run`` on the analysis side.

This module is h5py's only owner. It imports no torch.

Writing follows the SWMR recipe (h5py ``docs/swmr.rst``): create every table up front, switch
SWMR on, then only append and flush. A writer killed at any moment leaves a file that opens,
holding every row up to its last flush. Rows are buffered in memory and written in one append
per table at each flush, so the cost of a flush does not grow with the number of steps.

What can go wrong, and what happens then (tests/test_reliability.py shows each):

* the writer is killed: the file reads as it was at the last flush (status "interrupted");
* a write fails (disk full, file deleted): the writer stops for good, and the file is left as
  the last good flush left it, readable (``Writer.flush``, ``Writer.abandon``);
* the file is damaged, truncated or not ours: ``load`` and ``inspect`` raise ``RunFileError``,
  one sentence naming the file, and never hang: a SWMR reader's metadata retries are bounded,
  and nothing is read from HDF5's unchecksummed global heap (no variable-length data);
* one table is damaged but ``/steps`` is not: the run loads without it (``Run.damaged``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import json
import os
import re
import select
import signal
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import h5py
import numpy as np

from ..errors import FormatTooNewError, RunFileError
from ..version import __version__
from . import schema

# ---------------------------------------------------------------------------------------------
# Writing


_WRITING: set[tuple[int, int]] = set()  # files this process's open writers are writing
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
        self._attrs = {
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
        self._identity: tuple[int, int] | None = None
        self._tables: dict[str, Any] = {}
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in schema.TABLES}
        self._placed = {name: 0 for name in schema.TABLES}  # rows given a place in the file
        self.committed = {name: 0 for name in schema.TABLES}  # rows on disk (last good flush)
        self._blob = bytearray()  # queued bytes of /blob, which start at self._blob_placed
        self._blob_placed = 0
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
                          f"cannot create {self.path}: {_reason(exc)}") from None
        self._fd = _file_descriptor(self._file)
        self._identity = _identity(building)
        _WRITING.add(self._identity)
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
                raise WriteError(_errno(exc), f"cannot create {self.path}: "
                                              f"{_reason(exc)}") from exc
            raise

    def _create_tables(self) -> None:
        for key, value in self._attrs.items():
            # Text as fixed-length bytes: a variable-length string lives in HDF5's global
            # heap, which has no checksum, and a damaged one can send HDF5 into a loop.
            self._file.attrs[key] = np.bytes_(value.encode()) if isinstance(value, str) \
                else value
        # The datasets stay open as long as the writer: closing one flushes its chunk cache,
        # and a write that fails there (disk full) is swallowed by h5py and leaves HDF5 in a
        # state that crashes the process at exit. Open, every failed write reaches flush().
        for name, dtype in schema.TABLES.items():
            self._tables[name] = self._file.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dtype,
                chunks=(schema.CHUNK_ROWS[name],), compression="gzip", compression_opts=4,
                shuffle=True)
        self._tables[schema.BLOB] = self._file.create_dataset(
            schema.BLOB, shape=(0,), maxshape=(None,), dtype="u1", chunks=(schema.BLOB_CHUNK,),
            compression="gzip", compression_opts=4)

    # -- buffering --------------------------------------------------------------------------

    def append(self, table: str, rows: np.ndarray) -> int:
        """Queue rows for ``table``; return the index of the first one."""
        first = self.rows(table)
        if len(rows):
            self._pending[table].append(np.asarray(rows, schema.TABLES[table]))
        return first

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
        """Record a configuration value (JSON). A later row for the same key wins."""
        row = schema.empty("meta", 1)
        row["step"] = step
        row["key"] = key.encode()[:32]
        row["value_off"], row["value_len"] = self.text(json.dumps(value, default=str))
        self.append("meta", row)

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
                                   f"({_reason(self.failed)})")
        try:
            self._check_still_there()
            self._write_queued()
            self._file.flush()
        except BaseException as exc:
            # Whatever HDF5 still writes for this flush (when the objects of the failed call
            # are released, at close) must not reach the file: it stays as the last good
            # flush left it. Writes that keep failing inside HDF5 can also crash it later.
            self.failed = exc
            self._fit_superblock()
            self._retire_descriptor()
            if isinstance(exc, Exception) and not isinstance(exc, OSError):
                raise WriteError(_errno(exc), _reason(exc)) from exc
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

    def _check_still_there(self) -> None:
        """A deleted file (its directory removed) still takes writes that nobody will read."""
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            raise FileNotFoundError(errno.ENOENT, f"{self.path} was deleted while being "
                                                  "written (its directory removed?)")

    def _fit_superblock(self) -> None:
        """After a failed write, make the superblock's end-of-file match the file's size.

        HDF5 writes the superblock (with the new end of file) before it extends the file; a
        write that fails in between (disk full) leaves a file shorter than its header says,
        which HDF5 refuses to open although everything up to the last good flush is there.
        Rewriting the 48 bytes in place needs no new disk space.
        """
        if self._fd is None:
            return
        try:
            head = os.pread(self._fd, 48, 0)
            fixed = _superblock_with_eof(head, os.fstat(self._fd).st_size)
            if fixed is not None:
                os.pwrite(self._fd, fixed, 0)
        except OSError:
            pass

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
        _WRITING.discard(self._identity)
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
        if getattr(self, "_file", None) is None:
            return
        try:
            self._file.close()
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
        _WRITING.discard(getattr(self, "_identity", None))
        if self._fd is None:
            return
        try:
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, self._fd)
            finally:
                os.close(null)
        except OSError:
            pass
        self._fd = None


def _append_rows(ds: Any, rows: np.ndarray) -> None:
    start = ds.shape[0]
    ds.resize((start + len(rows),))
    ds[start:] = rows


_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _superblock_with_eof(head: bytes, size: int) -> bytes | None:
    """A version 2/3 superblock whose end of file is clamped to ``size``; None if unchanged
    or not a superblock this knows (8-byte addresses, checksum intact)."""
    if len(head) < 48 or head[:8] != _SIGNATURE or head[8] not in (2, 3) or head[9] != 8:
        return None
    if struct.unpack("<I", head[44:48])[0] != _lookup3(head[:44]):
        return None
    base, ext, eof, root = struct.unpack("<4Q", head[12:44])
    if base + eof <= size or size < base:
        return None
    body = head[:28] + struct.pack("<Q", size - base) + head[36:44]
    return body + struct.pack("<I", _lookup3(body))


def _lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 hash ("hashlittle"): HDF5's checksum of metadata blocks."""
    mask = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & mask

    n = len(data)
    v = [(0xDEADBEEF + n + initval) & mask] * 3  # a, b, c
    i = 0
    while n - i > 12:
        for j in range(3):
            v[j] = (v[j] + int.from_bytes(data[i + 4 * j:i + 4 * j + 4], "little")) & mask
        # mix(a, b, c): x -= y; x ^= rot(y, k); y += z
        for x, y, z, k in ((0, 2, 1, 4), (1, 0, 2, 6), (2, 1, 0, 8), (0, 2, 1, 16),
                           (1, 0, 2, 19), (2, 1, 0, 4)):
            v[x] = ((v[x] - v[y]) & mask) ^ rot(v[y], k)
            v[y] = (v[y] + v[z]) & mask
        i += 12
    if n == i:
        return v[2]
    tail = data[i:] + bytes(12 - (n - i))
    for j in range(3):
        v[j] = (v[j] + int.from_bytes(tail[4 * j:4 * j + 4], "little")) & mask
    # final(a, b, c): x ^= y; x -= rot(y, k)
    for x, y, k in ((2, 1, 14), (0, 2, 11), (1, 0, 25), (2, 1, 16), (0, 2, 4), (1, 0, 14),
                    (2, 1, 24)):
        v[x] = ((v[x] ^ v[y]) - rot(v[y], k)) & mask
    return v[2]


def _errno(exc: BaseException) -> int | None:
    """The OS error number inside an h5py message ("errno = 28"), if any."""
    found = re.search(r"errno = (\d+)", str(exc))
    return int(found.group(1)) if found else None


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


def _file_descriptor(f: h5py.File) -> int | None:
    """The OS descriptor under an HDF5 file (default sec2 driver), or None."""
    try:
        fd = int(f.id.get_vfd_handle())
        os.fstat(fd)
        return fd
    except Exception:  # noqa: BLE001 - another driver: no descriptor checks, nothing else
        return None


def _reason(exc: BaseException) -> str:
    """The useful part of an exception's message, on one line.

    h5py nests the cause in parentheses ("Unable to open file (file signature not found)")
    and a failed write names the OS error inside ("... error message = 'No space left ...'").
    """
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    os_error = re.search(r"error message = '([^']*)'", str(exc))
    if os_error:
        return os_error.group(1)
    text = (str(exc).strip().splitlines() or [""])[0]
    _head, paren, rest = text.partition("(")
    if paren and rest.endswith(")"):
        text = rest[:-1]
    return text.strip() or type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Reading
#
# Everything read from a file is data: numbers, UTF-8 text, JSON. Nothing is unpickled or
# evaluated. Every failure of h5py on a damaged file becomes one RunFileError sentence.

H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)  # what h5py raises

# HDF5 gives a SWMR reader 100 attempts, with back-off, at each metadata block whose checksum
# fails, because a live writer may be half-way through a flush. On a damaged file that is
# minutes of retrying. A few attempts cover a live writer; `load` retries the whole read.
SWMR_READ_ATTEMPTS = 4
LIVE_RETRIES = 3
BLOB_WHOLE = 8 << 20  # a /blob up to this size is read at once; a larger one by ranges


class Table:
    """Rows of one table, read on demand: columns, slices and chunks, never more than asked.

    Wraps an HDF5 dataset (a loaded run) or a numpy array (a run built in memory, tests).
    A read that fails on a damaged file raises ``RunFileError`` naming the file.
    """

    def __init__(self, data: Any, nrows: int | None = None, path: str | None = None,
                 name: str = "stats"):
        self._data = data
        self._n = len(data) if nrows is None else nrows
        self.dtype = data.dtype
        self._path = path
        self._name = name

    def __len__(self) -> int:
        return self._n

    def _read(self, what: Any, start: int, stop: int | None) -> np.ndarray:
        stop = self._n if stop is None else min(stop, self._n)
        if isinstance(self._data, np.ndarray):
            data = self._data if what is None else self._data[what]
            return data[start:stop]
        if stop <= start:
            dtype = self.dtype if what is None else (
                self.dtype[what] if isinstance(what, str)
                else np.dtype([(n, self.dtype[n]) for n in what]))
            return np.empty(0, dtype)
        try:
            source = self._data if what is None else self._data.fields(what)
            return source[start:stop]
        except H5_ERRORS as exc:
            raise RunFileError(f"{self._path} is damaged: reading /{self._name} failed "
                               f"({_reason(exc)})") from None

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._read(name, start, stop)

    def columns(self, names: list[str] | tuple[str, ...], start: int = 0,
                stop: int | None = None) -> np.ndarray:
        return self._read(list(names), start, stop)

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._read(None, start, stop)

    def chunks(self, size: int = 1 << 16, names: tuple[str, ...] | None = None
               ) -> Iterator[np.ndarray]:
        """Iterate over the table ``size`` rows at a time (bounded memory)."""
        for start in range(0, self._n, size):
            if names is None:
                yield self.rows(start, start + size)
            else:
                yield self.columns(names, start, start + size)

    def read(self) -> np.ndarray:
        return self.rows()

    def __getitem__(self, key: Any) -> np.ndarray:
        """``table["lr"]``: a whole column; anything else indexes the rows (reads them all)."""
        return self.column(key) if isinstance(key, str) else self.rows()[key]


class Blob:
    """The /blob byte heap: text and array bytes by (offset, length).

    A small heap is read once; a large one (snapshots' batches) is read by range, so that
    decoding a few names never loads the saved arrays.
    """

    def __init__(self, data: Any = None, path: str | None = None):
        self._path = path
        self._ds = None
        self._bytes = b""
        if isinstance(data, (bytes, bytearray, np.ndarray)):
            self._bytes = bytes(np.asarray(data, dtype="u1").tobytes()
                                if isinstance(data, np.ndarray) else data)
            self.size = len(self._bytes)
        elif data is not None:
            self.size = int(data.shape[0])
            if self.size <= BLOB_WHOLE:
                self._bytes = np.asarray(data[:]).tobytes()
            else:
                self._ds = data
        else:
            self.size = 0

    def read(self, off: int, length: int) -> bytes | None:
        """The bytes at ``off``, or None when the range lies outside the heap (damage)."""
        if length <= 0:
            return b""
        if off < 0 or off + length > self.size:
            return None
        if self._ds is None:
            return self._bytes[off:off + length]
        try:
            return np.asarray(self._ds[off:off + length]).tobytes()
        except H5_ERRORS as exc:
            raise RunFileError(f"{self._path} is damaged: reading /blob failed "
                               f"({_reason(exc)})") from None

    def text(self, off: int, length: int) -> str:
        """Text at a reference; '' for a reference outside the heap (a damaged file)."""
        raw = self.read(off, length)
        return raw.decode("utf-8", errors="replace") if raw else ""


TENSOR_VIEW = np.dtype([("id", "<i4"), ("kind", "i1"), ("index", "<i2"), ("dtype", "i1"),
                        ("numel", "<i8"), ("name", object), ("type", object)])


@dataclass
class Run:
    """A recorded run: numpy views of every table plus what the run learnt about itself.

    ``steps``, ``events``, ``snapshots``, ``arrays`` and ``tensors`` are loaded whole (text
    decoded to ``str``); ``stats`` and ``groups`` (a row per step and param group, which the
    analysis does not need) are ``Table``s read on demand: ``run.groups["lr"]``.

    Example::

        run = ampdoctor.load("run.h5")
        run.steps["scale"]          # loss scale before each update
        run.meta["autocast_dtype"]  # 'float16'
        run.tensor_name(7)          # 'blocks.3.attn'
    """

    path: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    steps: np.ndarray = field(default_factory=lambda: schema.empty("steps"))
    groups: Any = field(default_factory=lambda: Table(schema.empty("groups"), name="groups"))
    tensors: np.ndarray = field(default_factory=lambda: np.zeros(0, TENSOR_VIEW))
    stats: Table = field(default_factory=lambda: Table(schema.empty("stats")))
    events: np.ndarray = field(default_factory=lambda: decoded(schema.empty("events"), ["text"]))
    snapshots: np.ndarray = field(default_factory=lambda: decoded(
        schema.empty("snapshots"), ["module", "module_type", "detail"]))
    arrays: np.ndarray = field(default_factory=lambda: decoded(schema.empty("arrays"), ["name"]))
    live: bool = False  # the writer has the file open and is still running
    damaged: list = field(default_factory=list)  # tables that could not be read (left empty)
    _file: Any = field(default=None, repr=False)
    _blob: Any = field(default=None, repr=False)

    def _meta_dict(self, key: str) -> dict[str, Any] | None:
        value = self.meta.get(key)
        return value if isinstance(value, dict) else None

    # Typed views of /meta (schema.META_KEYS): None (or []) when the run did not record it.
    @property
    def autocast(self) -> dict[str, Any] | None:
        """``{"enabled": True, "dtype": "float16", "device_type": "cuda", ...}``"""
        return self._meta_dict("autocast")

    @property
    def scaler(self) -> dict[str, Any] | None:
        return self._meta_dict("scaler")

    @property
    def device(self) -> dict[str, Any] | None:
        return self._meta_dict("device")

    @property
    def model(self) -> dict[str, Any] | None:
        return self._meta_dict("model")

    @property
    def sharding(self) -> dict[str, Any] | None:
        return self._meta_dict("sharding")

    @property
    def compiled(self) -> dict[str, Any] | None:
        return self._meta_dict("compiled")

    @property
    def recorder_settings(self) -> dict[str, Any] | None:
        return self._meta_dict("recorder")

    @property
    def clip(self) -> dict[str, Any] | None:
        """``{"max_norm": 1.0, "norm_type": 2.0, "foreach": None}``, the latest call's."""
        return self._meta_dict("clip")

    @property
    def torch_info(self) -> dict[str, Any] | None:
        return self._meta_dict("torch")

    @property
    def optimizers(self) -> list[dict[str, Any]]:
        opt = self.meta.get("optimizer")
        return [o for o in opt if isinstance(o, dict)] if isinstance(opt, list) else []

    @property
    def roots(self) -> list[str]:
        roots = self.meta.get("roots")
        return [str(r) for r in roots] if isinstance(roots, list) else []

    @property
    def status(self) -> str:
        """'finished', 'exception:<Type>', 'signal:<NAME>', 'running' (still being written),
        or 'interrupted' (the writer never closed the file: it was killed)."""
        status = self.meta.get("status", schema.STATUS_RUNNING)
        if not isinstance(status, str) or status == schema.STATUS_RUNNING:
            return "running" if self.live else "interrupted"
        return status

    @property
    def rank(self) -> int:
        return int(self.attrs.get("rank", 0))

    def tensor_name(self, tensor_id: int) -> str:
        rows = self.tensors[self.tensors["id"] == tensor_id]
        return str(rows["name"][0]) if len(rows) else f"<tensor {tensor_id}>"

    def array(self, row: int) -> np.ndarray:
        """The saved array of ``arrays[row]`` (a snapshot's batch), as numpy."""
        meta = self.arrays[row]
        blob = self._blob if isinstance(self._blob, Blob) else Blob(self._blob)
        raw = blob.read(int(meta["data_off"]), int(meta["data_len"]))
        try:
            dtype = np.dtype(bytes(meta["dtype"]).decode("ascii"))
            if dtype.kind not in "biuf" or dtype.fields or dtype.subdtype or raw is None:
                raise ValueError(f"array {row} has an unusable dtype or data")
            shape = tuple(int(d) for d in meta["shape"][: max(0, int(meta["ndim"]))])
            out = np.frombuffer(raw, dtype=dtype)
            if int(meta["saved"]) != int(meta["numel"]) and shape:
                shape = (-1,) + shape[1:]
            return out.reshape(shape)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise RunFileError(f"{self.path} is damaged: saved array {row} cannot be read "
                               f"({exc})") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def decoded(rows: np.ndarray, texts: list[str], blob: Blob | None = None) -> np.ndarray:
    """Replace each (name_off, name_len) pair by a ``name`` column of Python strings."""
    fields = [(n, rows.dtype[n]) for n in rows.dtype.names
              if not any(n in (f"{t}_off", f"{t}_len") for t in texts)]
    out = np.zeros(len(rows), fields + [(t, object) for t in texts])
    for name, _ in fields:
        out[name] = rows[name]
    for t in texts:
        out[t] = [blob.text(int(o), int(n)) if blob is not None else ""
                  for o, n in zip(rows[f"{t}_off"], rows[f"{t}_len"])]
    return out


# -- opening ----------------------------------------------------------------------------------


def _open(path: str) -> tuple[h5py.File, bool]:
    """Open ``path`` read-only; return the file and whether it is flagged as being written.

    A file whose writer has not closed it (still running, or killed) can only be opened by
    a SWMR reader. Such a reader skips HDF5's end-of-file check and retries unreadable
    metadata, so a truncated file is refused here first, and the retries are bounded.
    """
    _check_path(path)
    if not _flagged_as_written(path):
        try:
            return h5py.File(path, "r"), False
        except H5_ERRORS as exc:
            message = str(exc)
            if "signature" in message:
                raise RunFileError(f"{path} is not an ampdoctor run file (not HDF5)") from None
            if "already open for write" not in message:  # a writer may just have opened it
                raise RunFileError(f"{path} could not be opened as HDF5 (truncated or "
                                   f"damaged: {_reason(exc)})") from None
    # A live writer's flush writes the header's new end of file just before it extends the
    # file, so "shorter than its header says" can last a moment: `load` tries again.
    if os.path.getsize(path) < _stored_eof(path):
        raise RunFileError(f"{path} could not be opened as HDF5 (truncated or damaged: "
                           "shorter than its header says)")
    try:
        return _open_swmr(path), True
    except H5_ERRORS as exc:
        raise RunFileError(f"{path} could not be opened as HDF5 (truncated or damaged: "
                           f"{_reason(exc)})") from None


def _flagged_as_written(path: str) -> bool:
    """The superblock says a writer has the file open (it is being written, or was killed)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(12)
    except OSError:
        return False
    return len(head) == 12 and head[:8] == _SIGNATURE and head[8] in (2, 3) and \
        bool(head[11] & 0x05)  # write access, SWMR write access


def _check_path(path: str) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise RunFileError(f"{path} cannot be read ({_reason(exc)})") from None
    if stat.S_ISDIR(info.st_mode):
        raise RunFileError(f"{path} is a directory, not a run file")
    if not stat.S_ISREG(info.st_mode):
        raise RunFileError(f"{path} is not a regular file, not a run file")
    if info.st_size == 0:
        raise RunFileError(f"{path} is empty: not an ampdoctor run file")
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path} cannot be read (permission denied)")


def _open_swmr(path: str) -> h5py.File:
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    lib = _hdf5_library()
    if lib is not None:
        lib.H5Pset_metadata_read_attempts(fapl.id, SWMR_READ_ATTEMPTS)
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ,
                        fapl=fapl)
    return h5py.File(fid)


@functools.lru_cache(maxsize=None)
def _hdf5_library() -> Any:
    """The HDF5 library h5py runs on, for the one setting h5py does not expose (the SWMR
    reader's metadata read attempts). None when it cannot be told for sure which library
    that is; readers then keep HDF5's default."""
    paths = set()
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "libhdf5" in line}
    except OSError:
        pass
    here = os.path.dirname(os.path.dirname(h5py.__file__))
    paths |= set(glob.glob(os.path.join(os.path.dirname(h5py.__file__), ".dylibs", "libhdf5*")))
    paths = {p for p in paths if re.match(r"libhdf5([-.]|$)", os.path.basename(p))}
    if len(paths) > 1:
        paths = {p for p in paths if p.startswith(here)}
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop())
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        lib.H5get_libversion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        if (major.value, minor.value, release.value) != h5py.version.hdf5_version_tuple[:3]:
            return None
        lib.H5Pset_metadata_read_attempts.argtypes = [ctypes.c_int64, ctypes.c_uint]
        lib.H5Pset_metadata_read_attempts.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def _stored_eof(path: str) -> int:
    """End-of-file address recorded in an HDF5 superblock of version 2 or 3 (0 if unknown)."""
    with open(path, "rb") as fh:
        head = fh.read(48)
    if len(head) < 12 or head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (2, 3):
        return 0
    size = head[9]
    if size != 8 or len(head) < 12 + 4 * size:
        return 0
    base, _ext, eof, _root = struct.unpack("<4Q", head[12:44])
    return base + eof


def _check_format(path: str, attrs: dict[str, Any]) -> int:
    name = attrs.get("format")
    if name is _VLEN:  # stored variable-length, and its value could not be read in time
        raise RunFileError(f"{path} is damaged: its format attribute could not be read")
    if name != schema.FORMAT_NAME:
        raise RunFileError(f"{path} is an HDF5 file but not an ampdoctor run "
                           "(no 'ampdoctor-run' format attribute)")
    version = attrs.get("format_version")
    try:
        version = int(version)
    except (TypeError, ValueError):
        raise RunFileError(f"{path} has an unreadable format version") from None
    if version > schema.FORMAT_VERSION:
        raise FormatTooNewError(
            f"{path} was written by format version {version}; this ampdoctor reads up to "
            f"{schema.FORMAT_VERSION}: upgrade ampdoctor")
    if version < 1:
        raise RunFileError(f"{path} has an invalid format version ({version})")
    return version


_PLAIN_TYPES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.STRING)
MAX_ATTR_ELEMENTS = 4096


_VLEN = object()  # _attr's answer for a variable-length string attribute
VLEN_SECONDS = 5.0  # time limit for reading variable-length root attributes


def _attr(f: h5py.File, key: str) -> Any:
    """One root attribute, None when it is absent, unreadable or not plain data, or ``_VLEN``
    for a variable-length string (read apart: see ``_vlen_attrs``).

    Numbers and fixed-length strings are read here. A variable-length value is kept in HDF5's
    global heap, which has no checksum: a damaged one can loop forever inside HDF5.
    """
    try:
        if key not in f.attrs:
            return None
        attr = h5py.h5a.open(f.id, key.encode())
        kind = attr.get_type()
        if kind.get_class() not in _PLAIN_TYPES:
            return None
        if attr.get_storage_size() > MAX_ATTR_ELEMENTS * 64 or \
                int(np.prod(attr.shape or ())) > MAX_ATTR_ELEMENTS:
            return None
        if kind.get_class() == h5py.h5t.STRING and kind.is_variable_str():
            return _VLEN if attr.shape == () else None
        return f.attrs[key]
    except H5_ERRORS:
        return None


def _vlen_attrs(f: h5py.File, keys: list[str]) -> dict[str, str]:
    """Variable-length string root attributes, as the first writer of format 1 (ampdoctor
    0.1.0 before fixed-length attributes) stored ``format``, ``argv`` and ``host``.

    Their values sit in HDF5's global heap, which has no checksum, and a damaged heap can hang
    HDF5; so they are read in a forked child (which shares the open file: HDF5 reads with
    pread, so the parent's file position is untouched) that has ``VLEN_SECONDS`` to answer.
    What it cannot read reads as absent. Without fork, they are read directly.
    """
    def read() -> dict[str, str]:
        out = {}
        for key in keys:
            try:
                value = f.attrs[key]
            except H5_ERRORS:
                continue
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            if isinstance(value, str):
                out[key] = value
        return out

    if not hasattr(os, "fork"):
        return read()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into the caller
        code = 1
        try:
            os.close(r)
            answer = memoryview(json.dumps(read()).encode())
            while answer:
                answer = answer[os.write(w, answer):]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + VLEN_SECONDS
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                chunks = []
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    try:
        out = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {}
    return {k: v for k, v in out.items() if isinstance(v, str)} if isinstance(out, dict) else {}


def _dataset(path: str, f: h5py.File, name: str, dtype: np.dtype) -> Any:
    if name not in f or not isinstance(f[name], h5py.Dataset):
        raise RunFileError(f"{path} is damaged: table /{name} is missing")
    ds = f[name]
    if ds.dtype != dtype or ds.ndim != 1:
        raise RunFileError(f"{path} is damaged: table /{name} has unexpected columns or shape")
    return ds


# -- loading ----------------------------------------------------------------------------------


def load(path: str | os.PathLike) -> Run:
    """Open a run file and return its ``Run``.

    Raises ``RunFileError`` (one sentence naming the file) for anything that is not a readable
    ampdoctor run of a version this ampdoctor knows. Works on a file that is still being
    written: it sees every row up to the writer's last flush.

    Example::

        with ampdoctor.load("run.h5") as run:
            print(len(run.steps), run.status)
    """
    path = os.fspath(path)
    return _retrying(path, lambda: _load_once(path))


def _retrying(path: str, read: Any) -> Any:
    """``read()``, tried again a few times for a file flagged as being written: its writer
    may have been half-way through a flush. A damaged file fails the same way each time."""
    tries = LIVE_RETRIES if _flagged_as_written(path) else 1
    for attempt in range(tries):
        try:
            return read()
        except RunFileError:
            if attempt == tries - 1:
                raise
        time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _load_once(path: str) -> Run:
    f, live = _open(path)
    try:
        return _read(path, f, live)
    except RunFileError:
        f.close()
        raise
    except H5_ERRORS as exc:
        f.close()
        raise RunFileError(f"{path} is damaged and could not be read "
                           f"({_reason(exc)})") from None


_ON_DEMAND = ("stats", "groups")  # tables read by range when asked, never whole at load
# Tables that refer to others come before what they refer to (stats -> tensors, rows -> /blob).
_READ_ORDER = ("stats", "events", "snapshots", "arrays", "steps", "groups", "meta", "tensors",
               schema.BLOB)


def _read(path: str, f: h5py.File, live: bool) -> Run:
    """Read a run; tables that point into others are read before what they point at.

    On a live file every table may grow between two reads. Reading the referring tables
    (stats → tensors, rows → /blob) first means every reference read has its target.
    """
    attrs = _attrs(f)
    _check_format(path, attrs)
    # HDF5 shares one open file among every open of it in a process (a Run not closed yet):
    # a plain open may hand back a SWMR reader's file, whose cached tables can be stale.
    live = live or bool(f.swmr_mode)
    raw: dict[str, Any] = {}
    damaged = []
    for name in _READ_ORDER:  # each table's length is fixed here, in this order
        try:
            raw[name] = _read_table(path, f, name, live)
        except H5_ERRORS:
            if name == "steps":  # without its steps a run has nothing to tell
                raise
            damaged.append(name)  # one damaged table (a torn write) does not lose the rest
            raw[name] = Table(schema.empty(name), name=name) if name in _ON_DEMAND else \
                Blob() if name == schema.BLOB else schema.empty(name)
    stats, blob = raw["stats"], raw[schema.BLOB]
    run = Run(path=path, attrs=attrs, _file=f, _blob=blob)
    run.live = live and _writer_alive(run.attrs, path)
    run.meta = _meta(raw["meta"], blob)
    run.steps = raw["steps"]
    run.groups = raw["groups"]
    # A writer numbers tensors 0, 1, 2... in row order; an id outside that (damage) would
    # make a reader size its id -> tensor maps by it (a 2**31 id: gigabytes).
    ids = raw["tensors"]["id"]
    valid = (ids >= 0) & (ids < len(ids))
    if not valid.all():
        damaged.append("tensors")
    run.tensors = _tensor_view(raw["tensors"][valid], blob)
    run.stats = stats
    run.events = decoded(raw["events"], ["text"], blob)
    _known(raw["snapshots"], "phase", schema.Phase, schema.Phase.UNKNOWN)
    _known(raw["snapshots"], "autocast", schema.DType, schema.DType.UNKNOWN)
    run.snapshots = decoded(raw["snapshots"], ["module", "module_type", "detail"], blob)
    run.arrays = decoded(raw["arrays"], ["name"], blob)
    run.damaged = damaged
    return run


def _read_table(path: str, f: h5py.File, name: str, live: bool) -> Any:
    """One table: rows (small tables), a ``Table`` (stats, read on demand) or a ``Blob``."""
    ds = _dataset(path, f, name, schema.TABLES.get(name, np.dtype("u1")))
    if live:
        ds.refresh()
    if name in _ON_DEMAND:
        return Table(ds, nrows=_written_rows(ds), path=path, name=name)
    if name == schema.BLOB:
        return Blob(ds, path)
    return _without_unwritten_tail(name, ds[:])


def _writer_alive(attrs: dict[str, Any], path: str) -> bool:
    """Is the process that wrote this file still running, with the file open? (Same host
    only: elsewhere a live writer and a killed one look alike.)"""
    if attrs.get("host") != socket.gethostname():
        return False
    try:
        pid = int(attrs.get("pid"))
        created = float(attrs.get("created"))
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except PermissionError:
        return True  # someone else's process, alive
    except (OSError, TypeError, ValueError, OverflowError):
        return False
    started = _process_start(pid)
    if started is not None and started > created + 1.0:
        return False  # a later process reusing the pid
    if pid == os.getpid():  # this process's own readers hold the file too: ask its writers
        return _identity(path) in _WRITING
    return _has_open(pid, path) is not False


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
        return info.st_dev, info.st_ino
    except OSError:
        return None


def _has_open(pid: int, path: str) -> bool | None:
    """Does process ``pid`` hold ``path`` open? None where /proc cannot tell. (A writer that
    stepped aside after a failure, in a process still training, has let go of it.)"""
    try:
        target = os.stat(path)
        folder = f"/proc/{pid}/fd"
        for name in os.listdir(folder):
            try:
                held = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
                return True
        return False
    except OSError:
        return None


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (unix time), where /proc tells; else None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _without_unwritten_tail(name: str, rows: np.ndarray) -> np.ndarray:
    """Rows up to the last one a writer wrote.

    A flush cut short (disk full, or a kill while HDF5 evicted part of it) can leave a table
    longer than what reached it: the rows past the end read as HDF5's fill value, zeros.
    The writer never writes an all-zero row (text has a length, floats default to NaN, a
    step has its time), so trailing zero rows are rows that never arrived.
    """
    if not len(rows):
        return rows
    if name == "steps":
        written = rows["time"] != 0
    else:
        written = np.frombuffer(rows.tobytes(), np.uint8).reshape(len(rows), -1).any(axis=1)
    last = np.flatnonzero(written)
    return rows[: last[-1] + 1 if len(last) else 0]


def _written_rows(ds: Any, block: int = 4096) -> int:
    """Like ``_without_unwritten_tail`` for a table read on demand: reads only its end."""
    n = int(ds.shape[0])
    while n > 0:
        start = max(0, n - block)
        tail = _without_unwritten_tail(ds.name.lstrip("/"), ds[start:n])
        if len(tail):
            return start + len(tail)
        n = start
    return 0


def _known(rows: np.ndarray, column: str, codes: Any, unknown: int) -> None:
    """A code this reader does not know (damage, or a later writer) reads as ``unknown``."""
    valid = np.isin(rows[column], [int(c) for c in codes])
    rows[column] = np.where(valid, rows[column], int(unknown))


def _attrs(f: h5py.File) -> dict[str, Any]:
    """The root attributes (what ``Run.attrs`` holds); ``argv`` decoded from JSON."""
    out = {}
    try:
        keys = list(f.attrs.keys())
    except H5_ERRORS:
        keys = []
    for key in keys:
        value = _attr(f, key)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    vlen = [key for key, value in out.items() if value is _VLEN]
    if vlen:
        found = _vlen_attrs(f, vlen)
        for key in vlen:  # an unreadable format stays _VLEN, for _check_format to name
            out[key] = found.get(key, _VLEN if key == "format" else None)
    try:
        out["argv"] = json.loads(out.get("argv", "[]"))
    except (TypeError, ValueError, RecursionError):
        pass
    return out


def _meta(rows: np.ndarray, blob: Blob) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for row in rows:
        key = bytes(row["key"]).decode(errors="replace")
        text = blob.text(int(row["value_off"]), int(row["value_len"]))
        try:
            meta[key] = json.loads(text)
        except (ValueError, RecursionError):
            meta[key] = text
    return meta


def _tensor_view(rows: np.ndarray, blob: Blob) -> np.ndarray:
    out = np.zeros(len(rows), TENSOR_VIEW)
    for name in ("id", "kind", "index", "dtype", "numel"):
        out[name] = rows[name]
    out["name"] = [blob.text(int(o), int(n)) for o, n in zip(rows["name_off"], rows["name_len"])]
    out["type"] = [blob.text(int(o), int(n)) for o, n in zip(rows["type_off"], rows["type_len"])]
    return out


@contextlib.contextmanager
def opened(run: Any, caller: str = "this") -> Iterator[Run]:
    """The one way a path or a ``Run`` becomes a loaded ``Run``: a ``Run`` is used as given (and
    left open), a path is resolved (``run.h5``, else its rank files: rank 0 stands for the
    training) and loaded, and closed at the end.

    Example::

        with store.opened("run.h5") as run:
            len(run.steps)
    """
    if isinstance(run, Run):
        yield run
        return
    if not isinstance(run, (str, os.PathLike)):
        raise TypeError(f"{caller}() takes a path or a Run, not {type(run).__name__}")
    from .paths import resolve

    with load(resolve(os.fspath(run))[0]) as loaded:
        yield loaded


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a file holds, for ``ampdoctor dump``: attributes, meta, and each table's rows.

    Unlike ``load`` it shows a damaged run as far as it can (a missing or unreadable table is
    listed as missing), but it still refuses what is not an ampdoctor run.
    """
    path = os.fspath(path)
    return _retrying(path, lambda: _inspect_once(path))


def _inspect_once(path: str) -> dict[str, Any]:
    f, live = _open(path)
    with f:
        attrs = _attrs(f)
        version = _check_format(path, attrs)
        info: dict[str, Any] = {"path": path, "format_version": version, "attrs": attrs,
                                "tables": {}, "live": live}
        for name in list(schema.TABLES) + [schema.BLOB]:
            info["tables"][name] = _table_info(f, name)
            expected = schema.TABLES.get(name, np.dtype("u1"))
            if info["tables"][name] is not None:
                info["tables"][name]["damaged"] = info["tables"][name].pop("dtype") != expected
        try:
            blob = Blob(f[schema.BLOB], path)
            info["meta"] = _meta(f["meta"][:], blob)
        except (*H5_ERRORS, RunFileError):
            info["meta"] = {}
        info["file_bytes"] = os.path.getsize(path)
        return info


def _table_info(f: h5py.File, name: str) -> dict[str, Any] | None:
    try:
        obj = f.get(name)
        if not isinstance(obj, h5py.Dataset):
            return None
        return {
            "rows": int(obj.shape[0]) if obj.ndim else 0,
            "columns": list(obj.dtype.names or ("bytes",)),
            "chunk_rows": obj.chunks[0] if obj.chunks else None,
            "compression": obj.compression,
            "stored_bytes": int(obj.id.get_storage_size()),
            "dtype": obj.dtype if obj.ndim == 1 else None,
        }
    except H5_ERRORS:
        return None


# ---------------------------------------------------------------------------------------------
# Following a file that is being written


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
        self._file, self.live = _retrying(self.path, lambda: _open(self.path))
        try:
            self.attrs = _attrs(self._file)
            _check_format(self.path, self.attrs)
        except BaseException:
            self._file.close()
            raise
        self.live = self.live or bool(self._file.swmr_mode)
        self.identity = _identity(self.path)
        self.done = {name: 0 for name in schema.TABLES}  # rows handed out so far, per table
        self.stats = Table(schema.empty("stats"), name="stats")
        self._datasets: dict[str, Any] = {}  # opened and checked once, refreshed at each read
        self._stats_shape = -1  # /stats length at the last read, all of it written

    def read(self) -> dict[str, Any]:
        """New rows of every table but ``/stats`` (``meta``: the keys written since, decoded)."""
        if self._file is None:
            raise RunFileError(f"{self.path} is no longer open")
        try:
            rows, stats = self._new_rows()
            blob = self._blob()
            out = {"steps": rows["steps"], "groups": rows["groups"],
                   "meta": _meta(rows["meta"], blob),
                   "tensors": _tensor_view(rows["tensors"], blob),
                   "events": decoded(rows["events"], ["text"], blob),
                   "arrays": decoded(rows["arrays"], ["name"], blob)}
            _known(rows["snapshots"], "phase", schema.Phase, schema.Phase.UNKNOWN)
            _known(rows["snapshots"], "autocast", schema.DType, schema.DType.UNKNOWN)
            out["snapshots"] = decoded(rows["snapshots"], ["module", "module_type", "detail"],
                                        blob)
        except H5_ERRORS as exc:
            raise RunFileError(f"{self.path} could not be read ({_reason(exc)})") from None
        for name, new in rows.items():
            self.done[name] += len(new)
        self.stats = stats
        # Known for good only once every row of it is written (a flush may be half-way).
        self._stats_shape = len(stats) if len(stats) == len(stats._data) else -1
        return out

    def _new_rows(self) -> tuple[dict[str, np.ndarray], Table]:
        rows: dict[str, np.ndarray] = {}
        stats = self.stats
        for name in _READ_ORDER:  # referring tables first, as in ``_read``
            if name == schema.BLOB:
                continue
            ds = self._table(name)
            if name == "stats":
                if ds.shape[0] != self._stats_shape:  # finding the written end reads rows
                    stats = Table(ds, nrows=_written_rows(ds), path=self.path, name="stats")
                continue
            start = self.done[name]
            rows[name] = _without_unwritten_tail(name, ds[start:]) if ds.shape[0] > start \
                else schema.empty(name)
        return rows, stats

    def _blob(self) -> "_Ranged":
        return _Ranged(self._table(schema.BLOB), self.path)

    def _table(self, name: str) -> Any:
        ds = self._datasets.get(name)
        if ds is None:
            ds = self._datasets[name] = _dataset(self.path, self._file, name, schema.TABLES.get(
                name, np.dtype("u1")))
        if self.live:
            ds.refresh()
        return ds

    def writer_alive(self) -> bool | None:
        """Is the writer still running with the file open? None where this cannot be told
        from here (another host: a live writer and a killed one look alike)."""
        if self.attrs.get("host") != socket.gethostname():
            return None
        return _writer_alive(self.attrs, self.path)

    def replaced(self) -> bool:
        """Is ``path`` now another file (a new recording with ``--force``), or gone?"""
        return _identity(self.path) != self.identity

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
