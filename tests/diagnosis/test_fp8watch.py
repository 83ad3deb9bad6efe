"""The early warning in fp8 terms (diagnosis/fp8watch.py) on /fp8 rows built in memory (no
torch): the headroom under a delayed scale, the amax's growth, the input's kurtosis, and which
layer is at risk from which sampled step; a steady run has none."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ampdoctor.diagnosis import fp8watch
from ampdoctor.runfile import schema
from ampdoctor.runfile.schema import E4M3_MAX, E5M2_MAX, Fp8Format, Recipe, Role

STEPS = (0, 10, 20, 30, 40, 50)


def rows(amaxes: dict, kurtosis: dict = None, steps=STEPS) -> np.ndarray:
    """DELAYED rows of tensor 0 ("fc") with each role's amax per step and its delayed scale
    from the earlier steps' largest amax (as record/fp8.py's History sets it)."""
    out = []
    for role, values in amaxes.items():
        fmt = Fp8Format.E5M2 if role == Role.GRAD_OUTPUT else Fp8Format.E4M3
        top = E5M2_MAX if fmt == Fp8Format.E5M2 else E4M3_MAX
        for i, (step, a) in enumerate(zip(steps, values)):
            r = schema.empty("fp8", 1)
            seen = max(values[:i], default=a)
            r["step"], r["tensor"], r["role"], r["recipe"] = step, 0, int(role), \
                int(Recipe.DELAYED)
            r["format"], r["amax"], r["scale"] = int(fmt), a, top / seen
            r["kurtosis"] = (kurtosis or {}).get(role, [math.nan] * len(steps))[i]
            out.append(r)
    return np.concatenate(out)


def steady(n=6):
    return {Role.INPUT: [4.0] * n, Role.WEIGHT: [0.1] * n, Role.GRAD_OUTPUT: [1e-3] * n}


def test_a_steady_layer_keeps_its_headroom_and_is_never_at_risk():
    w = fp8watch.watch(rows(steady(), {Role.INPUT: [3.0] * 6}), {0: "fc"})
    fc = w.layers["fc"]
    assert np.allclose(fc.headroom, 0, atol=1e-6) and np.allclose(fc.growth[2:], 0, atol=1e-9)
    assert w.at_risk == [] and w.first_warned == {} and w.step == 50
    assert math.isnan(fc.growth[1])  # two sampled steps: no slope yet


def test_an_outlier_growing_3x_per_sampled_step_is_at_risk_from_the_second_jump():
    """log2(1/3) = -1.58 binades each step after the first: below -1 at steps 10 and 20, so
    at risk from step 20 (one jump is not a trend); its growth is log2(3) per 10 steps."""
    a = steady()
    a[Role.INPUT] = [4.0 * 3 ** i for i in range(6)]
    w = fp8watch.watch(rows(a), {0: "fc"})
    fc = w.layers["fc"]
    assert fc.headroom[1:] == pytest.approx([-math.log2(3)] * 5, abs=1e-5)
    assert fc.first_warned == 20 and fc.risk[1] == [] and fc.risk[2] == ["saturates"]
    assert fc.growth[-1] == pytest.approx(100 * math.log2(3) / 10, rel=1e-6)
    assert fc.growing[-1] == "input"
    assert [x.name for x in w.at_risk] == ["fc"] and "x2 every 6 steps" in fc.why()


def test_one_jump_then_steady_is_no_risk():
    a = steady()
    a[Role.GRAD_OUTPUT] = [1e-3, 4e-3, 4e-3, 4e-3, 4e-3, 4e-3]  # early training: once, x4
    fc = fp8watch.watch(rows(a), {0: "fc"}).layers["fc"]
    assert fc.headroom[1] == pytest.approx(-2, abs=1e-5) and fc.first_warned is None


def test_a_high_kurtosis_input_is_at_risk_and_a_weights_or_gradients_is_not_counted():
    k = {Role.INPUT: [3, 3, 20, 60, 200, 250], Role.GRAD_OUTPUT: [500] * 6}
    w = fp8watch.watch(rows(steady(), k), {0: "fc"})
    fc = w.layers["fc"]
    assert list(fc.kurtosis) == [3, 3, 20, 60, 200, 250]
    assert fc.first_warned == 30 and fc.risk[-1] == ["outlier"]
    assert w.to_dict()["at_risk"][0]["kurtosis"] == 250


def test_a_file_before_format_5_reads_no_kurtosis_and_judges_the_headroom_alone():
    a = steady()
    a[Role.WEIGHT] = [0.1 * 4 ** i for i in range(6)]
    w = fp8watch.watch(rows(a), {0: "fc"})
    assert np.isnan(w.layers["fc"].kurtosis).all() and w.first_warned == {"fc": 20}
    assert w.layers["fc"].at()["kurtosis"] is None


def test_a_non_finite_amax_is_at_risk_and_a_skipped_steps_gradient_is_left_out():
    a = steady()
    a[Role.GRAD_OUTPUT] = [1e-3, 1e-3, math.inf, 1e-3, 1e-3, 1e-3]
    fc = fp8watch.watch(rows(a), {0: "fc"}).layers["fc"]
    assert math.isnan(fc.headroom[2]) and fc.risk[2] == ["saturates"]
    assert "non-finite" in fc.why(2)
    fc = fp8watch.watch(rows(a), {0: "fc"}, skipped=[20]).layers["fc"]
    assert fc.first_warned is None


def test_other_recipes_and_unnamed_tensors_are_ignored():
    r = rows(steady())
    other = r.copy()
    other["recipe"] = int(Recipe.TENSOR)
    other["amax"] *= 1000
    w = fp8watch.watch(np.concatenate([r, other]), {0: "fc"})
    assert np.allclose(w.layers["fc"].headroom, 0, atol=1e-6)
    assert fp8watch.watch(r, {}).layers == {}
    assert fp8watch.watch(schema.empty("fp8"), {0: "fc"}).step is None
