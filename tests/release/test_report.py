"""Release material: plots, fp16 readiness, the precision decision, fp32 parity, the HTML and
Markdown reports, and the ``report`` and ``compare`` commands.

Unit tests build ``store.Run`` objects in memory (no torch); the end-to-end ones record tiny
runs with ``ampdoctor.watch`` (fp32, bf16 autocast, and a bf16 run whose weights are corrupted
at a known step) and go through the library and the real CLI.
"""

import base64
import json
import os
import re
import subprocess

import numpy as np
import pytest
from conftest import PYTHON, ROOT, python_env

import ampdoctor
from ampdoctor import cli
from ampdoctor.errors import AmpDoctorError
from ampdoctor.release import comparison, readiness
from ampdoctor.release import report as release
from ampdoctor.render import plots
from ampdoctor.render import release as report_release
from ampdoctor.runfile import schema, store
from ampdoctor.runfile.schema import Event, Kind, Source, flag

PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# Runs built in memory


def synth(n=40, *, dtype="float16", scaler=True, every=4, loss=None, skips=(), nan_loss=(),
          layers=(), device=None, grad_norm=None):
    """A ``store.Run`` as the recorder would have written it. ``layers``: (kind, name, fn)
    with ``fn(step) -> dict`` of stats columns for each sampled step."""
    s = schema.empty("steps", n)
    s["step"] = np.arange(n)
    s["dt"] = 0.01
    s["loss"] = 2.0 - np.arange(n) / n if loss is None else loss
    s["grad_norm"] = 1.0 if grad_norm is None else grad_norm
    s["lr"] = 1e-3
    s["peak_mem"] = 1 << 30
    s["skipped"] = 0
    s["flags"] = 0
    s["sampled"] = (np.arange(n) % every == 0) if every else 0
    if scaler:
        scale = np.full(n, 2.0**16)
        for i in sorted(skips):
            scale[i + 1:] /= 2
        s["scale"] = scale
        s["scale_after"] = np.append(scale[1:], scale[-1])
    for i in skips:
        s["skipped"][i] = 1
        s["flags"][i] |= flag(Event.SKIPPED)
    for i in nan_loss:
        s["loss"][i] = np.nan
        s["flags"][i] |= flag(Event.NONFINITE_LOSS)
    tensors = np.zeros(len(layers), store.TENSOR_VIEW)
    rows = []
    for tid, (kind, name, fn) in enumerate(layers):
        tensors[tid] = (tid, int(kind), 0, 1, 4096, name, "Linear")
        for step in np.flatnonzero(s["sampled"]):
            row = schema.empty("stats", 1)
            row["step"], row["tensor"], row["source"] = step, tid, Source.SAMPLED
            row["numel"] = row["sample_n"] = 1024
            for col in ("zeros", "nan", "posinf", "neginf", "over16", "near16", "sub16",
                        "flush16"):
                row[col] = 0
            row["absmax"], row["absmin"], row["rms"] = 1.0, 1e-3, 0.1
            for col, value in fn(int(step)).items():
                row[col] = value
            rows.append(row)
    stats = np.concatenate(rows) if rows else schema.empty("stats")
    meta = {"status": "finished",
            "autocast": {"device_type": "cpu", "enabled": dtype is not None, "dtype": dtype},
            "device": device or {"type": "cpu", "name": "x86_64"},
            "model": {"trainable": 1000}}
    if scaler:
        meta["scaler"] = {"class": "GradScaler", "enabled": True, "init_scale": 2.0**16}
    return store.Run(path="synthetic.h5", meta=meta, steps=s, tensors=tensors,
                     stats=store.Table(stats))


def const(**cols):
    return lambda step: cols


# ---------------------------------------------------------------------------------------------
# plots


def test_every_figure_renders_headless_from_a_synthetic_run():
    run = synth(layers=[(Kind.OUTPUT, "attn", const(absmax=40000.0, near16=3)),
                        (Kind.PARAM_GRAD, "fc.weight", const(sub16=200, flush16=50))],
                skips=(0, 1, 20), nan_loss=(20,))
    figs = plots.figures(run, ampdoctor.diagnose(run))
    assert list(figs) == ["loss", "scale", "grad_norm", "lr", "activations", "grad_underflow"]
    for fig in figs.values():
        assert plots.png(fig).startswith(PNG)
    # The loss plot marks the skipped steps and the non-finite one.
    labels = figs["loss"].axes[0].get_legend_handles_labels()[1]
    assert any("skipped step (2)" in x for x in labels)  # 20 has a NaN loss: a rug mark
    assert any("non-finite loss (1)" in x for x in labels)
    # The activation plot draws fp16's limits.
    labels = figs["activations"].axes[0].get_legend_handles_labels()[1]
    assert "fp16 max 65504" in labels and any(x.startswith("attn") for x in labels)


def test_a_run_without_scaler_or_sampled_steps_gets_only_the_curves_it_has():
    run = synth(dtype=None, scaler=False, every=0)
    assert set(plots.figures(run)) == {"loss", "grad_norm", "lr"}
    assert plots.figures(synth(n=0, scaler=False, every=0)) == {}


def test_grad_norm_plot_shows_clipping_on_scaled_gradients():
    run = synth()
    run.steps["clip_norm"] = run.steps["grad_norm"] * 2.0**16  # clip_grad_norm_ before unscale_
    labels = plots.grad_norm_figure(run).axes[0].get_legend_handles_labels()[1]
    assert "norm clip_grad_norm_ saw" in labels
    run.steps["clip_norm"] = run.steps["grad_norm"]
    labels = plots.grad_norm_figure(run).axes[0].get_legend_handles_labels()[1]
    assert labels[0] == "grad norm (= what clip_grad_norm_ saw)"


def test_thinning_keeps_a_one_step_spike():
    x = np.arange(1_000_000)
    y = np.ones(len(x))
    y[123_457] = 50.0
    tx, ty = plots.thin(x, y)
    assert len(tx) <= plots.MAX_POINTS + 2 and ty.max() == 50.0 and 123_457 in tx


# ---------------------------------------------------------------------------------------------
# fp16 readiness


def test_readiness_names_the_layer_that_would_overflow_with_its_step():
    run = synth(dtype=None, scaler=False, layers=[
        (Kind.OUTPUT, "blocks.3.attn", lambda t: {"absmax": 9e4, "over16": 7, "near16": 9}
         if t >= 8 else {"absmax": 100.0}),
        (Kind.OUTPUT, "mlp", const(absmax=3.0))])
    r = readiness.fp16_readiness(run)
    assert r.status == "overflow"
    [x] = r.overflowing
    assert (x.name, x.kind, x.first_over, x.over_steps) == ("blocks.3.attn", "activation", 8, 8)
    assert x.over == pytest.approx(7 / 1024)
    assert "blocks.3.attn" in r.advice and "bf16" in r.advice


def test_an_outlier_the_sample_missed_still_counts_as_overflow():
    run = synth(dtype=None, scaler=False,
                layers=[(Kind.OUTPUT, "proj", const(absmax=70000.0))])  # counts all zero
    assert readiness.fp16_readiness(run).status == "overflow"


@pytest.mark.parametrize("cols, scaler, status, says", [
    (dict(absmax=0.5, absmin=1e-9, flush16=30, sub16=600), False, "needs_scaler", "fits"),
    # 2**70 between largest and smallest: GradScaler (about 64 here) cannot lift them all
    (dict(absmax=1e3, absmin=1e-12, flush16=30, sub16=600), False, "needs_scaler",
     "still flush"),
    # recorded in fp16: what flushed is zero already, only the subnormal pile-up shows
    (dict(absmax=2e-3, absmin=6e-8, sub16=600, dtype=schema.DType.FLOAT16), False,
     "needs_scaler", "already zero"),
    (dict(absmax=2000.0, absmin=1e-12, flush16=30, sub16=600), True, "underflow", "bf16"),
    (dict(absmax=1e5, absmin=1e-3), True, "ready", "safe"),  # scaled by 2**16: 1.5 unscaled
    (dict(absmax=0.5, absmin=1e-6, flush16=3, sub16=90), False, "ready", "safe"),  # 9%: fine
])
def test_readiness_of_gradients(cols, scaler, status, says):
    run = synth(dtype="float16" if scaler else None, scaler=scaler,
                layers=[(Kind.PARAM_GRAD, "fc.weight", const(**cols))])
    r = readiness.fp16_readiness(run)
    assert r.status == status and says in r.advice, r.advice
    if status != "ready":
        [x] = r.underflowing
        assert x.sub == pytest.approx(600 / 1024) and x.sub_step == 0


def test_nan_values_are_named_and_skipped_steps_gradients_ignored():
    run = synth(skips=(0,), layers=[
        (Kind.OUTPUT, "blocks.1.attn", lambda t: {"nonfinite": 1, "nan": 1024, "absmax": np.nan}
         if t >= 12 else {}),
        (Kind.PARAM_GRAD, "fc.weight", lambda t: {"nonfinite": 2, "posinf": 5,
                                                  "absmax": np.inf} if t == 0 else {})])
    r = readiness.fp16_readiness(run)
    assert r.status == "nonfinite" and "blocks.1.attn activation from step 12" in r.advice
    assert [x.name for x in r.nonfinite] == ["blocks.1.attn"]  # step 0 was a calibration skip
    assert not r.overflowing


def test_readiness_near_the_limit_and_without_statistics():
    run = synth(layers=[(Kind.OUTPUT, "attn", const(absmax=40000.0, near16=2))])
    assert readiness.fp16_readiness(run).status == "tight"
    r = readiness.fp16_readiness(synth(every=0))
    assert r.status == "unknown" and "--every" in r.advice
    json.dumps(r.to_dict(), allow_nan=False)


# ---------------------------------------------------------------------------------------------
# summary and precision decision


def test_summary_counts_calibration_apart_and_finds_the_peaks():
    norms = np.ones(40)
    norms[17] = 9.0
    norms[3] = np.inf
    run = synth(skips=(0, 1, 2, 30), nan_loss=(30,), grad_norm=norms)
    s = release.summarize(run)
    assert (s.skipped, s.calibration_skips, s.skipped_after) == (4, 3, 1)
    assert s.skip_rate == pytest.approx(1 / 37)
    assert (s.nonfinite_loss, s.first_nonfinite_loss) == (1, 30)
    assert (s.peak_grad_norm, s.peak_grad_norm_step) == (9.0, 17)
    assert (s.init_scale, s.final_scale, s.min_scale) == (2.0**16, 2.0**12, 2.0**12)
    assert s.median_step_time == pytest.approx(0.01)


CUDA = {"type": "cuda", "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0],
        "bf16_supported": True}
V100 = {"type": "cuda", "name": "Tesla V100-SXM2-16GB", "capability": [7, 0]}


def test_decision_on_ampere_after_an_fp16_range_failure_is_bf16():
    run = synth(device=CUDA)
    d = release.decide(run, "unstable_op", readiness.fp16_readiness(run))
    assert d.generation == "Ampere" and d.bf16_supported and d.capability == "8.0"
    assert d.recommendation == "bf16 autocast"
    assert "compute capability 8.0, Ampere" in d.device


def test_decision_before_ampere_keeps_fp16_with_the_fixes():
    run = synth(device=V100)
    d = release.decide(run, "unstable_op", readiness.fp16_readiness(run))
    assert d.generation == "Volta" and d.bf16_supported is False
    assert d.recommendation.startswith("fp16 autocast + GradScaler")
    assert any("predates Ampere" in x for x in d.reasons)


def test_decision_from_an_fp32_run_follows_readiness():
    over = [(Kind.OUTPUT, "attn", const(absmax=1e5, over16=4))]
    run = synth(dtype=None, scaler=False, device=V100, layers=over)
    d = release.decide(run, "healthy", readiness.fp16_readiness(run))
    assert d.recommendation == "fp16 autocast + GradScaler, with fp32 islands"
    run = synth(dtype=None, scaler=False, layers=over)  # CPU: GPU unknown
    d = release.decide(run, "healthy", readiness.fp16_readiness(run))
    assert d.recommendation.startswith("bf16 autocast (on an Ampere") and d.bf16_supported is None
    assert "CPU" in d.reasons[0]


def test_decision_for_half_weights_without_autocast_keeps_fp32_weights():
    run = synth(dtype=None, scaler=False, device=CUDA)
    run.meta["model"]["param_dtypes"] = {"bfloat16": 1000}
    d = release.decide(run, "healthy", readiness.fp16_readiness(run))
    assert d.run_dtype == "bfloat16" and not d.autocast
    assert d.recommendation == "bf16 autocast with fp32 weights"


def test_decision_after_an_fp16_run_whose_gradients_underflow_under_the_scaler():
    run = synth(device=CUDA, layers=[(Kind.PARAM_GRAD, "aux.weight", const(sub16=900))])
    r = readiness.fp16_readiness(run)
    assert r.status == "underflow"
    assert release.decide(run, "healthy", r).recommendation == "bf16 autocast"
    run.meta["device"] = V100
    assert "fixes" in release.decide(run, "healthy", r).recommendation


def test_a_script_bug_is_fixed_first_whatever_the_dtype():
    run = synth()
    d = release.decide(run, "clip_order", readiness.fp16_readiness(run))
    assert d.fix_first and "clip_order" in d.fix_first


# ---------------------------------------------------------------------------------------------
# compare on synthetic losses


def pair(amp_loss, n=100, **kw):
    base = synth(n, dtype=None, scaler=False, every=0)
    amp = synth(n, dtype="bfloat16", scaler=False, every=0, loss=amp_loss)
    return comparison.compare(base, amp, **kw)


@pytest.mark.parametrize("same_layers", [True, False])
def test_compare_reads_the_amp_runs_stats_once_for_layers_and_range(same_layers):
    """The fp16 range and the layer differences from one read of the amp run's rows are what
    two reads gave (rows in the same order in both runs, or not: a layer only one run has)."""
    grow = [(Kind.OUTPUT, "a", lambda i: {"absmax": 2.0 + i, "rms": 1.0 + i}),
            (Kind.PARAM_GRAD, "a.weight", lambda i: {"absmax": 9e4, "rms": 0.5}),
            (Kind.INPUT, "a", lambda i: {"absmax": 3.0, "rms": 1.0})]
    base = synth(40, dtype=None, scaler=False, layers=grow)
    other = grow[:2] + [(Kind.OUTPUT, "b", lambda i: {"absmax": 7e4, "rms": 2.0 ** -i})]
    amp = synth(40, layers=[(k, n, lambda i, f=f: {**f(i), "rms": f(i)["rms"] * 1.5})
                            for k, n, f in (grow if same_layers else other)])
    c = comparison.compare(base, amp)
    common = np.arange(40)
    apart, _ = comparison._layer_diffs(base, amp, common)
    assert [repr(x) for x in c.layers] == [repr(x) for x in apart] and apart
    assert c.amp_range == comparison._range_summary(readiness.fp16_readiness(amp))
    assert c.amp_range["status"] in ("overflow", "ready")


def test_compare_identical_curves_match():
    c = pair(2.0 - np.arange(100) / 100 + 1e-4)
    assert c.verdict == "match" and c.divergence_step is None and c.max_rel < 1e-3


def test_compare_finds_the_step_a_divergence_starts_despite_smoothing():
    loss = 2.0 - np.arange(100) / 100
    loss[60:] *= np.where(np.arange(40) % 2, 1.015, 1.5)  # every other batch near the baseline
    c = pair(loss)
    assert c.tolerance["window"] == 10
    assert c.verdict == "diverged" and c.divergence_step == 60


def test_compare_a_run_that_goes_nan_diverges_at_its_first_nan():
    loss = 2.0 - np.arange(100) / 100
    loss[73:] = np.nan
    c = pair(loss)
    assert (c.verdict, c.divergence_step, c.nonfinite_count) == ("diverged", 73, 27)


def test_compare_a_spike_that_comes_back_is_drift():
    loss = 2.0 - np.arange(100) / 100
    loss[40:45] *= 2
    c = pair(loss)
    assert c.verdict == "drift" and c.divergence_step is None
    assert 40 <= c.max_rel_step <= 50


def test_compare_refuses_runs_with_nothing_in_common():
    base = synth(10, dtype=None, scaler=False)
    other = synth(10)
    other.steps["step"] += 100
    with pytest.raises(AmpDoctorError, match="share no step"):
        comparison.compare(base, other)
    nan_base = synth(10, dtype=None, scaler=False, loss=np.full(10, np.nan))
    with pytest.raises(AmpDoctorError, match="baseline must itself be sound"):
        comparison.compare(nan_base, synth(10))


def test_a_baseline_that_went_nonfinite_against_its_fix_is_no_parity_match():
    """The new user's ``compare half_adam.h5 half_adam_fixed.h5``: the first run's loss is
    non-finite from step 1, the second (its fix) trains. Not "match, largest difference 0%":
    a fix comparison whose verdict is ``fixed``, with both runs' story."""
    loss = 2.0 - np.arange(100) / 100
    bad = synth(100, every=0, nan_loss=range(1, 100))
    good = synth(100, every=0, loss=loss)
    good.meta["applied"] = [{"fix": "adam_eps", "arg": "adam_eps=0.001"}]
    c = comparison.compare(bad, good)
    assert c.kind == "fix" and c.verdict == "fixed", c.summary
    t = c.treatment
    assert (t["base"]["nonfinite"], t["base"]["first_nonfinite"]) == (99, 1)
    assert t["amp"]["nonfinite"] == 0 and t["amp"]["applied"] == ["adam_eps=0.001"]
    assert t["change"] == {"added": ["adam_eps=0.001"], "removed": []}
    assert t["amp"]["last_loss"] == {"step": 99, "loss": pytest.approx(loss[-1])}
    text = report_release.render_comparison(c, "text")
    assert "verdict: fixed" in text and "match" not in text.split("\n")[3]
    assert "--apply adam_eps=0.001" in text and "99 of 100, from step 1" in text
    assert comparison.compare(bad, good).to_dict()["kind"] == "fix"
    assert "What the fix changed: `fixed`" in report_release.render_comparison(c, "markdown")
    # the fix that did not help, and the treated run that broke a healthy one
    assert comparison.compare(bad, synth(100, every=0, nan_loss=range(5, 100))).verdict == \
        "still_failing"
    worse = synth(100, every=0, nan_loss=range(50, 100))
    worse.meta["applied"] = [{"fix": "lr_factor", "arg": "lr_factor=2"}]
    assert comparison.compare(synth(100, every=0, loss=loss), worse).verdict == "worse"


def test_a_treated_run_whose_loss_stays_at_its_untrained_level_is_not_fixed(monkeypatch):
    """Issue 40: diffusers at LR 10, treated with an LR 400x too high, ended at 1.10, its
    untrained level, with no failure and a healthy diagnosis, and compare called it
    ``fixed``. A fix that stops the failure by not training is ``not_trained``; the same
    treatment whose loss falls below its start is ``fixed``."""
    from ampdoctor.diagnosis import engine
    from ampdoctor.release import fix_outcome

    bad = synth(100, every=0, nan_loss=range(20, 100))
    noise = np.random.default_rng(0).normal(0.0, 0.15, 100)  # a diffusion loss's noise
    flat = synth(100, every=0, loss=1.0 + 0.1 * np.arange(100) / 100 + noise)
    falling = synth(100, every=0, loss=1.0 - 0.5 * np.arange(100) / 100)
    for run in (flat, falling):
        run.meta["applied"] = [{"fix": "lr_factor", "arg": "lr_factor=0.04"}]
    lv = fix_outcome.levels(flat.steps["loss"])
    assert lv["learned"] is False and lv["end"] > lv["start"] * 0.9
    real = engine.diagnose
    # as the diffusers run was: the treated run's own diagnosis finds nothing wrong
    monkeypatch.setattr(engine, "diagnose",
                        lambda run, **kw: real(falling if run is flat else run, **kw))
    c = comparison.compare(bad, flat)
    assert c.kind == "fix" and c.verdict == "not_trained", c.summary
    assert "did not learn" in c.summary and "--apply lr_factor=0.04" in c.summary
    assert "verdict: not_trained" in report_release.render_comparison(c, "text")
    assert comparison.compare(bad, falling).verdict == "fixed"
    assert fix_outcome.verdict(False, True, None) == "fixed"  # too few losses to tell


def test_two_fp32_runs_say_nothing_of_fp16():
    """Both runs in fp32 (nanoGPT on CPU uses no autocast): no fp16 range verdict."""
    base = synth(50, dtype=None, scaler=False, every=0)
    other = synth(50, dtype=None, scaler=False, every=0, loss=2.0 - np.arange(50) / 50 + 1e-4)
    c = comparison.compare(base, other)
    assert c.kind == "parity" and c.verdict == "match" and not c.amp_range
    assert "fp16" not in report_release.render_comparison(c, "text")


# ---------------------------------------------------------------------------------------------
# Real recorded runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp32, bf16 autocast, and bf16 whose head weights are multiplied by 30 at step 15."""
    torch = pytest.importorskip("torch")
    from helpers import fresh, train

    root = tmp_path_factory.mktemp("report")

    def record(name, dtype, corrupt_at=None):
        path = str(root / f"{name}.h5")
        model, opt = fresh()

        def corrupt(i):  # after step i: before step i + 1's forward
            if i + 1 == corrupt_at:
                with torch.no_grad():
                    model.head.weight.mul_(30)

        with ampdoctor.watch(model, opt, None, path=path, every=5):
            train(model, opt, None, steps=30, dtype=dtype, on_step=corrupt)
        return path

    return {"fp32": record("fp32", None), "bf16": record("bf16", torch.bfloat16),
            "bad": record("bad", torch.bfloat16, corrupt_at=15), "dir": root}


def test_compare_fp32_and_bf16_recordings_match(runs):
    c = ampdoctor.compare(runs["fp32"], runs["bf16"])
    assert c.verdict == "match", c.summary
    assert c.base["dtype"] == "float32" and c.amp["dtype"] == "bfloat16"
    assert c.common_steps == 30 and c.layer_steps == 6
    assert {x.kind for x in c.layers} >= {"activation", "weight grad"}
    assert all(0.9 < x.ratio < 1.1 for x in c.layers)
    assert c.speedup is not None and c.memory_ratio is not None
    json.dumps(c.to_dict(), allow_nan=False)
    assert str(c).startswith("ampdoctor compare:")


def test_compare_names_the_step_of_an_injected_divergence(runs):
    c = ampdoctor.compare(runs["fp32"], runs["bad"])
    assert (c.verdict, c.divergence_step) == ("diverged", 15), c.summary


def test_plots_render_from_a_recorded_run(runs):
    with ampdoctor.load(runs["bf16"]) as run:
        figs = plots.figures(run, ampdoctor.diagnose(run))
        assert {"loss", "grad_norm", "lr", "activations", "grad_underflow"} <= set(figs)
        assert "scale" not in figs  # no GradScaler in this run
        assert plots.png(figs["activations"]).startswith(PNG)


def test_html_report_is_self_contained_and_holds_the_key_figures(runs):
    with ampdoctor.release_report(runs["bad"], baseline=runs["fp32"]) as r:
        page = report_release.render_release(r, "html")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) >= 6
    assert all(base64.b64decode(img).startswith(PNG) for img in images)
    rest = re.sub(r"base64,[A-Za-z0-9+/=]+", "", page)
    assert "http" not in rest and "<script" not in rest and "<link" not in rest
    assert "url(" not in rest and re.findall(r'src="(?!data:)', rest) == []
    for text in ("Diagnosis:", "skipped steps", "non-finite loss steps", "peak gradient norm",
                 "median step time",
                 "Precision decision", "bf16 supported", "fp16 readiness",
                 "fp32 parity: <code>diverged</code>", 'id="fig-parity"', 'id="fig-loss"'):
        assert text in page, text


def test_html_of_an_fp16_run_shows_its_scaler_story():
    run = synth(skips=(0, 1, 25), nan_loss=(25,), device=CUDA,
                layers=[(Kind.OUTPUT, "attn", const(absmax=1e5, over16=3))])
    with ampdoctor.release_report(run) as r:
        page = r._repr_html_()
        md = r.markdown()
    for text in ("skip rate after calibration", "2.63% (1 of 38;", "65536 (2**16)",
                 "8192 (2**13)", "non-finite loss steps</th><td>1 (first at step 25)",
                 'id="fig-scale"', "NVIDIA A100-SXM4-80GB", "fp16 readiness: <code>overflow",
                 "attn"):
        assert text in page, text
    assert ("| skip rate after calibration | 2.63% (1 of 38; GradScaler's probing accounts "
            "for up to 3) |") in md
    assert "![" not in md  # no --plots-dir: no figures


def test_html_diagnosis_escapes_and_keeps_chain_also_and_fix_snippets():
    from ampdoctor.diagnosis.engine import Diagnosis, Evidence
    from ampdoctor.diagnosis.fixes import Fix

    d = Diagnosis("unstable_op", 0.9, "q @ k.T passes 65504 in <attn>.", {"step": 3,
                  "module": "blocks.0.attn", "phase": "forward"},
                  [{"verdict": "unstable_op", "role": "root", "text": "x"},
                   {"verdict": "scale_collapse", "role": "consequence", "text": "y"},
                   {"verdict": "adam_eps", "role": "also", "text": "eps rounds to 0. More."}],
                  [Evidence("abs max 7e4 at step 3")], [Fix("fp32_island", "Wrap it.",
                                                            "x = a < b")], {"path": "r.h5"})
    page = report_release._diagnosis_html(d)
    assert "&lt;attn&gt;" in page and "<attn>" not in page and "x = a &lt; b" in page
    assert "<code>unstable_op</code> → <code>scale_collapse</code>" in page
    assert "<b>Also:</b> adam_eps: eps rounds to 0." in page


def test_markdown_report_writes_its_plots_beside_it(runs, tmp_path):
    out = tmp_path / "report.md"
    code = cli.main(["report", runs["fp32"], "--format", "markdown", "--plots-dir",
                     str(tmp_path / "plots"), "-o", str(out)])
    assert code == 0
    md = out.read_text()
    assert md.startswith("# ampdoctor release report") and "## Diagnosis: `healthy`" in md
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)
    assert "plots/loss.png" in links
    for link in links:
        assert (tmp_path / link).read_bytes().startswith(PNG)


def test_report_json_and_readiness_of_an_fp32_run(runs):
    r = ampdoctor.fp16_readiness(runs["fp32"])
    assert r.status in readiness.STATUSES and r.sampled_steps == 6 and not r.scaled
    assert {x.kind for x in r.layers} == {"input", "activation", "activation grad",
                                          "weight grad"}
    with ampdoctor.release_report(runs["fp32"]) as rep:
        data = json.loads(report_release.render_release(rep, "json"))
    assert data["readiness"]["status"] == r.status
    assert data["decision"]["run_dtype"] == "float32" and data["comparison"] is None


# ---------------------------------------------------------------------------------------------
# The commands


def test_compare_cli_formats_and_fail_on(runs, capsys):
    assert cli.main(["compare", runs["fp32"], runs["bf16"], "--fail-on", "drift"]) == 0
    assert "verdict: match" in capsys.readouterr().out
    assert cli.main(["compare", runs["fp32"], runs["bad"]]) == 0
    assert cli.main(["compare", runs["fp32"], runs["bad"], "--fail-on", "diverged"]) == 1
    capsys.readouterr()
    assert cli.main(["compare", runs["fp32"], runs["bad"], "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "diverged" and data["divergence_step"] == 15
    assert cli.main(["compare", runs["fp32"], runs["bad"], "--format", "markdown"]) == 0
    assert capsys.readouterr().out.startswith("## fp32 parity: `diverged`")


def test_report_never_overwrites_a_run_file(runs):
    before = os.path.getsize(runs["bf16"])
    assert cli.main(["report", runs["bf16"], "-o", runs["bf16"]]) == 2
    assert cli.main(["report", runs["fp32"], "-o", runs["bf16"]]) == 2
    assert os.path.getsize(runs["bf16"]) == before and ampdoctor.load(runs["bf16"]).steps.size


@pytest.mark.parametrize("args", [
    ["report", "/nonexistent/run.h5"],
    ["report", "{fp32}", "--baseline", "/nonexistent/base.h5", "-o", "{dir}/r.html"],
    ["report", "{fp32}", "-o", "/nonexistent/dir/report.html"],
    ["report", "{fp32}", "--plots-dir", "{dir}/p", "-o", "{dir}/r.html"],
    ["report", "{fp32}", "--format", "pdf"],
    ["compare", "{fp32}", "/nonexistent/amp.h5"],
    ["compare", "{fp32}", "{bf16}", "--rtol", "0.5", "--diverge", "0.1"],
    ["compare", "{fp32}"],
])
def test_bad_input_is_one_sentence_and_exit_2(runs, args):
    args = [a.format(**runs) for a in args]
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=python_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip()
    assert not os.path.exists(runs["dir"] / "r.html")


def test_report_and_compare_never_import_torch_or_pyplot(runs, tmp_path):
    out = str(tmp_path / "r.html")
    code = (f"import sys, ampdoctor; c = ampdoctor.compare({runs['fp32']!r}, {runs['bf16']!r}); "
            f"from ampdoctor import cli; rc = cli.main(['report', {runs['bad']!r}, '--baseline', "
            f"{runs['fp32']!r}, '-o', {out!r}]); assert rc == 0, rc; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'; print(c.verdict)")
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "match"
    assert "<!DOCTYPE html>" in open(out).read()


def test_only_drawing_loads_matplotlib(runs):
    code = (f"import sys, ampdoctor; r = ampdoctor.release_report({runs['bad']!r}, "
            f"baseline={runs['fp32']!r}); from ampdoctor.render import release as report_release; "
            "report_release.render_release(r, 'markdown'); "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
            "print(r.comparison.verdict)")
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "diverged"


@pytest.mark.slow
def test_the_readme_parity_commands_end_to_end(tmp_path):
    """`ampdoctor record` the bundled script in fp32 and bf16, then compare and report."""
    script = os.path.join(ROOT, "fixtures", "examples", "parity.py")
    procs = [subprocess.Popen([PYTHON, "-m", "ampdoctor", "record", "-q", "-o",
                               str(tmp_path / f"{name}.h5"), "--every", "10", "--", PYTHON,
                               script, "--dtype", dtype, "--steps", "40"],
                              env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "compare", "fp32.h5", "bf16.h5",
                           "--fail-on", "drift"], cwd=tmp_path, env=python_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "verdict: match" in proc.stdout, proc.stdout + proc.stderr
    assert "4 common sampled steps" in proc.stdout
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "report", "bf16.h5", "--baseline",
                           "fp32.h5", "-o", "report.html"], cwd=tmp_path, env=python_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "wrote report.html" in proc.stderr
    assert "fp32 parity: <code>match</code>" in (tmp_path / "report.html").read_text()


@pytest.mark.gpu
def test_report_of_a_cuda_run_names_the_gpu_and_its_bf16(tmp_path):
    """On a CUDA machine (benchmarks/gpu_check.sh): device meta, decision and memory measure."""
    import torch
    from helpers import fresh, train

    def record(name, dtype):
        path = str(tmp_path / f"{name}.h5")
        model, opt = fresh()
        model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with ampdoctor.watch(model, opt, None, path=path, every=5):
            train(model, opt, None, steps=20, dtype=dtype, device="cuda")
        return path

    base, amp = record("fp32", None), record("bf16", torch.bfloat16)
    cap = torch.cuda.get_device_capability()
    with ampdoctor.release_report(amp, baseline=base) as r:
        assert r.decision.capability == f"{cap[0]}.{cap[1]}"
        assert r.decision.bf16_supported == torch.cuda.is_bf16_supported()
        assert r.decision.generation == release.generation(cap)
        assert r.summary.memory_measure == "CUDA allocator peak" and r.summary.peak_memory > 0
        assert r.comparison.verdict == "match", r.comparison.summary
        page = report_release.render_release(r, "html")
    assert torch.cuda.get_device_name() in page


def test_write_report_is_the_command_in_one_library_call(runs, tmp_path):
    import inspect

    assert cli.main(["report", runs["bf16"], "--baseline", runs["fp32"], "--format",
                     "markdown", "-o", str(tmp_path / "cli.md")]) == 0
    r = ampdoctor.write_report(runs["bf16"], str(tmp_path / "lib.md"), baseline=runs["fp32"],
                               fmt="markdown")
    assert r.comparison is not None and r.diagnosis.verdict
    assert (tmp_path / "lib.md").read_text() == (tmp_path / "cli.md").read_text()
    page = ampdoctor.write_report(runs["fp32"], str(tmp_path / "r.html"))
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>") and page.diagnosis
    with pytest.raises(ampdoctor.AmpDoctorError, match="run file being reported on"):
        ampdoctor.write_report(runs["fp32"], runs["fp32"])
    # diagnose's options are its real keywords, not **options
    params = inspect.signature(ampdoctor.diagnose).parameters
    assert [(n, p.kind.name) for n, p in params.items()] == [
        ("run", "POSITIONAL_OR_KEYWORD"), ("rank", "KEYWORD_ONLY"), ("rules", "KEYWORD_ONLY"),
        ("baseline", "KEYWORD_ONLY")]


def test_a_run_with_its_linears_in_fp8_is_compared_for_parity_against_its_baseline():
    """``record --apply fp8`` changes the precision, not a failure: ``compare base.h5 fp8.h5``
    is a parity question (match, drift, diverged), and names the fp8 run by its recipe."""
    loss = 2.0 - np.arange(60) / 60
    base = synth(60, dtype="bfloat16", scaler=False, every=0, loss=loss)
    fp8 = synth(60, dtype="bfloat16", scaler=False, every=0, loss=loss * (1 + np.arange(60) / 200))
    fp8.meta["applied"] = [{"fix": "fp8", "arg": "fp8", "recipe": "tensorwise",
                            "converted": ["0", "2"], "kept": {}, "emulated": True}]
    c = comparison.compare(base, fp8)
    assert c.kind == "parity" and c.verdict == "diverged", c.summary
    assert c.amp["dtype"] == "float8 tensorwise + bfloat16"
    assert "The float8 tensorwise + bfloat16 run's loss diverges" in c.summary
    fp8.meta["applied"][0]["converted"] = []  # nothing converted: a treatment like any other
    assert comparison.compare(base, fp8).amp["dtype"] == "bfloat16"


def test_common_steps_finds_what_intersect1d_finds():
    """compare's steps in both runs, found by bisection when both are in order (a run's
    /steps): the same values and first positions as np.intersect1d, in or out of order."""
    from ampdoctor.release.comparison import common_steps

    rng = np.random.default_rng(0)
    for trial in range(200):
        b = np.sort(rng.integers(0, 30, rng.integers(0, 20)))
        a = np.sort(rng.integers(0, 30, rng.integers(0, 20)))
        if trial % 3 == 0:
            a = rng.permutation(a)
        got, want = common_steps(b, a), np.intersect1d(b, a, return_indices=True)
        assert all(np.array_equal(x, y) for x, y in zip(got, want)), (b, a)
