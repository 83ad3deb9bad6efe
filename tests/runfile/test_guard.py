"""The opener refuses what points outside a run file or past its size, before reading any table.

Each crafted file comes from fixtures/crafted/make_crafted.py (a copy of the v2 fixture changed
in one way); tests/integration/test_crafted.py runs the same files through every command's CLI.
"""

import importlib.util
import os
import time

import h5py
import numpy as np
import pytest
from conftest import ROOT
from reliability_tools import in_child, synthetic_run

from ampdoctor.errors import RunFileError
from ampdoctor.runfile import guard, hdf5, store, summary

spec = importlib.util.spec_from_file_location(
    "make_crafted", os.path.join(ROOT, "fixtures", "crafted", "make_crafted.py"))
crafted = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crafted)

STRUCTURAL = ("external_link", "virtual", "external_secret", "external_fifo", "group_table",
              "reference_dtype", "compression_bomb", "huge_shape")


def _refusal(path):
    """What ``store.load`` says of ``path``, in a child with a time limit (nothing may hang)."""
    def load():
        try:
            store.load(path).close()
        except RunFileError as exc:
            return f"refused: {exc}"
        return "loaded"
    outcome, said = in_child(load, timeout=20)
    assert outcome == "ok", (outcome, said)
    return said


@pytest.mark.parametrize("case", STRUCTURAL)
def test_a_file_pointing_outside_or_past_itself_is_refused_before_any_read(tmp_path, case):
    path = crafted.make(case, str(tmp_path))
    said = _refusal(path)
    assert said.startswith(f"refused: {path} "), said
    assert crafted.CASES[case] in said and "\n" not in said, said
    assert crafted.SECRET not in said


def test_the_external_link_sentence_in_full(tmp_path):
    path = crafted.make("external_link", str(tmp_path))
    with pytest.raises(RunFileError) as err:
        store.load(path)
    assert str(err.value) == (f"{path} points outside itself (/steps is an external link to "
                              "other.h5): ampdoctor reads only what is inside a run file")


@pytest.mark.parametrize("reader", ["load", "inspect", "summary", "tail"])
def test_every_reader_goes_through_the_guard(tmp_path, reader):
    path = crafted.make("external_secret", str(tmp_path))
    read = {"load": store.load, "inspect": store.inspect, "summary": summary.read,
            "tail": store.Tail}[reader]
    with pytest.raises(RunFileError, match="points outside itself"):
        read(path)


def test_a_link_deep_in_a_group_is_found_too(tmp_path):
    path = str(tmp_path / "run.h5")
    synthetic_run(path)
    with h5py.File(path, "r+") as f:
        f.create_group("extra/deeper")["x"] = h5py.ExternalLink("/etc/passwd", "/")
    with pytest.raises(RunFileError, match=r"/extra/deeper/x is an external link to /etc/passwd"):
        store.load(path)


def test_a_filter_other_than_gzip_shuffle_fletcher_is_refused(tmp_path):
    path = str(tmp_path / "run.h5")
    synthetic_run(path)
    with h5py.File(path, "r+") as f:
        f.create_dataset("extra", data=np.zeros(100), chunks=(10,), compression="lzf")
    with pytest.raises(RunFileError, match=r"/extra is compressed with filter 32000"):
        store.load(path)


def test_a_fifo_given_directly_is_refused_without_opening_it(tmp_path):
    path = crafted.make("fifo", str(tmp_path))
    start = time.monotonic()
    assert _refusal(path) == f"refused: {path} is not a regular file, not a run file"
    assert time.monotonic() - start < 10
    assert not hdf5.is_hdf5(path) and not hdf5.flagged_as_written(path)


def test_a_table_inflating_past_the_ratio_is_refused_but_small_tables_never(tmp_path):
    path = str(tmp_path / "run.h5")
    synthetic_run(path)
    with h5py.File(path, "r+") as f:  # 8 MB of zeros in a few KB: under FREE_BYTES, read
        f.create_dataset("small", data=np.zeros(1 << 20), chunks=(1 << 17,), compression="gzip")
    store.load(path).close()
    with h5py.File(path, "r+") as f:
        del f["small"]
        rows = (guard.FREE_BYTES // 8) * 2
        f.create_dataset("big", shape=(rows,), dtype="f8", chunks=(1 << 20,),
                         compression="gzip")
    with pytest.raises(RunFileError, match=r"/big declares 16777216 rows \(134 MB\)"):
        store.load(path)


@pytest.mark.parametrize("name", ["v1.h5", "v1-vlen-attrs.h5", "v2.h5"])
def test_every_fixture_version_passes_the_guard(name):
    path = os.path.join(ROOT, "fixtures", "formats", name)
    with store.load(path) as run:
        assert len(run.steps) == 6


def test_a_file_being_written_passes_the_guard(tmp_path):
    path = str(tmp_path / "live.h5")
    w = synthetic_run(path, close=False)
    try:
        with store.load(path) as run:
            assert run.live and len(run.steps) == 40
        with store.Tail(path) as tail:
            assert len(tail.read()["steps"]) == 40
    finally:
        w.close("finished")


# -- values: the schema's contract checked at the reader ---------------------------------------

VALUES = {
    "meta_types": "/meta row 0 (status) holds a list where a text is expected",
    "negative_steps": "/steps row 2 holds step -5 (steps count up from 0)",
    "unordered_steps": "/steps row 4 holds step 3 after step 4 (steps never go back)",
    "tensor_nowhere": "/stats row 1 names tensor 2147483647, which /tensors does not hold "
                      "(16 tensors)",
    "text_offset": "/events row 0 points at text past the end of /blob "
                   "(offset 4611686018427387904, 6 bytes, in 7462)",
}


def _read_all(path):
    with store.load(path) as run:
        run.stats.column("tensor")


def _follow(path):
    with store.Tail(path) as tail:
        tail.read()
        tail.stats.rows()


@pytest.mark.parametrize("case", VALUES)
@pytest.mark.parametrize("read", [_read_all, _follow], ids=["load", "tail"])
def test_a_value_outside_the_contract_names_file_table_and_row(tmp_path, case, read):
    path = crafted.make(case, str(tmp_path))
    with pytest.raises(RunFileError) as err:
        read(path)
    assert str(err.value) == f"{path} is damaged: {VALUES[case]}"


def test_a_follower_checks_steps_across_its_reads():
    from ampdoctor.runfile import schema, values

    rows = schema.empty("steps", 2)
    rows["step"] = [7, 8]
    values.check_steps("run.h5", rows, start=10, before=7)  # a step may repeat, never go back
    with pytest.raises(RunFileError, match=r"/steps row 10 holds step 7 after step 9"):
        values.check_steps("run.h5", rows, start=10, before=9)


def test_events_about_no_tensor_pass_and_a_meta_null_passes(tmp_path):
    from ampdoctor.runfile import values

    values.check_ids("run.h5", "events", np.array([-1, 0, 3]), 4, none=-1)
    with pytest.raises(RunFileError, match=r"/events row 1 names tensor -2"):
        values.check_ids("run.h5", "events", np.array([-1, -2]), 4, none=-1)
    values.check_meta("run.h5", "clip", None, 3)
    values.check_meta("run.h5", "some_later_key", 5, 3)  # keys a later writer adds: any type


def test_a_wall_time_that_is_no_time_is_damage():
    from ampdoctor.runfile import schema, values

    rows = schema.empty("steps", 3)
    rows["step"], rows["time"] = [0, 1, 2], [1.7e9, np.inf, 1.7e9]
    with pytest.raises(RunFileError, match=r"/steps row 6 holds the wall time inf"):
        values.check_steps("run.h5", rows, start=5)


@pytest.mark.parametrize("attrs,said", [
    ({"rank": ""}, "its root attribute rank holds '' where a whole number is expected"),
    ({"rank": True}, "its root attribute rank holds True where a whole number is expected"),
    ({"world_size": 0}, "its root attribute world_size holds 0 (at least 1)"),
    ({"rank": 4, "world_size": 4}, "its root attributes say rank 4 of a world of 4"),
    ({"host": 7}, "its root attribute host holds 7 where a text is expected"),
    ({"argv": "python x.py"}, "its root attribute argv holds 'python x.py' where a list is "
                              "expected"),
    ({"argv": [1]}, "its root attribute argv holds a list of something else than texts"),
    ({"created": "today"}, "its root attribute created holds 'today' where a number is "
                           "expected"),
])
def test_root_attributes_of_another_type_are_one_sentence(attrs, said):
    from ampdoctor.runfile import values

    values.check_attrs("run.h5", {"rank": 0, "world_size": 1, "argv": ["x.py"]})
    with pytest.raises(RunFileError) as err:
        values.check_attrs("run.h5", attrs)
    assert str(err.value) == f"run.h5 is damaged: {said}"
