"""fp8 readiness (release/fp8.py): the statuses and ranking on /fp8 rows built in memory (no
torch), the JSON shape, and on recorded runs: a layer fed by one outlier channel, or one
outlier token, is flagged under per-tensor scaling and not under the recipes whose scales
are fine-grained enough to isolate the outlier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, python_env
from synthetic import Synth

import ampdoctor
from ampdoctor.release import fp8
from ampdoctor.runfile import schema, store
from ampdoctor.runfile.schema import Kind, Recipe, Role


def rows(tensor, step=0, role=Role.INPUT, recipe=Recipe.TENSOR, n=1000, **counts):
    r = schema.empty("fp8", 1)
    r["step"], r["tensor"], r["role"], r["recipe"] = step, tensor, role, recipe
    r["sample_n"], r["numel"], r["amax"], r["sqnr_db"] = n, n, 1.0, 30.0
    for key, value in counts.items():
        r[key] = value
    return r


def run_with(*parts, skipped=()):
    s = Synth(10, dtype="float16" if skipped else "bfloat16", scaler=bool(skipped))
    for name in ("fc1", "fc2", "fc3", "fc4"):
        s.tensor(Kind.OUTPUT, name)
    s.skip(skipped)
    run = s.run()
    run.fp8 = store.Table(np.concatenate(parts), name="fp8")
    return run


def test_each_status_from_its_threshold_and_the_ranking():
    run = run_with(rows(0, flushed=50),  # 5 % flushed
                   rows(1, recipe=Recipe.DELAYED, saturated=20),
                   rows(2, sqnr_db=12.0),
                   rows(3, flushed=5, subnormal=20, sqnr_db=29.0),  # within every threshold
                   rows(1, step=1, subnormal=300, zeros=0),  # 30 % subnormal: squeezed
                   rows(2, recipe=Recipe.MX, saturated=50, sqnr_db=26.0))  # MX: bounded
    r = fp8.fp8_readiness(run)
    tw = r.recipes["tensorwise"]
    assert {n: layer.status for n, layer in tw.layers.items()} == \
        {"fc1": "flushes", "fc2": "flushes", "fc3": "low_sqnr", "fc4": "ok"}
    assert tw.keep_high_precision == ["fc1", "fc2", "fc3"]  # 5 % flushed before 30 % subnormal
    assert r.recipes["delayed"].layers["fc2"].status == "saturates"
    assert r.recipes["mxfp8"].layers["fc3"].status == "ok"
    assert r.recipes["mxfp8"].keep_high_precision == []


def test_to_dict_has_exactly_the_documented_shape_and_is_json():
    run = run_with(rows(0, flushed=50), rows(0, role=Role.WEIGHT),
                   rows(0, role=Role.GRAD_OUTPUT, sqnr_db=np.inf),
                   rows(1, recipe=Recipe.ROWWISE, amax=np.nan, sqnr_db=np.nan))
    d = ampdoctor.fp8_readiness(run).to_dict()
    assert list(d) == ["trial", "suits", "recipes"]
    assert d["trial"] == {} and d["suits"] == ""  # no trial in this run
    assert list(d["recipes"]) == ["tensorwise", "delayed", "rowwise", "mxfp8"]
    for recipe in d["recipes"].values():
        assert set(recipe) == {"keep_high_precision", "decided_by", "trial", "paste", "layers"}
        assert recipe["decided_by"] == "statistics" and recipe["trial"] == {}
        assert set(recipe["paste"]) == {"torchao", "transformer_engine", "apply"}
        for layer in recipe["layers"].values():
            assert set(layer) == {"status", "tensors"}
            for role, t in layer["tensors"].items():
                assert role in ("input", "weight", "grad_output")
                assert set(t) == {"flushed", "saturated", "sqnr_db"}
    fc1 = d["recipes"]["tensorwise"]["layers"]["fc1"]
    assert fc1["status"] == "flushes" and fc1["tensors"]["input"]["flushed"] == 0.05
    assert fc1["tensors"]["grad_output"]["sqnr_db"] == "inf"  # no error at all
    assert d["recipes"]["rowwise"]["layers"]["fc2"]["status"] == "nonfinite"
    json.dumps(d, allow_nan=False)


def test_a_skipped_steps_gradients_are_left_out_and_an_old_run_reads_empty():
    run = run_with(rows(0, step=0, role=Role.GRAD_OUTPUT),
                   rows(0, step=3, role=Role.GRAD_OUTPUT, amax=np.inf, sqnr_db=np.nan),
                   skipped=(3,))
    assert fp8.fp8_readiness(run).recipes["tensorwise"].layers["fc1"].status == "ok"
    old = ampdoctor.fp8_readiness(os.path.join(ROOT, "fixtures", "formats", "v3.h5")).to_dict()
    assert all(r["keep_high_precision"] == [] and r["layers"] == {}
               for r in old["recipes"].values())


def test_reading_imports_no_torch():
    v4 = os.path.join(ROOT, "fixtures", "formats", "v4.h5")
    code = ("import sys, ampdoctor; "
            f"r = ampdoctor.fp8_readiness({v4!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "print(sorted(r.recipes['tensorwise'].layers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=python_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['fc1', 'fc2']"


# -- recorded ---------------------------------------------------------------------------------


def record(tmp_path, outlier: str):
    """A tiny fp32 model whose second Linear reads an activation with one channel (or one
    token) 3000x the others; a few steps, every one sampled."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Outlier(nn.Module):
        def forward(self, x):
            gain = torch.ones_like(x)
            if outlier == "channel":
                gain[..., 3] = 3000.0
            else:
                gain[5] = 3000.0
            return x * gain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), Outlier(), nn.Linear(256, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    path = str(tmp_path / f"{outlier}.h5")
    # (the statistics alone: the fp8 trial, which would decide keep_high_precision, is off)
    with ampdoctor.watch(model, opt, path=path, every=1, strict=True, fp8_trial=0):
        for _ in range(3):
            loss = model(torch.randn(64, 32)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return ampdoctor.fp8_readiness(path)


def test_an_outlier_channel_is_flagged_per_tensor_not_rowwise_nor_mx(tmp_path):
    r = record(tmp_path, "channel")
    assert r.recipes["tensorwise"].layers["2"].status == "flushes"
    assert r.recipes["tensorwise"].keep_high_precision == ["2"]
    assert r.recipes["mxfp8"].layers["2"].status == "ok"
    # A channel outlier is in every row, but each row's scale follows that row's own outlier
    # value (|x| * 3000 varies by row): rowwise squeezes the rest less than one tensor scale
    # does (about 8 % subnormal against 18 %), enough to pass here, not by a wide margin.
    rowwise = r.recipes["rowwise"].layers["2"]
    tensorwise = r.recipes["tensorwise"].layers["2"]
    assert rowwise.status == "ok"
    assert rowwise.tensors["input"].subnormal < tensorwise.tensors["input"].subnormal / 2
    # Its gradient flows back into the first layer with the same outlier: rowwise casts
    # gradients to e4m3 (tensorwise to e5m2, whose range holds it).
    assert r.recipes["rowwise"].layers["0"].status == "flushes"
    assert r.recipes["tensorwise"].layers["0"].status == "ok"


def test_an_outlier_token_is_flagged_per_tensor_not_rowwise_nor_mx(tmp_path):
    r = record(tmp_path, "token")
    assert r.recipes["tensorwise"].layers["2"].status == "flushes"
    # the token stays an outlier through the next layers: their inputs flush too
    assert "4" in r.recipes["tensorwise"].keep_high_precision
    assert r.recipes["rowwise"].layers["2"].status == "ok"
    assert r.recipes["mxfp8"].layers["2"].status == "ok"


def test_the_release_report_carries_it():
    v4 = os.path.join(ROOT, "fixtures", "formats", "v4.h5")
    with ampdoctor.release_report(v4) as report:
        d = report.to_dict()
        markdown = report.markdown()
        html = report.html()
    assert "<h2>fp8 readiness</h2>" in html and "<td>tensorwise</td>" in html
    assert d["fp8"] == ampdoctor.fp8_readiness(v4).to_dict()
    assert set(d["fp8"]["recipes"]["tensorwise"]["layers"]) == {"fc1", "fc2"}
    assert "## fp8 readiness" in markdown and "| tensorwise |" in markdown
    with ampdoctor.release_report(os.path.join(ROOT, "fixtures", "formats", "v3.h5")) as old:
        assert "fp8 readiness" not in old.markdown()


def trial_run(text):
    s = Synth(10, dtype="bfloat16", scaler=False)
    for name in ("fc1", "fc2"):
        s.tensor(Kind.OUTPUT, name)
    s.event(9, schema.Event.FP8_TRIAL, text=text)
    run = s.run()
    run.fp8 = store.Table(np.concatenate([rows(0, flushed=50), rows(1)]), name="fp8")
    return run


def test_the_trial_decides_where_it_ran_and_the_report_shows_what_it_measured():
    effect = {"loss": 1.0, "loss_change": 0.002, "grad_error": 0.04, "grad_cosine": 0.99}
    text = json.dumps({"step": 8, "weights_step": 9, "suits": "tensorwise", "runs": 7,
                       "seconds": 0.5, "recipes": {"tensorwise": {
                           "all": {**effect, "grad_error": 0.3}, "keep": ["fc2"],
                           "all_but_keep": effect, "untried": [],
                           "layers": {"fc1": effect, "fc2": {**effect, "grad_error": 0.2}}}}})
    r = fp8.fp8_readiness(trial_run(text))
    tw = r.recipes["tensorwise"]
    # the statistics flag fc1 (5 % flushed), the trial keeps fc2: the trial decides
    assert tw.layers["fc1"].status == "flushes"
    assert (tw.keep_high_precision, tw.decided_by, r.suits) == (["fc2"], "trial", "tensorwise")
    assert r.recipes["rowwise"].decided_by == "statistics"
    d = r.to_dict()
    assert d["recipes"]["tensorwise"]["layers"]["fc2"]["trial"]["grad_error"] == 0.2
    assert d["recipes"]["tensorwise"]["paste"]["apply"] == "--apply fp8=tensorwise:keep=fc2"
    assert d["recipes"]["mxfp8"]["paste"]["apply"] == ""  # record cannot train MX
    json.dumps(d, allow_nan=False)
    from ampdoctor.render.release import fp8_paste, fp8_rows
    row = dict((r[0], r) for r in fp8_rows(r))["tensorwise"]
    assert row[1:3] == ("trial", "1: fc2")
    assert row[3] == ("all Linears: gradient 30% off, loss +0.2%; all but those kept: "
                      "gradient 4% off, loss +0.2%")
    recipe, intro, paste = fp8_paste(r)
    assert recipe == "tensorwise" and "step 8's batch" in intro and "KEEP = {'fc2'}" in \
        paste["torchao"]


@pytest.mark.parametrize("text", [
    "not json", "[1, 2]",
    json.dumps({"step": "x", "runs": [1], "seconds": {}, "suits": 3, "recipes": {
        "tensorwise": {"keep": ["a\nb", 5], "layers": [1], "untried": 7, "all": "x"},
        "rowwise": {"keep": "fc1"}}}),
])
def test_a_damaged_trial_reads_as_far_as_it_goes(text):
    r = fp8.fp8_readiness(trial_run(text))
    json.dumps(r.to_dict(), allow_nan=False)
    from ampdoctor.render.release import fp8_paste, fp8_rows
    fp8_rows(r), fp8_paste(r)
    assert r.recipes["rowwise"].decided_by == "statistics"


# -- when fp8 pays: the precision decision's fp8 line (release/fp8pays.py) ---------------------


def test_the_decision_says_which_cards_have_fp8_matmuls_and_which_layers_can_use_them():
    from ampdoctor.release import fp8 as release_fp8
    from ampdoctor.release.fp8pays import fp8_matmuls, fp8_pays
    from ampdoctor.release.report import Decision

    def card(name, cap, generation):
        return Decision(device=name, device_type="cuda", run_dtype="bfloat16", scaler=False,
                        recommendation="bf16 autocast", capability=cap, generation=generation)

    h100, a100 = card("H100", "9.0", "Hopper"), card("A100", "8.0", "Ampere")
    cpu = Decision(device="CPU", device_type="cpu", run_dtype="float32", scaler=False,
                   recommendation="")
    assert fp8_matmuls(h100) is True and fp8_matmuls(a100) is False and fp8_matmuls(cpu) is None
    assert fp8_matmuls(card("L4", "8.9", "Ada Lovelace")) is True
    assert fp8_matmuls(h100, "mxfp8") is False  # MX blocks in hardware: Blackwell
    assert fp8_matmuls(card("B200", "10.0", "Blackwell"), "mxfp8") is True
    ok, bad = release_fp8.TensorFp8(0, 0, 0, 30.0, False, 2), \
        release_fp8.TensorFp8(0.2, 0, 0, 30.0, False, 2)
    recipe = release_fp8.RecipeFp8(name="tensorwise", layers={
        "fc1": release_fp8.LayerFp8("fc1", {"input": ok}),
        "fc2": release_fp8.LayerFp8("fc2", {"input": bad})})
    readiness = release_fp8.Fp8Readiness(recipes={"tensorwise": recipe})
    has, text = fp8_pays(h100, readiness)
    assert has is True and "H100 has them" in text
    assert "under tensorwise, 1 of 2 Linears in fp8, fc2 kept in bf16" in text
    assert "ranked from the sampled statistics" in text
    has, text = fp8_pays(a100, readiness)
    assert has is False and "emulated" in text
    # no fp8 figures (the counts off, an older file): nothing said
    empty = release_fp8.Fp8Readiness(recipes={"tensorwise": release_fp8.RecipeFp8()})
    assert fp8_pays(h100, empty) == (None, "")
