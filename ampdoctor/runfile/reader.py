"""The analysis side of the run file: ``load`` -> ``Run``, ``inspect`` for ``ampdoctor dump``.

Reading never trusts the file: everything read is data (numbers, UTF-8 text, JSON; nothing is
unpickled or evaluated), and every failure of h5py on a damaged file becomes one
``RunFileError`` sentence naming the file. What can go wrong, and what happens then
(tests/integration/test_reliability.py shows each):

* the file is still being written, or its writer was killed: it opens as a SWMR reader and
  reads as it was at the writer's last flush (``Run.live``, ``Run.status``);
* the file is damaged, truncated or not ours: ``load`` and ``inspect`` raise ``RunFileError``,
  and never hang: a SWMR reader's metadata retries are bounded (``hdf5.open_swmr``), and
  nothing is read from HDF5's unchecksummed global heap (``attributes``);
* one table is damaged but ``/steps`` is not: the run loads without it (``Run.damaged``).

Example::

    with load("run.h5") as run:
        print(len(run.steps), run.status)
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import Any, Iterable, Iterator

import h5py
import numpy as np

from ..errors import RunFileError
from . import guard, hdf5, inflate, liveness, migrations, schema, values
from .attributes import check_format, root_attrs
from .columns import Columns
from .hdf5 import H5_ERRORS, reason
from .paths import resolve
from .run import TEXTS, Blob, Run, Table, decoded_rows, meta_dict, tensor_view

LIVE_RETRIES = 3  # reads of a file flagged as being written (its writer may be mid-flush)

ON_DEMAND = ("stats", "groups", "fp8")  # tables read by range when asked, never whole at load
# Tables that refer to others come before what they refer to (stats -> tensors, rows -> /blob).
READ_ORDER = ("stats", "fp8", "events", "snapshots", "arrays", "steps", "groups", "losses",
              "optimizers", "meta", "tensors", schema.BLOB)


def load(path: str | os.PathLike, columns: Iterable[str] | None = None,
         steps: Columns | None = None) -> Run:
    """Open a run file and return its ``Run``.

    ``columns``: the /steps columns to hold (``Columns.read``'s ``keep``): a reader that asks
    for a few of a long run's columns holds those, and any other is read when first asked for.
    ``steps``: this file's /steps as read already (checked, as ``load_steps`` or a ``Tail``
    reads it): used instead of reading it again where the file holds that many rows still,
    else /steps is read as usual.

    Raises ``RunFileError`` (one sentence naming the file) for anything that is not a readable
    ampdoctor run of a version this ampdoctor knows. Works on a file that is still being
    written: it sees every row up to the writer's last flush.

    Example::

        with ampdoctor.load("run.h5") as run:
            print(len(run.steps), run.status)
    """
    path = os.fspath(path)
    return retrying(path, lambda: _load_once(path, columns, steps))


@contextlib.contextmanager
def opened(run: Any, caller: str = "this", columns: Iterable[str] | None = None
           ) -> Iterator[Run]:
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
    with load(resolve(os.fspath(run))[0], columns) as loaded:
        yield loaded


def load_steps(path: str | os.PathLike) -> Columns:
    """Only the /steps rows of a run file, as ``load(path).steps`` holds them: what a reader of
    a large job's many rank files needs of a rank it does not load (its loss scales, its
    shares of a sharded gradient norm). Raises ``RunFileError`` as ``load`` does.

    Example::

        steps = store.load_steps("run.rank7.h5")
        steps["scale"]
    """
    path = os.fspath(path)
    return retrying(path, lambda: _steps_once(path))


def _steps_once(path: str) -> Columns:
    f, live = open_file(path)
    try:
        version = check_format(path, root_attrs(f, ("format", "format_version")))
        return _read_table(path, f, "steps", live or bool(f.swmr_mode), version)
    except H5_ERRORS as exc:
        raise RunFileError(f"{path} is damaged and could not be read "
                           f"({reason(exc)})") from None
    finally:
        f.close()


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a file holds, for ``ampdoctor dump``: attributes, meta, and each table's rows.

    Unlike ``load`` it shows a damaged run as far as it can (a missing or unreadable table is
    listed as missing), but it still refuses what is not an ampdoctor run.
    """
    path = os.fspath(path)
    return retrying(path, lambda: _inspect_once(path))


# -- opening ---------------------------------------------------------------------------------


def retrying(path: str, read: Any) -> Any:
    """``read()``, tried again a few times for a file flagged as being written: its writer
    may have been half-way through a flush. A damaged file fails the same way each time."""
    tries = LIVE_RETRIES if hdf5.flagged_as_written(path) else 1
    for attempt in range(tries):
        try:
            return read()
        except RunFileError:
            if attempt == tries - 1:
                raise
        time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def is_run_file(path: str | os.PathLike) -> bool:
    """Is ``path`` a regular file that ampdoctor wrote (HDF5 declaring its format, of any
    version; or HDF5 too damaged to open whose first bytes name the format)? What
    ``record --force`` may replace: never a script, a text file or a device.

    Example::

        store.is_run_file("run.h5"), store.is_run_file("train.py")      # (True, False)
    """
    path = os.fspath(path)
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or not hdf5.is_hdf5(path):
            return False
        head = hdf5.head(path, 1 << 16)
    except OSError:
        return False
    try:
        f, _live = open_file(path, guarded=False)
    except RunFileError:  # a recording killed mid-write: its header still names the format
        return schema.FORMAT_NAME.encode() in head
    with f:
        try:
            return root_attrs(f, ("format",)).get("format") == schema.FORMAT_NAME
        except H5_ERRORS:
            return False


def open_file(path: str, guarded: bool = True) -> tuple[h5py.File, bool]:
    """Open ``path`` read-only; return the file and whether it is flagged as being written.

    A file whose writer has not closed it (still running, or killed) can only be opened by
    a SWMR reader. Such a reader skips HDF5's end-of-file check and retries unreadable
    metadata, so a truncated file is refused here first, and the retries are bounded.
    ``guarded``: refused if it points outside itself (``guard.check``); only the root
    attributes may be read of a file opened unguarded.
    """
    _check_path(path)
    if not hdf5.flagged_as_written(path):
        try:
            f = h5py.File(path, "r")
        except H5_ERRORS as exc:
            message = str(exc)
            if "signature" in message:
                raise RunFileError(f"{path} is not an ampdoctor run file (not HDF5)") from None
            if "already open for write" not in message:  # a writer may just have opened it
                raise _unopenable(path, reason(exc)) from None
        else:
            return (_checked(path, f) if guarded else f), False
    # A live writer's flush writes the header's new end of file just before it extends the
    # file, so "shorter than its header says" can last a moment: `load` tries again.
    size = os.path.getsize(path)
    superblock = hdf5.read_superblock(path)
    if superblock is not None and size < superblock.end:
        raise _unopenable(path, "shorter than its header says")
    try:
        f = hdf5.open_swmr(path)
    except H5_ERRORS as exc:
        raise _unopenable(path, reason(exc)) from None
    return (_checked(path, f) if guarded else f), True


def _checked(path: str, f: h5py.File) -> h5py.File:
    """``f``, once ``guard.check`` found nothing in it pointing outside or past the file."""
    try:
        guard.check(path, f)
    except RunFileError:
        f.close()
        raise
    except H5_ERRORS as exc:
        f.close()
        raise _unopenable(path, reason(exc)) from None
    return f


def _unopenable(path: str, why: str) -> RunFileError:
    return RunFileError(f"{path} could not be opened as HDF5 (truncated or damaged: {why})")


def _check_path(path: str) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise RunFileError(f"{path} cannot be read ({reason(exc)})") from None
    if stat.S_ISDIR(info.st_mode):
        raise RunFileError(f"{path} is a directory, not a run file")
    if not stat.S_ISREG(info.st_mode):
        raise RunFileError(f"{path} is not a regular file, not a run file")
    if info.st_size == 0:
        raise RunFileError(f"{path} is empty: not an ampdoctor run file")
    if not os.access(path, os.R_OK):
        raise RunFileError(f"{path} cannot be read (permission denied)")


# -- reading ---------------------------------------------------------------------------------


def _load_once(path: str, columns: Iterable[str] | None = None,
               steps: Columns | None = None) -> Run:
    f, live = open_file(path)
    try:
        return _read(path, f, live, columns, steps)
    except RunFileError:
        f.close()
        raise
    except H5_ERRORS as exc:
        f.close()
        raise RunFileError(f"{path} is damaged and could not be read "
                           f"({reason(exc)})") from None


def _read(path: str, f: h5py.File, live: bool, columns: Iterable[str] | None = None,
          steps: Columns | None = None) -> Run:
    """Read a run; tables that point into others are read before what they point at.

    On a live file every table may grow between two reads. Reading the referring tables
    (stats → tensors, rows → /blob) first means every reference read has its target.
    """
    attrs = root_attrs(f)
    version = check_format(path, attrs)
    # HDF5 shares one open file among every open of it in a process (a Run not closed yet):
    # a plain open may hand back a SWMR reader's file, whose cached tables can be stale.
    live = live or bool(f.swmr_mode)
    raw: dict[str, Any] = {}
    damaged = []
    for name in READ_ORDER:  # each table's length is fixed here, in this order
        try:
            if name == "steps" and steps is not None and _same_rows(path, f, version, live, steps):
                raw[name] = steps  # read already: not decompressed a second time
                continue
            raw[name] = _read_table(path, f, name, live, version, columns)
        except H5_ERRORS:
            if name == "steps":  # without its steps a run has nothing to tell
                raise
            damaged.append(name)  # one damaged table (a torn write) does not lose the rest
            raw[name] = Table(schema.empty(name), name=name) if name in ON_DEMAND else \
                Blob() if name == schema.BLOB else schema.empty(name)
    stats, blob = raw["stats"], raw[schema.BLOB]
    # (/steps was checked a block at a time as it was read: ``_read_table``)
    check_values(path, {k: v for k, v in raw.items() if k != "steps"},
                 blob.size if schema.BLOB not in damaged else None)
    if "tensors" not in damaged:
        stats.tensors = len(raw["tensors"])
    run = Run(path=path, attrs=attrs, _file=f, _blob=blob)
    run.live = live and liveness.writer_alive(run.attrs, path)
    run.meta = meta_dict(raw["meta"], blob, path)
    run.steps = raw["steps"]
    run.groups = raw["groups"]
    run.losses = raw["losses"]
    run.optimizer_steps = raw["optimizers"]
    # A writer numbers tensors 0, 1, 2... in row order; an id outside that (damage) would
    # make a reader size its id -> tensor maps by it (a 2**31 id: gigabytes).
    ids = raw["tensors"]["id"]
    valid = (ids >= 0) & (ids < len(ids))
    if not valid.all():
        damaged.append("tensors")
    run.tensors = tensor_view(raw["tensors"][valid], blob)
    run.stats = stats
    fp8 = raw["fp8"]  # (a format before 4 has none: rows, not a Table)
    run.fp8 = fp8 if isinstance(fp8, Table) else Table(fp8, name="fp8")
    if "tensors" not in damaged:
        run.fp8.tensors = len(raw["tensors"])
    run.events = decoded_rows("events", raw["events"], blob)
    run.snapshots = decoded_rows("snapshots", raw["snapshots"], blob)
    run.arrays = decoded_rows("arrays", raw["arrays"], blob)
    run.damaged = damaged
    return run


# The text references of each table read whole, checked against /blob before they are decoded.
REFS = {**TEXTS, "arrays": [*TEXTS["arrays"], "data"], "meta": ["value"],
        "tensors": ["name", "type"]}


def check_values(path: str, rows: dict[str, Any], blob_size: int | None,
                 start: dict[str, int] | None = None, last_step: int | None = None) -> None:
    """The values of the tables read whole hold to the schema's contract (``values``): step
    numbers, tensor ids of /events, references into a /blob of ``blob_size`` bytes (None:
    /blob could not be read, and its references read as empty text). ``start``: the row
    number of each table's first row here; ``last_step``: the step read before them (a Tail's).
    """
    start = start or {}
    if "steps" in rows:
        values.check_steps(path, rows["steps"], start.get("steps", 0), last_step)
    if "tensors" in rows and "events" in rows:
        values.check_ids(path, "events", rows["events"]["tensor"],
                         start.get("tensors", 0) + len(rows["tensors"]),
                         start.get("events", 0), none=-1)
    if blob_size is None:
        return
    for name, texts in REFS.items():
        if name in rows:
            values.check_refs(path, name, rows[name], texts, blob_size, start.get(name, 0))


def _read_table(path: str, f: h5py.File, name: str, live: bool,
                version: int = schema.FORMAT_VERSION, columns: Iterable[str] | None = None
                ) -> Any:
    """One table: rows (small tables), a ``Table`` (stats, read on demand) or a ``Blob``;
    a table an older format wrote lifted into the current dtype (``migrations``), and one
    added since that format (``schema.SINCE``) empty."""
    if name in schema.TABLES and name not in schema.tables_of(version):
        return schema.empty(name)
    ds = dataset(path, f, name, version)
    if live:
        ds.refresh()
    if name in ON_DEMAND:
        return Table(ds, nrows=written_rows(ds), path=path, name=name,
                     lift=migrations.find(name, version, ds.dtype), threads=not live)
    if name == schema.BLOB:
        return Blob(ds, path)
    if name == "steps":  # column by column, read a block at a time (``columns``)
        stored = None if live else inflate.Stored.of(ds)
        return Columns.read(lambda a, b: migrations.lift(name, version, _rows(ds, stored, a, b)),
                            written_rows(ds), schema.STEPS, keep=columns,
                            check=_steps_checker(path))
    return migrations.lift(name, version, without_unwritten_tail(name, ds[:]))


def _rows(ds: Any, stored: inflate.Stored | None, start: int, stop: int) -> np.ndarray:
    """Rows ``start`` to ``stop`` of ``ds``: by its stored chunks where it can (``inflate``)."""
    rows = None if stored is None else stored.rows(start, stop)
    return ds[start:stop] if rows is None else rows


def _same_rows(path: str, f: h5py.File, version: int, live: bool, steps: Columns) -> bool:
    """Whether /steps holds as many written rows as ``steps`` (read from it before)."""
    ds = dataset(path, f, "steps", version)
    if live:
        ds.refresh()
    return written_rows(ds) == len(steps)


def _steps_checker(path: str) -> Any:
    """``values.check_steps`` on each block of /steps as it is read, each against the step
    before it: every column checked, whichever a reader keeps."""
    last: list[int] = []

    def check(rows: np.ndarray, start: int) -> None:
        values.check_steps(path, rows, start, last[-1] if last else None)
        if len(rows):
            last[:] = [int(rows["step"][-1])]
    return check


def dataset(path: str, f: h5py.File, name: str, version: int = schema.FORMAT_VERSION) -> Any:
    """Table ``name`` of ``f``, checked to have the columns this reader expects: the current
    schema's, or those of a migration declared for format ``version`` (``migrations``)."""
    if name not in f or not isinstance(f[name], h5py.Dataset):
        raise RunFileError(f"{path} is damaged: table /{name} is missing")
    ds = f[name]
    known = ds.dtype == expected_dtype(name) or \
        migrations.find(name, version, ds.dtype) is not None
    if not known or ds.ndim != 1:
        raise RunFileError(f"{path} is damaged: table /{name} has unexpected columns or shape")
    return ds


def expected_dtype(name: str) -> np.dtype:
    """The dtype of table ``name`` (``schema.TABLES``; /summary; /blob: bytes)."""
    if name == schema.SUMMARY_TABLE:
        return schema.SUMMARY
    return schema.TABLES.get(name, np.dtype("u1"))


def without_unwritten_tail(name: str, rows: np.ndarray) -> np.ndarray:
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


def written_rows(ds: Any, block: int = 4096) -> int:
    """Like ``without_unwritten_tail`` for a table read on demand: reads only its end."""
    n = int(ds.shape[0])
    while n > 0:
        start = max(0, n - block)
        tail = without_unwritten_tail(ds.name.lstrip("/"), ds[start:n])
        if len(tail):
            return start + len(tail)
        n = start
    return 0


# -- inspecting ------------------------------------------------------------------------------


def _inspect_once(path: str) -> dict[str, Any]:
    f, live = open_file(path)
    with f:
        attrs = root_attrs(f)
        version = check_format(path, attrs)
        info: dict[str, Any] = {"path": path, "format_version": version, "attrs": attrs,
                                "tables": {}, "live": live}
        extra = [schema.SUMMARY_TABLE] if version >= 2 else []  # format 1 had no /summary
        for name in list(schema.tables_of(version)) + [schema.BLOB] + extra:
            table = info["tables"][name] = _table_info(f, name)
            if table is not None:
                dtype = table.pop("dtype")
                table["damaged"] = dtype != expected_dtype(name) and \
                    (dtype is None or migrations.find(name, version, dtype) is None)
        info["meta"] = {}
        usable = [info["tables"][n] for n in ("meta", schema.BLOB)]
        if all(t is not None and not t["damaged"] for t in usable):  # rows of the schema's type
            try:
                info["meta"] = meta_dict(f["meta"][:], Blob(f[schema.BLOB], path))
            except (*H5_ERRORS, RunFileError):
                pass
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
