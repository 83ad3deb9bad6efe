"""The diagnosis rules on runs built in memory (no torch): each class, its discriminator, and
the neighbour it must not be confused with."""

import json
import math

import numpy as np
import pytest
from synthetic import Synth, grow

from ampdoctor.diagnosis import culprit, engine, fixes, misuse, overflow, thresholds, trends
from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.diagnosis.facts import Facts, fp16_rounds_to_zero
from ampdoctor.diagnosis.scale import runs_of
from ampdoctor.runfile.schema import DType, Event, Kind


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
# C3 / C7a / C2: the located first non-finite value


def test_unstable_op_from_replay_with_fp32_check():
    s = Synth(30)
    s.skip(range(30), loss_nan=True)
    for step in (1, 2, 3):
        s.snapshot(step, "forward", "blocks.3.attn", "Attention", fp32_finite=1,
                   fp32_absmax=7.1e4, op={"op": "matmul", "created": ["posinf", "neginf"],
                                          "in_absmax": 240.0})
    d = verdict(s)
    assert d.verdict == "unstable_op" and d.confidence >= 0.85
    assert d.first_bad == {"step": 0, "module": "blocks.3.attn", "phase": "forward"}
    assert fix_ids(d)[:2] == ["fp32_island", "scale_attention"]
    snippet = d.fixes[0].snippet
    assert "for block in model.blocks:" in snippet and "block.attn = FP32Island(block.attn)" \
        in snippet
    assert [c["role"] for c in d.causes] == ["root", "consequence"]
    assert d.causes[1]["verdict"] == "scale_collapse"
    assert any(e.key == "first_nonfinite_op" and "matmul" in e.text for e in d.evidence)


def test_an_op_in_the_models_own_forward_gets_an_op_island():
    s = Synth(20)
    s.meta["roots"] = ["EnergyNet"]
    s.skip(range(20), loss_nan=True)
    s.snapshot(1, "forward", "EnergyNet", "EnergyNet", fp32_finite=1,
               op={"op": "exp", "created": ["posinf"], "in_absmax": 14.0})
    d = verdict(s)
    assert d.verdict == "unstable_op" and "EnergyNet.forward" in d.fixes[0].snippet
    assert "model.EnergyNet" not in d.fixes[0].snippet and "(exp)" in d.fixes[0].text


def test_an_overflow_passed_on_through_a_residual_add_is_blamed_on_its_producer():
    s = Synth(20)
    s.skip(range(20), loss_nan=True)
    chain = ["Enc", "layers.1.ffn", "layers.1.ffn.wo", "layers.2.norm", "layers.2.ffn", "out"]
    s.meta["roots"] = ["Enc"]
    s.snapshot(1, "forward", "layers.2.norm", "LayerNorm", fp32_finite=0, in_absmax=math.inf,
               how="it turned -inf in its inputs into NaN/inf", chain=chain)
    d = verdict(s)
    assert d.verdict == "unstable_op" and d.first_bad["module"] == "layers.1.ffn.wo"
    assert "block.ffn.wo = FP32Island(block.ffn.wo)" in d.fixes[0].snippet
    assert culprit.chain_origin(chain, {"Enc"}) == "layers.1.ffn.wo"


def test_mask_constant_overflow_is_told_from_an_unstable_op():
    s = Synth(20)
    s.skip(range(20), loss_nan=True)
    s.snapshot(1, "forward", "layers.0.self_attn", "SelfAttention", fp32_finite=1,
               op={"op": "mul", "created": ["neginf"], "big_scalar": 1e9, "in_absmax": 1.0})
    d = verdict(s)
    assert d.verdict == "mask_overflow"
    assert d.first_bad["module"] == "layers.0.self_attn"
    assert fix_ids(d)[0] == "safe_mask" and "SelfAttention" in d.fixes[0].text


def test_fully_masked_softmax_rows_are_a_mask_problem():
    op = {"op": "softmax", "created": ["nan"], "in_neginf": True, "in_posinf": False,
          "in_nan": False}
    assert culprit.mask_pattern(op)
    assert culprit.mask_pattern({"op": "matmul", "created": ["posinf", "neginf"]}) is None
    # -inf alone but from a small constant: not a mask constant
    assert culprit.mask_pattern({"op": "add", "created": ["neginf"], "big_scalar": 16.0,
                               "in_absmax": 10.0}) is None


def _growing(s: Synth, until: int) -> Synth:
    """Weights, updates and activations growing on sampled steps before ``until``."""
    for name in ("trunk.0", "trunk.2", "out"):
        s.sampled(range(10, until, 10), Kind.PARAM, f"{name}.weight",
                  norm=grow(5.0, 8.0, until), update=0.05)
        s.sampled(range(10, until, 10), Kind.OUTPUT, name, absmax=grow(2.0, 500.0, until))
    return s


def test_lr_overflow_when_weights_grew_before_the_overflow():
    s = _growing(Synth(120, lr=0.2), 80)
    s.set("lr", np.minimum(np.arange(120) / 40, 1.0) * 0.2)
    s.skip(range(80, 120), loss_nan=True)
    s.snapshot(80, "forward", "trunk.2", "Linear", fp32_finite=0)
    d = verdict(s)
    assert d.verdict == "lr_overflow"
    assert d.first_bad["step"] == 80 and d.first_bad["module"] == "trunk.2"
    # the LR from the run: update ratio 0.05 at LR 0.05..0.2, ~1e-3 per step is healthy
    lower = d.fixes[0]
    assert lower.id == "lower_lr" and lower.values["lr"] == 0.004 and "lr=0.004" in lower.snippet
    assert lower.values["lr_factor"] == 0.02 and lower.apply == "lr_factor=0.02"
    assert "update ratio 0.05" in lower.source
    keys = {e.key for e in d.evidence}
    assert {"weight_norm_growth", "update_ratio", "activation_growth"} <= keys
    assert "lr_at_failure" in keys
    assert "peak 0.2, reached at step 40 after a warmup" in next(
        e.text for e in d.evidence if e.key == "lr_at_failure")


def test_a_warm_up_still_rising_at_the_end_has_no_peak_to_name():
    """The new user's schedule of peak 3 that ended at 1.6: the highest LR recorded is no peak
    'reached after a warmup'."""
    s = _growing(Synth(120, lr=0.2), 80)
    s.set("lr", np.arange(120) / 600)
    s.skip(range(80, 120), loss_nan=True)
    s.snapshot(80, "forward", "trunk.2", "Linear", fp32_finite=0)
    text = next(e.text for e in verdict(s).evidence if e.key == "lr_at_failure")
    assert "still rising in a warm-up when the run ended" in text and "119" in text, text
    assert "after a warmup" not in text


def test_steady_weights_make_it_an_unstable_op_not_the_lr():
    s = Synth(120)
    for name in ("trunk.0", "trunk.2"):
        s.sampled(range(10, 80, 10), Kind.PARAM, f"{name}.weight", norm=5.0, update=1e-3)
        s.sampled(range(10, 80, 10), Kind.OUTPUT, name, absmax=100.0)
    s.skip(range(80, 120), loss_nan=True)
    s.snapshot(80, "forward", "trunk.2", "Linear", fp32_finite=1, fp32_absmax=9e4)
    assert verdict(s).verdict == "unstable_op"


def test_early_lr_ramp_overflow_without_sampled_steps_is_the_lr():
    """A one-cycle ramp overflows at step 6, before any sampled step could show the weights
    growing: the loss and the gradient norm ramping in the steps before are enough, even
    though the culprit is finite in fp32 (an island would only postpone it)."""
    s = Synth(40, lr=1.0, every=100)
    s.set("lr", np.linspace(0.1, 3.0, 40))
    s.set("loss", [0.5, 0.5, 0.49, 0.47, 0.41, 1.4, 14.0], steps=range(7))
    s.set("grad_norm", [0.3, 0.35, 0.42, 0.57, 1.1, 4.2], steps=range(6))
    s.skip(range(6, 40)).nan_loss(range(8, 40))  # gradients overflow first, then the loss
    s.snapshot(6, "forward", "body.4", "Linear", fp32_finite=1, fp32_absmax=3e6)
    d = verdict(s)
    assert d.verdict == "lr_overflow" and d.first_bad["module"] == "body.4"
    assert {"loss_spike", "grad_norm_growth"} <= {e.key for e in d.evidence}


def test_an_lr_ramp_alone_does_not_make_an_op_overflow_the_lr():
    s = Synth(40, lr=1.0, every=100)
    s.set("lr", np.linspace(0.01, 1.0, 40))  # 100x warmup, but the loss and grads are calm
    s.skip(range(30, 40), loss_nan=True)
    s.snapshot(30, "forward", "blocks.0.attn", "Attention", fp32_finite=1, fp32_absmax=9e4)
    assert verdict(s).verdict == "unstable_op"
    # the same ramp with the loss blowing up right before the overflow: the LR's doing
    s.set("loss", [2.0, 9.0, 30.0], steps=[27, 28, 29])
    d = verdict(s)
    assert d.verdict == "lr_overflow"
    assert {"loss_spike", "lr_rise"} <= {e.key for e in d.evidence}


def test_lr_overflow_located_from_sampled_steps_without_a_replay():
    s = _growing(Synth(120), 80)
    s.skip(range(80, 120), loss_nan=True)
    s.sampled([90], Kind.OUTPUT, "trunk.2", nonfinite=2, absmax=math.inf)
    d = verdict(s)
    assert d.verdict == "lr_overflow" and d.first_bad["module"] == "trunk.2"


def test_poisoned_weights_are_not_one_ops_overflow():
    s = Synth(30, scaler=False, dtype="bfloat16")
    s.nan_loss(range(10, 30)).nan_grad(range(10, 30))
    s.sampled([0, 5], Kind.PARAM, "fc.weight", norm=1.0, update=0.05)  # one growth signal
    s.snapshot(10, "forward", "fc", "Linear", fp32_finite=0, weights_nonfinite=["weight"])
    assert verdict(s).verdict not in ("unstable_op", "lr_overflow")


def test_backward_culprit_is_an_unstable_op_in_backward():
    s = Synth(40)
    s.skip(range(10, 40))  # loss finite, gradients NaN, every step
    s.snapshot(10, "backward", "loss_head.focal", "FocalLoss", fp32_finite=1)
    d = verdict(s)
    assert d.verdict == "unstable_op" and d.first_bad["phase"] == "backward"


def test_nonfinite_in_fp32_too_without_growth_is_not_claimed():
    s = Synth(30, scaler=False)
    s.nan_loss(range(10, 30)).nan_grad(range(10, 30))
    s.snapshot(10, "forward", "encoder.0", "Linear", fp32_finite=0)
    d = verdict(s)
    assert d.verdict == "nonfinite" and d.confidence <= 0.4
    assert d.first_bad["module"] == "encoder.0"


# ---------------------------------------------------------------------------------------------
# C5, C10, C4, C7b


def test_bad_input_from_the_replay():
    s = Synth(64)
    s.skip([15, 39], loss_nan=True)
    s.snapshot(15, "input", "Regressor", "Regressor")
    s.snapshot(39, "input", "Regressor", "Regressor")
    d = verdict(s)
    assert d.verdict == "bad_input" and d.first_bad == {"step": 15, "module": "Regressor",
                                                         "phase": "input"}
    assert fix_ids(d) == ["check_data"]


def test_bad_input_from_a_sampled_input_audit():
    s = Synth(50)
    s.skip([20], loss_nan=True)
    s.sampled([20], Kind.INPUT, "Net:args.0", nonfinite=1, nan=3)
    assert verdict(s).verdict == "bad_input"


def test_state_poisoning_when_buffers_stay_nonfinite_and_weights_do_not():
    s = Synth(40)
    s.skip([12], loss_nan=True)
    s.snapshot(12, "input", "BNNet", "BNNet")
    for step in (10, 20, 30):
        bad = step > 12
        s.stat(step, Kind.BUFFER, "features.1.running_var", nonfinite=1 if bad else 0)
        s.stat(step, Kind.PARAM, "features.0.weight", norm=3.0, update=1e-3)
    d = verdict(s)
    assert d.verdict == "state_poisoning"
    assert d.first_bad == {"step": 12, "module": "features.1", "phase": "forward"}
    assert fix_ids(d)[:2] == ["guard_buffers", "check_data"]
    assert any(c["verdict"] == "bad_input" and c["role"] == "also" for c in d.causes)


def test_state_poisoning_from_the_audit_of_a_failing_step():
    s = Synth(40, every=100)
    s.skip([12], loss_nan=True)
    s.snapshot(12, "input", "BNNet", "BNNet")
    tid = s.tensor(Kind.BUFFER, "features.1.running_var")
    s.event(12, Event.NONFINITE_BUFFER, tensor=tid)
    d = verdict(s)
    assert d.verdict == "state_poisoning" and d.first_bad["module"] == "features.1"


def test_a_buffer_finite_again_at_a_later_sample_is_not_poisoned():
    s = Synth(40)
    s.skip([12], loss_nan=True)
    s.snapshot(12, "input", "BNNet", "BNNet")
    tid = s.tensor(Kind.BUFFER, "features.1.running_var")
    s.event(12, Event.NONFINITE_BUFFER, tensor=tid)
    s.stat(20, Kind.BUFFER, "features.1.running_var", nonfinite=0)  # the user reset it
    assert verdict(s).verdict == "bad_input"


def test_buffers_nonfinite_with_weights_nonfinite_is_not_poisoning():
    s = Synth(40)
    s.skip(range(12, 40), loss_nan=True)
    for step in (20, 30):
        s.stat(step, Kind.BUFFER, "bn.running_mean", nonfinite=1)
        s.stat(step, Kind.PARAM, "fc.weight", norm=np.nan)
    assert verdict(s).verdict != "state_poisoning"


def test_adam_eps_on_fp16_weights():
    s = Synth(40, dtype=None, scaler=False, params="float16", optimizer="Adam", eps=1e-8)
    s.set("loss_dtype", DType.FLOAT16)
    s.nan_loss(range(1, 40)).nan_grad(range(1, 40))
    s.snapshot(1, "forward", "embed", "EmbeddingBag", fp32_finite=0)
    d = verdict(s)
    assert d.verdict == "adam_eps" and d.confidence >= 0.85
    assert d.first_bad == {"step": 0, "module": "embed", "phase": "optimizer"}
    assert fix_ids(d)[:2] == ["adam_eps", "fp32_master_weights"]
    assert "torch.optim.Adam(" in d.fixes[0].snippet and "eps=1e-4" in d.fixes[0].snippet


@pytest.mark.parametrize("eps,params", [(1e-4, "float16"), (1e-8, "float32")])
def test_adam_eps_needs_fp16_weights_and_an_eps_fp16_cannot_hold(eps, params):
    s = Synth(40, dtype=None, scaler=False, params=params, optimizer="Adam", eps=eps)
    s.nan_loss(range(1, 40)).nan_grad(range(1, 40))
    assert verdict(s).verdict != "adam_eps"


def test_an_overflowing_op_in_a_half_model_is_not_blamed_on_adam():
    s = Synth(30, dtype=None, scaler=False, params="float16", optimizer="Adam", eps=1e-8)
    s.nan_loss(range(30)).nan_grad(range(30))
    s.snapshot(0, "forward", "energy.exp", "ExpHead", fp32_finite=1, fp32_absmax=1.6e5)
    d = verdict(s)
    assert d.verdict == "unstable_op"
    assert any(c["verdict"] == "adam_eps" and c["role"] == "also" for c in d.causes)


def test_adam_eps_risk_before_any_nan():
    s = Synth(10, dtype=None, scaler=False, params="float16", optimizer="AdamW", eps=1e-8)
    d = verdict(s)
    assert d.verdict == "adam_eps" and d.confidence <= 0.5 and d.first_bad is None


def test_fp16_loss_overflows_with_finite_gradients():
    s = Synth(30)
    s.set("loss_dtype", DType.FLOAT16)
    s.nan_loss(range(30), value=np.inf)
    d = verdict(s)
    assert d.verdict == "fp16_loss" and d.first_bad["phase"] == "loss"
    assert fix_ids(d)[0] == "loss_in_fp32"


def test_finite_fp16_loss_is_a_note_not_a_verdict():
    s = Synth(30)
    s.set("loss_dtype", DType.FLOAT16)
    d = verdict(s)
    assert d.verdict == "healthy" and any("float16" in n for n in d.notes)


@pytest.mark.parametrize("mask_operand,expected", [(False, None), (True, "mask"), (None, "mask")])
def test_a_dense_add_making_minus_inf_is_not_a_mask(mask_operand, expected):
    """Issue 16: a residual add of two large activations is an overflow; an additive mask
    operand (or a file from before the probe recorded it) is a mask."""
    op = {"op": "add", "created": ["neginf"], "in_absmax": 4.0e4, "big_scalar": None}
    if mask_operand is not None:
        op["mask_operand"] = mask_operand
    found = culprit.mask_pattern(op)
    assert (found is not None) == (expected == "mask")


def _loss_snap(s, step, dtype="float32", grad_nonfinite=False, **detail):
    """A replay that found the model finite and the trouble in the loss (_loss_or_nothing)."""
    loss = {"dtype": dtype, "value": 0.4, "grad_fp32": 65536.0,
            "grad": np.inf if grad_nonfinite else 65536.0, "grad_nonfinite": grad_nonfinite}
    detail.setdefault("loss_nonfinite", False)
    return s.snapshot(step, "loss", output_grad_nonfinite=True, loss=loss, **detail)


def test_calibration_skip_of_an_fp16_loss_is_healthy():
    """Issue 16: step 0 skipped because 65536 does not fit the fp16 loss, then 300 clean steps."""
    s = Synth(300)
    s.set("loss_dtype", DType.FLOAT16)
    s.skip([0])
    _loss_snap(s, 0, "float16", grad_nonfinite=True)
    assert verdict(s).verdict == "healthy"


def test_an_fp16_loss_that_overflows_later_says_what_the_replay_saw():
    s = Synth(60)
    s.set("loss_dtype", DType.FLOAT16)
    s.nan_loss(range(30, 60), value=np.inf)
    _loss_snap(s, 30, "float16", loss_nonfinite=True)
    d = verdict(s)
    assert d.verdict == "fp16_loss" and d.first_bad["step"] == 30 and not d.causes[0].get("kind")
    text = next(e.text for e in d.evidence if e.key == "replay_loss_phase")
    assert "the loss (float16) is not" in text


def _loss_backward_run(loss_dtype=DType.FLOAT32):
    """Sigmoid + BCELoss saturating in fp16: skipping from step 12 on, every loss finite."""
    s = Synth(150)
    s.set("loss_dtype", loss_dtype)
    s.skip(range(12, 150, 3))  # the scale falls 46 halvings; no loss is ever non-finite
    return s


def test_loss_backward_overflow_is_the_loss_not_the_model():
    s = _loss_backward_run()
    _loss_snap(s, 12, output_grad={"nonfinite": 3, "numel": 128, "finite_absmax": 2.5,
                                   "output_values": [1.0]})
    d = verdict(s)
    assert d.verdict == "fp16_loss" and d.causes[0]["kind"] == "loss_backward"
    assert d.first_bad == {"step": 12, "module": None, "phase": "loss"}
    assert fix_ids(d)[:2] == ["loss_on_logits", "loss_in_fp32"]
    text = next(e.text for e in d.evidence if e.key == "replay_loss_backward")
    assert "3 of 128" in text and "exactly 1" in text and "loss (0.4, float32)" in text
    assert "the loss is not" not in text


def test_loss_backward_from_a_sampled_root_gradient():
    s = _loss_backward_run(DType.FLOAT16)
    s.sampled([30], Kind.GRAD_OUTPUT, "Classifier", nonfinite=4)
    s.meta["roots"] = ["Classifier"]
    d = verdict(s)
    assert d.verdict == "fp16_loss" and d.causes[0]["kind"] == "loss_backward"
    assert not any(c["verdict"] == "unstable_op" for c in d.causes)


def test_one_loss_backward_overflow_at_a_high_scale_is_calibration():
    s = Synth(150)
    s.skip([40])
    _loss_snap(s, 40)
    assert verdict(s).verdict == "healthy"


# ---------------------------------------------------------------------------------------------
# C6: GradScaler API misuse


def test_clip_before_unscale_from_the_norms_alone():
    s = Synth(40)
    s.set("grad_norm", 0.4)
    s.set("clip_norm", 0.4 * 2.0 ** 16)
    d = verdict(s)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "clip_before_unscale"
    assert fix_ids(d) == ["unscale_before_clip"]
    assert any(e.key == "clip_norm_over_grad_norm" and e.value == pytest.approx(65536)
               for e in d.evidence)


def test_clip_after_unscale_is_healthy():
    s = Synth(40)
    s.set("grad_norm", 0.4)
    s.set("clip_norm", 0.4)
    assert verdict(s).verdict == "healthy"


def test_clip_before_unscale_event():
    s = Synth(40)
    for i in range(40):
        s.event(i, Event.CLIP_BEFORE_UNSCALE)
    d = verdict(s)
    assert d.verdict == "clip_order" and d.confidence >= 0.9 and d.first_bad["step"] == 0


def test_optimizer_step_bypassing_the_scaler():
    s = Synth(20)
    s.event(3, Event.STEP_BYPASSES_SCALER, "SGD")
    d = verdict(s)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "step_bypasses_scaler"
    assert fix_ids(d) == ["use_scaler_step"]


def test_a_gradient_penalty_of_scaled_gradients():
    s = Synth(20)
    for i in range(3, 20):
        s.event(i, Event.SCALED_GRADS_IN_LOSS)
    d = verdict(s)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "scaled_grads_in_loss"
    assert d.first_bad["step"] == 3 and fix_ids(d) == ["unscale_autograd_grad"]
    assert "on 17 steps (first at step 3)" in d.evidence[0].text


def test_scaler_recreated_every_epoch():
    n = 300
    scales = np.full(n, 2.0 ** 16)
    skips = []
    for epoch_start in (0, 100, 200):  # a new scaler: calibration again each epoch
        for k in range(3):
            scales[epoch_start + k] = 2.0 ** (16 - k)
            skips.append(epoch_start + k)
        scales[epoch_start + 3:epoch_start + 100] = 2.0 ** 13
    s = Synth(n).scales(scales)
    s.skip(skips)
    for epoch_start in (100, 200):
        s.event(epoch_start, Event.SCALER_CREATED, value=2.0 ** 16)
    d = verdict(s)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "scaler_recreated"
    assert fix_ids(d) == ["create_scaler_once"]


def _scaler_per_step(n=40):
    """A GradScaler made every step: each starts at 65536 and skips (issue 16, clip_order.py
    --scaler-per-step)."""
    s = Synth(n).scales(np.full(n, 2.0 ** 16))
    s.skip(range(n))
    for i in range(n):
        s.event(i, Event.SCALER_CREATED, value=2.0 ** 16)
    return s


def test_a_backward_overflow_the_scale_explains_is_not_a_second_cause():
    s = _scaler_per_step()
    # fc's backward overflowed at 65536; in fp32 its gradient is 2e5, 3.1 unscaled: it fits
    # fp16 at any scale <= 16384.
    s.snapshot(0, "backward", "fc", "Linear", fp32_finite=1, fp32_absmax=2.0e5)
    d = verdict(s)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "scaler_recreated"
    assert not any(c["verdict"] == "unstable_op" for c in d.causes), str(d)
    assert "fp32_island" not in fix_ids(d)


def test_a_backward_singularity_is_still_a_culprit():
    s = Synth(40)
    s.skip(range(10, 40))
    # fp16 inf, fp32 small: a derivative at a singularity, not the scale
    s.snapshot(10, "backward", "head.clamp", "Clamp", fp32_finite=1, fp32_absmax=30.0)
    d = verdict(s)
    assert d.verdict == "unstable_op" and d.first_bad["module"] == "head.clamp"


def test_a_sampled_overflow_inside_the_recalibration_is_not_listed_as_also():
    s = _scaler_per_step()
    s.sampled([0, 10, 20], Kind.GRAD_OUTPUT, "6", nonfinite=3)
    d = verdict(s)
    assert d.verdict == "clip_order"
    assert not any(c["role"] == "also" for c in d.causes), str(d)


def test_grads_not_zeroed_after_an_overflow():
    s = Synth(40)
    s.skip(range(10, 40))  # loss finite, every step overflows after one bad step
    s.snapshot(10, "none", stale_grads=True)
    d = verdict(s)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "grad_not_zeroed"
    assert fix_ids(d)[0] == "zero_grad_every_step"


@pytest.mark.parametrize("message,expected,kind", [
    ("value cannot be converted to type at::Half without overflow", "mask_overflow", "constant"),
    ("Attempting to unscale FP16 gradients.", "clip_order", "fp16_params_with_scaler"),
    ("unscale_() has already been called on this optimizer since the last update().",
     "clip_order", "call_order"),
    ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.",
     "fp16_loss", "bce"),
])
def test_known_amp_exceptions(message, expected, kind):
    s = Synth(3).exception("RuntimeError", message)
    d = verdict(s)
    assert d.verdict == expected and d.causes[0]["kind"] == kind
    assert any("raised" in n for n in d.notes)


def test_amp_error_before_the_first_step_is_named_not_no_training():
    s = Synth(0).exception("RuntimeError", "value cannot be converted to type at::Half without "
                           "overflow")
    assert verdict(s).verdict == "mask_overflow"


def test_bypass_event_says_more_than_the_error_it_leads_to():
    s = Synth(0)
    s.event(0, Event.STEP_BYPASSES_SCALER, "AdamW")
    s.exception("AssertionError", "No inf checks were recorded prior to update.")
    d = verdict(s)
    assert d.verdict == "clip_order" and fix_ids(d)[0] == "use_scaler_step"


def test_unknown_exception_keeps_the_numeric_verdict():
    s = Synth(30).exception("KeyError", "'label'")
    d = verdict(s)
    assert d.verdict == "healthy" and any("KeyError" in n for n in d.notes)


# ---------------------------------------------------------------------------------------------
# C1, C8a, C9a: trends without a non-finite value


def _underflowing_grads(s: Synth, names, under: int, steps=range(10, 60, 10)):
    for name in names:
        s.sampled(steps, Kind.PARAM_GRAD, name, sub16=under, flush16=under // 4,
                  zeros=under // 4, absmax=1e-5, rms=1e-6)


def test_grad_underflow_without_a_scaler():
    s = Synth(60, scaler=False)
    _underflowing_grads(s, ["encoder.0.weight", "encoder.2.weight", "decoder.0.weight"], 3000)
    d = verdict(s)
    assert d.verdict == "grad_underflow" and d.confidence >= 0.8
    assert d.first_bad["module"].startswith(("encoder", "decoder"))
    assert fix_ids(d) == ["add_grad_scaler", "use_bf16"]


def test_grad_underflow_at_a_low_scale():
    s = Synth(60, init_scale=4.0)
    _underflowing_grads(s, ["emb.weight", "fc.weight"], 3000)
    d = verdict(s)
    assert d.verdict == "grad_underflow" and fix_ids(d)[0] == "raise_init_scale"
    assert "init_scale=4" in d.fixes[0].snippet


def test_fp16_counts_do_not_matter_in_a_bf16_run():
    s = Synth(60, dtype="bfloat16", scaler=False)
    _underflowing_grads(s, ["aux.weight"], 3000)  # subbf16 stays 0
    assert verdict(s).verdict == "healthy"


def test_fp16_without_scaler_not_measured_is_a_low_confidence_warning():
    s = Synth(20, scaler=False, every=100)
    d = verdict(s)
    assert d.verdict == "grad_underflow" and d.confidence < 0.5
    assert any("No sampled step" in n for n in d.notes)


@pytest.mark.parametrize("zeros,sub", [(2048, 0), (3900, 20)])
def test_structural_zeros_are_not_underflow(zeros, sub):
    s = Synth(60)
    # most elements exactly zero (unused embedding rows, dead units), the rest healthy with a
    # few subnormal ones: not underflow
    s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, "embed.weight", zeros=zeros, sub16=sub,
              absmax=10.0, rms=1.0)
    s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, "fc.weight", absmax=10.0, rms=1.0)
    assert verdict(s).verdict == "healthy"


def test_masked_underflow_at_a_healthy_scale():
    s = Synth(60)
    _underflowing_grads(s, ["aux_head.0.weight", "aux_head.2.weight"], 4000)
    for name in ("trunk.0.weight", "cls_head.weight"):
        s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, name, absmax=300.0, rms=50.0)
    d = verdict(s)
    assert d.verdict == "masked_underflow" and d.first_bad["module"] == "aux_head"
    assert fix_ids(d) == ["use_bf16", "rebalance_losses"]
    assert "model.aux_head.parameters()" in d.fixes[1].snippet
    ratio = next(e.value for e in d.evidence if e.key == "grad_rms_ratio")
    assert ratio == pytest.approx(50.0 / 1e-6) and "5e7" in d.fixes[1].snippet


def test_masked_underflow_says_when_the_layer_stopped_moving():
    """Issue 23's seed: the scale high and steady while one layer's gradients underflow, and
    from step 30 on (SGD) its weights no longer move."""
    s = Synth(60, optimizer="SGD")
    _underflowing_grads(s, ["aux_head.0.weight"], 4000)
    s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, "trunk.0.weight", absmax=300.0, rms=50.0)
    s.sampled(range(10, 60, 10), Kind.PARAM, "aux_head.0.weight", norm=3.0,
              update=lambda i: 1e-4 if i < 30 else 1e-9, unchanged=lambda i: 0.1 if i < 30 else 0.9)
    s.sampled(range(10, 60, 10), Kind.PARAM, "trunk.0.weight", norm=3.0, update=1e-3,
              unchanged=0.0)
    d = verdict(s)
    assert d.verdict == "masked_underflow", str(d)
    stopped = next(e for e in d.evidence if e.key == "weights_stopped")
    assert stopped.step == 30 and stopped.module == "aux_head.0"
    assert "from sampled step 30 on (it moved until step 20)" in stopped.text


def test_masked_underflow_says_how_much_less_an_adam_layer_moves():
    s = Synth(60)
    _underflowing_grads(s, ["aux_head.0.weight"], 4000)
    s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, "trunk.0.weight", absmax=300.0, rms=50.0)
    for name, upd in (("aux_head.0.weight", 1e-5), ("trunk.0.weight", 1e-2)):
        s.sampled(range(10, 60, 10), Kind.PARAM, name, norm=3.0, update=upd, unchanged=0.0)
    slow = next(e for e in verdict(s).evidence if e.key == "weights_slow")
    assert slow.value == pytest.approx(1e3, rel=0.01) and "from sampled step 10 to 50" in slow.text


def _aux_flushed(s: Synth, arriving=0.0, grad_output_dtype=DType.FLOAT16, steps=range(0, 60, 20)):
    """The new user's aux_underflow.py: a trunk and a classifier that train, and an auxiliary
    branch whose gradient is exactly 0 on every sampled step, as is the gradient arriving at
    its output (fp16 under autocast, scale 65536)."""
    for name in ("trunk.0", "cls", "aux.0"):
        s.tensor(Kind.OUTPUT, name)
        s.tensor(Kind.GRAD_OUTPUT, name)
        s.tensor_dtypes[(int(Kind.OUTPUT), name)] = DType.FLOAT16  # computed under autocast
        s.tensor_dtypes[(int(Kind.GRAD_OUTPUT), name)] = grad_output_dtype
    s.sampled(steps, Kind.GRAD_OUTPUT, "aux.0", zeros=4096 if not arriving else 0,
              absmax=arriving, rms=arriving)
    for name in ("trunk.0", "cls"):
        s.sampled(steps, Kind.GRAD_OUTPUT, name, absmax=50.0, rms=5.0)
    for name in ("trunk.0.weight", "cls.weight"):
        s.sampled(steps, Kind.PARAM_GRAD, name, absmax=300.0, rms=50.0)
        s.sampled(steps, Kind.PARAM, name, norm=3.0, update=1e-3, unchanged=0.0)
    for name in ("aux.0.weight", "aux.0.bias"):
        s.sampled(steps, Kind.PARAM_GRAD, name, zeros=4096, absmax=0.0, rms=0.0)
        s.sampled(steps, Kind.PARAM, name, norm=3.311, update=0.0, unchanged=0.0)
    return s


def test_a_layer_whose_gradient_flushes_whole_at_a_high_scale_is_masked_underflow():
    """Issue 23's seed asked per layer (the new user's aux_underflow.py, called healthy): the
    aux branch's gradient is exactly 0 on every sampled step although a gradient arrives at it
    (its output's gradient is recorded in fp16, all zeros), the scale is 65536 throughout, and
    its weights do not move."""
    d = verdict(_aux_flushed(Synth(60)))
    assert d.verdict == "masked_underflow" and d.causes[0]["kind"] == "flushed", str(d)
    assert d.first_bad == {"step": 0, "module": "aux.0", "phase": "backward"}
    assert fix_ids(d) == ["use_bf16", "rebalance_losses"]
    flushed = next(e for e in d.evidence if e.key == "flushed_layers")
    assert "aux.0.weight, aux.0.bias" in flushed.text and "exactly 0 on every one of the 3" \
        in flushed.text
    assert "or a loss term weighted by exactly 0" in flushed.text  # it cannot be told apart
    stopped = next(e for e in d.evidence if e.key == "weights_stopped")
    assert "aux.0.weight does not move: its norm is 3.311 at sampled step 0 and still at " \
        "step 40" in stopped.text
    assert "too small to measure" in d.fixes[1].snippet and "~1e6x" not in d.fixes[1].snippet


@pytest.mark.parametrize("case", ["gradient_arrives", "fp32", "one_sample", "dead_layer",
                                  "no_grad_output"])
def test_structural_zero_gradients_are_not_a_flushed_layer(case):
    """A gradient arriving non-zero (units dead beside it), an fp32 gradient, a single sampled
    step (a zero-initialised layer after it), a dead layer downstream, and a frozen layer with
    no gradient arriving at all stay healthy."""
    s = Synth(60)
    if case == "gradient_arrives":
        _aux_flushed(s, arriving=0.5)
    elif case == "fp32":
        _aux_flushed(s, grad_output_dtype=DType.FLOAT32)
    elif case == "one_sample":
        _aux_flushed(s, steps=[0])
    elif case == "dead_layer":
        _aux_flushed(s)
        s.sampled(range(0, 60, 20), Kind.OUTPUT, "aux.1", zeros=4096, absmax=0.0)
    else:
        _aux_flushed(s)
        s.stats = [r for r in s.stats if r["tensor"][0] != s.tensor(Kind.GRAD_OUTPUT, "aux.0")]
    assert verdict(s).verdict == "healthy"


def test_bf16_weights_whose_updates_round_away():
    s = Synth(40, dtype=None, scaler=False, params="bfloat16")
    for name in ("encoder.0.weight", "encoder.3.weight", "tagger.weight"):
        s.sampled(range(10, 40, 10), Kind.PARAM, name, norm=5.0, update=1e-5, unchanged=0.99)
    d = verdict(s)
    assert d.verdict == "lost_updates" and fix_ids(d) == ["fp32_master_weights"]
    assert any(e.key == "unchanged_fraction" and e.value > 0.9 for e in d.evidence)


def test_fp16_weights_under_plain_sgd_lose_their_updates_too():
    """Issue 23: model.half() with SGD, no autocast, no master weights: gradients are normal
    fp16 numbers, but LR x gradient falls below half an ulp of the weights."""
    s = Synth(60, dtype=None, scaler=False, params="float16", optimizer="SGD", lr=0.01)
    s.set("grad_norm", 0.3)
    for name in ("fc1.weight", "fc2.weight", "head.weight"):
        s.sampled(range(0, 60, 10), Kind.PARAM, name, norm=20.0, update=5.7e-5, unchanged=0.86)
        s.sampled(range(0, 60, 10), Kind.PARAM_GRAD, name, zeros=0, absmax=0.05, sub16=0)
    d = verdict(s)
    assert d.verdict == "lost_updates" and fix_ids(d) == ["fp32_master_weights"], str(d)
    assert d.first_bad == {"step": 0, "module": None, "phase": "optimizer"}
    ratio = next(e for e in d.evidence if e.key == "update_ratio")
    assert ratio.value == pytest.approx(5.7e-5, rel=0.01) and "2**-11" in ratio.text
    intended = next(e for e in d.evidence if e.key == "intended_update")
    # LR x |g| / |W|: 0.01 x 0.3 / sqrt(3 x 20**2)
    assert intended.value == pytest.approx(0.01 * 0.3 / math.sqrt(3 * 400), rel=0.01)
    assert "fp16" in d.summary and "11 significant bits" in d.summary
    assert "not_learning" not in [c["verdict"] for c in d.causes]


def test_the_old_id_bf16_precision_is_understood():
    from ampdoctor.diagnosis.verdict import ALIASES, VERDICTS, canonical

    assert canonical("bf16_precision") == "lost_updates" and canonical("healthy") == "healthy"
    assert set(ALIASES.values()) <= set(VERDICTS) and not set(ALIASES) & set(VERDICTS)


def test_fp32_master_weights_with_small_updates_are_fine():
    s = Synth(40, dtype="bfloat16", scaler=False, params="float32")
    s.sampled(range(10, 40, 10), Kind.PARAM, "fc.weight", norm=5.0, update=1e-5, unchanged=0.99)
    assert verdict(s).verdict == "healthy"


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


def test_every_fix_snippet_is_valid_python():
    ctx = fixes.Context(device="cuda", optimizer="AdamW", lr=3e-4, eps=1e-8, init_scale=65536,
                        growth_interval=2000, module="blocks.3.attn", module_type="Attention",
                        autocast="float16", step=12)
    for fx in fixes.make(list(fixes.FIX_IDS), ctx):
        compile(fx.snippet.replace("...\n", "pass\n"), fx.id, "exec")
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
    s = _growing(Synth(120), 80)
    _underflowing_grads(s, ["a.weight", "b.weight"], 3000, steps=range(10, 80, 10))
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


# ---------------------------------------------------------------------------------------------
# Early LR blow-ups seen on real stacks (fixtures/stacks/nanogpt_train.py at LR 30 and 1000)


def test_a_step_that_replaced_the_weights_is_the_lr_not_one_op():
    """fp16 nanoGPT at LR 30: one Adam step at LR 1.4 moved every weight by more than its own
    size, and step 1 overflows. No ramp had time to show, and the culprit is finite in fp32,
    but the weights were not steady: lr_overflow, not an fp32 island."""
    def run(update):
        s = Synth(30, every=100)  # only step 0 is sampled, as with the default interval
        s.sampled([0], Kind.PARAM, "transformer.h.0.mlp.weight", norm=3.0, update=update)
        s.skip(range(1, 30))
        s.snapshot(1, "forward", "transformer.h.0.attn.c_proj", "Linear", fp32_finite=1,
                   fp32_absmax=2.2e6)
        return verdict(s)
    d = run(update=12.0)
    assert d.verdict == "lr_overflow"
    assert d.first_bad == {"step": 1, "module": "transformer.h.0.attn.c_proj",
                           "phase": "forward"}
    replaced = next(e for e in d.evidence if e.key == "weights_replaced")
    assert replaced.step == 0 and "10x or more" in replaced.text
    assert fix_ids(d)[0] == "lower_lr"
    assert run(update=0.05).verdict == "unstable_op"  # a sane first step: the op's overflow


def test_without_a_scaler_the_first_applied_nonfinite_gradient_starts_the_failure():
    """fp32 nanoGPT at LR 1000: gradients are inf at step 4 and applied (no scaler to skip
    them), the loss is NaN from step 6 and the replays see poisoned weights. The failure
    starts at step 4, and the poisoned module is not named as where it began."""
    s = Synth(20, dtype=None, scaler=False, every=100)
    s.sampled([0], Kind.PARAM, "transformer.h.0.mlp.weight", norm=3.0, update=15.0)
    s.set("loss", [2.9, 2.5e4, 9e5, 7.5e6, 2.9e8, 5e9], steps=range(6))
    s.set("grad_norm", [0.67, 1.9e3, 1.2e10, 9.7e14], steps=range(4))
    s.nan_grad(range(4, 20)).nan_loss(range(6, 20))
    s.snapshot(7, "forward", "transformer.wte", "Embedding", fp32_finite=0,
               weights_nonfinite=["weight"])
    f = Facts(s.run())
    assert f.failure_step == 4
    d = verdict(s)
    assert d.verdict == "lr_overflow" and d.first_bad["step"] == 4
    assert d.first_bad["module"] is None


def test_a_blowup_in_the_first_steps_is_the_lr():
    """HF Trainer with SGD at LR 1000: the loss 1.3 -> 237 -> 5.8e7 and the gradient norm
    1.8 -> 421 -> 4.5e12 in three steps, then NaN; the culprit is non-finite in fp32 too. Too
    short for the usual ramp checks, but both grew 100x: the LR's doing. A calmer start, or
    only one of the two growing, is not enough."""
    def run(loss, grad):
        s = Synth(12, dtype="bfloat16", scaler=False, every=100)
        s.set("loss", loss, steps=range(4))
        s.set("grad_norm", grad, steps=range(4))
        s.nan_loss(range(4, 12)).nan_grad(range(4, 12))
        s.snapshot(4, "forward", "transformer.h.0.attn.c_proj", "Conv1D", fp32_finite=0)
        return verdict(s)
    d = run([1.32, 1.32, 237.0, 5.8e7], [1.78, 1.66, 421.0, 4.5e12])
    assert d.verdict == "lr_overflow" and d.first_bad["step"] == 4
    assert {"loss_spike", "grad_norm_growth"} <= {e.key for e in d.evidence}
    assert run([1.32, 1.32, 1.5, 6.0], [1.78, 1.66, 421.0, 4.5e12]).verdict != "lr_overflow"
    assert run([1.32, 1.32, 237.0, 5.8e7], [1.78, 1.66, 1.7, 1.9]).verdict != "lr_overflow"


# ---------------------------------------------------------------------------------------------
# an overflow hidden inside a module (the sampled step's op probe): no NaN anywhere


def _hidden(s: Synth, steps, module="blocks.0.norm", type_="RMSNorm", op="mul",
            dtype="float16", created=2, zeros=4000):
    tid = s.tensor(Kind.OUTPUT, module, type_)
    for i in steps:
        s.stat(i, Kind.OUTPUT, module, type_, zeros=zeros, absmax=2.0)
        s.steps["sampled"][i] = 1
        s.event(i, Event.HIDDEN_NONFINITE, value=created, tensor=tid,
                text=json.dumps({"op": op, "dtype": dtype, "inner": module, "index": 3,
                                 "ops": 1}))
    return s


def _flat(n=60, **kw):
    s = Synth(n, **kw)
    s.set("loss", 2.08 + 0.01 * np.sin(np.arange(n)))
    return s


def test_a_hidden_fp16_overflow_in_a_hand_written_norm_is_unstable_op():
    d = verdict(_hidden(_flat(), range(0, 60, 10)))
    assert d.verdict == "unstable_op" and d.causes[0]["kind"] == "hidden_overflow", str(d)
    assert d.first_bad == {"step": 0, "module": "blocks.0.norm", "phase": "forward"}
    assert fix_ids(d)[:2] == ["norm_in_fp32", "fp32_island"] and d.confidence == 0.85
    assert "x.float()" in d.fixes[0].snippet and "RMSNorm.forward" in d.fixes[0].snippet
    assert "for block in model.blocks" in d.fixes[1].snippet
    keys = [e.key for e in d.evidence]
    assert {"hidden_overflow", "output_zeroed", "loss_not_falling", "hidden"} <= set(keys)
    zeroed = next(e for e in d.evidence if e.key == "output_zeroed")
    assert zeroed.value == pytest.approx(4000 / 4096)
    assert "x * x passes 65504" in d.summary
    assert "not_learning" not in [c["verdict"] for c in d.causes]


def test_a_hidden_overflow_whose_output_comes_out_as_zeros_needs_no_flat_loss():
    s = _hidden(Synth(15), [0, 10])  # too short to judge the loss
    d = verdict(s)
    assert d.verdict == "unstable_op" and d.confidence == 0.7, str(d)


def test_a_hidden_overflow_in_a_run_that_learns_is_a_note():
    s = _hidden(Synth(60), range(0, 60, 10), zeros=0, module="mlp.act", type_="NewGELU",
                op="pow")
    d = verdict(s)
    assert d.verdict == "healthy", str(d)
    assert any("Inside mlp.act, pow made +inf in float16 on 6 sampled steps" in n
               for n in d.notes)


@pytest.mark.parametrize("dtype,op,created", [("float32", "log", 4), ("float16", "add", 4)])
def test_an_fp32_singularity_or_a_mask_sum_is_not_a_hidden_overflow(dtype, op, created):
    """log(0) in fp32 is no precision problem; two fp16 mask constants summed to -inf are a
    mask, which softmax takes."""
    s = _hidden(_flat(), range(0, 60, 10), module="attn", type_="Attention", op=op,
                dtype=dtype, created=created)
    assert verdict(s).verdict == "not_learning"


def test_the_early_warning_says_no_headroom_stable_for_a_module_that_overflowed_inside():
    from ampdoctor.diagnosis.forecast import forecast

    s = _hidden(Synth(120), range(70, 120, 10), zeros=0)
    for i in range(0, 120, 10):
        s.stat(i, Kind.OUTPUT, "head", absmax=3.0, dtype=int(DType.FLOAT16))
        s.steps["sampled"][i] = 1
    fc = forecast(s.run())
    assert fc.status == "unknown" and "headroom stable" not in fc.text
    assert "inside blocks.0.norm, mul already overflowed float16 on sampled step 70" in fc.text
    before = forecast(s.run(), until=70)  # as if the run had stopped before the overflow
    assert before.status == "stable" and "headroom stable" in before.text


# the numbers or the machine (issue 20), targets that are NaN in fp32 too (issue 23)

UNREPRODUCED = {"reproduced": False, "loss_recomputed": True,
                "recorded": {"loss_nonfinite": True, "output_nonfinite": True},
                "rerun": {"finite": True, "loss": 1.25, "loss_finite": True,
                          "loss_fns": ["cross_entropy"], "grads": "finite"}}


def test_a_failure_the_replay_does_not_reproduce_is_the_machine():
    s = Synth(60)
    for step in (12, 30, 48):
        s.skip([step], loss_nan=True)
        s.snapshot(step, "none", **UNREPRODUCED)
    d = verdict(s)
    assert d.verdict == "not_reproducible" and d.first_bad["step"] == 12
    assert fix_ids(d) == ["test_device", "rerun_elsewhere", "deterministic_algorithms"]
    texts = " | ".join(e.text for e in d.evidence)
    assert "3 of the 3 replayed non-finite steps did not reproduce (steps 12, 30, 48)" in texts
    assert "the loss recomputed by cross_entropy is 1.25" in texts
    assert "batch held" not in texts + d.summary  # no batch is blamed: the replay found it finite


def test_the_machine_fixes_name_the_recorded_command_and_the_device_kind():
    ctx = fixes.Context(device="cuda", rank=3, step=12, argv=["pretrain.py", "--lr", "3e-4"],
                        world_size=8)
    device, rerun = fixes.make(["test_device", "rerun_elsewhere"], ctx)
    assert "nvidia-smi" in device.snippet and "rank 3" in device.snippet
    assert '"python", "pretrain.py", "--lr", "3e-4"]' in rerun.snippet
    assert "CUDA_VISIBLE_DEVICES" in rerun.snippet and "one rank of 8" in rerun.snippet
    cpu = fixes.make(["rerun_elsewhere"], fixes.Context(device="cpu", argv=["t.py"]))[0]
    assert "CUDA_VISIBLE_DEVICES" not in cpu.snippet and "another host" in cpu.snippet
    assert "one rank of" not in cpu.snippet


def test_one_unreproduced_skip_in_a_healthy_run_is_a_note_not_a_verdict():
    s = Synth(60)
    s.skip([20], loss_nan=True)
    s.snapshot(20, "none", **UNREPRODUCED)
    d = verdict(s)
    assert d.verdict == "healthy", str(d)
    assert any("did not reproduce" in n and "test_device" in n for n in d.notes)
    assert not any("more often than probing explains" in n for n in d.notes)


def test_unreproduced_without_a_scaler_explains_the_poisoned_steps_after_it():
    s = Synth(40, dtype="bfloat16", scaler=False)
    s.nan_loss(range(10, 40))
    s.nan_grad(range(10, 40))
    s.snapshot(10, "none", **UNREPRODUCED)
    s.snapshot(11, "forward", "body.0", "Linear", fp32_finite=0, weights_nonfinite=["weight"])
    d = verdict(s)
    assert d.verdict == "not_reproducible" and d.first_bad["step"] == 10
    assert not [c for c in d.causes if c["role"] == "also"], str(d)
    poisoned = next(e for e in d.evidence if e.key == "weights_poisoned")
    assert "30 non-finite steps followed" not in poisoned.text  # 29 after step 10
    assert "29 non-finite steps followed (the replays of steps 11 find" in poisoned.text


@pytest.mark.parametrize("phase,detail", [
    ("none", {}),  # a file written before the comparison: every micro-batch stayed finite
    ("none", UNREPRODUCED),
])
def test_nonfinite_is_never_the_verdict_where_the_replay_was_finite(phase, detail):
    for bad in ([20], [20, 21, 40]):
        s = Synth(60, dtype="bfloat16", scaler=False)
        s.nan_loss(bad)
        for step in bad:
            s.snapshot(step, phase, **detail)
        d = verdict(s)
        assert d.verdict == "not_reproducible", str(d)


def test_a_replayed_loss_with_a_hand_written_formula_claims_no_batch():
    s = Synth(40, dtype="bfloat16", scaler=False)
    s.nan_loss([15])
    s.snapshot(15, "loss", loss_nonfinite=True, loss_recomputed=False,
               loss_not_recomputed="no torch loss function was called after the model",
               recorded={"loss_nonfinite": True, "output_nonfinite": False})
    d = verdict(s)
    assert d.verdict == "nonfinite"
    text = next(e.text for e in d.evidence if e.key == "replay_loss_phase")
    assert "finite (in the real step too)" in text and "not recomputed" in text
    assert "had one" not in d.fixes[0].snippet and "As a guard" in d.fixes[0].text


def test_targets_all_ignore_index_are_bad_input_not_precision():
    s = Synth(40)
    s.nan_loss([25])
    target = {"fn": "cross_entropy", "numel": 64, "ignore_index": -100, "ignored": 64,
              "all_ignored": True, "reduction": "mean",
              "problem": "every one of the 64 targets is ignore_index (-100): the mean over "
                         "no targets is 0/0 = NaN"}
    s.snapshot(25, "loss", fp32_finite=0, reproduced=True, loss_nonfinite=True,
               loss_fp32={"loss_finite": False, "loss": "nan", "grads": "zero"},
               targets=[target])
    d = verdict(s)
    assert (d.verdict, d.causes[0]["kind"]) == ("bad_input", "targets")
    assert d.first_bad == {"step": 25, "module": None, "phase": "loss"}
    assert "in fp32 as well" in d.summary and "every gradient exactly zero" in d.summary
    fix = d.fixes[0]
    assert fix.id == "check_data" and "(y != -100).sum() == 0" in fix.snippet
    assert "AMP is not the cause" in fix.text


def test_check_data_names_the_step_its_check_measured():
    s = Synth(64)
    s.skip(range(15, 18), loss_nan=True)
    s.snapshot(17, "input", "Regressor", "Regressor",
               bad_inputs=[{"label": "args.0", "nan": 3}])
    d = verdict(s)
    assert d.verdict == "bad_input" and d.first_bad["step"] == 15  # the run of bad steps
    snippet = d.fixes[0].snippet
    assert "step 17's batch held NaN/inf (args.0)" in snippet and "step 15" not in snippet
    assert "GradScaler skipped those steps" in d.summary
    s = Synth(64, dtype="bfloat16", scaler=False)
    s.nan_loss([15])
    s.snapshot(15, "input", "Regressor", "Regressor")
    assert "No GradScaler skipped those steps" in verdict(s).summary


def test_merged_ranks_count_the_unreproduced_steps_of_each_rank():
    from ampdoctor.diagnosis import ranks

    runs = []
    for rank in (0, 1):
        s = Synth(40)
        s.skip([7, 21], loss_nan=rank == 1)
        detail = UNREPRODUCED if rank == 1 else dict(UNREPRODUCED, recorded={
            "loss_nonfinite": False, "output_nonfinite": False})
        for step in (7, 21):
            s.snapshot(step, "none", **detail)
        run = s.run()
        run.attrs.update(rank=rank, world_size=2)
        runs.append(run)
    d = ranks.merge([(ranks.outline(r), diagnose(r), ranks.scales(r)) for r in runs])
    assert d.verdict == "not_reproducible" and d.first_bad["rank"] == 1
    count = next(e for e in d.evidence if e.key == "unreproduced_by_rank")
    assert count.text == ("rank 1: 2 of the run's 2 non-finite steps began there and did not "
                          "reproduce when replayed (steps 7, 21); rank 0: 0")
    assert "rank 1" in d.summary and "rank 1" in d.fixes[0].text
