"""The misuse rules (``diagnosis/rules/misuse.py``) on runs built in memory (no torch):
GradScaler API misuse and AMP's own errors, and the overflows beside them that are not a
second cause."""



import numpy as np
import pytest
from synthetic import Synth

from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.runfile.schema import Event, Kind


def verdict(s: Synth):
    return diagnose(s.run())


def fix_ids(d):
    return [fx.id for fx in d.fixes]


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


def _sam(n=30, late=True):
    """SAM's two passes with one unscale_ after the first (blind6 sam_unscale_first_pass): the
    first step applied scaled gradients, then every forward overflows and the scale falls."""
    s = Synth(n)
    s.set("grad_norm", 0.55 * 2.0 ** 16, steps=[0])
    s.skip(range(1, n), loss_nan=True)
    for i in range(n if late else 0):
        s.event(i, Event.BACKWARD_AFTER_UNSCALE, value=1.0)
    return s


def test_a_backward_after_unscale_is_a_misuse_with_its_own_fix_only():
    d = verdict(_sam())
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "backward_after_unscale"
    assert d.confidence >= 0.9 and d.first_bad["step"] == 0
    # the collapse that follows is its consequence: no precision or LR fix beside it
    assert fix_ids(d) == ["unscale_after_last_backward"]
    assert "multiplied by the loss scale (65536 at step 0)" in d.evidence[0].text
    norm = next(e for e in d.evidence if e.key == "scaled_grad_norm")
    assert "the loss scale times 0.55" in norm.text


def test_no_backward_after_unscale_is_not_that_misuse():
    d = verdict(_sam(late=False))
    assert d.causes[0].get("kind") != "backward_after_unscale"
    assert "unscale_after_last_backward" not in fix_ids(d)


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


def test_a_scaler_not_restored_at_one_resume_is_healthy_with_a_note():
    """A resume that re-creates the GradScaler without load_state_dict: it restarts at
    init_scale and recalibrates once; not the every-epoch misuse above (issue 40 item 5)."""
    n = 160
    scales = np.full(n, 2.0 ** 13)
    for start in (0, 80):
        scales[start:start + 3] = [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]
    s = Synth(n).scales(scales)
    s.skip([0, 1, 2, 80, 81, 82])
    s.event(80, Event.SCALER_CREATED, value=2.0 ** 16)
    d = verdict(s)
    assert d.verdict == "healthy", str(d)
    assert any("restarted at 65536 at step 80" in n and "skipped 3 steps to recalibrate" in n
               and "scaler.state_dict()" in n for n in d.notes), d.notes


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
    s.snapshot(10, "none", stale_grads=["fc.weight"])
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
