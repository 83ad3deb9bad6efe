"""The early warning (``ampdoctor.forecast``): headroom, the crossing forecast and its gates, the
instability warning, and how ``diagnose`` carries them.

Synthetic runs (``synthetic.Synth``, no training) check the arithmetic and each gate; two
forecast fixtures recorded once (``attn_logits.py``, ``lr_ramp.py``) and a long healthy one
check it on real runs, cut before their first bad step.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from conftest import ROOT
from synthetic import Synth

import ampdoctor
from ampdoctor.diagnosis import forecast as F
from ampdoctor.diagnosis import forecastrows
from ampdoctor.render.diagnosis import render
from ampdoctor.runfile.schema import BF16_MAX, FP16_MAX, DType, Kind

EVERY = 5
LIMIT = math.log2(FP16_MAX)


def growing(log2_at, steps=range(0, 120, EVERY), name="blocks.3.attn", kind=Kind.OUTPUT,
            dtype=DType.FLOAT16, n=200, **kw) -> Synth:
    """A run whose ``name`` has ``2 ** log2_at(step)`` as abs max on the sampled steps."""
    s = Synth(n, every=EVERY, **kw)
    s.sampled(steps, kind, name, absmax=lambda i: 2.0 ** log2_at(i), dtype=int(dtype))
    s.sampled(steps, Kind.OUTPUT, "blocks.0.mlp", absmax=3.0, dtype=int(DType.FLOAT16))
    return s


def noisy(i: int) -> float:
    """A deterministic +-0.1 doubling wobble."""
    return 0.1 * math.sin(1.7 * i)


def test_exponential_growth_is_forecast_with_its_crossing_and_headroom():
    s = growing(lambda i: 4 + 0.1 * i + noisy(i))  # passes 65504 at about step 120
    fc = F.forecast(s.run())
    assert fc.status == "overflow_expected", fc.text
    assert (fc.layer, fc.kind, fc.dtype, fc.limit) == ("blocks.3.attn", "output", "float16",
                                                       FP16_MAX)
    assert fc.window == [60, 115] and fc.points == F.WINDOW
    assert abs(fc.doublings_per_100_steps - 10) < 0.5
    assert abs(fc.step - 120) <= 2 and fc.range[0] <= 120 <= fc.range[1]
    assert fc.range[1] - fc.range[0] < 20  # a usable range, not everything
    assert 0 < fc.headroom < 1.0
    assert fc.layers[0].name == "blocks.3.attn" and fc.layers[1].name == "blocks.0.mlp"
    assert abs(fc.layers[1].headroom - (LIMIT - math.log2(3.0))) < 1e-6
    assert "passes 65504" in fc.text and "blocks.3.attn's output" in fc.text
    ids = [fx.id for fx in fc.fixes]
    assert ids[:2] == ["scale_attention", "fp32_island"] and "FP32Island(block.attn)" in \
        fc.fixes[1].snippet


def test_until_cuts_the_run():
    s = growing(lambda i: 4 + 0.1 * i).run()
    with_all = F.forecast(s)
    early = F.forecast(s, until=61)  # sampled steps 0..60 only
    assert early.until == 61 and early.layers[0].window == [5, 60]
    assert early.status == "stable"  # 9.5 doublings left, 95 steps out: beyond one window
    assert early.layers[0].gates == [next(g for g in early.layers[0].gates
                                          if "beyond the horizon" in g)]
    assert with_all.status == "overflow_expected"


@pytest.mark.parametrize("log2_at,gate", [
    (lambda i: 10 + 3 * math.sin(2.3 * i), "within the noise"),  # flat, noisy
    (lambda i: 14.2 + 0.03 * (i - 60), "rose"),  # 1.6 doublings over the window, 1.8 left
    (lambda i: 4 + 0.1 * min(i, 90) + 0.02 * max(i - 90, 0), "levelling off"),
    (lambda i: -20 + 0.15 * i, "still small"),
    (lambda i: 2 + 0.05 * i, "beyond the horizon"),  # 2.75 doublings per window, 8 left
])
def test_each_gate_stops_a_forecast(log2_at, gate):
    fc = F.forecast(growing(log2_at).run())
    assert fc.status == "stable", fc.text
    trend = next(x for x in fc.layers if x.name == "blocks.3.attn")
    assert any(gate in g for g in trend.gates), trend.gates


def test_limit_follows_the_recorded_dtype():
    fc = F.forecast(growing(lambda i: 4 + 0.1 * i, dtype=DType.BFLOAT16).run())
    assert fc.status == "stable"
    top = next(x for x in fc.layers if x.name == "blocks.3.attn")
    assert top.dtype == "bfloat16" and top.limit == BF16_MAX
    assert top.headroom > 100  # bf16 has fp32's exponent range
    assert fc.layers[0].name == "blocks.0.mlp"  # the fp16 layer has the least headroom


def test_gradients_count_only_where_no_scaler_guards_them():
    grad = lambda i: 4 + 0.1 * i  # noqa: E731
    scaled = F.forecast(growing(grad, name="head", kind=Kind.GRAD_OUTPUT).run())
    assert scaled.status == "stable"  # the scaler's job: it backs off
    assert all(x.name != "head" for x in scaled.layers)
    bare = F.forecast(growing(grad, name="head", kind=Kind.GRAD_OUTPUT, scaler=False).run())
    assert (bare.status, bare.layer, bare.kind) == ("overflow_expected", "head",
                                                    "output gradient")
    assert [fx.id for fx in bare.fixes] == ["add_grad_scaler"]
    half = F.forecast(growing(grad, name="fc.weight", kind=Kind.PARAM_GRAD).run())
    assert (half.status, half.layer, half.kind) == ("overflow_expected", "fc.weight",
                                                    "gradient")  # fp16 .grad, scaler or not


def test_non_finite_samples_are_left_out_of_the_fit():
    s = growing(lambda i: 4 + 0.1 * i, steps=range(0, 110, EVERY))
    s.stat(110, Kind.OUTPUT, "blocks.3.attn", absmax=np.inf, nonfinite=3,
           dtype=int(DType.FLOAT16))
    fc = F.forecast(s.run())  # the window is the last 12 sampled steps: 55..110, 110 left out
    assert fc.status == "overflow_expected" and fc.window == [55, 105] and fc.points == 11


def params(s: Synth, steps, norm, update, numel=4096) -> Synth:
    return s.sampled(steps, Kind.PARAM, "fc.weight", norm=norm, update=update, numel=numel)


def test_instability_needs_two_signals():
    steps = range(0, 80, EVERY)
    both = params(growing(lambda i: 6.0, steps=steps), steps, lambda i: 1.0 * 1.08 ** i, 0.05)
    fc = F.forecast(both.run())
    assert fc.status == "unstable", fc.text
    assert len(fc.signals) == 2 and "weight norm x" in fc.signals[0]
    assert "update ratio ~0.05" in fc.signals[1]
    assert [fx.id for fx in fc.fixes] == ["lower_lr"]
    one = params(growing(lambda i: 6.0, steps=steps), steps, 1.0, 0.05)
    fc = F.forecast(one.run())
    assert fc.status == "stable" and len(fc.signals) == 1


def test_a_falling_scale_with_finite_losses_is_a_signal():
    steps = range(0, 80, EVERY)
    s = params(growing(lambda i: 6.0, steps=steps, n=80), steps, 1.0, 0.05)
    s.scales(2.0 ** 16 / 2.0 ** np.clip((np.arange(80) - 40) // 8, 0, None))
    fc = F.forecast(s.run())
    assert fc.status == "unstable"
    assert any("halvings below its calibrated level" in x for x in fc.signals)


def test_too_few_sampled_steps_is_unknown():
    fc = F.forecast(growing(lambda i: 4 + 0.1 * i, steps=range(0, 25, EVERY)).run())
    assert fc.status == "unknown" and "too few sampled steps" in fc.text
    assert fc.layers and fc.layers[0].doublings_per_100_steps is None  # headroom, no trend
    assert F.forecast(Synth(30, every=0).run()).status == "unknown"


def test_diagnose_warns_under_a_healthy_verdict_without_changing_it():
    run = growing(lambda i: 4 + 0.1 * i + noisy(i)).run()
    d = ampdoctor.diagnose(run)
    assert d.verdict == "healthy" and not d.fixes
    assert d.forecast.status == "overflow_expected" and d.forecast.layer == "blocks.3.attn"
    text = render(d, "text")
    assert "\nwarning:" in text and "passes 65504" in text and "[fp32_island]" in text
    assert "Early warning" in render(d, "markdown")
    data = json.loads(render(d, "json"))["forecast"]
    assert data["status"] == "overflow_expected" and data["layer"] == "blocks.3.attn"
    assert data["range"][0] <= data["step"] <= data["range"][1]


def test_diagnose_of_a_stable_run_prints_no_warning():
    d = ampdoctor.diagnose(growing(lambda i: 8.0 + noisy(i)).run())
    assert d.healthy and d.forecast.status == "stable"
    assert "warning:" not in render(d, "text")


def test_a_failed_run_says_from_when_the_warning_would_have_fired():
    s = growing(lambda i: 4 + 0.1 * i + noisy(i), steps=range(0, 120, EVERY))
    s.skip(range(120, 200), loss_nan=True)
    s.sampled(range(120, 200, EVERY), Kind.OUTPUT, "blocks.3.attn", absmax=np.inf,
              nonfinite=5, dtype=int(DType.FLOAT16))
    s.snapshot(120, "forward", "blocks.3.attn", "Attention", fp32_finite=1)
    d = ampdoctor.diagnose(s.run())
    assert not d.healthy and d.first_bad["step"] == 120
    fc = d.forecast
    assert fc.until == 120 and fc.status == "overflow_expected"
    assert fc.warned_status == "overflow_expected" and 60 < fc.warned_from < 120
    assert F.read(s.run()).at(fc.warned_from - EVERY).status != "overflow_expected"
    assert f"would have been forecast from step {fc.warned_from} on" in render(d, "text")


# ---------------------------------------------------------------------------------------------
# recorded runs

FORECAST = os.path.join(ROOT, "fixtures", "forecast")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """attn_logits (overflows in ``logits``), lr_ramp (diverges with the LR) and a healthy
    long run, recorded side by side at --every 5."""
    from recording import finish, start

    out = tmp_path_factory.mktemp("forecast")
    # Cut short a little after their failures (steps 141 and 111) to keep the suite lean.
    jobs = {"attn": ("attn_logits.py", ["--steps", "160"]),
            "ramp": ("lr_ramp.py", ["--steps", "140"]),
            "healthy": ("healthy_long.py", ["--steps", "300"])}
    procs = {k: (str(out / f"{k}.h5"), start(os.path.join(FORECAST, script), str(out / f"{k}.h5"),
                                             args, every=EVERY))
             for k, (script, args) in jobs.items()}
    done = {}
    for k, (path, proc) in procs.items():
        _, err = finish(proc, timeout=300)
        assert proc.returncode == 0, err[-2000:]
        done[k] = path
    return done


def test_attention_overflow_is_forecast_before_it_happens(recorded):
    d = ampdoctor.diagnose(recorded["attn"])
    first = d.first_bad["step"]
    assert d.first_bad["module"] == "logits"
    with ampdoctor.load(recorded["attn"]) as run:
        series = F.read(run)
    for ahead in (10, 20):
        fc = series.at(first - ahead)
        assert fc.status == "overflow_expected" and fc.layer == "logits", fc.text
        assert fc.range[0] <= first <= fc.range[1], fc.text
    assert d.forecast.warned_from <= first - 20


def test_lr_ramp_is_called_unstable_before_it_overflows(recorded):
    d = ampdoctor.diagnose(recorded["ramp"])
    first = d.first_bad["step"]
    # Where the CPU computes fp16 matmuls natively (AMX), the trunk's output passes 65504 at
    # step ~111; on one without (AMD Zen 4: avx512_bf16, no avx512_fp16) the rounding differs
    # and an earlier LR step kills the ReLU units at step ~100, before any overflow. Either
    # way the cause is the LR, whose fix comes first.
    assert d.verdict in ("lr_overflow", "dead_units"), str(d)
    assert d.fixes[0].id == "lower_lr"
    with ampdoctor.load(recorded["ramp"]) as run:
        fc = F.forecast(run, until=first - EVERY)
    assert fc.status == "unstable" and len(fc.signals) >= 2, fc.text
    assert d.forecast.warned_status == "unstable" and d.forecast.warned_from < first


def test_long_healthy_run_gets_no_failure_forecast_at_any_cut(recorded):
    d = ampdoctor.diagnose(recorded["healthy"])
    assert d.healthy and not d.forecast.warns
    with ampdoctor.load(recorded["healthy"]) as run:
        series = F.read(run)
    assert not [c for c in range(50, 302, 25) if series.at(c).warns]


def test_report_figure_extends_the_forecast_layer_to_its_limit():
    from ampdoctor.render import plots

    run = growing(lambda i: 4 + 0.1 * i + noisy(i)).run()
    d = ampdoctor.diagnose(run)
    fig = plots.figures(run, d)["activations"]
    ax = fig.axes[0]
    line = next(x for x in ax.get_lines() if x.get_label().startswith("forecast: blocks.3.attn"))
    xs, ys = line.get_data()
    assert xs[0] == 60 and xs[-1] == d.forecast.step
    assert abs(math.log2(ys[-1]) - LIMIT) < 0.3  # reaches 65504 where the forecast says
    stable = ampdoctor.diagnose(growing(lambda i: 8.0 + noisy(i)).run())
    labels = plots.activation_range_figure(run, forecast=stable.forecast).axes[0] \
        .get_legend_handles_labels()[1]
    assert not any(x.startswith("forecast") for x in labels)


def test_a_long_table_is_read_near_the_cut_only(monkeypatch):
    s = Synth(400, every=EVERY)
    for i in range(0, 400, EVERY):  # in step order, as the recorder appends them
        for j in range(10):
            s.stat(i, Kind.OUTPUT, f"layer{j}", absmax=2.0 ** (4 + 0.1 * (i % 120) + j / 10),
                   dtype=int(DType.FLOAT16))
    run = s.run()
    monkeypatch.setattr(forecastrows, "BLOCK", 20)  # 800 rows: 40 blocks
    monkeypatch.setattr(forecastrows, "WHOLE", 4)
    window = forecastrows.rows_near(run, 240, F.NEEDED)
    assert 0 < window.stats.start and window.stats.stop < len(run.stats)
    for cut in (None, 240, 300):
        whole, near = F.read(run).at(cut), F.forecast(run, until=cut)
        assert (near.status, near.layer, near.step, near.range) == \
            (whole.status, whole.layer, whole.step, whole.range)
        assert [x.headroom for x in near.layers] == [x.headroom for x in whole.layers]
    assert F.forecast(run, until=240).status == "overflow_expected"


def test_live_view_shows_each_layers_trend_and_the_warning():
    from ampdoctor.live import frame, top

    run = growing(lambda i: 4 + 0.1 * i + noisy(i)).run()
    lines, _ = frame._layer_lines(run)
    warning = frame._trends(run, lines)
    assert warning == F.forecast(run).text
    attn = next(x for x in lines if x.name == "blocks.3.attn")
    assert abs(attn.trend - 10) < 0.5
    fr = frame.Frame(path="run.h5", status="running", final=False, layers=lines,
                     layer_step=115, every=EVERY, forecast=warning)
    table = top._layer_table(fr, 80, top._painter(False))
    assert table[1].split()[-2:] == ["trend", "underflow"]
    row = next(x for x in table if x.split()[:1] == ["blocks.3.attn"])
    assert row.split()[4] == f"{attn.trend:+.1f}"
    assert any(x.strip().startswith("warning: at the growth") for x in table)
    assert all(len(x) <= 80 for x in table)
    flat = growing(lambda i: 8.0 + noisy(i)).run()
    lines, _ = frame._layer_lines(flat)
    assert frame._trends(flat, lines) is None


def test_live_view_of_a_recorded_run_has_the_trends_of_diagnose(recorded):
    from ampdoctor.live import follow, frame

    with follow.Follower(recorded["attn"]) as f:
        f.poll()
        fr = frame.build(f.states)
    with ampdoctor.load(recorded["attn"]) as run:
        series = F.read(run)
    trends, fc = series.trends(), series.at(None)
    shown = [x for x in fr.layers if x.kind == "activation" and not math.isnan(x.headroom)]
    assert shown and all(x.trend == pytest.approx(trends[(x.name, x.kind)]) for x in shown)
    assert fr.forecast == (fc.text if fc.warns else None)
