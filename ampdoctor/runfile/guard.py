"""A run file is untrusted input: what HDF5 lets a file do that a run file must not.

Run files travel (bug reports, shared filesystems), and HDF5 lets a file point elsewhere: an
external link, a virtual dataset mapped onto other files, a dataset whose raw bytes live in
another file (a secret, a FIFO that blocks forever, ``/proc/self/environ``). It lets a table
declare a shape far beyond what the file stores (read as fill values, or inflated from one
small compressed chunk). ``check`` walks every link of a freshly opened file, following none,
and refuses all of that with one sentence before any table is read. What it accepts stays
inside the file and costs at most ``INFLATION`` times what the file stores.

Example::

    f = h5py.File("run.h5", "r")
    check("run.h5", f)   # RunFileError: run.h5 points outside itself (/steps is an external
                         # link to other.h5): ampdoctor reads only what is inside a run file
"""

from __future__ import annotations

import os
from typing import Any

import h5py

from ..errors import RunFileError
from . import schema

MAX_LINKS = 1000  # a run file holds a dozen tables; a walk stops well short of a crafted maze
# A table may read as this many times the bytes it stores: gzip of real columns is 2-10x; a
# compression bomb (a chunk of zeros) is ~1000x. Below FREE_BYTES any table is read as is.
INFLATION = 100
FREE_BYTES = 64 << 20
# Built-in filters only: deflate (gzip), shuffle, fletcher32. Any other makes HDF5 look for a
# plugin, code that is not ampdoctor's, chosen by the file.
FILTERS = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32}
TABLES = (*schema.TABLES, schema.BLOB, schema.SUMMARY_TABLE)


def check(path: str, f: h5py.File) -> None:
    """Refuse ``f`` (opened from ``path``) if it points outside itself, holds a type or filter
    a run file never holds, or declares more than it stores; raises ``RunFileError``."""
    size = os.path.getsize(path)
    links: list[tuple[str, int]] = []

    def visit(name: bytes, info: Any) -> Any:  # h5py hands every call the same ``info``
        links.append((name.decode(errors="replace"), int(info.type)))
        return None if len(links) <= MAX_LINKS else True  # a true value stops the walk

    f.id.links.visit(visit, info=True)
    if len(links) > MAX_LINKS:
        raise RunFileError(f"{path} holds more than {MAX_LINKS} objects: "
                           "not an ampdoctor run file")
    for name, kind in links:
        _check_link(path, f, name, kind)
    for name in TABLES:
        if name in f and not isinstance(f.get(name), h5py.Dataset):
            raise RunFileError(f"{path} is damaged: /{name} is a group, not a table")
    for name, kind in links:
        if kind == h5py.h5l.TYPE_HARD:
            obj = h5py.h5o.open(f.id, name.encode())
            if isinstance(obj, h5py.h5d.DatasetID):
                _check_dataset(path, f"/{name}", obj, size)


def _outside(path: str, what: str) -> RunFileError:
    return RunFileError(f"{path} points outside itself ({what}): ampdoctor reads only what "
                        "is inside a run file")


def _check_link(path: str, f: h5py.File, name: str, kind: int) -> None:
    if kind == h5py.h5l.TYPE_EXTERNAL:
        target, _inside = f.id.links.get_val(name.encode())
        raise _outside(path, f"/{name} is an external link to "
                             f"{target.decode(errors='replace')}")
    if kind not in (h5py.h5l.TYPE_HARD, h5py.h5l.TYPE_SOFT):
        raise _outside(path, f"/{name} is a user-defined link")


def _check_dataset(path: str, name: str, ds: Any, size: int) -> None:
    dcpl = ds.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise _outside(path, f"{name} is a virtual dataset, mapped onto other files")
    if dcpl.get_external_count():
        target = dcpl.get_external(0)[0].decode(errors="replace")
        raise _outside(path, f"{name} is stored in {target}")
    for i in range(dcpl.get_nfilters()):
        code = dcpl.get_filter(i)[0]
        if code not in FILTERS:
            raise RunFileError(f"{path} is damaged: {name} is compressed with filter {code}, "
                               "which a run file never uses")
    kind = ds.get_type()
    if _has_reference(kind):
        raise RunFileError(f"{path} is damaged: {name} holds object references, "
                           "which a run file never does")
    _check_size(path, name, ds, kind.get_size(), size)


def _has_reference(kind: Any) -> bool:
    """Does HDF5 type ``kind`` hold an object or region reference anywhere inside it?"""
    cls = kind.get_class()
    if cls == h5py.h5t.REFERENCE:
        return True
    if cls == h5py.h5t.COMPOUND:
        return any(_has_reference(kind.get_member_type(i)) for i in range(kind.get_nmembers()))
    if cls in (h5py.h5t.ARRAY, h5py.h5t.VLEN):
        return _has_reference(kind.get_super())
    return False


def _check_size(path: str, name: str, ds: Any, row_bytes: int, size: int) -> None:
    """A table's declared bytes against what it stores and what the file can hold."""
    shape = ds.get_space().shape
    declared = row_bytes
    for n in shape:
        declared *= int(n)
    stored = int(ds.get_storage_size())
    rows = int(shape[0]) if shape else 1
    if stored > size or (declared > FREE_BYTES and declared > INFLATION * stored):
        raise RunFileError(
            f"{path} is damaged: {name} declares {rows} rows ({_bytes(declared)}) "
            f"but the file stores {_bytes(stored)} of it in {_bytes(size)}: ampdoctor reads "
            f"at most {INFLATION} times what a table stores")


def _bytes(n: int) -> str:
    """``_bytes(1 << 40)``: '1.1 TB'."""
    if n < 1000:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000:
            break
    return f"{value:.3g} {unit}"
