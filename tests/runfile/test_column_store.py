"""/steps as a loaded run holds it: column by column (``runfile/columns.py``), read a block at
a time, and answering what the analysis asks of a structured array alike."""

import numpy as np
import pytest

from ampdoctor.runfile import schema, store
from ampdoctor.runfile.columns import Columns


def _rows(n):
    rows = schema.empty("steps", n)
    rows["step"] = np.arange(n)
    rows["time"] = 1.7e9 + np.arange(n)
    rows["loss"] = np.linspace(3.0, 1.0, n)
    rows["skipped"] = np.arange(n) % 7 == 3
    return rows


def _same(a, b):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()  # (NaN equal to NaN)


def test_columns_answer_as_the_rows_do():
    rows = _rows(10)
    cols = Columns.of(rows)
    assert len(cols) == 10 and cols.dtype == rows.dtype and cols.shape == (10,)
    for name in rows.dtype.names:
        np.testing.assert_array_equal(cols[name], rows[name])
        assert cols[name].flags.c_contiguous
    mask = rows["skipped"] == 1
    _same(cols[mask], rows[mask])
    _same(cols[2:5], rows[2:5])
    _same(cols[np.array([9, 0])], rows[np.array([9, 0])])
    _same(cols[-1], rows[-1])
    assert cols[3]["loss"] == rows[3]["loss"]
    picked = cols[["step", "loss"]]
    assert picked.dtype.names == ("step", "loss")
    np.testing.assert_array_equal(picked["loss"], rows["loss"])
    _same(np.asarray(cols), rows)
    assert [r["step"] for r in cols] == list(range(10))
    with pytest.raises(IndexError):
        cols[10]


def test_writing_a_column_writes_the_table():
    cols = Columns.of(_rows(6))
    cols["grad_norm"][[1, 4]] = 2.5  # as NormShares.apply writes a global norm
    cols["flags"][1] |= 8
    assert cols[1]["grad_norm"] == 2.5 and cols[4]["grad_norm"] == 2.5 and cols[1]["flags"] == 8
    copy = cols.copy()
    copy["loss"] = 0.0
    assert cols["loss"][0] == 3.0


@pytest.mark.parametrize("block", [1, 3, 4, 64])
def test_read_by_blocks_holds_every_row(block):
    rows = _rows(10)
    got = Columns.read(lambda a, b: rows[a:b], len(rows), rows.dtype, block=block)
    _same(np.asarray(got), rows)


def test_a_loaded_run_holds_its_steps_as_columns_up_to_the_last_written(tmp_path):
    path = str(tmp_path / "run.h5")
    w = store.Writer(path)
    w.append("steps", _rows(5000))
    w.close()
    with store.load(path) as run:
        assert isinstance(run.steps, Columns)
        _same(np.asarray(run.steps), _rows(5000))
    np.testing.assert_array_equal(store.load_steps(path)["loss"], _rows(5000)["loss"])
