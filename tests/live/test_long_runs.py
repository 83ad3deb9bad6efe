"""Month-long runs read by ``top`` and ``export``: /steps followed column by column, the layer
curves reduced as they are read and thinned to each curve's extremes (a spike and a non-finite
step survive). The runs are small; ``MAX_STEPS`` is lowered so that they count as long."""

from __future__ import annotations

import glob
import math
import os
import sys

import numpy as np
import pytest
from conftest import ROOT

from ampdoctor.live import follow, tensorboard
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
    monkeypatch.setattr(tensorboard, "MAX_STEPS", 100)
    steps = np.arange(5000, dtype=np.int64)
    quiet = np.sin(steps / 50.0)  # curve 0: a smooth wave with one spike
    quiet[1234] = 40.0
    small = np.full(len(steps), 1e-3)  # curve 1: flat but for a NaN and a dip
    small[3210], small[777] = np.nan, 1e-9
    step = np.concatenate([steps, steps])
    curve = np.r_[np.zeros(len(steps), np.int64), np.ones(len(steps), np.int64)]
    value = np.concatenate([quiet, small])
    keep = tensorboard._thinned_layers(step, curve, value)
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
    s, c, v = tensorboard._largest(step, curve, value)
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

    monkeypatch.setattr(tensorboard, "MAX_STEPS", 500)
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
    assert np.array_equal(tensorboard._distinct(steps), np.unique(steps))
