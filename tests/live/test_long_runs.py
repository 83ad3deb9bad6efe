"""Month-long runs read by ``top``, ``export`` and ``compare``: /steps followed column by column,
the layer curves reduced as they are read and thinned to each curve's extremes (a spike and a
non-finite step survive); a run loaded with only the columns a reader asks for, the others read
when first used, /steps checked a block at a time; ``compare``'s trailing means by slices, its
common steps, its figures' curve thinned (extremes, non-finite steps, first and last kept). The
runs are small; ``MAX_STEPS`` and the points kept are lowered so that they count as long."""

from __future__ import annotations

import glob
import math
import os
import sys

import numpy as np
import pytest
from conftest import ROOT

from ampdoctor.diagnosis import parity
from ampdoctor.errors import RunFileError
from ampdoctor.live import follow, tensorboard, thinning
from ampdoctor.release import comparison
from ampdoctor.runfile import schema, store, values
from ampdoctor.runfile.columns import Columns

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import make_large_run  # noqa: E402


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("long") / "long.h5")
    make_large_run.write_large_run(path, steps=6000, modules=3, every=2, flush_steps=1000,
                                   overflow_step=4000)
    return path


def test_thinned_layer_curves_keep_each_curves_extremes_and_the_nonfinite_step(monkeypatch):
    monkeypatch.setattr(thinning, "MAX_STEPS", 100)
    steps = np.arange(5000, dtype=np.int64)
    quiet = np.sin(steps / 50.0)  # curve 0: a smooth wave with one spike
    quiet[1234] = 40.0
    small = np.full(len(steps), 1e-3)  # curve 1: flat but for a NaN and a dip
    small[3210], small[777] = np.nan, 1e-9
    step = np.concatenate([steps, steps])
    curve = np.r_[np.zeros(len(steps), np.int64), np.ones(len(steps), np.int64)]
    value = np.concatenate([quiet, small])
    keep = thinning.thinned_layers(step, curve, value)
    kept = set(step[keep].tolist())
    assert {1234, 3210, 777} <= kept  # the spike, the NaN, the other curve's dip
    assert int(np.argmax(quiet)) in kept and int(np.argmin(quiet)) in kept
    assert len(kept) < len(steps) / 10
    # a kept step keeps every curve's value there
    assert len(keep) == 2 * len(kept)


def test_largest_per_step_and_curve_puts_nan_first():
    step = np.array([3, 3, 3, 1, 1], np.int64)
    curve = np.array([0, 0, 1, 0, 0], np.int64)
    value = np.array([1.0, np.nan, 2.0, 5.0, 7.0])
    s, c, v = thinning.largest(step, curve, value)
    assert s.tolist() == [1, 3, 3] and c.tolist() == [0, 0, 1]
    assert v[0] == 7.0 and math.isnan(v[1]) and v[2] == 2.0


def test_the_follower_keeps_steps_column_by_column_as_read(long_run):
    with follow.Follower(long_run) as f:
        [delta] = f.poll()
        assert isinstance(delta.rows["steps"], Columns) and len(delta.rows["steps"]) == 6000
        state = f.states[0]
        assert isinstance(state.steps, Columns)
        # the first read's columns are kept, not copied
        assert np.shares_memory(state.steps["loss"], delta.rows["steps"]["loss"])
        assert state.steps["step"][-1] == 5999


def test_export_of_a_long_run_thins_every_curve_but_keeps_the_overflow(long_run, tmp_path,
                                                                       monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    monkeypatch.setattr(thinning, "MAX_STEPS", 500)
    done = tensorboard.export(long_run, str(tmp_path / "tb"))
    assert done.steps == 6000 and done.thinned > 0
    points: dict[str, dict[int, float]] = {}
    [events] = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    for e in map(Event.FromString, RawEventFileLoader(events).Load()):
        for v in e.summary.value:
            if not v.HasField("tensor"):
                points.setdefault(v.tag, {})[e.step] = v.simple_value
    absmax = [t for t in points if t.startswith("ampdoctor-absmax/")]
    assert absmax and all(len(points[t]) < 3000 for t in absmax)  # 3000 sampled steps
    assert any(4000 in points[t] and not math.isfinite(points[t][4000]) for t in absmax)
    assert len(points["ampdoctor/loss"]) < 6000
    assert "ampdoctor/diagnosis" not in points  # the text is at the last step written


@pytest.mark.parametrize("steps", [[], [3, 3, 4, 4, 9], [5, 1, 5, 2], [1, 1, 1]])
def test_distinct_steps_are_np_unique_whether_in_order_or_not(steps):
    steps = np.array(steps, np.int64)
    assert np.array_equal(thinning.distinct(steps), np.unique(steps))


def test_lr_rows_read_groups_once_and_keep_every_row_of_a_short_read(long_run, monkeypatch):
    """One pass over /groups (a month-long run's is 20 M rows): every row while the read holds
    at most MAX_STEPS steps, else the rows at POINTS evenly spaced steps of the read."""
    with store.load(long_run) as run:
        reads = []
        real = run.groups.chunks
        monkeypatch.setattr(run.groups, "chunks", lambda *a, **k: reads.append(1) or real(*a, **k))
        rows = thinning.lr_rows(run.groups, run.steps["step"])
        whole = run.groups.columns(("step", "group", "lr"))
        assert len(reads) == 1 and np.array_equal(rows, whole)  # 6000 steps: all of them
        monkeypatch.setattr(thinning, "MAX_STEPS", 500)
        monkeypatch.setattr(thinning, "POINTS", 200)
        thin = thinning.lr_rows(run.groups, run.steps["step"])
        steps = np.unique(whole["step"])
        assert len(reads) == 2 and len(np.unique(thin["step"])) == 200
        assert thin["step"][0] == steps[0] and thin["step"][-1] == steps[-1]
        for g in np.unique(whole["group"]):  # each group's LR at each kept step, as stored
            mine = whole[np.isin(whole["step"], thin["step"]) & (whole["group"] == g)]
            assert np.array_equal(thin[thin["group"] == g], mine)


def test_export_diagnoses_the_steps_the_follower_read_not_a_second_read(long_run, tmp_path,
                                                                         monkeypatch):
    """The diagnosis takes the follower's /steps (``store.load``'s ``steps``) where the file
    still holds that many rows; a file grown since is read again."""
    pytest.importorskip("tensorboard")
    from ampdoctor.diagnosis import engine

    reads = []
    real = Columns.read
    monkeypatch.setattr(Columns, "read", lambda *a, **k: reads.append(1) or real(*a, **k))
    tensorboard.export(long_run, str(tmp_path / "tb"))
    assert len(reads) == 1  # the follower's read, and nothing more
    given = store.load_steps(long_run)
    reads.clear()
    with store.load(long_run, engine.STEP_COLUMNS, steps=given) as run:
        assert run.steps is given and not reads
        assert engine.diagnose(run).to_dict() == engine.diagnose(long_run).to_dict()
    with store.load(long_run, steps=given.head(len(given) - 1)) as run:  # not the file's
        assert len(run.steps) == len(given) and reads


def test_event_records_are_tensorboards_own_byte_for_byte(tmp_path):
    """``tfrecord`` frames and checksums each event as tensorboard's RecordWriter does (its
    pure-Python CRC-32C), whatever the lengths in a batch."""
    pytest.importorskip("tensorboard")
    import io

    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from tensorboard.summary.writer.record_writer import RecordWriter

    from ampdoctor.live import tfrecord

    rng = np.random.default_rng(0)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 700, 300)] + [b"", b"x" * 5000]
    assert tfrecord.masked_crc32c(records).tolist() == [masked_crc32c(r) for r in records]
    events = [event_pb2.Event(step=i, wall_time=1.5 * i, summary=summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=f"t{j}", simple_value=float(j)) for j in range(i % 7)]))
        for i in range(3000)]  # more than a batch
    f = tfrecord.EventFile(str(tmp_path))
    for e in events:
        f.add_event(e)
    f.close()
    theirs = io.BytesIO()
    writer = RecordWriter(theirs)
    for e in events:
        writer.write(e.SerializeToString())
    [path] = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert open(path, "rb").read() == theirs.getvalue()


# ---------------------------------------------------------------------------------------------
# compare on long runs: the columns it reads, its sums by slices, its thinned curves


def test_a_run_loaded_with_a_few_columns_reads_the_others_when_asked(long_run):
    whole = store.load(long_run)
    few = store.load(long_run, columns=("step", "loss"))
    try:
        assert set(few.steps._cols) == {"step", "loss"}
        assert np.array_equal(few.steps["step"], whole.steps["step"])
        narrow = few.steps.narrowed(("step",))
        assert set(narrow._cols) == {"step"}
        for name in whole.steps.dtype.names:  # each left out is read on first use, the same
            assert np.array_equal(narrow[name], whole.steps[name], equal_nan=True), name
        assert set(narrow._cols) == set(whole.steps.dtype.names)
        assert np.array_equal(few.steps[10:20]["dt"], whole.steps[10:20]["dt"])
    finally:
        whole.close()
        few.close()


def test_steps_are_checked_a_block_at_a_time_as_they_are_read():
    rows = schema.empty("steps", 10)
    rows["step"], rows["time"] = np.arange(10), 1.0
    rows["step"][7] = 2  # goes back, in the third block of three rows
    seen = []

    def check(part, start):
        seen.append(start)
        before = None if start == 0 else int(rows["step"][start - 1])
        values.check_steps("x.h5", part, start, before)

    with pytest.raises(RunFileError, match="row 7 holds step 2 after step 6"):
        Columns.read(lambda a, b: rows[a:b], 10, schema.STEPS, block=3, keep=("loss",),
                     check=check)
    assert seen == [0, 3, 6]


def _windows(x, w):
    out = np.empty(len(x))
    for i in range(len(x)):
        part = x[max(0, i - w + 1):i + 1]
        out[i] = part.mean() if np.isfinite(part).all() else np.nan
    return out


@pytest.mark.parametrize("n, w", [(0, 5), (3, 5), (5, 5), (40, 1), (40, 7), (41, 40)])
def test_trailing_is_the_mean_of_each_window_and_nan_where_one_is_not_finite(n, w):
    x = np.random.default_rng(n + w).lognormal(size=n)
    if n > 20:
        x[[4, 11]] = [np.nan, np.inf]
    got, want = parity.trailing(x, w), _windows(x, w)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    assert np.allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-12)


@pytest.mark.parametrize("b, a", [(range(10), range(10)), (range(3, 20), range(8)),
                                  (range(5), range(7, 9)), (range(0), range(4)),
                                  ([0, 1, 1, 2, 3], range(4)), ([0, 2, 4, 6], range(10)),
                                  ([9, 3, 5], [5, 9])])
def test_common_steps_are_intersect1d_in_order_by_slices_or_not(b, a):
    b, a = np.array(b, np.int64), np.array(a, np.int64)
    for got, want in zip(comparison.common_steps(b, a), np.intersect1d(b, a,
                                                                       return_indices=True)):
        assert np.array_equal(got, want)


def test_a_long_comparisons_curve_keeps_extremes_nonfinite_steps_first_and_last():
    n = 50_000
    step = np.arange(n, dtype=np.int64)
    base = np.cos(step / 300.0)
    amp = base.copy()
    amp[12_345], amp[30_001], base[44_444] = 9.0, np.inf, np.nan
    rel = np.abs(amp - base)
    curve = comparison.thinned({"step": step, "base": base, "amp": amp, "rel": rel},
                               points=1000)
    kept = curve["step"].tolist()
    assert len(kept) < 2500 and kept == sorted(kept)
    assert {0, n - 1, 12_345, 30_001, 44_444} <= set(kept)
    assert int(np.argmin(base)) in kept
    for name in ("base", "amp", "rel"):  # each kept step keeps every curve's value there
        assert np.array_equal(curve[name], {"base": base, "amp": amp, "rel": rel}[name][kept],
                              equal_nan=True)
    short = {"step": step[:10], "base": base[:10]}
    assert comparison.thinned(short, points=1000) is short


def test_compare_of_paths_is_compare_of_runs_loaded_whole(long_run):
    with store.load(long_run) as b, store.load(long_run) as a:
        whole = comparison.compare(b, a)
        assert len(b.steps._cols) == len(b.steps.dtype.names)  # a given run is left as it is
    from_paths = comparison.compare(long_run, long_run)
    assert from_paths.to_dict() == whole.to_dict()
    assert from_paths.layers and from_paths.common_steps == 6000


def test_holding_reads_only_the_columns_named_that_are_missing_in_one_pass(long_run):
    whole = store.load_steps(long_run)
    with store.load(long_run, columns=("step", "loss", "dt")) as run:
        few = run.steps
        reads = []
        rows_of, block = few._rest
        few._rest = (lambda a, b: reads.append(a) or rows_of(a, b), block)
        held = few.holding(("step", "grad_norm", "scale_after"))
        assert set(held._cols) == {"step", "grad_norm", "scale_after"}
        assert held._cols["step"] is few._cols["step"]  # the same array, not read again
        assert len(reads) == -(-len(whole) // block)  # one pass
        for name in ("grad_norm", "scale_after"):
            assert np.array_equal(held[name], whole[name], equal_nan=True)
        assert set(few._cols) == {"step", "loss", "dt"}  # the run's own columns unchanged
    assert whole.holding(("step",)) is whole  # held whole (no file behind): as it is


def test_a_fix_comparison_reads_the_diagnosis_columns_once_per_run(long_run, monkeypatch):
    """A run and its fix: each run compare loaded gets the diagnosis's /steps columns in one
    pass of its own (never the wall clock), and the answer is the one of runs loaded whole."""
    from ampdoctor.release import fix_outcome

    monkeypatch.setattr(fix_outcome, "question", lambda *a: "fix")
    with store.load(long_run) as b, store.load(long_run) as a:
        whole = comparison.compare(b, a)
    asked = []
    real = Columns.holding
    monkeypatch.setattr(Columns, "holding", lambda self, keep: asked.append(
        tuple(n for n in self.dtype.names if n in set(keep) and n not in self._cols))
        or real(self, keep))
    passes = []  # a read of every column left out (a column asked for and not held)
    real_whole = Columns._whole
    monkeypatch.setattr(Columns, "_whole", lambda self: passes.append(self._rest is not None)
                        or real_whole(self))
    got = comparison.compare(long_run, long_run)
    assert got.kind == "fix" and got.to_dict() == whole.to_dict()
    assert len(asked) == 2 and all("time" not in names and names for names in asked)
    assert not any(passes)
