"""A run in fp8 measured against itself (``rules/fp8own.py``) and a delayed scale that saturates
(``rules/fp8.py``), on runs built in memory (no torch): a tensor mostly flushed by one outlier,
a gradient's tail that is no underflow, the fp8 trial's high-precision re-run read as a drift
without a baseline, and the neighbours each must not be confused with."""

from __future__ import annotations

import json

import numpy as np
from synthetic import Synth
from test_fp8verdicts import healthy, layer, row, run_with

from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.runfile import store
from ampdoctor.runfile.schema import Event, Kind, Recipe, Role


def _effect(grad_error, loss_change=None, output_term=None):
    out = {"loss": None, "loss_change": loss_change, "grad_error": grad_error,
           "grad_cosine": 0.9, "worst_param": "fc1.weight", "worst_param_error": grad_error}
    if output_term is not None:
        out["output_term"] = output_term
    return out


def _own(as_recorded, fc1, fc2, fc1_rowwise=None):
    layers = {"fc1": {"high_precision": fc1}, "fc2": {"high_precision": fc2}}
    if fc1_rowwise is not None:
        layers["fc1"]["rowwise"] = fc1_rowwise
    return {"loss": None, "as_recorded": as_recorded, "layers": layers,
            "thresholds": {"grad_error": 0.1, "loss_change": 0.01}}


def with_trial(rows, own, n=6, step=4):
    """``run_with(rows)`` with an fp8 trial on ``step`` whose ``own`` re-runs are these."""
    s = Synth(n, dtype="bfloat16", scaler=False, every=1)
    for name in ("fc1", "fc2"):
        s.tensor(Kind.OUTPUT, name)
    s.meta["fp8_layers"] = {name: layer("tensorwise") for name in ("fc1", "fc2")}
    s.event(n - 1, Event.FP8_TRIAL, json.dumps({"step": step, "own": own}), value=5)
    run = s.run()
    run.fp8 = store.Table(np.concatenate(rows), name="fp8")
    return run


def _sink(rowwise_flushed=60, steps=range(6)):
    """fc1's input per tensor: 960 of 1000 values flushed (one outlier took the scale);
    row-wise, ``rowwise_flushed``."""
    rows = [r for r in healthy(steps=steps) + healthy(steps=steps, recipe=Recipe.ROWWISE)
            if not (r["tensor"][0] == 0 and r["role"][0] == Role.INPUT)]
    for s in steps:
        rows.append(row(0, s, Role.INPUT, amax=1e6, flushed=960))
        rows.append(row(0, s, Role.INPUT, Recipe.ROWWISE, amax=1e6, flushed=rowwise_flushed))
    return rows


def test_a_tensor_mostly_flushed_by_one_outlier_is_fp8_flushed_with_rowwise_first():
    d = diagnose(run_with(_sink()))
    assert d.verdict == "fp8_flushed" and d.causes[0]["kind"] == "mostly"
    assert d.first_bad == {"step": 0, "module": "fc1", "phase": "forward"}
    assert "96% of its non-zero values cast to 0" in d.summary
    assert [f.id for f in d.fixes] == ["fp8_rowwise", "fp8_keep_layer"]
    assert d.fixes[0].apply == "fp8=rowwise" and not d.fixes[0].tried
    # row-wise loses as much: the one scale is not the cause, the layer stays in bf16
    d = diagnose(run_with(_sink(rowwise_flushed=900)))
    assert d.verdict == "fp8_flushed" and [f.id for f in d.fixes] == ["fp8_keep_layer"]


def test_a_few_values_flushed_are_not_mostly_flushed():
    """Half is the line: 40 % flushed (and a tensor wholly fine) stays healthy here."""
    rows = [r for r in _sink() if not (r["tensor"][0] == 0 and r["role"][0] == Role.INPUT
                                       and r["recipe"][0] == Recipe.TENSOR)]
    rows += [row(0, s, Role.INPUT, amax=1e6, flushed=400) for s in range(6)]
    assert diagnose(run_with(rows)).verdict == "healthy"


def test_the_trial_tries_the_fixes_of_a_mostly_flushed_tensor_on_the_saved_step():
    own = _own(_effect(0.93), fc1=_effect(0.86), fc2=_effect(0.9), fc1_rowwise=_effect(0.25))
    d = diagnose(with_trial(_sink(), own))
    assert d.verdict == "fp8_flushed" and d.causes[0]["kind"] == "mostly"
    rowwise, keep = d.fixes
    assert rowwise.tried and rowwise.proven is True and "25.0% off" in rowwise.outcome
    assert keep.tried and keep.proven is False and "86.0% off" in keep.outcome
    # the lost values move nothing on the saved step: the premise fails, no verdict
    own = _own(_effect(0.04), fc1=_effect(0.03), fc2=_effect(0.04))
    d = diagnose(with_trial(_sink(), own))
    assert d.verdict != "fp8_flushed"
    assert "fp8_flushed" in [r["verdict"] for r in d.to_dict()["rejected"]]


def test_a_gradient_tail_below_e4m3_is_not_underflow():
    """blind7's padded tagger: the softmax gradient's improbable classes, 3.3 % flushed and
    5.5 % subnormal row-wise (e5m2 per tensor loses 1.8 % too): a tail, not a bulk."""
    rows = [r for r in healthy(recipe=Recipe.ROWWISE) + healthy()
            if not (r["tensor"][0] == 1 and r["role"][0] == Role.GRAD_OUTPUT)]
    for s in range(6):
        rows.append(row(1, s, Role.GRAD_OUTPUT, Recipe.ROWWISE, zeros=425, flushed=20,
                        subnormal=33))
        rows.append(row(1, s, Role.GRAD_OUTPUT, Recipe.TENSOR, zeros=425, flushed=11))
    assert diagnose(run_with(rows, recipe="rowwise")).verdict == "healthy"
    rows = [r for r in rows if not (r["tensor"][0] == 1 and r["role"][0] == Role.GRAD_OUTPUT
                                    and r["recipe"][0] == Recipe.ROWWISE)]
    rows += [row(1, s, Role.GRAD_OUTPUT, Recipe.ROWWISE, zeros=425, flushed=20, subnormal=60)
             for s in range(6)]  # a tenth at the bottom: a gradient squeezed, underflow
    assert diagnose(run_with(rows, recipe="rowwise")).verdict == "fp8_grad_underflow"


def test_without_a_baseline_the_trial_high_precision_rerun_is_a_drift():
    own = _own(_effect(1.12, 1.37), fc1=_effect(0.76, 1.23), fc2=_effect(0.81, 0.11))
    d = diagnose(with_trial(healthy(), own))
    assert d.verdict == "fp8_drift" and d.causes[0]["kind"] == "self" and d.confidence == 0.5
    assert d.first_bad == {"step": 4, "module": "fc2", "phase": "backward"}  # fc2 kept: 11 %
    assert "112.0% off and the loss by +137.0%" in d.summary
    assert d.fixes[0].id == "fp8_keep_layer" and d.fixes[0].tried


def test_the_loss_change_to_first_order_where_the_loss_was_not_recomputed():
    """The trial backpropagates the recorded output gradient g when the training code computed
    the loss: sum <g, y> differs by ``output_term``, read over the step's recorded loss."""
    run = with_trial(healthy(), _own(_effect(0.057, output_term=0.0), fc1=_effect(0.05),
                                     fc2=_effect(0.03)))
    loss = float(run.steps["loss"][4])
    assert diagnose(run).verdict == "healthy"  # 5.7 % of the gradient, no loss change
    run = with_trial(healthy(), _own(_effect(0.057, output_term=1.4 * loss),
                                     fc1=_effect(0.05, output_term=1.1 * loss),
                                     fc2=_effect(0.03, output_term=0.1 * loss)))
    d = diagnose(run)
    assert d.verdict == "fp8_drift" and "+140.0% (to first order" in d.summary
    assert d.first_bad["module"] == "fc2"


def test_a_healthy_fp8_step_moves_the_gradient_less_than_a_drift():
    """blind7's healthy two-branch classifier: 18 % of the gradient, loss -1.1 %."""
    own = _own(_effect(0.18, -0.011), fc1=_effect(0.09, 0.013), fc2=_effect(0.11, -0.013))
    assert diagnose(with_trial(healthy(), own)).verdict == "healthy"


def _delayed(saturated: int, current_saturated: int = 0, jump: float = 8.0):
    """fc2's input, cast with a delayed scale, clamps ``saturated`` values on step 3, its amax
    ``jump`` x the earlier steps'."""
    rows = [r for r in healthy() + healthy(recipe=Recipe.DELAYED)
            if not (r["tensor"][0] == 1 and r["role"][0] == Role.INPUT)]
    for s in range(6):
        amax = jump if s >= 3 else 1.0
        rows.append(row(1, s, Role.INPUT, Recipe.DELAYED, amax=amax,
                        saturated=saturated if s == 3 else 0))
        rows.append(row(1, s, Role.INPUT, Recipe.TENSOR, amax=amax,
                        saturated=current_saturated if s == 3 else 0))
    return rows


def _delayed_layers():
    cast = {"scaling": "delayed", "granularity": "tensorwise", "dtype": "float8_e4m3fn"}
    out = layer("tensorwise")
    return dict(out, recipe="custom", input=cast, weight=cast,
                grad_output=dict(cast, dtype="float8_e5m2"))


def test_a_delayed_scale_behind_an_amax_jump_saturates():
    run = run_with(_delayed(saturated=40))
    run.meta["fp8_layers"] = {"fc1": layer("tensorwise"), "fc2": _delayed_layers()}
    d = diagnose(run)
    assert d.verdict == "fp8_saturated" and d.causes[0]["kind"] == "amax_jump"
    assert d.first_bad == {"step": 3, "module": "fc2", "phase": "forward"}
    assert "4.00% of its values were clamped" in d.summary and "jumped 8x" in d.summary
    assert [f.id for f in d.fixes] == ["fp8_current_scaling", "fp8_keep_layer"]


def test_current_scaling_never_saturates_and_a_tensor_clamped_under_it_too_is_not_a_lag():
    # the same rows for a layer cast with its current amax: the delayed rows are readiness
    run = run_with(_delayed(saturated=40))
    assert diagnose(run).verdict == "healthy"
    run = run_with(_delayed(saturated=40, current_saturated=40))
    run.meta["fp8_layers"] = {"fc1": layer("tensorwise"), "fc2": _delayed_layers()}
    d = diagnose(run)
    assert d.verdict != "fp8_saturated"
    assert "fp8_saturated" in [r["verdict"] for r in d.to_dict()["rejected"]]
