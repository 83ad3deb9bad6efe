"""Fixes proven on the saved step, on runs built in memory (no torch): what the replay's trials
(a snapshot's ``trials``) and the loss's fp32 check (``Event.LOSS_SINGULAR``, a snapshot's
``loss_singular_fp32``) make of each fix's ``tried``, ``outcome`` and ``finite``, of the
evidence, and of the fixes' order (``diagnosis/proofs.py``, ``diagnosis/singular.py``)."""

import json

import numpy as np
from synthetic import Synth

import ampdoctor
from ampdoctor.diagnosis import proofs
from ampdoctor.diagnosis.fixes import Fix
from ampdoctor.render.diagnosis import fix_lines
from ampdoctor.runfile.schema import DType, Event


def fix_ids(d):
    return [fx.id for fx in d.fixes]


def tried(finite, loss=2.31, first="", **more):
    return {"tried": True, "finite": finite, "loss": loss, "first": first, "step": 3, **more}


def attention_run(trials):
    """An unstable op in blocks.3.attn, replayed at steps 3-5; the first replay's trials."""
    s = Synth(30)
    s.skip(range(3, 30), loss_nan=True)
    for step in (3, 4, 5):
        detail = {"trials": trials} if step == 3 else {}
        s.snapshot(step, "forward", "blocks.3.attn", "Attention", fp32_finite=1,
                   fp32_absmax=7.1e4, **detail)
    return ampdoctor.diagnose(s.run())


# The run's losses before step 3 are 2, 1.967 and 1.933 (Synth's falling loss).
IN_RANGE = "with this fix, step 3 is finite (loss 2.31; the run's losses before it: 1.933 to 2)"


def test_a_trial_says_on_its_fix_and_in_the_evidence_what_it_did():
    d = attention_run({"fp32_island": tried(True), "use_bf16": tried(False, first="backward")})
    assert d.verdict == "unstable_op" and fix_ids(d) == ["fp32_island", "scale_attention",
                                                         "use_bf16"]
    island, attention, bf16 = d.fixes
    assert (island.tried, island.finite) == (True, True)
    assert island.outcome == IN_RANGE and island.proven is True
    assert (attention.tried, attention.finite) == (False, None)
    assert attention.outcome.startswith("not tried")
    assert (bf16.tried, bf16.finite) == (True, False)
    assert bf16.outcome == "still non-finite at step 3 (in the backward): not enough on its own"
    lines = {e.key: e.text for e in d.evidence}
    assert lines["trial_fp32_island"] == f"tried fp32_island on the saved step: {IN_RANGE}"
    assert "not enough on its own" in lines["trial_use_bf16"]
    assert f"tried: {IN_RANGE}" in fix_lines(island)
    out = d.to_dict()["fixes"][0]
    assert (out["tried"], out["finite"], out["outcome"]) == (True, True, island.outcome)


def test_the_verdicts_first_fix_gives_way_only_to_a_trial_that_refutes_it():
    # untried or proven, the verdict's own first fix stays first
    d = attention_run({"use_bf16": tried(True)})
    assert fix_ids(d) == ["fp32_island", "use_bf16", "scale_attention"]
    # refuted: the fixes a trial made finite first, then the untried, then the refuted
    d = attention_run({"fp32_island": tried(False, first="forward"), "use_bf16": tried(True)})
    assert fix_ids(d) == ["use_bf16", "scale_attention", "fp32_island"]
    assert "(in the forward)" in d.fixes[-1].outcome


def test_ranked_keeps_each_group_in_the_verdicts_order():
    def fx(i, was_tried=False, finite=None):
        return Fix(i, "", tried=was_tried, finite=finite)

    fixes = [fx("a"), fx("b", True, False), fx("c"), fx("d", True, True), fx("e", True, True)]
    assert [f.id for f in proofs.ranked(fixes)] == ["a", "d", "e", "c", "b"]
    assert [f.id for f in proofs.ranked([fx("a", True, False), fx("b")])] == ["b", "a"]
    assert proofs.ranked([]) == []


def test_a_fix_not_tried_says_why():
    d = attention_run({"use_bf16": {"tried": False, "note": "the weights are half"}})
    bf16 = d.fixes[-1]
    assert bf16.outcome == "not tried: the weights are half" and not bf16.tried
    assert not any(e.key.startswith("trial_") for e in d.evidence)
    assert not any(line.startswith("tried:") for line in fix_lines(bf16))


def test_a_trial_finite_only_at_a_lower_scale_says_so():
    d = attention_run({"fp32_island": tried(True, at_scale=1.0, recorded_scale=65536.0)})
    assert d.fixes[0].finite and "at loss scale 1 (at the recorded 65536 its gradients " \
        "overflow fp16" in d.fixes[0].outcome


def test_trials_of_a_replay_before_the_failure_are_not_its():
    s = Synth(30)
    s.skip([0])  # GradScaler's first calibration, replayed, tried
    s.snapshot(0, "forward", "blocks.3.attn", "Attention", fp32_finite=1,
               trials={"fp32_island": tried(False, first="backward")})
    s.skip(range(10, 30), loss_nan=True)
    s.snapshot(10, "forward", "blocks.3.attn", "Attention", fp32_finite=1, fp32_absmax=7e4)
    d = ampdoctor.diagnose(s.run())
    assert d.first_bad["step"] == 10 and fix_ids(d)[0] == "fp32_island"
    assert not d.fixes[0].tried


# ---------------------------------------------------------------------------------------------
# the loss's backward at the failing values in fp32


def loss_backward_run(singular=None, at=14, handwritten=True):
    """Probabilities saturating in fp16: skipping from step 12 on, every loss finite; the
    replay of step 12 found the loss's backward non-finite."""
    s = Synth(150)
    s.set("loss_dtype", DType.FLOAT16 if handwritten else DType.FLOAT32)
    s.skip(range(12, 150, 3))
    loss = {"dtype": "float16", "value": 0.4, "grad_fp32": 65536.0, "grad": 65536.0,
            "grad_nonfinite": False}
    note = {"tried": False, "note": "the loss is written by hand"}
    trials = {"loss_on_logits": note, "loss_in_fp32": note} if handwritten else {
        "loss_on_logits": tried(True, step=12), "loss_in_fp32": tried(False, first="backward",
                                                                      step=12)}
    s.snapshot(12, "loss", output_grad_nonfinite=True, loss_nonfinite=False, loss=loss,
               output_grad={"nonfinite": 3, "numel": 64, "finite_absmax": 2.5,
                            "output_values": [1.0]}, trials=trials,
               **({} if handwritten or singular is None else {"loss_singular_fp32": singular}))
    if handwritten and singular is not None:
        s.event(at, Event.LOSS_SINGULAR, json.dumps({"ops": singular}),
                value=singular[0]["fp32"]["nonfinite"])
    return ampdoctor.diagnose(s.run())


POW = {"op": "pow", "node": "PowBackward0", "exponent": 0.5, "points": [0.0],
       "dtype": "float16", "numel": 64, "at_point": 3, "run": {"nonfinite": 3, "largest": 22.6},
       "fp32": {"nonfinite": 3, "largest": 22.6}, "nearest": 0.00048828125,
       "eps_nearest": 0.00048828125, "eps": 0.00049, "clamped": {"nonfinite": 0,
                                                                 "largest": 22.6}}
LOG = {"op": "log", "node": "LogBackward0", "exponent": None, "points": [0.0],
       "dtype": "float16", "numel": 64, "at_point": 0, "run": {"nonfinite": 0, "largest": 511.5},
       "fp32": {"nonfinite": 0, "largest": 511.5}, "nearest": 0.001955, "eps": 0.002,
       "clamped": {"nonfinite": 0, "largest": 511.5}}


def test_a_loss_singular_in_fp32_too_gets_the_clamp_first():
    d = loss_backward_run([POW, LOG])
    assert d.verdict == "fp16_loss" and d.causes[0]["kind"] == "loss_backward"
    assert fix_ids(d)[:3] == ["clamp_loss_input", "loss_on_logits", "loss_in_fp32"]
    assert "pow(x, 0.5) in the loss reaches the point where its derivative is infinite, in " \
        "fp32 too" in d.summary
    clamp = d.fixes[0]
    assert clamp.values == {"eps": 0.00049} and "x.clamp(min=4.9e-4) ** 0.5" in clamp.snippet
    assert "at step 14" in clamp.source and "float16" in clamp.source
    assert (clamp.tried, clamp.finite) == (True, True) and "eps=4.9e-04" in clamp.outcome
    assert clamp.apply is None and clamp.apply_note == "the loss's code must change"
    text = next(e.text for e in d.evidence if e.key == "loss_singular_fp32")
    assert text.startswith("at step 14 the input of pow(x, 0.5) in the loss")
    assert "exactly 0 at 3 of 64 values" in text and "0.5 * x ** -0.5" in text
    assert "fp32 too" in text and "in the loss's formula" in text
    assert d.fixes[1].outcome == "not tried: the loss is written by hand"


def test_a_loss_finite_in_fp32_keeps_precision_first():
    d = loss_backward_run([LOG])
    assert fix_ids(d)[:2] == ["loss_on_logits", "loss_in_fp32"]
    assert "clamp_loss_input" not in fix_ids(d)
    text = next(e.text for e in d.evidence if e.key == "loss_singular_fp32")
    assert "comes within 0.001955 of 0" in text and "not singular in fp32" in text
    assert "backward is singular" not in d.summary


def test_a_torch_losss_fp32_derivative_decides_too():
    finite = {"nonfinite": 0, "largest": 24.47, "numel": 64, "loss_fns": ["binary_cross_entropy"]}
    d = loss_backward_run(finite, handwritten=False)
    assert fix_ids(d)[:2] == ["loss_on_logits", "use_bf16"] or fix_ids(d)[0] == "loss_on_logits"
    assert d.fixes[0].tried and d.fixes[0].finite
    assert fix_ids(d)[-1] == "loss_in_fp32" and d.fixes[-1].finite is False
    text = next(e.text for e in d.evidence if e.key == "loss_singular_fp32")
    assert "binary_cross_entropy recomputed in fp32" in text and "at most 24.47" in text
    singular = dict(finite, nonfinite=5)
    d = loss_backward_run(singular, handwritten=False)
    assert fix_ids(d)[0] == "clamp_loss_input" and not d.fixes[0].tried
    assert "binary_cross_entropy(p, y)" in d.fixes[0].snippet and d.fixes[0].values == {}


def test_a_check_before_the_failure_is_not_its():
    d = loss_backward_run([POW], at=5)  # a calibration skip's reading, before step 12
    assert fix_ids(d)[0] == "loss_on_logits"
    assert not any(e.key == "loss_singular_fp32" for e in d.evidence)


def test_an_unreadable_check_is_passed_by():
    s = Synth(150)
    s.set("loss_dtype", DType.FLOAT16)
    s.skip(range(12, 150, 3))
    s.snapshot(12, "loss", output_grad_nonfinite=True, loss_nonfinite=False,
               loss={"dtype": "float16", "value": 0.4})
    s.event(14, Event.LOSS_SINGULAR, "not json", value=np.nan)
    s.event(15, Event.LOSS_SINGULAR, json.dumps({"ops": [{"error": "RuntimeError: x"}]}))
    d = ampdoctor.diagnose(s.run())
    assert d.verdict == "fp16_loss" and fix_ids(d)[0] == "loss_on_logits"


# A finite step is not a fixed step (issue 28 item 4)


def test_a_finite_trial_whose_loss_is_far_outside_the_runs_range_is_not_proven():
    d = attention_run({"fp32_island": tried(True, loss=1.1e6), "use_bf16": tried(True, loss=1248)})
    island = next(fx for fx in d.fixes if fx.id == "fp32_island")
    bf16 = next(fx for fx in d.fixes if fx.id == "use_bf16")
    assert (island.tried, island.finite, island.proven) == (True, True, False)
    assert island.outcome == ("step 3 is finite but the loss 1.1e+06 is outside the run's range "
                              "[1.933, 2] (its losses before step 3): not proven")
    assert "outside the run's range [1.933, 2]" in bf16.outcome and bf16.proven is False
    assert "with this fix" not in " ".join(e.text for e in d.evidence)
    # neither proves anything: the untried fix ranks above both
    assert fix_ids(d) == ["scale_attention", "fp32_island", "use_bf16"]
    out = d.to_dict()["fixes"]
    assert [f["proven"] for f in out] == [None, False, False]


def test_the_healthy_range_leaves_out_the_spike_into_the_failure():
    s = Synth(30)
    s.steps["loss"][:5] = [2.2, 2.1, 2.0, 1.9, 713.0]
    s.skip(range(5, 30), loss_nan=True)
    s.snapshot(5, "forward", "blocks.3.attn", "Attention", fp32_finite=1, fp32_absmax=7.1e4,
               trials={"fp32_island": tried(True, loss=500.0)})
    d = ampdoctor.diagnose(s.run())
    island = next(fx for fx in d.fixes if fx.id == "fp32_island")
    assert island.proven is False and "[1.9, 2.2]" in island.outcome


def test_no_loss_before_the_failure_leaves_the_trial_unjudged_and_says_so():
    s = Synth(30)
    s.skip(range(0, 30), loss_nan=True)
    s.snapshot(0, "forward", "blocks.3.attn", "Attention", fp32_finite=1, fp32_absmax=7.1e4,
               trials={"fp32_island": dict(tried(True, loss=4.32), step=0)})
    d = ampdoctor.diagnose(s.run())
    island = d.fixes[0]
    assert island.id == "fp32_island" and island.finite and island.proven is None
    assert island.outcome == ("with this fix, step 0 is finite (loss 4.32; the run had no "
                              "finite loss before it)")


def test_trials_that_failed_inside_ampdoctor_say_why_in_the_evidence():
    s = Synth(30)
    s.skip(range(3, 30), loss_nan=True)
    error = "RuntimeError: Trying to backward through the graph a second time"
    s.snapshot(3, "forward", "blocks.3.attn", "Attention", fp32_finite=1, fp32_absmax=7.1e4,
               trials_error=error)
    d = ampdoctor.diagnose(s.run())
    line = next(e for e in d.evidence if e.key == "trials_error")
    assert line.text == ("the fixes could not be tried on the saved step 3: the trials failed "
                         f"inside ampdoctor ({error})")
    s = Synth(30)
    s.skip(range(3, 30), loss_nan=True)
    s.snapshot(3, "forward", "blocks.3.attn", "Attention", fp32_finite=1, fp32_absmax=7.1e4,
               trials={"fp32_island": {"tried": False, "note": f"the trial failed: {error}"}})
    d = ampdoctor.diagnose(s.run())
    assert any(e.key == "trial_fp32_island" and error in e.text for e in d.evidence)
