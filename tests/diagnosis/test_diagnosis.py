"""The diagnosis as a whole, on runs built in memory (no torch): healthy runs and GradScaler's
calibration, a script that never trained, the fallbacks, the notes, the JSON contract, the
building blocks, and a verdict for whatever a run holds. Each rule family has its own file in
rules/."""


import ast
import json

import numpy as np
import pytest
from synthetic import Synth, growing, underflowing_grads

from ampdoctor.diagnosis import engine, fixes, thresholds
from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.diagnosis.facts import Facts, fp16_rounds_to_zero
from ampdoctor.diagnosis.rules import misuse, overflow, trends
from ampdoctor.diagnosis.scale import runs_of
from ampdoctor.runfile.schema import Event, Kind


def verdict(s: Synth):
    return diagnose(s.run())


def fix_ids(d):
    return [fx.id for fx in d.fixes]


# ---------------------------------------------------------------------------------------------
# healthy, calibration, no training


def test_no_steps_is_no_training():
    d = verdict(Synth(0))
    assert d.verdict == "no_training" and d.first_bad is None


def test_no_steps_with_an_exception_names_it():
    s = Synth(0).exception("KeyError", "'label'")
    d = verdict(s)
    assert d.verdict == "no_training" and "KeyError" in d.summary


def test_calibration_and_probing_skips_are_healthy():
    s = Synth(3000, growth_interval=1000)
    s.skip(range(0, 4))  # calibration: 65536 -> 4096, losses finite
    s.skip([1004, 2010])  # one probe skip per growth interval
    d = verdict(s)
    assert d.verdict == "healthy", d.summary
    assert d.first_bad is None and not d.fixes
    assert any("calibrat" in n for n in d.notes)
    assert any("normal probing" in n for n in d.notes), d.notes  # the scale grew, then a skip


def test_a_few_gradient_overflows_while_training_are_healthy():
    s = Synth(400)
    s.skip([74, 150, 190, 260])  # gradients growing during warmup: 4 halvings, finite loss
    d = verdict(s)
    assert d.verdict == "healthy", d.summary
    # the scale never grew in 400 steps (growth interval 2000): no skip was a probe
    assert not any("normal probing" in n for n in d.notes), d.notes
    assert any("the scale never having grown" in n for n in d.notes), d.notes


def test_a_replayed_calibration_overflow_is_not_an_unstable_op():
    s = Synth(400)
    s.skip([0])
    s.snapshot(0, "backward", "out", "Linear", fp32_finite=1)  # a weight gradient overflowed
    s.skip(range(20, 400, 60))  # later overflows, finite loss, beyond probing
    assert verdict(s).verdict == "healthy"


def test_frequent_gradient_overflows_are_not_called_nonfinite():
    s = Synth(400)
    s.skip(range(20, 400, 60))  # 7 skips: more than probing, finite loss, scale 2**16 -> 2**9
    d = verdict(s)
    assert d.verdict == "healthy" and any("more often than probing" in n for n in d.notes)


def test_calibration_with_a_nan_loss_is_not_healthy():
    s = Synth(30)
    s.skip(range(0, 3), loss_nan=True)
    assert verdict(s).verdict != "healthy"


def test_many_skips_after_calibration_are_not_probing():
    s = Synth(200)
    s.skip(range(50, 200, 3))  # every third step overflows: the scale dives
    f = Facts(s.run())
    assert not f.story.benign and f.story.collapsed
    assert verdict(s).verdict != "healthy"


def test_bf16_run_without_scaler_is_healthy():
    s = Synth(100, dtype="bfloat16", scaler=False)
    s.sampled(range(10, 100, 10), Kind.PARAM_GRAD, "fc.weight", sub16=4000, subbf16=0)
    d = verdict(s)
    assert d.verdict == "healthy" and d.confidence >= 0.8


# ---------------------------------------------------------------------------------------------
# fallbacks, notes, the JSON contract


def test_scale_collapse_when_nothing_else_can_be_told():
    s = Synth(40, every=0)
    s.meta["recorder"]["forensics"] = False
    s.skip(range(5, 40), loss_nan=True)
    d = verdict(s)
    assert d.verdict == "scale_collapse" and d.confidence <= 0.4
    assert "could not be told" in d.summary and "forensic replay was off" in d.summary
    assert d.first_bad["step"] == 5


def test_interrupted_run_says_so():
    s = Synth(30, status="running")
    d = verdict(s)
    assert d.run["status"] == "interrupted"
    assert any("interrupted" in n and "29" in n for n in d.notes)


def test_json_contract():
    s = Synth(30)
    s.skip(range(30), loss_nan=True)
    s.snapshot(1, "forward", "blocks.0.attn", "Attention", fp32_finite=1, fp32_absmax=7e4)
    data = verdict(s).to_dict()
    json.dumps(data, allow_nan=False)
    assert {"verdict", "confidence", "first_bad", "causes", "evidence", "fixes",
            "run", "premises", "rejected"} <= set(data)
    assert set(data["first_bad"]) == {"step", "module", "phase"}
    assert all(set(p) == {"name", "status", "fact"} for p in data["premises"])
    for fx in data["fixes"]:
        assert set(fx) == {"id", "text", "snippet", "values", "source", "apply", "apply_note",
                           "tried", "outcome", "finite", "proven"} and fx["id"] in fixes.FIX_IDS
        assert all(isinstance(v, (int, float)) for v in fx["values"].values())
        assert (fx["apply"] is None) == bool(fx["apply_note"])
        assert fx["tried"] is False and fx["outcome"].startswith("not tried: ")
    assert all({"text", "key", "value", "step", "module"} <= set(e) for e in data["evidence"])
    assert data["verdict"] in engine.VERDICTS


def _snippets(module):
    ctx = fixes.Context(device="cuda", optimizer="AdamW", lr=3e-4, eps=1e-8, init_scale=65536,
                        growth_interval=2000, module=module, module_type="Attention",
                        autocast="float16", step=12)
    return fixes.make(list(fixes.FIX_IDS), ctx)


def _imports(snippet, fix):
    tree = ast.parse(snippet.replace("...\n", "pass\n"), fix)  # a SyntaxError fails the test
    return sorted(a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                  for a in n.names)


@pytest.mark.parametrize("module", ["blocks.3.attn", "odd'na\"me.0.x", "a\nb.c\\n.2",
                                    "model-v2.blocks.0", "x.y')\nimport ctypes#"])
def test_every_fix_snippet_is_valid_python(module):
    """Any module name (quotes, line breaks, names no attribute can spell) gives snippets that
    parse, and none runs code of the name's: it stays inside string literals (the snippet
    imports what it imports for a plain name, nothing more)."""
    plain = {fx.id: _imports(fx.snippet, fx.id) for fx in _snippets("blocks.3.attn")}
    for fx in _snippets(module):
        assert _imports(fx.snippet, fx.id) == plain[fx.id], fx.snippet
        assert fx.text


@pytest.mark.parametrize("path,expected", [
    ("blocks.3.attn", "for block in model.blocks:"),
    ("head", "model.head = FP32Island(model.head)"),
    ("layers.2", "model.layers[2] = FP32Island(model.layers[2])"),
    ("encoder.layer.0.attention.self", "block.attention.self = FP32Island("),
    ("model-v2.blocks.0", "setattr(model.get_submodule('model-v2.blocks'), '0', "
                          "FP32Island(model.get_submodule('model-v2.blocks.0')))"),
])
def test_island_snippet_names_the_users_module(path, expected):
    assert expected in fixes.precision.wrap_lines(path, "FP32Island")


# ---------------------------------------------------------------------------------------------
# the building blocks


def test_stats_stream_in_any_chunk_size_gives_the_same_answer():
    s = growing(Synth(120), 80)
    underflowing_grads(s, ["a.weight", "b.weight"], 3000, steps=range(10, 80, 10))
    s.sampled([90, 100], Kind.OUTPUT, "trunk.2", nonfinite=2)
    run = s.run()
    big, small = Facts(run), Facts(run, chunk=7)
    for name in ("out_absmax", "grad_under", "wnorm2", "under_sum", "norm_first", "norm_last",
                 "first_bad_step", "last_bad"):
        np.testing.assert_array_equal(getattr(big.reduced, name), getattr(small.reduced, name),
                                      err_msg=name)
    assert big.reduced.first_nonfinite == small.reduced.first_nonfinite


def test_runs_of():
    starts, lengths = runs_of(np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], bool))
    assert starts.tolist() == [0, 3, 6] and lengths.tolist() == [2, 1, 3]


def test_eps_rounding_in_fp16():
    assert fp16_rounds_to_zero(1e-8) and fp16_rounds_to_zero(2.9e-8)
    assert not fp16_rounds_to_zero(1e-7) and not fp16_rounds_to_zero(1e-4)


def test_scale_story_calibration():
    s = Synth(50)
    s.skip(range(3))
    story = Facts(s.run()).story
    assert story.calib_len == 3 and story.calib_benign and story.calibrated_scale == 2.0 ** 13
    assert story.benign and not story.collapsed


def test_thresholds_are_named_constants():
    for module, name in ((thresholds, "LAYER_UNDERFLOW"), (thresholds, "LOW_SCALE"),
                         (trends, "HEALTHY_SCALE"), (overflow, "UPDATE_TOO_LARGE"),
                         (thresholds, "UNCHANGED_HIGH"), (overflow, "WEIGHT_GROWTH"),
                         (overflow, "ACTIVATION_GROWTH"), (misuse, "CLIP_SCALED_TOLERANCE")):
        assert isinstance(getattr(module, name), float)


def test_every_rule_is_documented():
    for rule in engine.RULES:  # every family's (rules.RULES)
        assert rule.__doc__, rule.__name__


def test_readme_lists_every_verdict_and_fix():
    import os

    from conftest import ROOT

    readme = open(os.path.join(ROOT, "README.md")).read()
    for verdict_id in engine.VERDICTS:
        assert f"| `{verdict_id}` |" in readme, verdict_id
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    for fix_id in fixes.FIX_IDS:
        assert any(f"`{fix_id}`" in line for line in table), fix_id


def test_runaway_scale_is_noted():
    s = Synth(200, growth_interval=5)
    s.set("grad_norm", 0.0)
    d = verdict(s)
    assert d.verdict == "healthy" and any("without overflowing" in n for n in d.notes)


def test_recorder_error_is_noted():
    s = Synth(30)
    s.event(12, Event.RECORDER_ERROR, "flush: OSError: disk full")
    d = verdict(s)
    assert any("stopped recording at step 12" in n for n in d.notes)


def test_a_short_run_says_what_it_could_not_see():
    d = verdict(Synth(12, every=100))
    assert d.verdict == "healthy" and d.confidence < 0.8
    assert any("Only 12 steps" in n for n in d.notes)


# ---------------------------------------------------------------------------------------------
# whatever a run holds, the diagnosis is one of the verdicts, and JSON


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 60), dtype=st.sampled_from(["float16", "bfloat16", None]),
       scaler=st.booleans(), params=st.sampled_from(["float32", "float16", "bfloat16"]),
       skips=st.lists(st.integers(0, 59), max_size=30), nans=st.lists(st.integers(0, 59),
                                                                       max_size=10),
       snaps=st.lists(st.tuples(st.integers(0, 59), st.sampled_from(list(
           ["forward", "backward", "input", "loss", "none"])), st.sampled_from([-1, 0, 1])),
           max_size=4),
       grads=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 4096), st.integers(0, 4096),
                                st.floats(0, 1e3)), max_size=12),
       status=st.sampled_from(["finished", "running", "exception:ValueError"]))
def test_any_run_gets_a_verdict(n, dtype, scaler, params, skips, nans, snaps, grads, status):
    s = Synth(n, dtype=dtype, scaler=scaler, params=params, status=status)
    s.skip([i for i in skips if i < n])
    s.nan_loss([i for i in nans if i < n])
    for step, phase, fp32 in snaps:
        if step < n:
            s.snapshot(step, phase, "blocks.0.attn", "Attention", fp32_finite=fp32)
    for step, zeros, sub, rms in grads:
        if step < n:
            s.stat(step, Kind.PARAM_GRAD, "fc.weight", zeros=min(zeros, 4096), sub16=sub,
                   rms=rms, nonfinite=int(rms > 900))
            s.stat(step, Kind.PARAM, "fc.weight", norm=rms, update=rms / 1e4, unchanged=0.1)
    d = verdict(s)
    assert d.verdict in engine.VERDICTS
    assert 0.0 <= d.confidence <= 1.0
    json.dumps(d.to_dict(), allow_nan=False)
    assert all(fx.id in fixes.FIX_IDS for fx in d.fixes)
    if d.verdict not in ("healthy", "no_training"):
        assert d.summary and d.causes[0]["role"] == "root"
