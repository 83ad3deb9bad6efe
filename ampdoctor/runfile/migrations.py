"""Declared migrations: how the reader lifts a table an older format version wrote into the
current schema's dtype, so that adding a column keeps every older file readable.

The reader accepts a table whose dtype is the current one (``schema.TABLES``) or the ``dtype``
of a ``Migration`` declared here for that table and the file's format version; it hands out the
rows lifted (``lift``): each column the old dtype shares with the current one copied, the
columns added since set to the migration's ``defaults`` (any other to ``schema.empty``'s
neutral value: NaN floats, -1 ids, zeros). Any other dtype is still damage.

Adding a column to a table is then one declaration (docs/development.md, "Adding a key or a
column"): the column in ``schema.py``, ``FORMAT_VERSION`` raised, and here::

    Migration("steps", versions=(1, 2), dtype=OLD_STEPS, defaults={"new_column": 0})

where ``OLD_STEPS`` is the table's dtype as those versions wrote it (copy it from the
schema before editing). Formats 1 to 4 share every table's dtype; format 5 added /fp8's
``kurtosis`` (``FP8_V4``). A format that added a whole table (3: /losses and /optimizers,
4: /fp8) declares it in ``schema.SINCE`` instead, and a file older than that reads the table
as empty.
This module imports numpy only, as the schema does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from . import schema


@dataclass(frozen=True)
class Migration:
    """Table ``table`` as format ``versions`` wrote it (``dtype``), and the values of the
    columns added since (``defaults``: column name -> value)."""

    table: str
    versions: tuple[int, ...]
    dtype: np.dtype
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def lift(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` of the old dtype as rows of the current one."""
        out = schema.empty(self.table, len(rows))
        current = set(out.dtype.names or ())
        for name in rows.dtype.names or ():
            if name in current:
                out[name] = rows[name]
        for name, value in self.defaults.items():
            out[name] = value
        return out


# /fp8 as format 4 wrote it: no kurtosis (read as NaN: not measured).
FP8_V4 = np.dtype([("step", "<i8"), ("tensor", "<i4"), ("call", "<i2"), ("role", "i1"),
                   ("recipe", "i1"), ("format", "i1"), ("numel", "<i8"), ("sample_n", "<i8"),
                   ("zeros", "<i8"), ("flushed", "<i8"), ("subnormal", "<i8"),
                   ("saturated", "<i8"), ("sqnr_db", "<f4"), ("amax", "<f4"), ("scale", "<f4")])

# Every migration, oldest first. One per (table, older dtype).
MIGRATIONS: tuple[Migration, ...] = (
    Migration("fp8", versions=(4,), dtype=FP8_V4, defaults={"kurtosis": np.nan}),
)


def find(table: str, version: int, dtype: np.dtype) -> Migration | None:
    """The migration that lifts ``table`` stored as ``dtype`` by format ``version``, if any."""
    for m in MIGRATIONS:
        if m.table == table and version in m.versions and np.dtype(m.dtype) == dtype:
            return m
    return None


def lift(table: str, version: int, rows: np.ndarray) -> np.ndarray:
    """``rows`` of ``table`` as the current schema holds them: as read when their dtype is the
    current one, else lifted by the migration declared for it (the reader checked there is
    one: ``find``)."""
    if rows.dtype == schema.TABLES.get(table):
        return rows
    m = find(table, version, rows.dtype)
    if m is None:
        raise ValueError(f"no migration declared for /{table} as format {version} wrote it")
    return m.lift(rows)


def check_declarations() -> None:
    """Each migration names a table of the schema and an older format version, its defaults
    name columns the current dtype has and the old one has not, and its dtype differs from
    the current one (tests/runfile/test_migrations.py calls this)."""
    for m in MIGRATIONS:
        current = schema.TABLES[m.table]
        assert np.dtype(m.dtype) != current, m
        assert all(0 < v < schema.FORMAT_VERSION + 1 for v in m.versions), m
        old = set(np.dtype(m.dtype).names or ())
        for name in m.defaults:
            assert name in (current.names or ()) and name not in old, (m.table, name)
