"""The overflow rules (``diagnosis/rules/overflow.py`` and, for an overflow hidden inside a
module, ``rules/hidden.py``) on runs built in memory (no torch): one op's overflow, a mask
constant, the LR's growth, located by the replay or the sampled tier, the early LR blow-ups of
real stacks, an overflow hidden inside a module; each told from the neighbour it must not be
confused with."""


import json
import math

import numpy as np
import pytest
from synthetic import Synth, growing

from ampdoctor.diagnosis import culprit
from ampdoctor.diagnosis.engine import diagnose
from ampdoctor.diagnosis.facts import Facts
from ampdoctor.runfile.detail import OpRecord
from ampdoctor.runfile.schema import DType, Event, Kind


def verdict(s: Synth):
    return diagnose(s.run())


def fix_ids(d):
    return [fx.id for fx in d.fixes]


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
    op = OpRecord(op="softmax", created=["nan"], in_neginf=True, in_posinf=False, in_nan=False)
    assert culprit.mask_pattern(op)
    assert culprit.mask_pattern(OpRecord(op="matmul", created=["posinf", "neginf"])) is None
    # -inf alone but from a small constant: not a mask constant
    assert culprit.mask_pattern(OpRecord(op="add", created=["neginf"], big_scalar=16.0,
                                         in_absmax=10.0)) is None


def test_lr_overflow_when_weights_grew_before_the_overflow():
    s = growing(Synth(120, lr=0.2), 80)
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
    s = growing(Synth(120, lr=0.2), 80)
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


@pytest.mark.parametrize("betas,expected", [(True, "unstable_op"), (False, "lr_overflow")])
def test_adams_first_update_says_nothing_of_the_lr(betas, expected):
    """blind10's Performer: an update ratio of 0.021 at step 0 and 0.007 at step 49, median
    0.012. Adam's first step (bias-corrected: the sign of the gradient) moves every weight by
    the full LR, so under Adam it is left out and the weights were steady; an optimizer
    without betas keeps it, and the median says the updates were too large."""
    s = Synth(120, every=0)
    if betas:
        s.meta["optimizer"][0]["hyper"]["betas"] = [0.9, 0.999]
    for step, update in ((0, 0.021), (49, 0.007)):
        s.sampled([step], Kind.PARAM, "attn.weight", norm=5.0, update=update)
        s.sampled([step], Kind.OUTPUT, "attn", absmax=3.0)
    s.skip(range(100, 120), loss_nan=True)
    s.snapshot(100, "backward", "attn", "FavorAttention", fp32_finite=1)
    assert verdict(s).verdict == expected


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
    s = growing(Synth(120), 80)
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
    # The replay that is evidence is step 7's: said as the poison it shows, and where the
    # failure began (the first bad step), not as the values reaching wte out of range.
    replay = next(e for e in d.evidence if e.key == "culprit")
    assert replay.text.startswith("replay of step 7: the first non-finite value appears in the "
                                  "forward of transformer.wte (Embedding), from finite inputs "
                                  "but with its weights (transformer.wte.weight) already "
                                  "non-finite")
    assert replay.text.endswith("not where the failure began (step 4)")
    fp32 = next(e for e in d.evidence if e.key == "fp32_nonfinite")
    assert fp32.text == "re-run in fp32, transformer.wte is still non-finite: its weights are"


def test_a_first_bad_step_is_never_a_step_at_lr_0():
    """Issue 40: litgpt ``--precision bf16-true`` said "first bad: step 0", a warm-up step at
    LR 0, which moves no weight. The same run as above with its warm-up at LR 0 up to the
    step the gradients went inf: the failure the LR made begins at the first step with an LR."""
    s = Synth(20, dtype=None, scaler=False, every=100)
    s.sampled([0], Kind.PARAM, "transformer.h.0.mlp.weight", norm=3.0, update=15.0)
    s.set("loss", [2.9, 2.5e4, 9e5, 7.5e6, 2.9e8, 5e9], steps=range(6))
    s.set("grad_norm", [0.67, 1.9e3, 1.2e10, 9.7e14], steps=range(4))
    s.nan_grad(range(4, 20)).nan_loss(range(6, 20))
    s.snapshot(7, "forward", "transformer.wte", "Embedding", fp32_finite=0,
               weights_nonfinite=["weight"])
    s.set("lr", np.r_[np.zeros(5), np.full(15, 1000.0)])
    d = verdict(s)
    assert Facts(s.run()).failure_step == 4
    assert d.verdict == "lr_overflow" and d.first_bad["step"] == 5, d.first_bad


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


@pytest.mark.parametrize("fp32_absmax, amplified", [(7.45e7, True), (2.0e5, False)])
def test_a_backward_that_amplifies_its_gradient_while_the_scale_keeps_falling(fp32_absmax,
                                                                              amplified):
    """A LayerNorm with eps=1e-12 on zeroed padded rows: its backward multiplies the gradient
    by ~1e6, so GradScaler skips one batch in ten and halves down to 16 while the loss stays
    finite (``rules/amplified.py``). A backward that amplifies it ~700x is an ordinary
    overflow at the scale, GradScaler's to answer: no unstable_op."""
    s = Synth(120)
    s.skip(range(2, 120, 10))  # twelve skips after calibration, each with a finite loss
    s.snapshot(2, "backward", "enc.norm", "LayerNorm", fp32_finite=1, fp32_absmax=fp32_absmax,
               in_absmax=271.5, out_absmax=math.inf)
    d = verdict(s)
    assert (d.verdict == "unstable_op") == amplified, d.verdict
    if amplified:
        assert d.confidence < 0.9 and d.first_bad == {"step": 2, "module": "enc.norm",
                                                      "phase": "backward"}
        assert "eps" in d.summary and any(e.key == "amplified_backward" for e in d.evidence)
