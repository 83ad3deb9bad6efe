"""The located rules (``diagnosis/rules/located.py``) on runs built in memory (no torch): the
batch itself, poisoned buffers, an Adam eps fp16 cannot hold, the loss and its backward; each
told from the neighbour it must not be confused with."""



import numpy as np
import pytest
from synthetic import Synth

from ampdoctor.diagnosis import culprit
from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.runfile.detail import OpRecord
from ampdoctor.runfile.schema import DType, Event, Kind


def verdict(s: Synth):
    return diagnose(s.run())


def fix_ids(d):
    return [fx.id for fx in d.fixes]


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
    found = culprit.mask_pattern(OpRecord.from_json(op))
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


def test_a_loss_made_non_finite_by_the_steps_own_fp16_ops_is_the_loss_not_a_module():
    """Blind corpus 5: an entropy bonus -(p * log p) on an fp16 softmax, cast to fp32 at the
    end. Probabilities underflow to 0 and 0 x -inf is NaN. The replay finds every module output
    finite and the loss not; the sampled tier's first non-finite backward value is at the
    model's last layer, where the loss's NaN arrives: that module is not the culprit (it was
    unstable_op 0.5 there, with an island around it). The loss is hand-written: neither the op
    nor fp32 is measured, and the confidence is 0.6."""
    s = Synth(200)
    s.skip(range(53, 200, 2), loss_nan=True)
    _loss_snap(s, 53, loss_nonfinite=True)
    s.sampled([100], Kind.GRAD_INPUT, "2", nonfinite=4)
    d = verdict(s)
    assert (d.verdict, d.confidence) == ("fp16_loss", 0.6), str(d)
    assert d.first_bad == {"step": 53, "module": None, "phase": "loss"}
    assert fix_ids(d)[0] == "loss_in_fp32" and "could not recompute it" in d.summary
    assert not any(c["verdict"] == "unstable_op" for c in d.causes)


def _bf16_sigmoid_bce_run(**detail):
    """Blind corpus 11: BCE written by hand on a bf16 sigmoid, no scaler. A logit of 6.66
    rounds its sigmoid to exactly 1.0, log(1 - p) is -inf and (1 - y) * -inf NaN: the loss is
    NaN from step 84 while the outputs are finite, then the gradients and the weights."""
    s = Synth(200, dtype="bfloat16", scaler=False, device="cpu")
    s.nan_loss(range(84, 200)).nan_grad(range(84, 200))
    return _loss_snap(s, 84, loss_nonfinite=True, output_grad={
        "nonfinite": 1, "numel": 1024, "finite_absmax": 8e-4, "output_values": [6.65625]},
        **detail)


def test_a_hand_written_loss_non_finite_on_finite_bf16_outputs_is_the_loss():
    """It was nonfinite 0.3 with check_data (the rule asked for fp16): a bf16 run's loss that
    fails on finite outputs fails on bf16's precision, said as such, with the logits' fix."""
    d = verdict(_bf16_sigmoid_bce_run())
    assert (d.verdict, d.confidence) == ("fp16_loss", 0.6), str(d)
    assert d.first_bad == {"step": 84, "module": None, "phase": "loss"}
    assert "run in bf16" in d.summary and "fp16" not in d.summary
    text = next(e.text for e in d.evidence if e.key == "loss_output_grad")
    assert "1 of 1024 elements, where the output is 6.656" in text
    assert "exactly 1.0 in bf16" in text
    fx = d.fixes[0]
    assert fix_ids(d) == ["loss_in_fp32"] and "65504" not in fx.text
    assert "bfloat16" in fx.snippet and "binary_cross_entropy_with_logits" in fx.snippet


def test_a_bf16_loss_non_finite_in_fp32_too_is_not_the_precision():
    """The neighbour: the replay recomputed the loss in fp32 and it was NaN there too."""
    d = verdict(_bf16_sigmoid_bce_run(loss_fp32={"loss_finite": False, "loss": "nan"}))
    assert d.verdict != "fp16_loss", str(d)


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


def test_a_loss_backward_replay_of_steps_whose_loss_was_nan_is_not_fp16_loss():
    """Blind corpus 4: a GAN whose discriminator's attention overflows. The replay re-ran the
    generator's call, found its output finite and the gradient into it not, and did not
    recompute the loss; the recorded loss was NaN on every step. The premise losses_finite
    fails: not fp16_loss (it was, at 0.85)."""
    s = _loss_backward_run()
    s.nan_loss(range(12, 150, 3))
    _loss_snap(s, 12, output_grad={"nonfinite": 3, "numel": 128, "finite_absmax": 2.5,
                                   "output_values": [1.0]})
    d = verdict(s)
    assert d.verdict != "fp16_loss", str(d)
    rejected = {r["verdict"]: r for r in d.to_dict()["rejected"]}
    assert [p["name"] for p in rejected["fp16_loss"]["premises"]
            if p["status"] == "failed"] == ["losses_finite"]
