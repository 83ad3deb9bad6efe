"""A run file's root attributes: read without ever hanging, and the format they declare checked.

The root attributes say what a file is (``format``, ``format_version``) and who wrote it
(``pid``, ``host``, ``created``, ``rank``, ``argv``, ...). ``root_attrs`` reads numbers and
fixed-length strings directly, refuses anything that is not plain data or is oversized, and
reads the variable-length strings of format 1's first writer in a forked child with a time
limit (``VLEN_SECONDS``), because their values sit in HDF5's unchecksummed global heap, where
damage can loop HDF5 forever. ``check_format`` turns what they declare into the one sentence a
user reads when the file is not ours, or too new.

Example::

    attrs = root_attrs(f)              # {'format': 'ampdoctor-run', 'rank': 0, 'argv': [...]}
    check_format("run.h5", attrs)      # 1, or RunFileError / FormatTooNewError
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Any, Callable

import h5py
import numpy as np

from ..errors import FormatTooNewError, RunFileError
from . import schema, values
from .hdf5 import H5_ERRORS

_PLAIN_TYPES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.STRING)
MAX_ATTR_ELEMENTS = 4096


_VLEN = object()  # _attr's answer for a variable-length string attribute
VLEN_SECONDS = 5.0  # time limit for reading variable-length root attributes


def root_attrs(f: h5py.File, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The root attributes (what ``Run.attrs`` holds); ``argv`` decoded from JSON.

    ``only``: read just these (each attribute read costs a tenth of a millisecond, which
    counts over the thousand files of a large job: ``summary.read``).
    """
    out = {}
    try:
        keys = list(f.attrs.keys()) if only is None else [k for k in only if k in f.attrs]
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
        for key in vlen:  # an unreadable format stays _VLEN, for check_format to name
            out[key] = found.get(key, _VLEN if key == "format" else None)
    if "argv" in out or only is None:
        try:
            out["argv"] = json.loads(out.get("argv", "[]"))
        except (TypeError, ValueError, RecursionError):
            pass
    return out


def scalar_attrs(f: h5py.File, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """Root attributes that are plain scalars (numbers, fixed-length strings), read through
    h5py's low-level calls (a tenth of ``root_attrs``' cost: ``summary.read`` reads a thousand
    files); None when one is anything else (``root_attrs`` then reads them its careful way).
    A missing key is left out."""
    out: dict[str, Any] = {}
    for key in keys:
        try:
            attr = h5py.h5a.open(f.id, key.encode())
        except KeyError:
            continue
        kind = attr.get_type()
        if attr.shape != () or kind.get_class() not in (h5py.h5t.INTEGER, h5py.h5t.STRING) \
                or (kind.get_class() == h5py.h5t.STRING and kind.is_variable_str()):
            return None
        value = np.zeros((), f"S{kind.get_size()}" if kind.get_class() == h5py.h5t.STRING
                         else attr.dtype)
        attr.read(value)
        out[key] = value[()].decode(errors="replace") if isinstance(value[()], bytes) \
            else value[()].item()
    return out


def check_format(path: str, attrs: dict[str, Any]) -> int:
    """The format version ``attrs`` declare; RunFileError (not ours, unreadable) or
    FormatTooNewError (a later ampdoctor's) otherwise."""
    name = attrs.get("format")
    if name is _VLEN:  # stored variable-length, and its value could not be read in time
        raise RunFileError(f"{path} is damaged: its format attribute could not be read")
    if name != schema.FORMAT_NAME:
        raise RunFileError(f"{path} is an HDF5 file but not an ampdoctor run "
                           "(no 'ampdoctor-run' format attribute)")
    version: Any = attrs.get("format_version")
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
    values.check_attrs(path, attrs)
    return version


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
    out = _answer_in_child(read, VLEN_SECONDS)
    return {k: v for k, v in out.items() if isinstance(v, str)} if isinstance(out, dict) else {}


def _answer_in_child(work: Callable[[], Any], seconds: float) -> Any:
    """``work()``, computed in a forked child and sent back as JSON; {} when the child does not
    answer within ``seconds`` (it is killed then) or answers what is not JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into the caller
        code = 1
        try:
            os.close(r)
            answer = memoryview(json.dumps(work()).encode())
            while answer:
                answer = answer[os.write(w, answer):]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + seconds
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
        return json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {}
