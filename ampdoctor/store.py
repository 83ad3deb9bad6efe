"""The HDF5 run file: ``Writer`` on the recording side, ``load`` → ``Run`` on the analysis side.

This module is h5py's only owner. It imports no torch.

Writing follows the SWMR recipe (h5py ``docs/swmr.rst``): create every table up front, switch
SWMR on, then only append and flush. A writer killed at any moment leaves a file that opens,
holding every row up to its last flush. Rows are buffered in memory and written in one append
per table at each flush, so the cost of a flush does not grow with the number of steps.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import h5py
import numpy as np

from . import __version__
from . import schema
from .errors import FormatTooNewError, RunFileError

# ---------------------------------------------------------------------------------------------
# Writing

_DISOWNED: list = []  # files inherited through fork: never closed in this process (Writer.disown)


class Writer:
    """Append-only writer of one run file.

    Example::

        w = Writer("run.h5", rank=0, world_size=1)
        rows = schema.empty("steps", 1); rows["step"] = 0; rows["loss"] = 2.3
        w.append("steps", rows)
        w.flush()            # rows reach the file; a SIGKILL after this keeps them
        w.close("finished")

    ``create=False`` defers the file: rows queue in memory until ``create(path)`` (or are
    dropped by ``close``), so a process that turns out not to train leaves nothing behind.
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
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in schema.TABLES}
        self._rows = {name: 0 for name in schema.TABLES}  # rows written or pending
        self._blob_pending: list[bytes] = []
        self._blob_len = 0
        self.closed = False
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
        # "w-" fails if another process created the file in between (overwrite=False).
        f = h5py.File(self.path, "w" if self.overwrite else "w-", libver="latest")
        try:
            for key, value in self._attrs.items():
                f.attrs[key] = value
            for name, dtype in schema.TABLES.items():
                f.create_dataset(
                    name, shape=(0,), maxshape=(None,), dtype=dtype,
                    chunks=(schema.CHUNK_ROWS[name],), compression="gzip", compression_opts=4,
                    shuffle=True)
            f.create_dataset(schema.BLOB, shape=(0,), maxshape=(None,), dtype="u1",
                             chunks=(schema.BLOB_CHUNK,), compression="gzip",
                             compression_opts=4)
            f.swmr_mode = True
        except BaseException:
            f.close()
            raise
        self._file = f

    # -- buffering --------------------------------------------------------------------------

    def append(self, table: str, rows: np.ndarray) -> int:
        """Queue rows for ``table``; return the index of the first one."""
        first = self._rows[table]
        if len(rows):
            self._pending[table].append(np.asarray(rows, schema.TABLES[table]))
            self._rows[table] += len(rows)
        return first

    def text(self, value: str) -> tuple[int, int]:
        """Queue a UTF-8 string in /blob; return its (offset, length)."""
        return self.bytes(value.encode("utf-8"))

    def bytes(self, data: bytes) -> tuple[int, int]:
        off = self._blob_len
        if data:
            self._blob_pending.append(data)
            self._blob_len += len(data)
        return off, len(data)

    def rows(self, table: str) -> int:
        """Rows of ``table`` written or queued so far."""
        return self._rows[table]

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

        Before ``create`` (a deferred writer) the rows stay queued.
        """
        if self.closed or self._file is None:
            return
        # The blob goes first: a row that points into it must never reach the file before
        # the bytes it points at.
        if self._blob_pending:
            data = np.frombuffer(b"".join(self._blob_pending), dtype="u1")
            ds = self._file[schema.BLOB]
            start = ds.shape[0]
            ds.resize((start + len(data),))
            ds[start:] = data
            self._blob_pending.clear()
        for name, chunks in self._pending.items():
            if not chunks:
                continue
            rows = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            ds = self._file[name]
            start = ds.shape[0]
            ds.resize((start + len(rows),))
            ds[start:] = rows
            chunks.clear()
        self._file.flush()

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
        finally:
            self.closed = True
            self._file.close()

    def disown(self) -> None:
        """In a forked child: make this process's copy of the open file unable to write to it.

        The child holds a copy of HDF5's state for the parent's file; closing that copy (or the
        child exiting normally) would flush it into the file the parent is still writing. The
        descriptor is pointed at /dev/null, and the handle is kept alive, so nothing from the
        child ever reaches the parent's file.
        """
        self.closed = True
        if self._file is None:
            return
        try:
            fd = self._file.id.get_vfd_handle()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, fd)
            os.close(null)
        except Exception:  # noqa: BLE001 - a driver without a descriptor: nothing to redirect
            pass
        _DISOWNED.append(self._file)

    def abandon(self) -> None:
        """Close without writing what is queued (the disk is gone); never raises."""
        self.closed = True
        if self._file is None:
            return
        try:
            self._file.close()
        except Exception:  # noqa: BLE001 - the file is already lost; nothing to report twice
            pass


# ---------------------------------------------------------------------------------------------
# Reading


class Table:
    """Rows of one table, read on demand: columns, slices and chunks, never more than asked.

    Wraps an HDF5 dataset (a loaded run) or a numpy array (a run built in memory, tests).
    """

    def __init__(self, data: Any, nrows: int | None = None):
        self._data = data
        self._n = len(data) if nrows is None else nrows
        self.dtype = data.dtype

    def __len__(self) -> int:
        return self._n

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self._n if stop is None else min(stop, self._n)
        if isinstance(self._data, np.ndarray):
            return self._data[name][start:stop]
        return self._data.fields(name)[start:stop] if stop > start else np.empty(
            0, self.dtype[name])

    def columns(self, names: list[str] | tuple[str, ...], start: int = 0,
                stop: int | None = None) -> np.ndarray:
        stop = self._n if stop is None else min(stop, self._n)
        if isinstance(self._data, np.ndarray):
            return self._data[list(names)][start:stop]
        if stop <= start:
            return np.empty(0, np.dtype([(n, self.dtype[n]) for n in names]))
        return self._data.fields(list(names))[start:stop]

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self._n if stop is None else min(stop, self._n)
        return self._data[start:stop] if stop > start else np.empty(0, self.dtype)

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


TENSOR_VIEW = np.dtype([("id", "<i4"), ("kind", "i1"), ("index", "<i2"), ("dtype", "i1"),
                        ("numel", "<i8"), ("name", object), ("type", object)])


@dataclass
class Run:
    """A recorded run: numpy views of every table plus what the run learnt about itself.

    ``steps``, ``groups``, ``events``, ``snapshots``, ``arrays`` and ``tensors`` are small and
    loaded whole (text decoded to ``str``); ``stats`` is a ``Table`` read on demand.

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
    groups: np.ndarray = field(default_factory=lambda: schema.empty("groups"))
    tensors: np.ndarray = field(default_factory=lambda: np.zeros(0, TENSOR_VIEW))
    stats: Table = field(default_factory=lambda: Table(schema.empty("stats")))
    events: np.ndarray = field(default_factory=lambda: _decoded(schema.empty("events"), ["text"]))
    snapshots: np.ndarray = field(default_factory=lambda: _decoded(
        schema.empty("snapshots"), ["module", "module_type", "detail"]))
    arrays: np.ndarray = field(default_factory=lambda: _decoded(schema.empty("arrays"), ["name"]))
    _file: Any = field(default=None, repr=False)
    _blob: Any = field(default=None, repr=False)

    @property
    def status(self) -> str:
        """'finished', 'exception:<Type>', or 'interrupted' (the writer never closed it)."""
        status = self.meta.get("status", schema.STATUS_RUNNING)
        return "interrupted" if status == schema.STATUS_RUNNING else status

    @property
    def rank(self) -> int:
        return int(self.attrs.get("rank", 0))

    def tensor_name(self, tensor_id: int) -> str:
        rows = self.tensors[self.tensors["id"] == tensor_id]
        return str(rows["name"][0]) if len(rows) else f"<tensor {tensor_id}>"

    def array(self, row: int) -> np.ndarray:
        """The saved array of ``arrays[row]`` (a snapshot's batch), as numpy."""
        meta = self.arrays[row]
        raw = self._read_blob(int(meta["data_off"]), int(meta["data_len"]))
        shape = tuple(int(d) for d in meta["shape"][: int(meta["ndim"])])
        out = np.frombuffer(raw, dtype=np.dtype(meta["dtype"].decode()))
        if int(meta["saved"]) != int(meta["numel"]) and shape:
            shape = (-1,) + shape[1:]
        return out.reshape(shape)

    def _read_blob(self, off: int, length: int) -> bytes:
        if self._blob is None or length <= 0:
            return b""
        return bytes(self._blob[off:off + length])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _decoded(rows: np.ndarray, texts: list[str], blob: Any = None) -> np.ndarray:
    """Replace each (name_off, name_len) pair by a ``name`` column of Python strings."""
    fields = [(n, rows.dtype[n]) for n in rows.dtype.names
              if not any(n in (f"{t}_off", f"{t}_len") for t in texts)]
    out = np.zeros(len(rows), fields + [(t, object) for t in texts])
    for name, _ in fields:
        out[name] = rows[name]
    for t in texts:
        out[t] = [_text_at(blob, int(o), int(n)) for o, n in zip(rows[f"{t}_off"], rows[f"{t}_len"])]
    return out


def _text_at(blob: Any, off: int, length: int) -> str:
    if blob is None or length <= 0:
        return ""
    if off < 0 or off + length > len(blob):
        raise RunFileError("a text reference points outside /blob")
    return bytes(blob[off:off + length]).decode("utf-8", errors="replace")


def _open(path: str) -> h5py.File:
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise RunFileError(f"{path} is a directory, not a run file")
    if os.path.getsize(path) == 0:
        raise RunFileError(f"{path} is empty: not an ampdoctor run file")
    try:
        return h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        error = str(exc)
    if "signature" in error:
        raise RunFileError(f"{path} is not an ampdoctor run file (not HDF5)")
    if "already open for write" in error:
        # A file still being written, or whose writer was killed: SWMR is the way in. A SWMR
        # reader skips HDF5's own end-of-file check and retries unreadable metadata for a long
        # time, so a truncated file must be refused here, before it gets that far.
        if os.path.getsize(path) < _stored_eof(path):
            raise RunFileError(f"{path} could not be opened as HDF5 (truncated or damaged: "
                               "shorter than its header says)")
        try:
            return h5py.File(path, "r", libver="latest", swmr=True)
        except (OSError, ValueError) as exc:
            error = str(exc)
    reason = error.split("(")[-1].split(")")[0].strip() if "(" in error else error.strip()
    raise RunFileError(f"{path} could not be opened as HDF5 (truncated or damaged: "
                       f"{reason.splitlines()[0] if reason else 'unknown'})")


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


def _check_format(path: str, f: h5py.File) -> int:
    name = f.attrs.get("format")
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    if name != schema.FORMAT_NAME:
        raise RunFileError(f"{path} is an HDF5 file but not an ampdoctor run "
                           "(no 'ampdoctor-run' format attribute)")
    version = f.attrs.get("format_version")
    try:
        version = int(version)
    except (TypeError, ValueError):
        raise RunFileError(f"{path} has an unreadable format version ({version!r})") from None
    if version > schema.FORMAT_VERSION:
        raise FormatTooNewError(
            f"{path} was written by format version {version}; this ampdoctor reads up to "
            f"{schema.FORMAT_VERSION}: upgrade ampdoctor")
    if version < 1:
        raise RunFileError(f"{path} has an invalid format version ({version})")
    return version


def _dataset(path: str, f: h5py.File, name: str, dtype: np.dtype) -> Any:
    if name not in f or not isinstance(f[name], h5py.Dataset):
        raise RunFileError(f"{path} is damaged: table /{name} is missing")
    ds = f[name]
    if ds.dtype != dtype or ds.ndim != 1:
        raise RunFileError(f"{path} is damaged: table /{name} has unexpected columns or shape")
    return ds


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
    f = _open(path)
    try:
        _check_format(path, f)
        tables = {n: _dataset(path, f, n, dt) for n, dt in schema.TABLES.items()}
        blob = _dataset(path, f, schema.BLOB, np.dtype("u1"))
        blob_bytes = np.asarray(blob[:]) if blob.shape[0] < (64 << 20) else blob
        run = Run(path=path, attrs=_attrs(f), _file=f, _blob=blob)
        run._blob = blob_bytes
        run.meta = _meta(tables["meta"][:], blob_bytes)
        run.steps = tables["steps"][:]
        run.groups = tables["groups"][:]
        run.tensors = _tensor_view(tables["tensors"][:], blob_bytes)
        run.stats = Table(tables["stats"], nrows=tables["stats"].shape[0])
        run.events = _decoded(tables["events"][:], ["text"], blob_bytes)
        run.snapshots = _decoded(tables["snapshots"][:], ["module", "module_type", "detail"],
                                 blob_bytes)
        run.arrays = _decoded(tables["arrays"][:], ["name"], blob_bytes)
        return run
    except RunFileError:
        f.close()
        raise
    except (OSError, KeyError, ValueError, TypeError) as exc:
        f.close()
        raise RunFileError(f"{path} is damaged and could not be read ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None


def _attrs(f: h5py.File) -> dict[str, Any]:
    out = {}
    for key, value in f.attrs.items():
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    try:
        out["argv"] = json.loads(out.get("argv", "[]"))
    except (TypeError, ValueError):
        pass
    return out


def _meta(rows: np.ndarray, blob: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for row in rows:
        key = row["key"].decode(errors="replace")
        text = _text_at(blob, int(row["value_off"]), int(row["value_len"]))
        try:
            meta[key] = json.loads(text)
        except ValueError:
            meta[key] = text
    return meta


def _tensor_view(rows: np.ndarray, blob: Any) -> np.ndarray:
    out = np.zeros(len(rows), TENSOR_VIEW)
    for name in ("id", "kind", "index", "dtype", "numel"):
        out[name] = rows[name]
    out["name"] = [_text_at(blob, int(o), int(n)) for o, n in zip(rows["name_off"], rows["name_len"])]
    out["type"] = [_text_at(blob, int(o), int(n)) for o, n in zip(rows["type_off"], rows["type_len"])]
    return out


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a file holds, for ``ampdoctor dump``: attributes, meta, and each table's rows.

    Unlike ``load`` it shows a damaged run as far as it can (a missing table is listed as
    missing), but it still refuses what is not an ampdoctor run.
    """
    path = os.fspath(path)
    with _open(path) as f:
        version = _check_format(path, f)
        info: dict[str, Any] = {"path": path, "format_version": version, "attrs": _attrs(f),
                                "tables": {}}
        for name in list(schema.TABLES) + [schema.BLOB]:
            obj = f.get(name)
            if not isinstance(obj, h5py.Dataset):
                info["tables"][name] = None
                continue
            info["tables"][name] = {
                "rows": int(obj.shape[0]) if obj.ndim else 0,
                "columns": list(obj.dtype.names or ("bytes",)),
                "chunk_rows": obj.chunks[0] if obj.chunks else None,
                "compression": obj.compression,
                "stored_bytes": int(obj.id.get_storage_size()),
            }
        try:
            blob = np.asarray(f[schema.BLOB][:])
            info["meta"] = _meta(f["meta"][:], blob)
        except (KeyError, OSError, ValueError, RunFileError):
            info["meta"] = {}
        info["file_bytes"] = os.path.getsize(path)
        return info
