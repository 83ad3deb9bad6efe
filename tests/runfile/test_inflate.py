"""Tables read by their stored chunks on two threads (``runfile/inflate.py``) and a block read
ahead of the caller (``columns.read_ahead``): the same rows as h5py reads, and h5py's own read
(its error included) wherever the table is not stored as the writer stores it."""

import threading

import h5py
import numpy as np
import pytest

from ampdoctor.errors import RunFileError
from ampdoctor.runfile import schema, store
from ampdoctor.runfile.columns import read_ahead
from ampdoctor.runfile.inflate import Stored
from ampdoctor.runfile.run import Table
from ampdoctor.runfile.schema import Kind


def _stats(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = schema.empty("stats", n)
    for name in rows.dtype.names:
        kind = rows.dtype[name].kind
        rows[name] = rng.normal(0, 1e4, n) if kind == "f" else rng.integers(0, 100, n)
    rows["step"] = np.arange(n) // 7
    return rows


WRITERS = dict(compression="gzip", compression_opts=4, shuffle=True)  # (``writer.py``'s)


def _table(path, rows, options=WRITERS):
    with h5py.File(path, "w") as f:
        f.create_dataset("stats", data=rows, chunks=(64,), maxshape=(None,), **options)


def _same(a, b):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("names", [None, ["absmax"], ["tensor", "step", "rms", "source"]])
def test_rows_are_what_h5py_reads(tmp_path, names):
    rows = _stats(1000)
    _table(tmp_path / "t.h5", rows)
    with h5py.File(tmp_path / "t.h5", "r") as f:
        ds = f["stats"]
        stored = Stored.of(ds)
        assert stored is not None
        for start, stop in [(0, 1000), (0, 64), (5, 6), (63, 129), (64, 640), (999, 1000),
                            (10, 10), (130, 1000)]:
            got = stored.rows(start, stop, names)
            _same(got, (ds if names is None else ds.fields(names))[start:stop])
        assert stored.rows(0, 1001) is None  # past the end: h5py's to answer


@pytest.mark.parametrize("options", [dict(compression="lzf"), dict(compression="gzip"),
                                     dict(compression="gzip", shuffle=True, fletcher32=True),
                                     dict()])
def test_a_table_stored_otherwise_is_left_to_h5py(tmp_path, options):
    rows = _stats(200)
    _table(tmp_path / "t.h5", rows, options)
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert Stored.of(f["stats"]) is None
    table = Table(h5py.File(tmp_path / "t.h5", "r")["stats"], threads=True)
    _same(table.rows(3, 150), rows[3:150])


def test_an_unwritten_chunk_reads_as_h5py_fills_it(tmp_path):
    rows = _stats(100)
    with h5py.File(tmp_path / "t.h5", "w") as f:
        ds = f.create_dataset("stats", shape=(1000,), maxshape=(None,), dtype=rows.dtype,
                              chunks=(64,), compression="gzip", shuffle=True)
        ds[:100] = rows
    with h5py.File(tmp_path / "t.h5", "r") as f:
        stored = Stored.of(f["stats"])
        _same(stored.rows(0, 100), rows)
        assert stored.rows(0, 500) is None  # chunks 2 to 7 were never written


def test_a_damaged_chunk_is_read_by_h5py_and_named(tmp_path):
    rows = _stats(1000)
    path = tmp_path / "t.h5"
    _table(path, rows)
    with h5py.File(path, "r") as f:
        ds = f["stats"]
        where = ds.id.get_chunk_info(3).byte_offset
    with open(path, "r+b") as f:
        f.seek(where + 20)
        f.write(b"\xff" * 40)
    with h5py.File(path, "r") as f:
        stored = Stored.of(f["stats"])
        _same(stored.rows(0, 128), rows[:128])  # the chunks before it
        assert stored.rows(0, 1000) is None
        table = Table(f["stats"], path=str(path), threads=True)
        with pytest.raises(RunFileError, match="is damaged: reading /stats failed"):
            table.rows(0, 1000)


def test_a_recorded_run_reads_alike_either_way(tmp_path):
    """A file the writer wrote: /steps and /stats through their stored chunks, as h5py."""
    from synthetic import Synth, write

    s = Synth(3000, every=1)
    for name in ("a", "b", "c"):
        s.sampled(range(3000), Kind.OUTPUT, name, absmax=2.0)
    path = str(tmp_path / "run.h5")
    write(s, path).close()
    with store.load(path) as run, h5py.File(path, "r") as f:
        assert Stored.of(f["steps"]) is not None and run.stats._stored is not None
        _same(np.asarray(run.steps), f["steps"][:len(run.steps)])
        _same(run.stats.rows(), f["stats"][:len(run.stats)])
        chunks = list(run.stats.chunks(100, names=("step", "absmax")))
        _same(np.concatenate(chunks), f["stats"].fields(["step", "absmax"])[:len(run.stats)])


def test_read_ahead_hands_out_every_block_in_order():
    calls = []

    def read(a, b):
        calls.append(threading.current_thread().name)
        return list(range(a, b))

    got = [x for block in read_ahead(read, 10, 3) for x in block]
    assert got == list(range(10))
    assert all(name.startswith("ampdoctor-read") for name in calls)
    assert list(read_ahead(read, 2, 3)) == [[0, 1]]  # one block: read where asked
    assert list(read_ahead(read, 0, 3)) == []


def test_read_ahead_raises_where_the_block_is_taken_and_stops_with_its_caller():
    def read(a, b):
        if a == 6:
            raise RunFileError("run.h5 is damaged")
        return (a, b)

    blocks = read_ahead(read, 12, 3)
    assert next(blocks) == (0, 3) and next(blocks) == (3, 6)
    with pytest.raises(RunFileError, match="damaged"):
        next(blocks)
    started = []
    early = read_ahead(lambda a, b: started.append(a) or a, 100, 3)
    assert next(early) == 0
    early.close()  # the block in flight, if it started, is waited for; none after it is read
    assert started in ([0], [0, 3])
