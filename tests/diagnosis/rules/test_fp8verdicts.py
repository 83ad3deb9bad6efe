"""The fp8 family (``rules/fp8.py``) on runs built in memory (no torch): the casts of layers
already in fp8, each failure class, its discriminator and the neighbours it must not be
confused with (the same /fp8 rows in a run with no fp8 layer: readiness, not a failure)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from conftest import ROOT, python_env
from synthetic import Synth

from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.diagnosis.fp8 import casts, headroom, layer_headroom
from ampdoctor.runfile import schema, store
from ampdoctor.runfile.schema import Fp8Format, Kind, Recipe, Role

CAST = {"tensorwise": {"scaling": "dynamic", "granularity": "tensorwise",
                       "dtype": "float8_e4m3fn"},
        "rowwise": {"scaling": "dynamic", "granularity": "axiswise", "dtype": "float8_e4m3fn"}}


def layer(recipe: str) -> dict:
    grad = dict(CAST[recipe], dtype="float8_e5m2" if recipe == "tensorwise" else
                "float8_e4m3fn")
    return {"library": "torchao", "recipe": recipe, "emulate": True, "input": CAST[recipe],
            "weight": CAST[recipe], "grad_output": grad, "grad_weight_in_high_precision": False}


def row(tensor, step, role=Role.INPUT, recipe=Recipe.TENSOR, n=1000, amax=1.0, **counts):
    r = schema.empty("fp8", 1)
    r["step"], r["tensor"], r["role"], r["recipe"] = step, tensor, role, recipe
    wide = role == Role.GRAD_OUTPUT and recipe in (Recipe.TENSOR, Recipe.DELAYED)
    r["format"] = Fp8Format.E5M2 if wide else Fp8Format.E4M3
    r["sample_n"], r["numel"], r["amax"], r["sqnr_db"] = n, n, amax, 30.0
    r["scale"] = (57344.0 if wide else 448.0) / max(amax, 1e-12)
    for name in ("zeros", "flushed", "subnormal", "saturated"):
        r[name] = 0
    for key, value in counts.items():
        r[key] = value
    return r


def run_with(rows, fp8=("fc1", "fc2"), recipe="tensorwise", n=6):
    s = Synth(n, dtype="bfloat16", scaler=False, every=1)
    for name in ("fc1", "fc2"):
        s.tensor(Kind.OUTPUT, name)
    s.meta["fp8_layers"] = {name: layer(recipe) for name in fp8}
    run = s.run()
    run.fp8 = store.Table(np.concatenate(rows), name="fp8")
    return run


def healthy(steps=range(6), recipe=Recipe.TENSOR):
    return [row(t, s, role, recipe) for s in steps for t in (0, 1) for role in Role]


def test_a_zero_input_on_some_steps_is_flushed_whole():
    rows = healthy(steps=(0, 2, 4, 5)) + [row(1, s, Role.INPUT, amax=0.0, zeros=1000)
                                          for s in (1, 3)]
    rows += [row(t, s, role) for s in (1, 3) for t, role in ((0, Role.INPUT), (0, Role.WEIGHT),
                                                             (0, Role.GRAD_OUTPUT),
                                                             (1, Role.WEIGHT),
                                                             (1, Role.GRAD_OUTPUT))]
    d = diagnose(run_with(rows))
    assert d.verdict == "fp8_flushed"
    assert d.first_bad == {"step": 1, "module": "fc2", "phase": "forward"}
    assert d.fixes[0].id == "fp8_keep_layer" and d.fixes[0].apply == "fp8=tensorwise:keep=fc2"
    assert d.fixes[0].outcome.startswith("not tried: the replay of the saved step does not")


def test_a_clamped_amax_and_a_gradient_flushed_whole_are_the_same_class():
    tiny = [row(1, 2, Role.GRAD_OUTPUT, amax=1e-20, flushed=1000)]
    d = diagnose(run_with(healthy(steps=(0, 1, 3)) + tiny))
    assert d.verdict == "fp8_flushed" and d.first_bad["phase"] == "backward"
    assert "below torchao's floor of 1e-12" in d.summary
    flushed = [row(0, 1, Role.GRAD_OUTPUT, amax=1e-5, zeros=10, flushed=990)]
    d = diagnose(run_with(healthy(steps=(0, 2)) + flushed))
    assert d.verdict == "fp8_flushed" and "every non-zero value cast to 0" in d.summary


def test_a_zero_weight_or_an_input_zero_everywhere_is_not_a_flushed_cast():
    """A weight at exactly 0 is an initialisation (LoRA's B, adaLN-zero), cast exactly; an
    input zero on every sampled step is a layer never fed: its premise fails."""
    zero_weight = [row(1, s, Role.WEIGHT, amax=0.0, zeros=1000) for s in range(3)]
    rest = [row(t, s, role) for s in range(3) for t, role in
            ((0, Role.INPUT), (0, Role.WEIGHT), (0, Role.GRAD_OUTPUT), (1, Role.INPUT),
             (1, Role.GRAD_OUTPUT))]
    assert diagnose(run_with(zero_weight + rest)).verdict == "healthy"
    never = [row(1, s, Role.INPUT, amax=0.0, zeros=1000) for s in range(3)]
    rest = [row(t, s, role) for s in range(3) for t, role in
            ((0, Role.INPUT), (0, Role.WEIGHT), (0, Role.GRAD_OUTPUT), (1, Role.WEIGHT),
             (1, Role.GRAD_OUTPUT))]
    d = diagnose(run_with(never + rest))
    assert d.verdict != "fp8_flushed"
    assert [r["verdict"] for r in d.to_dict()["rejected"]] == ["fp8_flushed"]


def _underflowing(e5m2_flushed: int):
    """fc1's output gradient, row-wise e4m3: 30 % flushed; per tensor e5m2: ``e5m2_flushed``."""
    rows = healthy(recipe=Recipe.ROWWISE) + healthy()
    rows = [r for r in rows if not (r["tensor"][0] == 0 and r["role"][0] == Role.GRAD_OUTPUT)]
    for s in range(6):
        rows.append(row(0, s, Role.GRAD_OUTPUT, Recipe.ROWWISE, flushed=300, subnormal=200))
        rows.append(row(0, s, Role.GRAD_OUTPUT, Recipe.TENSOR, flushed=e5m2_flushed))
    return rows


def test_a_gradient_that_underflows_e4m3_rowwise_not_e5m2_per_tensor():
    d = diagnose(run_with(_underflowing(0), recipe="rowwise"))
    assert d.verdict == "fp8_grad_underflow"
    assert d.first_bad == {"step": 0, "module": "fc1", "phase": "backward"}
    assert [f.id for f in d.fixes] == ["fp8_tensorwise", "fp8_keep_layer"]
    assert d.fixes[0].apply == "fp8=tensorwise"
    assert d.fixes[1].apply == "fp8=rowwise:keep=fc1"
    assert "the format is the cause" in d.summary
    # e5m2 per tensor loses them too: keep the layer in bf16, no other recipe
    d = diagnose(run_with(_underflowing(200), recipe="rowwise"))
    assert d.verdict == "fp8_grad_underflow" and [f.id for f in d.fixes] == ["fp8_keep_layer"]
    assert "than any fp8 format holds" in d.summary


def test_the_same_rows_without_fp8_layers_are_readiness_not_a_failure():
    """A bf16 run's /fp8 rows say what fp8 would do (fp8_readiness), not what it did."""
    d = diagnose(run_with(_underflowing(0), fp8=()))
    assert d.verdict == "healthy"
    # ... and a layer that is not in fp8 is not judged by another's recipe
    d = diagnose(run_with(_underflowing(0), fp8=("fc2",), recipe="rowwise"))
    assert d.verdict == "healthy"


def test_casts_read_the_recipe_each_operand_runs():
    run = run_with(_underflowing(0), recipe="rowwise")
    made, every = casts(run)
    assert {c.recipe for c in made} == {Recipe.ROWWISE}
    assert len(made) == 6 * 2 * 3
    first = made[0]
    assert every.other(first, Recipe.TENSOR).recipe == Recipe.TENSOR


def test_headroom_is_the_binades_left_under_the_delayed_scale():
    amax = np.array([1.0, 2.0, 0.5, 0.0, np.nan])
    scale = np.full(5, 448.0)  # set for an amax of 1
    fmt = np.zeros(5, np.int8)
    h = headroom(amax, scale, fmt)
    assert h[:3].tolist() == [0.0, -1.0, 1.0]
    assert h[3] == np.inf and np.isnan(h[4])
    assert headroom(np.array([1.0]), np.array([57344.0]), np.array([1]))[0] == 0.0


def test_the_fp8_diagnosis_imports_no_torch():
    code = ("import sys; import ampdoctor.diagnosis.rules.fp8, ampdoctor.diagnosis.fp8; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=python_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_layer_headroom_is_the_least_over_its_operands_and_flushed_is_its_own_casts():
    rows = np.concatenate([
        row(0, 1, Role.INPUT, Recipe.DELAYED, amax=2.0, scale=224.0),  # 0 binades
        row(0, 1, Role.GRAD_OUTPUT, Recipe.DELAYED, amax=4.0, scale=57344.0),  # -2
        row(1, 1, Role.INPUT, Recipe.DELAYED, amax=np.nan),  # no scale covers it
        row(1, 1, Role.WEIGHT, Recipe.DELAYED, amax=1.0),
        row(0, 1, Role.INPUT, Recipe.ROWWISE, flushed=100, zeros=500),  # 20 % of 500
        row(0, 1, Role.INPUT, Recipe.TENSOR, flushed=900),  # not fc1's cast: left out
    ])
    found = layer_headroom(rows, {0: "fc1", 1: "fc2"}, {"fc1": layer("rowwise")})
    assert found[(1, "fc1")] == (-2.0, 0.2)
    room, lost = found[(1, "fc2")]
    assert np.isnan(room) and np.isnan(lost)  # fc2 is not in fp8: no share of its own


# -- fp8_drift: against a baseline ------------------------------------------------------------


def _drifting(gap: float, n: int = 60):
    """An fp8 run whose loss ends ``gap`` above its baseline's (from step 20 on), fc1's input
    losing 20 % of its values; and the baseline."""
    rows = healthy(steps=range(0, n, 10))
    rows += [row(0, s, Role.INPUT, flushed=200) for s in range(0, n, 10)]
    rows = [r for r in rows if not (r["tensor"][0] == 0 and r["role"][0] == Role.INPUT
                                    and r["flushed"][0] == 0)]
    run = run_with(rows, n=n)
    base = Synth(n, dtype="bfloat16", scaler=False).run()
    run.steps["loss"] = base.steps["loss"] * np.where(np.arange(n) >= 20, 1 + gap, 1.0)
    return run, base


def test_a_run_in_fp8_that_drifts_from_its_baseline_names_the_layer_that_loses_most():
    run, base = _drifting(0.3)
    d = diagnose(run, baseline=base)
    assert d.verdict == "fp8_drift" and d.first_bad["module"] == "fc1"
    assert d.first_bad["step"] == 20 and d.to_dict()["causes"][0]["verdict"] == "fp8_drift"
    assert "fc1's casts lose the most" in d.summary
    assert d.fixes[0].apply == "fp8=tensorwise:keep=fc1"


def test_no_drift_without_a_baseline_within_the_tolerance_or_against_an_fp8_baseline():
    run, base = _drifting(0.3)
    assert diagnose(run).verdict != "fp8_drift"  # one run has nothing to drift from
    run, base = _drifting(0.01)
    assert diagnose(run, baseline=base).verdict != "fp8_drift"  # within compare's 2 %
    run, base = _drifting(0.3)
    base.meta["fp8_layers"] = {"fc1": layer("tensorwise")}
    d = diagnose(run, baseline=base)
    assert d.verdict != "fp8_drift"
    assert [r["verdict"] for r in d.to_dict()["rejected"]] == ["fp8_drift"]


def test_a_nan_in_the_fp8_run_is_not_a_drift():
    run, base = _drifting(0.3)
    run.steps["loss"][40] = np.nan
    assert diagnose(run, baseline=base).verdict != "fp8_drift"
