"""Per-layer answers at 10^5 modules: readiness computed for every layer at once gives each
layer's own figures, and the outputs that list layers stay readable past a few thousand.

Unit tests on rows built in memory (no torch).
"""

import math
import os
import sys

import numpy as np
import pytest
from conftest import ROOT

from ampdoctor.diagnosis import layers as _layers
from ampdoctor.release import readiness
from ampdoctor.runfile.schema import FP16_MAX, FP16_NEAR, STATS, Kind

# ---------------------------------------------------------------------------------------------
# readiness.layer_ranges against one layer at a time


def one_layer(layer, rows, scale):
    """The per-layer reference: each figure of ``LayerRange`` from one layer's own rows."""
    out = readiness.LayerRange(layer.name, layer.label, int(len(np.unique(rows["step"]))))
    codes, counts = np.unique(rows["dtype"], return_counts=True)
    out.dtype = readiness._DTYPE_NAMES.get(int(codes[np.argmax(counts)]), "")
    n = np.maximum(rows["sample_n"].astype(np.float64), 1)
    nonzero = readiness.nonzero_sampled(rows)
    absmax = rows["absmax"].astype(np.float64)
    inf = np.isinf(absmax) | ((rows["nonfinite"] & 6) != 0) | (rows["posinf"] + rows["neginf"]
                                                               > 0)
    finite_max = np.where(np.isfinite(absmax), absmax, -1.0)
    over = (rows["over16"] > 0) | inf | (absmax > FP16_MAX)
    near = over | (rows["near16"] > 0) | (absmax >= FP16_NEAR)
    out.absmax = float(np.inf if inf.any() else finite_max.max())
    out.absmax_step = int(rows["step"][int(np.argmax(np.where(inf, np.inf, finite_max)))])
    mins = rows["absmin"].astype(np.float64)
    mins = mins[np.isfinite(mins) & (mins > 0)]
    out.absmin = float(mins.min()) if len(mins) else math.nan
    if layer.kind in _layers.GRAD_KINDS:
        out.scale = float(np.median(scale))
    out.over = float(((rows["over16"] + rows["posinf"] + rows["neginf"]) / n).max())
    out.over_steps = len(np.unique(rows["step"][over]))
    out.first_over = int(rows["step"][over].min()) if over.any() else None
    out.near, out.near_steps = float((rows["near16"] / n).max()), len(np.unique(rows["step"][near]))
    for name, fraction in (("flush", rows["flush16"] / nonzero),
                           ("sub", readiness.underflow_share(rows))):
        i = int(np.argmax(fraction))
        setattr(out, name, float(fraction[i]))
        setattr(out, name + "_step", int(rows["step"][i]) if fraction[i] > 0 else None)
    bad = rows["nonfinite"] > 0
    out.nonfinite_steps = len(np.unique(rows["step"][bad]))
    out.first_nonfinite = int(rows["step"][bad].min()) if bad.any() else None
    return out


def random_rows(rng, layers, rows_per_layer):
    """Sampled rows of ``layers`` layers (some with none), steps out of order, repeated within
    a layer (a module called twice a step), with NaN, inf, zeros and ties."""
    names = [c for c in readiness.COLUMNS if c not in ("step", "tensor", "call")]
    dtype = np.dtype([("step", "<i8"), ("layer", "<i8")] + [(c, STATS[c]) for c in names])
    n = layers * rows_per_layer
    rows = np.zeros(n, dtype)
    rows["layer"] = rng.choice([i for i in range(layers) if i % 7 != 3], n)  # some: no rows
    rows["step"] = rng.choice([0, 3, 7, 8, 100, 101], n)
    rows["dtype"] = rng.choice([0, 1, 2, 2, 3], n)
    rows["sample_n"] = rng.choice([0, 1, 64, 4096], n)
    for c in ("zeros", "nan", "posinf", "neginf", "over16", "near16", "sub16", "flush16"):
        rows[c] = rng.choice([0, 0, 0, 1, 3, 40, 5000], n)
    rows["nonfinite"] = rng.choice([0, 0, 0, 1, 2, 4, 6, 7], n)
    rows["absmax"] = rng.choice([0.0, 1.0, 2.0, 4e4, 7e4, np.inf, np.nan, 1e-30], n)
    rows["absmin"] = rng.choice([0.0, 1e-8, 1e-3, 1.0, np.inf, np.nan, -1.0], n)
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_layer_ranges_match_one_layer_at_a_time(seed):
    rng = np.random.default_rng(seed)
    kinds = [Kind.INPUT, Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD]
    found = [_layers.Layer(kinds[i % 4], f"m{i}") for i in range(60)]
    rows = random_rows(rng, len(found), 5)
    if seed == 0:  # one dtype everywhere: the shortcut
        rows["dtype"] = 2
    order = np.argsort(rows["layer"], kind="stable")
    rows = rows[order]
    scale = rng.choice([1.0, 2.0**16, 2.0**15, 3.0], len(rows))
    got = readiness.layer_ranges(found, rows, scale)
    bounds = np.searchsorted(rows["layer"], np.arange(len(found) + 1))
    want = [one_layer(found[i], rows[a:b], scale[a:b])
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]
    assert len(got) < len(found)  # some layers have no rows, and no LayerRange
    assert [repr(x) for x in got] == [repr(x) for x in want]  # NaN == NaN in a repr


def test_layer_ranges_of_no_rows():
    rows = random_rows(np.random.default_rng(0), 3, 0)
    assert readiness.layer_ranges([_layers.Layer(Kind.OUTPUT, "a")], rows, np.ones(0)) == []


@pytest.mark.parametrize("seed", range(3))
def test_the_readiness_lists_are_their_definitions_made_once(seed):
    """``overflowing``, ``near``, ``underflowing``, ``nonfinite``: one pass, kept, each what
    its definition filters and sorts; made again when the layers are replaced."""
    rng = np.random.default_rng(seed)
    kinds = [Kind.INPUT, Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD]
    found = [_layers.Layer(kinds[i % 4], f"m{i}") for i in range(200)]
    rows = random_rows(rng, len(found), 4)
    rows = rows[np.argsort(rows["layer"], kind="stable")]
    ranges = readiness.layer_ranges(found, rows, rng.choice([1.0, 2.0**16, 0.5], len(rows)))
    r = readiness.Readiness("float16", True, 6, "unknown", "", layers=ranges)
    over = readiness._overflows
    assert r.overflowing == sorted([x for x in ranges if over(x)], key=lambda x: -x.absmax)
    assert r.near == sorted([x for x in ranges if x.near_steps and not over(x)
                             and not x.is_grad], key=lambda x: -x.absmax)
    assert r.underflowing == sorted([x for x in ranges if x.is_grad and x.sub >= 0.5],
                                    key=lambda x: (-x.sub, -x.flush))
    assert r.nonfinite == [x for x in ranges if x.nonfinite_steps and not over(x)]
    assert r.overflowing and sum(map(bool, (r.near, r.underflowing, r.nonfinite))) >= 1
    kept = r._lists
    r.overflowing.clear()  # (a copy: what is kept stays)
    assert r._lists is kept and r.overflowing
    r.layers = ranges[:3]
    assert r.overflowing == sorted([x for x in ranges[:3] if over(x)], key=lambda x: -x.absmax)
    assert "_lists" not in r.to_dict()


def test_a_tables_layers_are_found_once_and_let_go_with_it():
    tensors = np.zeros(4, _layers_tensor_view())
    tensors["id"], tensors["kind"] = [0, 1, 2, 3], [Kind.OUTPUT, Kind.PARAM_GRAD, Kind.OUTPUT,
                                                    Kind.OUTPUT]
    tensors["name"] = ["a", "a.weight", "b", "a"]
    first = _layers._found(tensors, (Kind.OUTPUT,))
    assert [x.name for x in first[0]] == ["a", "b"] and first[1].tolist() == [0, -1, 1, 0]
    assert _layers._found(tensors, (Kind.OUTPUT,)) is first
    assert _layers._found(tensors, (Kind.PARAM_GRAD,))[1].tolist() == [-1, 0, -1, -1]
    key = id(tensors)
    assert key in _layers._FOUND
    del tensors
    assert key not in _layers._FOUND


def _layers_tensor_view():
    from ampdoctor.runfile.run import TENSOR_VIEW

    return TENSOR_VIEW


@pytest.mark.parametrize("seed", range(20))
def test_matching_two_runs_rows_is_intersect1d(seed):
    from ampdoctor.release import comparison

    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 40, rng.integers(0, 60))
    for kb, ka in ((keys, keys.copy()), (keys, rng.integers(0, 40, len(keys))),
                   (keys, keys[::-1].copy())):
        want = np.intersect1d(kb, ka, return_indices=True)
        got = comparison._matches(kb, ka)
        assert all(np.array_equal(g, w) for g, w in zip(got, want[1:]))
        x, common = np.unique(kb), np.unique(ka)
        assert np.array_equal(comparison._within(x, common), np.intersect1d(x, common))


# ---------------------------------------------------------------------------------------------
# export --tensorboard past LAYER_CURVES layer curves


def test_export_past_its_layer_curves_writes_summaries_and_the_layers_closest_to_the_limits(
        tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator as ea

    from ampdoctor.live import tensorboard

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import make_large_run

    path = str(tmp_path / "run.h5")  # 30 modules, the 15th's output overflows at step 40
    make_large_run.write_large_run(path, steps=50, modules=30, every=10, overflow_step=40)
    written = {}
    for bound in (10_000, 20):
        monkeypatch.setattr(tensorboard, "LAYER_CURVES", bound)
        monkeypatch.setattr(tensorboard, "SHOWN_CURVES", 6)
        logdir = str(tmp_path / f"tb{bound}")
        tensorboard.export(path, logdir)
        acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 0})
        acc.Reload()
        written[bound] = {t: {e.step: e.value for e in acc.Scalars(t)}
                          for t in acc.Tags()["scalars"]}
    every, bounded = written[10_000], written[20]
    layer = [t for t in every if t.startswith(("ampdoctor-absmax/", "ampdoctor-underflow/"))]
    assert len(layer) > 20  # each layer's curve, below the bound
    shown = [t for t in bounded if t.startswith(("ampdoctor-absmax/", "ampdoctor-underflow/"))]
    assert len(shown) == 6 and all(bounded[t] == every[t] for t in shown)
    assert "ampdoctor-absmax/activation/blocks.1.layer5" in shown  # the overflow (inf)
    top = sorted(t for t in layer if t.startswith("ampdoctor-underflow/"))
    top.sort(key=lambda t: -max(every[t].values()))
    assert set(top[:3]) <= set(shown)
    for kind in ("activation", "activation_grad", "weight_grad"):
        tags = [t for t in layer if t.startswith(f"ampdoctor-absmax/{kind}/")]
        for step in (0, 10, 20, 30, 40):
            values = [every[t][step] for t in tags]
            assert bounded[f"ampdoctor-layers/absmax_max/{kind}"][step] == max(values)
            assert bounded[f"ampdoctor-layers/absmax_median/{kind}"][step] == \
                pytest.approx(float(np.median(values)), rel=1e-6)
    assert "ampdoctor-layers/underflow_max/weight_grad" in bounded
    assert bounded["ampdoctor/loss"] == every["ampdoctor/loss"]


def test_the_activation_figure_from_readiness_peaks_is_the_one_read_from_the_run(tmp_path):
    from ampdoctor.render import plots
    from ampdoctor.runfile.store import load

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import make_large_run

    path = str(tmp_path / "run.h5")  # an inf among 40 modules' outputs, from step 30 on
    make_large_run.write_large_run(path, steps=50, modules=40, every=10, overflow_step=30,
                                   persist=True)
    with load(path) as run:
        r = readiness.fp16_readiness(run)
        figures = [plots.activation_range_figure(run),
                   plots.activation_range_figure(run, readiness=r)]
    read, given = ([(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                    for line in fig.axes[0].lines] for fig in figures)
    assert read == given
    assert read[0][0] == "blocks.2.layer0 (activation)" and len(read) > plots.TOP_LAYERS
