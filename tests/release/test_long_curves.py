"""Month-long curves in ``diagnose``, ``report`` and ``compare``, read without a copy of every
step: the /steps columns each loads (the others read when used: the same answers), a curve
thinned as it is read a block at a time (``curves.Thinned``: each bin's extremes survive), the
LR figure's /groups read so, and the float64 and index arrays the diagnosis and ``compare`` no
longer make, each checked against the whole-array computation it replaced. The runs are small;
the blocks are lowered so that they count as long."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from conftest import ROOT

from ampdoctor.diagnosis import curve, engine, parity, restarts
from ampdoctor.release import curves, report
from ampdoctor.render import diagnosis as rendered
from ampdoctor.render import plots
from ampdoctor.runfile import schema, store
from ampdoctor.runfile.run import Table

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import make_large_run  # noqa: E402


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("curves") / "long.h5")
    make_large_run.write_large_run(path, steps=5000, modules=3, every=50, flush_steps=1000,
                                   overflow_step=4000)
    return path


# ---------------------------------------------------------------------------------------------
# the columns each command loads


def test_diagnose_and_report_load_fewer_columns_with_the_same_answers(long_run):
    assert {"time", "dt", "peak_mem"}.isdisjoint(engine.STEP_COLUMNS)
    assert "time" not in report.STEP_COLUMNS and "peak_mem" in report.STEP_COLUMNS
    with store.load(long_run) as whole:
        expected = rendered.render(engine.diagnose(whole), "json")
        summary = report.summarize(whole)
        assert rendered.render(engine.diagnose(long_run), "json") == expected
        with report.release_report(long_run) as r:
            assert r.summary == summary
            assert "dt" not in r.run.steps._cols  # taken first, then let go (``_measured``)
            assert np.array_equal(r.run.steps["dt"], whole.steps["dt"])  # read again if asked


def test_summarize_with_its_measures_taken_first_is_summarize(long_run):
    with store.load(long_run) as run:
        measured = (report.peak_memory(run), report.median_step_time(run))
        assert report.summarize(run, measured) == report.summarize(run)


# ---------------------------------------------------------------------------------------------
# a curve thinned a block at a time


def _series(n: int = 10_000) -> np.ndarray:
    y = np.sin(np.arange(n) / 300.0).astype(np.float32)
    y[1234], y[7777], y[4321] = 40.0, -30.0, np.nan  # a spike, a dip, a NaN
    return y


@pytest.mark.parametrize("block", [999, 4096, 10_000])
def test_thinned_blocks_keep_each_bins_extremes_whatever_the_blocks(block):
    y = _series()
    x = np.arange(len(y)) * 10
    t = curves.Thinned(total=len(y), max_points=200)
    for a in range(0, len(y), block):
        t.add(x[a:a + block], y[a:a + block])
    kx, ky = t.result()
    assert {12340, 77770} <= set(kx.tolist())  # the spike and the dip, at their steps
    assert 43210 not in set(kx.tolist())  # a NaN is no extreme (the figure rugs it)
    assert np.all(np.diff(kx) > 0) and np.array_equal(ky, y[kx // 10])
    assert len(kx) <= 200 + 2 * (len(y) // block + 1)  # the bins' extremes, a block's seam
    assert int(np.max(np.diff(kx // 10))) < 2 * t.width  # every bin keeps a point


def test_a_short_series_is_kept_whole():
    y = _series()[1000:1300]  # the spike among them
    t = curves.Thinned(total=300, max_points=1000)
    t.add(np.arange(300), y)
    kx, ky = t.result()
    assert np.array_equal(kx, np.arange(300)) and np.array_equal(ky, y, equal_nan=True)
    assert curves.Thinned(total=0, max_points=10).result()[0].size == 0


def test_lr_figure_reads_groups_a_block_at_a_time(monkeypatch):
    n = 6000
    rows = schema.empty("groups", 3 * n)
    rows["step"] = np.repeat(np.arange(n), 3)
    rows["group"] = np.tile([0, 1, 2], n)
    lr = np.linspace(1e-4, 3e-4, n, dtype=np.float32)
    lr[2500] = 1.0  # a spike in group 0's LR
    rows["lr"] = np.stack([lr, lr / 2, np.full(n, np.nan, np.float32)], axis=1).ravel()
    groups = Table(rows, name="groups")
    monkeypatch.setattr(plots, "LR_BLOCK", 1000)
    monkeypatch.setattr(plots, "MAX_POINTS", 100)
    got = plots._finite_lrs(groups)
    assert sorted(got) == [0, 1, 2] and len(got[2][0]) == 0  # every group, finite or not
    x, y = got[0]
    assert 2500 in set(x.tolist()) and float(y.max()) == 1.0
    assert x[0] == 0 and x[-1] == n - 1 and len(x) < n / 5
    assert np.array_equal(y, lr[x]) and np.array_equal(got[1][1], lr[got[1][0]] / 2)


@pytest.mark.parametrize("values", [[], [3], [2, 0, 2, -1], [5, 70_000, 5], [-40_000, 40_000]])
def test_distinct_small_integers_are_np_unique(values):
    values = np.array(values, np.int32)
    got = plots._distinct_small(values)
    assert np.array_equal(got, np.unique(values)) and got.dtype == values.dtype


def test_activation_figure_draws_each_layers_extremes_not_every_sampled_step(long_run,
                                                                             monkeypatch):
    """10^5 sampled steps drawn with a marker each were half a second of PNG: the line is
    thinned like every other (each bin's smallest and largest value: the peak survives)."""

    monkeypatch.setattr(plots, "MAX_POINTS", 20)
    with store.load(long_run) as run:
        fig = plots.activation_range_figure(run)
        rows, found = plots._layers.sampled(run, plots._layers.VALUE_KINDS, ("absmax",))
    drawn = [line for line in fig.axes[0].get_lines() if line.get_marker() == "."]
    assert drawn and all(len(line.get_xdata()) <= 2 * 20 + 2 for line in drawn)
    sampled = len(np.unique(rows["step"]))
    assert sampled > 40  # more than the points drawn of a line
    peaks = {float(np.max(line.get_ydata())) for line in drawn}
    absmax = rows["absmax"].astype(np.float64)
    for i in np.unique(rows["layer"]):  # each drawn layer's largest finite value is drawn
        mine = absmax[(rows["layer"] == i) & np.isfinite(absmax)]
        assert not len(mine) or len(drawn) < len(found) or float(mine.max()) in peaks


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64])
def test_extremes_in_the_series_own_dtype_are_those_of_its_float64_copy(dtype):
    """``extremes`` reads a float series as stored (no float64 copy): the same positions as
    on the widened copy, NaN and infinities included, a short last bin included."""
    rng = np.random.default_rng(3)
    y = (rng.standard_normal(10_007) * 100).astype(dtype)
    if dtype != np.int64:
        y[rng.integers(0, len(y), 900)] = np.nan
        y[rng.integers(0, len(y), 300)] = np.inf
        y[rng.integers(0, len(y), 300)] = -np.inf
        y[4000:4500] = np.nan  # a bin with nothing drawable
    wide = y.astype(np.float64)
    for points in (10, 999, 4000):
        for finite_only in (False, True):
            got = curves.extremes(y, points, finite_only)
            assert np.array_equal(got, curves.extremes(wide, points, finite_only))
            shown = np.isfinite(wide) if finite_only else ~np.isnan(wide)
            k = int(np.ceil(len(y) / (points // 2)))
            for start in range(0, len(y), k):  # each bin's min and max (where it has any)
                part = np.flatnonzero(shown[start:start + k]) + start
                if len(part):
                    assert {part[np.argmin(wide[part])], part[np.argmax(wide[part])]} <= \
                        set(got.tolist())


# ---------------------------------------------------------------------------------------------
# no float64 or index copies of every step, the same numbers


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1001])
def test_median_of_float32_is_the_median_of_its_float64_copy(n):
    x = np.random.default_rng(n).lognormal(0, 3, n).astype(np.float32)
    assert curve.median(x) == float(np.median(x.astype(np.float64)))


def test_noise_in_place_is_the_mad_of_the_differences():
    log = np.log(np.random.default_rng(1).lognormal(0, 0.3, 5001))
    d = np.diff(log)
    expected = float(curve._MAD_TO_SIGMA * np.median(np.abs(d - np.median(d))))
    assert curve.noise(log) == expected


def test_loss_curve_positions_are_steps_with_or_without_nonfinite_losses():
    loss = np.exp(-np.arange(600) / 300.0).astype(np.float32) + 1.0
    loss[400:] *= 50  # blows up at 400, and stays
    c = curve.read(loss)
    holed = loss.copy()
    holed[[10, 20, 30]] = np.nan
    h = curve.read(holed)
    assert c.spike is not None and c.spike.index == 400 and h.spike.index == 400
    assert h.n == c.n - 3


def test_scale_jumps_a_block_at_a_time_are_the_whole_arrays(monkeypatch):
    class Facts:
        def __init__(self, steps):
            self.steps, self._cache = steps, {}

        def memo(self, key, fn):
            return self._cache.setdefault(key, fn())

    rng = np.random.default_rng(3)
    steps = schema.empty("steps", 5000)
    steps["scale"] = 2.0 ** rng.integers(10, 17, 5000)
    steps["scale_after"] = steps["scale"] * rng.choice([0.5, 1.0, 2.0], 5000)
    steps["scale"][[999, 1000, 2048]] = 2.0 ** 24  # jumps around the blocks' seams
    steps["scale_after"][[5, 1999]] = np.nan
    before = steps["scale"][1:].astype(float)
    after = steps["scale_after"][:-1].astype(float)
    with np.errstate(invalid="ignore"):
        expected = np.flatnonzero(np.isfinite(before) & np.isfinite(after)
                                  & (before > after * 1.5))
    monkeypatch.setattr(restarts, "BLOCK", 1000)
    assert np.array_equal(restarts.scale_jumps(Facts(steps)), expected)
    assert {998, 999, 2047} <= set(expected.tolist())


def _divergence_start_by_positions(smooth, decided, rtol, diverge):
    pos = np.flatnonzero(decided)
    values = smooth[pos]
    within = np.flatnonzero(values <= rtol)
    after = int(within[-1]) + 1 if len(within) else 0
    out = np.flatnonzero(values[after:] > diverge)
    return int(pos[after + out[0]]) if len(out) else None


@pytest.mark.parametrize("seed", range(8))
def test_divergence_start_by_masks_is_by_positions(seed):
    rng = np.random.default_rng(seed)
    smooth = rng.choice([0.001, 0.01, 0.05, 0.3, np.nan, np.inf], 2000,
                        p=[0.3, 0.2, 0.2, 0.1, 0.15, 0.05])
    if seed % 2:
        smooth[1500:] = 0.3  # diverged for good
    decided = ~np.isnan(smooth)
    assert parity.divergence_start(smooth, decided, 0.02, 0.1) == \
        _divergence_start_by_positions(smooth, decided, 0.02, 0.1)
    assert parity.last_true(np.zeros(5, bool)) == -1
    assert parity.last_true(decided) == int(np.flatnonzero(decided)[-1])
