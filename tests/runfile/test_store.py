"""The run file: round trip, SWMR reading while written, and one clear sentence for bad files."""

import os
import subprocess
import textwrap

import h5py
import numpy as np
import pytest
from conftest import PYTHON, python_env

import ampdoctor
from ampdoctor.errors import FormatTooNewError, RunFileError
from ampdoctor.runfile import hdf5, schema, store, writer


def write_small(path, steps=5, close=True):
    w = store.Writer(path, rank=1, world_size=2, argv=["train.py", "--lr", "3"])
    rows = schema.empty("steps", steps)
    rows["step"] = np.arange(steps)
    rows["loss"] = np.linspace(2, 1, steps)
    rows["scale"] = 2.0**16
    w.append("steps", rows)
    t = schema.empty("tensors", 1)
    t["id"] = 0
    t["kind"] = schema.Kind.OUTPUT
    t["name_off"], t["name_len"] = w.text("blocks.3.attn")
    t["type_off"], t["type_len"] = w.text("Attention")
    w.append("tensors", t)
    s = schema.empty("stats", 3)
    s["step"] = [0, 0, 2]
    s["tensor"] = 0
    s["absmax"] = [1.0, 2.0, 70000.0]
    w.append("stats", s)
    w.meta("autocast", {"dtype": "float16", "enabled": True})
    w.meta("status", "running")
    if close:
        w.close("finished")
    else:
        w.flush()
    return w


def test_round_trip(tmp_path):
    path = str(tmp_path / "r.h5")
    write_small(path)
    with store.load(path) as run:
        assert run.status == "finished"
        assert run.attrs["rank"] == 1 and run.attrs["world_size"] == 2
        assert run.attrs["argv"] == ["train.py", "--lr", "3"]
        assert run.attrs["format"] == schema.FORMAT_NAME
        assert run.meta["autocast"]["dtype"] == "float16"
        np.testing.assert_allclose(run.steps["loss"], np.linspace(2, 1, 5), rtol=1e-6)
        assert run.tensor_name(0) == "blocks.3.attn"
        assert run.tensors["type"][0] == "Attention"
        assert len(run.stats) == 3
        np.testing.assert_array_equal(run.stats.column("absmax"), [1.0, 2.0, 70000.0])
        chunks = list(run.stats.chunks(size=2, names=("step", "absmax")))
        assert [len(c) for c in chunks] == [2, 1]


def test_every_table_exists_up_front_and_is_chunked_compressed(tmp_path):
    path = str(tmp_path / "r.h5")
    store.Writer(path).close()
    with h5py.File(path, "r") as f:
        for name, dtype in schema.TABLES.items():
            assert f[name].dtype == dtype
            assert f[name].chunks is not None and f[name].compression == "gzip"
            assert f[name].maxshape == (None,)


def test_killed_writer_leaves_a_readable_prefix(tmp_path):
    path = str(tmp_path / "killed.h5")
    code = textwrap.dedent(f"""
        import os, signal, numpy as np
        from ampdoctor.runfile import schema, store
        w = store.Writer({path!r})
        w.meta("status", "running")
        for i in range(10):
            rows = schema.empty("steps", 1); rows["step"] = i
            w.append("steps", rows)
            if i < 7:
                w.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([PYTHON, "-c", code], env=python_env())
    assert proc.returncode == -9
    with store.load(path) as run:
        assert list(run.steps["step"]) == list(range(7))
        assert run.status == "interrupted"


def test_live_file_can_be_read_while_written(tmp_path):
    path = str(tmp_path / "live.h5")
    w = write_small(path, close=False)
    with store.load(path) as run:
        assert len(run.steps) == 5
        assert run.status == "running"  # its writer (this process) is still writing
    rows = schema.empty("steps", 2)
    rows["step"] = [5, 6]
    w.append("steps", rows)
    w.flush()
    with store.load(path) as run:
        assert len(run.steps) == 7
    w.close("finished")


def make_other_hdf5(path):
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)


def make_newer(path):
    write_small(path)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = schema.FORMAT_VERSION + 1


def make_missing_table(path):
    write_small(path)
    with h5py.File(path, "r+") as f:
        del f["events"]


def make_wrong_dtype(path):
    write_small(path)
    with h5py.File(path, "r+") as f:
        del f["steps"]
        f.create_dataset("steps", data=np.zeros(3, dtype=[("step", "<i8")]))


def make_truncated(path):
    write_small(path)
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)


BAD = {
    "missing": (lambda p: None, "no such file"),
    "directory": (lambda p: os.mkdir(p), "is a directory"),
    "empty": (lambda p: open(p, "wb").close(), "is empty"),
    "random": (lambda p: open(p, "wb").write(os.urandom(4096)), "not HDF5"),
    "other_hdf5": (make_other_hdf5, "not an ampdoctor run"),
    "newer": (make_newer, "upgrade ampdoctor"),
    "missing_table": (make_missing_table, "table /events is missing"),
    "wrong_dtype": (make_wrong_dtype, "table /steps has unexpected columns"),
    "truncated": (make_truncated, "truncated or damaged"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_get_one_sentence(tmp_path, case):
    make, expected = BAD[case]
    path = str(tmp_path / f"{case}.h5")
    make(path)
    with pytest.raises(RunFileError) as info:
        store.load(path)
    message = str(info.value)
    assert expected in message and path in message
    assert "\n" not in message
    if case == "newer":
        assert isinstance(info.value, FormatTooNewError)
        assert f"format version {schema.FORMAT_VERSION + 1}" in message


def test_inspect_shows_tables_and_meta(tmp_path):
    path = str(tmp_path / "r.h5")
    write_small(path)
    info = store.inspect(path)
    assert info["tables"]["steps"]["rows"] == 5
    assert info["tables"]["stats"]["rows"] == 3
    assert info["meta"]["status"] == "finished"
    make_missing_table(str(tmp_path / "m.h5"))
    assert store.inspect(str(tmp_path / "m.h5"))["tables"]["events"] is None


def test_arrays_round_trip_without_pickle(tmp_path):
    path = str(tmp_path / "a.h5")
    w = store.Writer(path)
    data = np.arange(12, dtype=np.float16).reshape(3, 4)
    row = schema.empty("arrays", 1)
    row["snapshot"] = 0
    row["name_off"], row["name_len"] = w.text("args.0.0")
    row["dtype"] = data.dtype.str.encode()
    row["ndim"] = 2
    row["shape"][0, :2] = data.shape
    row["numel"] = row["saved"] = data.size
    row["data_off"], row["data_len"] = w.bytes(data.tobytes())
    w.append("arrays", row)
    w.close("finished")
    with store.load(path) as run:
        np.testing.assert_array_equal(run.array(0), data)
        assert run.arrays["name"][0] == "args.0.0"


def test_reading_never_imports_torch(tmp_path):
    path = str(tmp_path / "r.h5")
    write_small(path)
    code = (f"import sys, ampdoctor; r = ampdoctor.load({path!r}); "
            f"d = ampdoctor.diagnose({path!r}); from ampdoctor.render import diagnosis as report; "
            "report.render(d, 'json'); report.render(d, 'markdown'); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(d.verdict)")
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# Robustness of the writer and the reader (see also tests/integration/test_reliability.py)


def test_lookup3_is_the_checksum_hdf5_writes(tmp_path):
    path = str(tmp_path / "r.h5")
    write_small(path)
    head = open(path, "rb").read(48)
    assert int.from_bytes(head[44:48], "little") == hdf5.lookup3(head[:44])
    assert hdf5.lookup3(b"") == 0xDEADBEEF  # lookup3's value for no bytes, initval 0


def test_superblock_end_of_file_is_clamped_to_the_file(tmp_path):
    path = str(tmp_path / "r.h5")
    write_small(path)
    head = open(path, "rb").read(48)
    size = os.path.getsize(path)
    assert hdf5.superblock_with_eof(head, size) is None  # nothing to fix
    fixed = hdf5.superblock_with_eof(head, size - 100)
    assert fixed[:28] == head[:28] and fixed[36:44] == head[36:44]
    assert int.from_bytes(fixed[28:36], "little") == size - 100
    assert int.from_bytes(fixed[44:48], "little") == hdf5.lookup3(fixed[:44])
    damaged = bytearray(head)
    damaged[40] ^= 1  # the root group's address
    assert hdf5.superblock_with_eof(bytes(damaged), size - 100) is None  # checksum fails


def test_a_failed_flush_never_writes_again_and_the_file_keeps_what_was_flushed(tmp_path,
                                                                              monkeypatch):
    path = str(tmp_path / "r.h5")
    w = store.Writer(path)
    rows = schema.empty("steps", 3)
    rows["step"], rows["time"] = np.arange(3), 1.0
    w.append("steps", rows)
    w.flush()
    assert w.committed["steps"] == 3

    def full(ds, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_append_rows", full)
    more = schema.empty("steps", 2)
    more["step"], more["time"] = [3, 4], 1.0
    w.append("steps", more)
    with pytest.raises(OSError, match="No space left"):
        w.flush()
    monkeypatch.undo()
    with pytest.raises(store.WriteError, match="no longer written"):
        w.flush()  # even with the disk back: nothing is written twice or out of order
    w.abandon()
    assert w.closed and w.committed["steps"] == 3
    with store.load(path) as run:
        assert list(run.steps["step"]) == [0, 1, 2] and run.status == "interrupted"


def test_text_offsets_stay_right_across_flushes(tmp_path):
    path = str(tmp_path / "r.h5")
    w = store.Writer(path)
    refs = []
    for i in range(50):
        refs.append((f"name-{i}-" + "x" * (i % 7), w.text(f"name-{i}-" + "x" * (i % 7))))
        if i % 9 == 0:
            w.flush()
    w.close()
    with store.load(path) as run:
        for text, (off, n) in refs:
            assert run._blob.text(off, n) == text
        assert run._blob.text(run._blob.size - 1, 5) == ""  # outside the heap: damage, ""


def test_creation_is_atomic_and_leaves_nothing_behind_when_it_fails(tmp_path, monkeypatch):
    path = str(tmp_path / "r.h5")
    write_small(path)
    before = open(path, "rb").read()

    def broken(self):
        raise RuntimeError("interrupted while creating tables")

    monkeypatch.setattr(store.Writer, "_create_tables", broken)
    with pytest.raises(store.WriteError, match="cannot create"):
        store.Writer(path)
    assert open(path, "rb").read() == before  # the old run is untouched
    assert os.listdir(tmp_path) == ["r.h5"]  # and no half-made file is left
    monkeypatch.undo()
    with pytest.raises(FileExistsError):
        store.Writer(path, overwrite=False)


def test_rows_that_never_arrived_are_not_read(tmp_path):
    """A flush cut short can leave a table longer than what reached it (fill-value rows)."""
    path = str(tmp_path / "r.h5")
    write_small(path)
    with h5py.File(path, "r+") as f:
        for name in ("steps", "stats", "events"):
            f[name].resize((f[name].shape[0] + 3,))  # zeros past the end
    with store.load(path) as run:
        assert list(run.steps["step"]) == [0, 1, 2, 3, 4]
        assert len(run.stats) == 3 and len(run.events) == 0


def test_one_damaged_table_is_left_out_not_the_whole_run(tmp_path):
    from ampdoctor.diagnosis import engine

    path = str(tmp_path / "r.h5")
    w = write_small(path, close=False)
    ev = schema.empty("events", 1)
    ev["step"], ev["kind"] = 2, int(schema.Event.SKIPPED)
    w.append("events", ev)
    w.close("finished")
    with h5py.File(path, "r") as f:
        chunk = f["events"].id.get_chunk_info(0)
    with open(path, "r+b") as fh:  # garble the compressed chunk of /events
        fh.seek(chunk.byte_offset)
        fh.write(bytes(chunk.size))
    with store.load(path) as run:
        assert run.damaged == ["events"] and len(run.events) == 0 and len(run.steps) == 5
        d = engine.diagnose(run)
    assert any("/events could not be read" in note for note in d.notes)


def test_tensor_ids_outside_the_table_are_dropped(tmp_path):
    path = str(tmp_path / "r.h5")
    w = write_small(path, close=False)
    t = schema.empty("tensors", 1)
    t["id"], t["kind"] = 2**31 - 1, int(schema.Kind.OUTPUT)  # would size an id map at 16 GB
    w.append("tensors", t)
    w.close("finished")
    with store.load(path) as run:
        assert list(run.tensors["id"]) == [0] and "tensors" in run.damaged


def test_groups_are_read_on_demand(tmp_path):
    path = str(tmp_path / "r.h5")
    w = store.Writer(path)
    w.append("groups", np.array([(s, g, 1e-3 * (g + 1), 0.0) for s in range(4) for g in range(2)],
                                schema.GROUPS))
    w.close("finished")
    with store.load(path) as run:
        assert isinstance(run.groups, store.Table) and len(run.groups) == 8
        np.testing.assert_allclose(run.groups["lr"][:2], [1e-3, 2e-3])
        assert list(run.groups[run.groups["group"] == 1]["step"]) == [0, 1, 2, 3]


def test_meta_bytes_a_cut_flush_never_wrote_leave_the_earlier_value():
    """A full disk can leave a /meta row whose text was reserved in /blob but never written
    (zeros): the status reads as the value before it, never as NUL bytes."""
    from ampdoctor.runfile.run import Blob, meta_dict

    text = b'"running"' + b"\x00" * 10
    rows = np.zeros(2, schema.META)
    rows["key"] = b"status"
    rows["value_off"], rows["value_len"] = (0, 9), (9, 10)
    assert meta_dict(rows, Blob(text)) == {"status": "running"}
    rows["value_off"][1], rows["value_len"][1] = 19, 10  # a value written: the later row wins
    assert meta_dict(rows, Blob(text + b'"finished"'))["status"] == "finished"


def test_deferred_writer_touches_no_file_until_created(tmp_path):
    path = str(tmp_path / "late.h5")
    w = store.Writer(path, create=False)
    w.meta("status", "running")
    w.flush()
    assert not os.path.exists(path)
    w.create(str(tmp_path / "named.h5"), rank=3, world_size=4)
    w.close("finished")
    with ampdoctor.load(tmp_path / "named.h5") as run:
        assert run.rank == 3 and run.meta["status"] == "finished"
    never = store.Writer(path, create=False)
    never.close("finished")
    assert not os.path.exists(path)
