"""The trend rules (``diagnosis/rules/trends.py``) on runs built in memory (no torch): fp16
gradients that flush to zero, layers that underflow at a healthy scale, updates lost to
rounding; and the structural zeros that are none of these."""


import math

import pytest
from synthetic import Synth, underflowing_grads

from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.runfile.schema import DType, Kind


def verdict(s: Synth):
    return diagnose(s.run())


def fix_ids(d):
    return [fx.id for fx in d.fixes]


# ---------------------------------------------------------------------------------------------
# C1, C8a, C9a: trends without a non-finite value


def test_grad_underflow_without_a_scaler():
    s = Synth(60, scaler=False)
    underflowing_grads(s, ["encoder.0.weight", "encoder.2.weight", "decoder.0.weight"], 3000)
    d = verdict(s)
    assert d.verdict == "grad_underflow" and d.confidence >= 0.8
    assert d.first_bad["module"].startswith(("encoder", "decoder"))
    assert fix_ids(d) == ["add_grad_scaler", "use_bf16"]


def test_grad_underflow_at_a_low_scale():
    s = Synth(60, init_scale=4.0)
    underflowing_grads(s, ["emb.weight", "fc.weight"], 3000)
    d = verdict(s)
    assert d.verdict == "grad_underflow" and fix_ids(d)[0] == "raise_init_scale"
    assert "init_scale=4" in d.fixes[0].snippet


def test_fp16_counts_do_not_matter_in_a_bf16_run():
    s = Synth(60, dtype="bfloat16", scaler=False)
    underflowing_grads(s, ["aux.weight"], 3000)  # subbf16 stays 0
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
    underflowing_grads(s, ["aux_head.0.weight", "aux_head.2.weight"], 4000)
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
    underflowing_grads(s, ["aux_head.0.weight"], 4000)
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
    underflowing_grads(s, ["aux_head.0.weight"], 4000)
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


def _half_resnet(s: Synth, steps, unchanged=0.99, behind=0.0) -> Synth:
    """timm's test_resnet in fp16 under SGD, sampled at ``steps``: two small layers whose
    updates round away, and the large layers of a residual branch behind a norm scale
    initialised to 0, which get an all-zero gradient (unchanged ``behind``: the recorder wrote
    0.0 there, for 0 of 0 elements, before it wrote NaN)."""
    for name in ("stem.weight", "fc.weight"):
        s.sampled(steps, Kind.PARAM, name, norm=5.0, update=1e-6, unchanged=unchanged)
        s.sampled(steps, Kind.PARAM_GRAD, name, absmax=0.05)
    for name in ("block.conv1.weight", "block.conv2.weight"):
        s.tensor(Kind.PARAM, name, numel=100_000)
        s.sampled(steps, Kind.PARAM, name, norm=9.0, update=0.0, unchanged=behind)
        s.sampled(steps, Kind.PARAM_GRAD, name, absmax=0.0, zeros=4096)
    return s


def test_parameters_with_no_gradient_do_not_outvote_the_updates_that_round_away():
    """timm's --model-dtype float16, its one sampled step 0: the zero-initialised residual
    branches' large convolutions have an all-zero gradient; 'unchanged' is a share of the
    elements whose gradient was not 0, so they are not measured and do not count."""
    s = Synth(36, dtype=None, scaler=False, params="float16", optimizer="SGD", lr=0.05)
    d = verdict(_half_resnet(s, [0]))
    assert d.verdict == "lost_updates" and d.confidence == pytest.approx(0.7), str(d)
    assert evidence_value(d, "unchanged_fraction") == pytest.approx(0.99)
    assert d.premises[0].name == "at_peak_lr" and d.premises[0].status == "held"
    assert d.premises[0].fact.startswith("at LR 0.05 (the run's peak 0.05; sampled step 0) 99%")
    s = Synth(36, dtype=None, scaler=False, params="float16", optimizer="SGD", lr=0.05)
    assert verdict(_half_resnet(s, [0], unchanged=0.1)).verdict == "healthy"


def test_updates_lost_only_far_below_the_peak_lr_are_said_to_be_measured_there_only():
    """Only the warm-up (LR 1e-5, timm's first epoch) was sampled; the run trains at 0.05."""
    s = Synth(36, dtype=None, scaler=False, params="float16", optimizer="SGD", lr=0.05)
    s.set("lr", 1e-5, range(12))
    d = verdict(_half_resnet(s, [0]))
    assert d.verdict == "lost_updates" and d.confidence == pytest.approx(0.6), str(d)
    assert d.premises[0].status == "not measured"
    assert "at LR 1e-05 or below (sampled step 0), 5000x below the run's peak LR 0.05" in \
        d.premises[0].fact
    assert "far below the run's peak LR" in d.summary


def test_updates_lost_in_a_warm_up_but_applied_at_the_peak_lr_are_not_lost_updates():
    s = Synth(60, dtype=None, scaler=False, params="bfloat16", optimizer="SGD", lr=0.05)
    s.set("lr", 1e-5, range(30))
    _half_resnet(s, [0, 10, 20], unchanged=0.99)
    _half_resnet(s, [30, 40], unchanged=0.1)
    d = verdict(s)
    assert d.verdict != "lost_updates", str(d)
    rejected = next(r for r in d.rejected if r["verdict"] == "lost_updates")
    premise = rejected["premises"][0]
    assert premise["name"] == "at_peak_lr" and premise["status"] == "failed"
    assert premise["fact"].startswith("at LR 0.05 (the run's peak 0.05; sampled steps 30, 40) "
                                      "10% of the sampled elements")


def evidence_value(d, key):
    return next(e.value for e in d.evidence if e.key == key)


def test_the_old_id_bf16_precision_is_understood():
    from ampdoctor.diagnosis.verdict import ALIASES, VERDICTS, canonical

    assert canonical("bf16_precision") == "lost_updates" and canonical("healthy") == "healthy"
    assert set(ALIASES.values()) <= set(VERDICTS) and not set(ALIASES) & set(VERDICTS)


def test_fp32_master_weights_with_small_updates_are_fine():
    s = Synth(40, dtype="bfloat16", scaler=False, params="float32")
    s.sampled(range(10, 40, 10), Kind.PARAM, "fc.weight", norm=5.0, update=1e-5, unchanged=0.99)
    assert verdict(s).verdict == "healthy"


def test_one_tiny_bias_whose_gradient_underflows_is_not_masked_underflow():
    """Blind corpus 4: an attention key bias (64 elements) whose gradient is 0 in exact
    arithmetic sits in the subnormal band, the rest of the model healthy. Too small a share of
    the parameters for the run to hinge on: the premise share_matters fails, and it says so."""
    s = Synth(60)
    s.tensor(Kind.PARAM_GRAD, "attn.k.bias", numel=64)
    underflowing_grads(s, ["attn.k.bias"], 4000)  # (of a 4096-element sample)
    for name in ("attn.q.weight", "attn.k.weight", "mlp.weight"):
        s.tensor(Kind.PARAM_GRAD, name, numel=16384)
        s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, name, absmax=300.0, rms=50.0)
    d = verdict(s)
    assert d.verdict == "healthy", str(d)
    rejected = d.to_dict()["rejected"]
    assert rejected[0]["verdict"] == "masked_underflow"
    failed = [p for p in rejected[0]["premises"] if p["status"] == "failed"]
    assert failed[0]["name"] == "share_matters" and "64 of the 49216" in failed[0]["fact"]
