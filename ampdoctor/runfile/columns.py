"""A table held column by column: ``Columns``, what ``Run.steps`` is for a loaded run.

A run of ten million steps has a /steps of 620 MB (62 bytes a row). Held as rows, every column
the analysis reads is a strided view across them: ``np.searchsorted(steps["step"], ...)``
copies 80 MB on each call, ``steps["loss"].astype(float)`` walks 620 MB for 40. Held as one
contiguous array per column, a column is read where it lies, and the table is read from the
file a block of rows at a time (``read``), so the whole rows are never in memory at once.

``Columns`` answers what the analysis asks of a structured array: ``steps["loss"]`` (the column
itself: writing into it writes the table), ``steps[["step", "loss"]]``, ``len``, ``dtype``,
and rows by index, slice or mask (``steps[3]``, ``steps[mask]``: a structured copy).

Example::

    steps = Columns.of(schema.empty("steps", 3))
    steps["loss"][:] = 1.0
    steps[1]["loss"]            # 1.0
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np

BLOCK_ROWS = 1 << 16  # rows read from the file at a time (4 MB of /steps)


class Columns:
    """Rows of one table as one contiguous array per column (``dtype``'s fields)."""

    def __init__(self, columns: dict[str, np.ndarray], dtype: np.dtype, n: int | None = None):
        self.dtype = dtype
        self._cols = columns
        self._n = n if n is not None else len(next(iter(columns.values()))) if columns else 0
        # (rows_of, block) while columns of ``dtype`` are left to read (``read``'s ``keep``)
        self._rest: tuple[Callable[[int, int], np.ndarray], int] | None = None

    def _whole(self) -> dict[str, np.ndarray]:
        """Every column, the ones ``keep`` left out read now (one pass over the table)."""
        if self._rest is not None:
            rows_of, block = self._rest
            missing = tuple(n for n in self.dtype.names or () if n not in self._cols)
            self._cols.update(_read_columns(rows_of, self._n, self.dtype, missing, block))
            self._cols = {n: self._cols[n] for n in self.dtype.names or ()}
            self._rest = None
        return self._cols

    @classmethod
    def of(cls, rows: np.ndarray) -> "Columns":
        """The columns of structured ``rows`` (copied)."""
        names = rows.dtype.names or ()
        return cls({n: np.ascontiguousarray(rows[n]) for n in names}, rows.dtype)

    @classmethod
    def read(cls, rows_of: Callable[[int, int], np.ndarray], n: int, dtype: np.dtype,
             block: int = BLOCK_ROWS, keep: Iterable[str] | None = None,
             check: Callable[[np.ndarray, int], None] | None = None) -> "Columns":
        """``n`` rows of ``dtype`` read ``block`` at a time by ``rows_of(start, stop)``.

        ``keep``: hold only these columns; any other is read when first asked for (all the
        others at once: one more pass over the table). ``check(rows, start)``: called on each
        block read, whatever is kept (the values' checks see every column)."""
        names = dtype.names or ()
        held = names if keep is None else tuple(n for n in names if n in set(keep))
        cols = _read_columns(rows_of, n, dtype, held, block, check)
        out = cls(cols, dtype, n)
        if len(held) < len(names):
            out._rest = (rows_of, block)
        return out

    def narrowed(self, keep: Iterable[str]) -> "Columns":
        """The same rows holding only the columns ``keep`` (the same arrays); any other is
        read again when asked for. Columns read whole (not from a file) are returned as
        they are: there is nothing to read them again from."""
        if self._rest is None and len(self._cols) == len(self.dtype.names or ()):
            return self
        out = Columns({n: v for n, v in self._cols.items() if n in set(keep)}, self.dtype,
                      self._n)
        out._rest = self._rest
        return out

    def holding(self, keep: Iterable[str]) -> "Columns":
        """The same rows holding exactly the columns ``keep``: those held kept (the same
        arrays), the others of them read now, together (one pass over the table, none of the
        columns not named: ``narrowed`` then a first use would read every one left out)."""
        names = tuple(n for n in self.dtype.names or () if n in set(keep))
        missing = tuple(n for n in names if n not in self._cols)
        if missing and self._rest is None:  # nothing to read them from: held whole
            return self
        out = self.narrowed(names)
        if missing:
            rows_of, block = self._rest  # type: ignore[misc]
            out._cols.update(_read_columns(rows_of, self._n, self.dtype, missing, block))
        return out

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    @property
    def size(self) -> int:
        return self._n

    ndim = 1

    def head(self, n: int) -> "Columns":
        """The first ``n`` rows (views of the same columns)."""
        return Columns({k: v[:n] for k, v in self._whole().items()}, self.dtype)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self._cols[key] if key in self._cols else self._whole()[key]
        if isinstance(key, list) and key and all(isinstance(k, str) for k in key):
            out = np.empty(self._n, [(k, self.dtype[k]) for k in key])
            for k in key:
                out[k] = self[k]
            return out
        if isinstance(key, (int, np.integer)):
            i = int(key) + self._n if int(key) < 0 else int(key)
            if not 0 <= i < self._n:
                raise IndexError(f"index {int(key)} is out of bounds for {self._n} rows")
            return self._rows(slice(i, i + 1))[0]
        return self._rows(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, str):
            self[key][...] = value
            return
        for name, col in self._whole().items():
            col[key] = value[name]

    def _rows(self, key: Any) -> np.ndarray:
        picked = {k: v[key] for k, v in self._whole().items()}
        n = len(next(iter(picked.values()))) if picked else 0
        out = np.empty(n, self.dtype)
        for k, v in picked.items():
            out[k] = v
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        rows = self._rows(slice(None))
        return rows if dtype is None else rows.astype(dtype)

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, self._n, BLOCK_ROWS):
            yield from self._rows(slice(start, start + BLOCK_ROWS))

    def copy(self) -> "Columns":
        return Columns({k: v.copy() for k, v in self._whole().items()}, self.dtype)

    def __repr__(self) -> str:
        return f"Columns({self._n} rows: {', '.join(self.dtype.names or ())})"


def _read_columns(rows_of: Callable[[int, int], np.ndarray], n: int, dtype: np.dtype,
                  names: tuple[str, ...], block: int,
                  check: Callable[[np.ndarray, int], None] | None = None
                  ) -> dict[str, np.ndarray]:
    cols = {name: np.empty(n, dtype[name]) for name in names}
    for start, part in zip(range(0, n, block), read_ahead(rows_of, n, block)):
        if check is not None:
            check(part, start)
        for name, col in cols.items():
            col[start:start + len(part)] = part[name]
    return cols


T = TypeVar("T")


def read_ahead(read: Callable[[int, int], T], n: int, block: int) -> Iterator[T]:
    """``read(start, stop)`` of ``n`` rows, ``block`` at a time and in order, the next block
    read on a second thread while the caller works on this one.

    h5py lets go of the GIL while HDF5 reads and inflates a block, so the caller's numpy work
    on one block and the read of the next share the two cores: a pass over a month-long
    run's /steps or /stats costs its reads alone. One block is in flight at most; an error
    reading it is raised where the caller takes it; a caller that stops early waits for that
    one read, no more. A table of one block is read on the caller's thread."""
    starts = range(0, n, block)
    if len(starts) <= 1:
        for start in starts:
            yield read(start, min(n, start + block))
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampdoctor-read") as pool:
        pending = pool.submit(read, 0, min(n, block))
        try:
            for start in starts[1:]:
                done = pending.result()
                pending = pool.submit(read, start, min(n, start + block))
                yield done
            yield pending.result()
        finally:
            pending.cancel()  # (not started yet: dropped; started: waited for on leaving)
