"""A run as read: ``Run`` and its tables (``Table``, read on demand; ``Blob``, the byte heap).

These are the objects the analysis side works on. ``reader.load`` fills a ``Run`` from a file
(and ``tail.Tail`` hands out new rows decoded the same way); tests build one in memory from
numpy arrays. What is read is data only: numbers, UTF-8 text from ``/blob``, JSON in
``/meta``. A read that fails on a damaged file raises ``RunFileError`` naming the file.

Decoding lives here too, so that a loaded run and a followed one read alike: ``decoded``
(text references to strings), ``decoded_rows`` (a table as a ``Run`` holds it),
``tensor_view`` and ``meta_dict``.

Example::

    run = Run(steps=schema.empty("steps", 3), stats=Table(schema.empty("stats")))
    run.status                  # 'interrupted': no writer closed it
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ..errors import RunFileError
from . import inflate, records, schema, values
from .columns import read_ahead
from .hdf5 import H5_ERRORS, reason
from .meta import AppliedFix, BuffersInfo, LossSlot, OptimizerInfo, ScalerInfo, ShardingInfo
from .payloads import LrRange

BLOB_WHOLE = 8 << 20  # a /blob up to this size is read at once; a larger one by ranges
TEXT_SPAN = 1 << 20  # bytes of a large /blob read at a time for many texts (``Blob.texts``)

# The text columns of each table a Run holds decoded, in the order a Tail hands them out.
TEXTS = {"events": ["text"], "arrays": ["name"],
         "snapshots": ["module", "module_type", "detail"]}


class Table:
    """Rows of one table, read on demand: columns, slices and chunks, never more than asked.

    Wraps an HDF5 dataset (a loaded run) or a numpy array (a run built in memory, tests).
    A read that fails on a damaged file raises ``RunFileError`` naming the file.
    """

    def __init__(self, data: Any, nrows: int | None = None, path: str | None = None,
                 name: str = "stats", lift: Any = None, first: int = 0,
                 threads: bool = False):
        # rows ``first`` to ``nrows`` of ``data``, numbered from 0 here (a follower's new rows)
        self._data = data
        self._first = first
        self._n = (len(data) if nrows is None else nrows) - first
        # A table an older format wrote: read whole rows, handed out lifted into the current
        # dtype (a ``migrations.Migration``; None: stored as the schema has it).
        self._lift = lift
        self.dtype = data.dtype if lift is None else schema.TABLES[name]
        # ``threads``: a finished file's table, whose stored chunks may be inflated on two
        # threads (``inflate``); a file still written is read through HDF5 alone
        self._stored = inflate.Stored.of(data) if threads and lift is None else None
        self._path = path
        self._name = name
        # How many tensors /tensors holds, set by the reader: every id read is checked
        # against it (``values.check_ids``). None: not checked (a Run built in memory).
        self.tensors: int | None = None

    def __len__(self) -> int:
        return self._n

    def _read(self, what: Any, start: int, stop: int | None) -> np.ndarray:
        stop = self._n if stop is None else min(stop, self._n)
        start, stop = start + self._first, stop + self._first
        if isinstance(self._data, np.ndarray):
            data = self._data if what is None else self._data[what]
            return data[start:stop]
        if stop <= start:
            dtype = self.dtype if what is None else (
                self.dtype[what] if isinstance(what, str)
                else np.dtype([(n, self.dtype[n]) for n in what]))
            return np.empty(0, dtype)
        try:
            if self._lift is not None:
                out = self._lift.lift(self._data[start:stop])
                out = out if what is None else out[what]
            else:
                out = self._stored_rows(what, start, stop)
                if out is None:
                    source = self._data if what is None else self._data.fields(what)
                    out = source[start:stop]
        except H5_ERRORS as exc:
            raise RunFileError(f"{self._path} is damaged: reading /{self._name} failed "
                               f"({reason(exc)})") from None
        if self.tensors is not None:
            ids = out if what == "tensor" else out["tensor"] \
                if out.dtype.names and "tensor" in out.dtype.names else None
            if ids is not None:
                values.check_ids(str(self._path), self._name, ids, self.tensors, start)
        return out

    def _stored_rows(self, what: Any, start: int, stop: int) -> np.ndarray | None:
        """Rows read by their stored chunks (``inflate``), as h5py reads them; None: not so."""
        if self._stored is None:
            return None
        rows = self._stored.rows(start, stop, [what] if isinstance(what, str) else what)
        return rows[what] if rows is not None and isinstance(what, str) else rows

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._read(name, start, stop)

    def columns(self, names: list[str] | tuple[str, ...], start: int = 0,
                stop: int | None = None) -> np.ndarray:
        return self._read(list(names), start, stop)

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._read(None, start, stop)

    def chunks(self, size: int = 1 << 16, names: tuple[str, ...] | None = None
               ) -> Iterator[np.ndarray]:
        """Iterate over the table ``size`` rows at a time (bounded memory), the next chunk
        read while the caller works on this one (``columns.read_ahead``)."""
        what = None if names is None else list(names)
        yield from read_ahead(lambda start, stop: self._read(what, start, stop), self._n, size)

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
                               f"({reason(exc)})") from None

    def text(self, off: int, length: int) -> str:
        """Text at a reference; '' for a reference outside the heap (a damaged file)."""
        raw = self.read(off, length)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def texts(self, offs: np.ndarray, lengths: np.ndarray) -> list[str]:
        """``text`` at each reference, a heap read by range a ``TEXT_SPAN`` of bytes at a time
        (the texts in order of offset): 10^5 modules' 466 664 tensor names were as many
        reads of /blob, 2 minutes."""
        offs, lengths = np.asarray(offs, np.int64), np.asarray(lengths, np.int64)
        if self._ds is None:
            return [self.text(o, n) for o, n in zip(offs.tolist(), lengths.tolist())]
        out = [""] * len(offs)
        ok = np.flatnonzero((lengths > 0) & (offs >= 0) & (offs + lengths <= self.size))
        if len(ok):
            lo, hi = int(offs[ok].min()), int((offs[ok] + lengths[ok]).max())
            if hi - lo <= 2 * int(lengths[ok].sum()) + TEXT_SPAN:  # together: by windows
                self._together(offs, lengths, ok, out)
                return out
        order = ok[np.argsort(offs[ok], kind="stable")].tolist()
        at, n = offs.tolist(), lengths.tolist()
        i = 0
        while i < len(order):
            start, stop, j = at[order[i]], 0, i
            while j < len(order) and (j == i or at[order[j]] + n[order[j]] - start <= TEXT_SPAN):
                stop = max(stop, at[order[j]] + n[order[j]])
                j += 1
            raw = self.read(start, stop - start) or b""
            for k in order[i:j]:
                out[k] = raw[at[k] - start:at[k] - start + n[k]].decode("utf-8", errors="replace")
            i = j
        return out


    def _together(self, offs: np.ndarray, lengths: np.ndarray, ok: np.ndarray,
                  out: list[str]) -> None:
        """``texts`` of references that lie close together (no saved array between them):
        each ``TEXT_SPAN`` window of starts read once and cut in one pass, no loop over
        spans."""
        ok = ok[np.argsort(offs[ok], kind="stable")]
        start, end = offs[ok], offs[ok] + lengths[ok]
        window = (start - start[0]) // TEXT_SPAN
        cuts = np.flatnonzero(np.r_[True, window[1:] != window[:-1]]).tolist() + [len(ok)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            base = int(start[a])
            raw = self.read(base, int(end[a:b].max()) - base) or b""
            for k, at, n in zip(ok[a:b].tolist(), (start[a:b] - base).tolist(),
                                lengths[ok[a:b]].tolist()):
                out[k] = raw[at:at + n].decode("utf-8", errors="replace")


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
    # a structured array (a Run built in memory), or a loaded run's ``columns.Columns``: the
    # same columns, rows and length, held column by column
    steps: Any = field(default_factory=lambda: schema.empty("steps"))
    groups: Any = field(default_factory=lambda: Table(schema.empty("groups"), name="groups"))
    # several losses / optimizers (format 3): a row per step and loss, per step and optimizer
    losses: np.ndarray = field(default_factory=lambda: schema.empty("losses"))
    optimizer_steps: np.ndarray = field(default_factory=lambda: schema.empty("optimizers"))
    tensors: np.ndarray = field(default_factory=lambda: np.zeros(0, TENSOR_VIEW))
    stats: Table = field(default_factory=lambda: Table(schema.empty("stats")))
    # format 4: what each fp8 recipe would do to the Linear layers' operands (sampled steps)
    fp8: Table = field(default_factory=lambda: Table(schema.empty("fp8"), name="fp8"))
    events: np.ndarray = field(default_factory=lambda: _no_rows("events"))
    snapshots: np.ndarray = field(default_factory=lambda: _no_rows("snapshots"))
    arrays: np.ndarray = field(default_factory=lambda: _no_rows("arrays"))
    live: bool = False  # the writer has the file open and is still running
    damaged: list = field(default_factory=list)  # tables that could not be read (left empty)
    _file: Any = field(default=None, repr=False)
    _blob: Any = field(default=None, repr=False)

    def _meta_dict(self, key: str) -> dict[str, Any] | None:
        value = self.meta.get(key)
        return value if isinstance(value, dict) else None

    # Typed views of /meta (its keys: schema.py): None (or []) when the run did not record it.
    @property
    def autocast(self) -> dict[str, Any] | None:
        """``{"enabled": True, "dtype": "float16", "device_type": "cuda", ...}``"""
        return self._meta_dict("autocast")

    @property
    def scaler(self) -> ScalerInfo | None:
        value = self._meta_dict("scaler")
        return None if value is None else ScalerInfo.from_json(value)

    @property
    def device(self) -> dict[str, Any] | None:
        return self._meta_dict("device")

    @property
    def model(self) -> dict[str, Any] | None:
        return self._meta_dict("model")

    @property
    def buffers(self) -> BuffersInfo | None:
        """The buffers non-finite when the recording first saw them (``record/buffers.py``);
        None in a file recorded before it was kept (or holding an empty object)."""
        value = self._meta_dict("buffers")
        return BuffersInfo.from_json(value) if value else None

    @property
    def sharding(self) -> ShardingInfo | None:
        value = self._meta_dict("sharding")
        return None if value is None else ShardingInfo.from_json(value)

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
    def handles(self) -> dict[str, str]:
        """What the training code calls the recorded modules, {recorded path: expression}
        (``{"": "model.module"}``); {} where none was found or recorded."""
        value = self._meta_dict("handles") or {}
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)
                and _is_expression(v)}

    @property
    def skipped_modules(self) -> list[dict[str, Any]]:
        """Modules left out because recording them failed (the rest recorded):
        ``[{"module": "GPT", "where": "discover_pre", "why": "RuntimeError: ..."}]``."""
        value = self.meta.get("skipped_modules")
        return [s for s in value if isinstance(s, dict)] if isinstance(value, list) else []

    @property
    def applied(self) -> list[AppliedFix]:
        """``record --apply``: ``[AppliedFix(fix="lr_factor", arg="lr_factor=0.028"), ...]``;
        [] for a run that was not treated."""
        value = self.meta.get("applied")
        return [AppliedFix.from_json(a) for a in value if isinstance(a, dict)] \
            if isinstance(value, list) else []

    @property
    def fp8_layers(self) -> dict[str, dict[str, Any]]:
        """The layers trained in fp8, by module name: ``{"fc1": {"library": "torchao",
        "recipe": "rowwise", "input": {"scaling": "dynamic", "granularity": "axiswise",
        "dtype": "float8_e4m3fn"}, ...}}``; {} for a run that has none."""
        value = self._meta_dict("fp8_layers") or {}
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, dict)}

    @property
    def lr_range(self) -> LrRange | None:
        """The LR range test run at a divergence with no non-finite value (with its
        ``trigger``); None where none ran there."""
        value = self._meta_dict("lr_range")
        return None if value is None else LrRange.from_json(value)

    @property
    def optimizers(self) -> list[OptimizerInfo]:
        return records.read(list[OptimizerInfo], self.meta.get("optimizer"), [])

    @property
    def losses_meta(self) -> list[LossSlot]:
        """The losses of a run that backwarded several (/losses slot order): ``[LossSlot(
        site="train.py:41", optimizers=[0], reaches=[0]), ...]``; [] for one loss."""
        return records.read(list[LossSlot], self.meta.get("losses"), [])

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
    fields = [(n, rows.dtype[n]) for n in rows.dtype.names or ()
              if not any(n in (f"{t}_off", f"{t}_len") for t in texts)]
    out = np.zeros(len(rows), fields + [(t, object) for t in texts])
    for name, _ in fields:
        out[name] = rows[name]
    for t in texts:
        line = one_line if t in NAMES else str
        out[t] = [line(blob.text(int(o), int(n))) if blob is not None else ""
                  for o, n in zip(rows[f"{t}_off"], rows[f"{t}_len"])]
    return out


# Texts that are names (of modules and types), one line each by the schema's contract: a line
# break in one (a crafted file's, since torch's own printing would break on it too) is written
# out, so no name can start a line of its own in a diagnosis, a table or a report.
NAMES = frozenset({"name", "type", "module", "module_type"})
_BREAKS = {"\n": "\\n", "\r": "\\r", "\u2028": "\\u2028", "\u2029": "\\u2029",
           "\x85": "\\x85", "\x0b": "\\x0b", "\x0c": "\\x0c"}
_BREAK = re.compile("|".join(_BREAKS))


def one_line(text: str) -> str:
    """``text`` with every line break written out: ``one_line("a\\nb")`` is ``'a\\\\nb'``."""
    return _BREAK.sub(lambda m: _BREAKS[m.group()], text)


def _no_rows(table: str) -> np.ndarray:
    return decoded(schema.empty(table), TEXTS[table])


def decoded_rows(table: str, rows: np.ndarray, blob: Blob | None = None) -> np.ndarray:
    """Rows of ``events``, ``arrays`` or ``snapshots`` as a ``Run`` holds them: text decoded
    (``TEXTS``), and a snapshot's code this reader does not know read as UNKNOWN."""
    if table == "snapshots":
        _known(rows, "phase", schema.Phase, schema.Phase.UNKNOWN)
        _known(rows, "autocast", schema.DType, schema.DType.UNKNOWN)
    return decoded(rows, TEXTS[table], blob)


def _known(rows: np.ndarray, column: str, codes: Any, unknown: int) -> None:
    """A code this reader does not know (damage, or a later writer) reads as ``unknown``."""
    valid = np.isin(rows[column], [int(c) for c in codes])
    rows[column] = np.where(valid, rows[column], int(unknown))


def meta_dict(rows: np.ndarray, blob: Blob, path: str | None = None,
              start: int = 0) -> dict[str, Any]:
    """``/meta`` rows as ``Run.meta``: key -> JSON value (the text itself where it is not JSON);
    a later row for a key wins. With ``path``, a known key's value of the wrong type is
    ``RunFileError`` (``values.check_meta``; ``start``: the row number of ``rows[0]``)."""
    meta: dict[str, Any] = {}
    for i, row in enumerate(rows):
        key = bytes(row["key"]).decode(errors="replace")
        text = blob.text(int(row["value_off"]), int(row["value_len"]))
        if text and not text.strip("\x00"):
            continue  # bytes a flush cut short (a full disk) never wrote: the earlier value holds
        try:
            meta[key] = json.loads(text)
        except (ValueError, RecursionError):
            meta[key] = text
        if path is not None:
            values.check_meta(path, key, meta[key], start + i)
    return meta


def tensor_view(rows: np.ndarray, blob: Blob) -> np.ndarray:
    """``/tensors`` rows as ``Run.tensors`` (``TENSOR_VIEW``): names and types as strings."""
    out = np.zeros(len(rows), TENSOR_VIEW)
    for name in ("id", "kind", "index", "dtype", "numel"):
        out[name] = rows[name]
    out["name"] = _one_line_each(blob.texts(rows["name_off"], rows["name_len"]))
    out["type"] = _one_line_each(blob.texts(rows["type_off"], rows["type_len"]))
    return out


def _one_line_each(texts: list[str]) -> list[str]:
    """``one_line`` of each text, with one search of them all first: 10^5 modules' 466 664
    names seldom hold a line break."""
    broken = any(_BREAK.search("\0".join(texts[i:i + 4096])) for i in range(0, len(texts), 4096))
    return [one_line(t) for t in texts] if broken else texts


def _is_expression(text: str) -> bool:
    """A dotted name (``model``, ``self.model.module``): all a handle may be, since a snippet
    puts it into code the user runs."""
    return bool(text) and all(p.isidentifier() for p in text.split("."))
