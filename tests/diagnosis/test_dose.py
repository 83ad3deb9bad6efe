"""The numbers fixes prescribe come from the run (diagnosis/dose.py): the LR from the update
ratios and the LR history, the loss scale from the gradients, Adam's eps from the optimizer
state and the gradients, max_norm from the healthy steps; each says where it comes from, and
falls back to a documented default, saying why, when the run holds too little. Also the
scheduler stepped per micro-batch (the cause behind the LR) and the LR evidence gate. Runs built
in memory (no torch)."""

import numpy as np
import pytest
from synthetic import Synth

from ampdoctor.diagnosis import engine, fixes
from ampdoctor.diagnosis.dose import Doses
from ampdoctor.diagnosis.facts import Facts
from ampdoctor.numfmt import fmt
from ampdoctor.runfile.schema import DType, Event, Kind


def doses(s: Synth) -> Doses:
    return Facts(s.run()).doses


def fix(d, fix_id):
    return next(fx for fx in d.fixes if fx.id == fix_id)


# ---------------------------------------------------------------------------------------------
# the learning rate


def _adam_at(lr: float, ratio: float, n: int = 40, every: int = 5) -> Synth:
    s = Synth(n, dtype=None, scaler=False, lr=lr, every=every)
    s.sampled(range(0, n, every), Kind.PARAM, "fc.weight", norm=3.0, update=ratio)
    return s


def test_the_lr_comes_from_the_update_ratio():
    """The issue's nanoGPT: a ratio 10x the weights at LR 1.4 does not want LR 7.5 (30 / 4) but
    ~1.4e-3 / 10: healthy is ~1e-3 per step, and the ratio grows with the LR."""
    dose = doses(_adam_at(1.4, 0.5))("lr")
    assert dose.values["lr"] == 0.0028  # 1.4 * 1e-3 / 0.5
    assert dose.values["lr_factor"] == 0.002
    assert "update ratio 0.5 at LR 1.4" in dose.source and "median of 7" in dose.source


def test_the_first_step_is_left_out_when_others_were_sampled():
    s = Synth(40, dtype=None, scaler=False, lr=0.1, every=10)
    s.sampled([0], Kind.PARAM, "fc.weight", norm=3.0, update=1e-4)  # SGD momentum's first step
    s.sampled([10, 20, 30], Kind.PARAM, "fc.weight", norm=3.0, update=0.05)
    assert doses(s)("lr").values["lr"] == 0.002


def test_a_ratio_at_the_ceiling_says_at_least():
    dose = doses(_adam_at(30.0, 12.0, every=100))("lr")  # one sample, step 0, clipped at 10
    assert "at least 10" in dose.source and "sampled step 0" in dose.source
    # the first step is all there is: AdamW's is sign-sized, ~1e-2 at a sane LR: the LR is at
    # most 30 * 1e-2 / 10 = 0.03, a bound, and the run was never steady below it
    assert "AdamW's first, sign-sized step the LR is at most 0.03" in dose.source
    assert "only an upper bound" in dose.source and "no sampled step measured a healthy" \
        in dose.source
    assert dose.values["lr"] == 0.003


def test_a_bound_takes_the_highest_lr_of_a_healthy_sampled_step():
    """An LR warm-up into a blow-up: most sampled ratios sit at the ceiling (the run only
    bounds the LR there); the step sampled early in the warm-up was healthy at its LR, a value
    the run measured."""
    s = Synth(60, dtype=None, scaler=False, every=10)
    s.set("lr", np.arange(60) * 0.01)  # a warm-up
    s.set("grad_norm", np.where(np.arange(60) >= 45, 1e6, 1.0))  # blows up at step 45
    s.sampled([10], Kind.PARAM, "fc.weight", norm=3.0, update=2e-3)
    s.sampled([20, 30, 40, 50], Kind.PARAM, "fc.weight", norm=3.0, update=12.0)
    dose = doses(s)("lr")
    assert "only an upper bound" in dose.source, dose.source
    assert "at sampled step 10 the update ratio was still 0.002 at LR 0.1" in dose.source
    assert dose.values["lr"] == 0.1


def test_the_lr_is_capped_where_the_run_was_steady_and_set_below_where_it_jumped():
    s = Synth(60, dtype=None, scaler=False, every=100)
    s.set("lr", np.arange(60) * 0.01)  # a warm-up
    s.set("grad_norm", np.where(np.arange(60) >= 30, 50.0, 1.0))  # jumps at step 30
    s.sampled([0], Kind.PARAM, "fc.weight", norm=3.0, update=1e-5)  # a tiny first update
    dose = doses(s)("lr")
    # the ratio alone says LR 0 * ..., only step 0: no LR to scale -> no ratio; so a tenth of
    # the LR of the update before the jump (step 29, LR 0.29)
    assert dose.values["lr"] == 0.029
    assert "LR 0.29, the LR of the update before the gradient norm jumped at step 30" in \
        dose.source

    s.sampled([10, 20], Kind.PARAM, "fc.weight", norm=3.0, update=1e-5)  # ratios say LR 1+
    dose = doses(s)("lr")
    assert dose.values["lr"] == 0.28 and "capped at LR 0.28" in dose.source


def test_without_a_sampled_ratio_the_lr_default_says_why():
    s = Synth(40, dtype=None, scaler=False, lr=3e-4, every=0)
    dose = doses(s)("lr")
    assert dose.values["lr"] == 3e-5 and "a tenth of the peak LR" in dose.source
    assert "no sampled update ratio" in dose.source
    assert doses(Synth(40, dtype=None, scaler=False, lr=np.nan, every=0))("lr") is None


def test_lower_lr_at_lr_30_never_says_7_5():
    """The issue's regression: an update ratio of 10 at LR 1.43 on AdamW's first step (all that
    was sampled) says at most ~1.4e-3, not 7.5 (the old "peak / 4"); a ratio at the ceiling is
    a bound, and the LR is set a tenth below it."""
    s = _adam_at(30.0, 10.0, n=30, every=100)
    s.set("lr", np.minimum(30.0, 30.0 * (np.arange(30) + 1) / 21))
    s.skip(range(2, 30), loss_nan=True)
    s.snapshot(2, "forward", "transformer.h.0.attn", "Attention", fp32_finite=1,
               fp32_absmax=1e6)
    d = engine.diagnose(s.run())
    assert d.verdict == "lr_overflow"
    lower = fix(d, "lower_lr")
    assert lower.values["lr"] < 0.01 and "lr=7.5" not in lower.snippet
    assert "lr=1.4e-4" in lower.snippet and lower.values["lr"] == 0.00014  # a tenth of the bound
    assert lower.apply == "lr_factor=4.7e-6" and lower.values["lr_factor"] == 4.7e-6


# ---------------------------------------------------------------------------------------------
# the loss scale, Adam's eps, max_norm


def _grads(s: Synth, rms: dict, absmax: float, steps=range(0, 40, 10)) -> Synth:
    for name, value in rms.items():
        s.sampled(steps, Kind.PARAM_GRAD, name, rms=value, absmax=absmax)
    return s


def test_the_init_scale_lifts_the_smallest_gradients_without_overflowing_the_largest():
    s = _grads(Synth(40, scaler=False), {"enc.weight": 1e-6, "dec.weight": 1e-3}, absmax=0.01)
    dose = doses(s)("init_scale")
    # 2**-14 / 1e-6 -> 2**6; 65504 / 0.01 -> 2**22: the middle, 2**14
    assert dose.values["init_scale"] == 2.0 ** 14
    assert "enc.weight's gradient rms 1e-06" in dose.source and "2**6" in dose.source \
        and "2**22" in dose.source


def test_the_scaled_gradients_are_divided_by_the_recorded_scale():
    s = _grads(Synth(40, scaler=True, init_scale=1024.0), {"a.weight": 1e-6 * 1024},
               absmax=0.01 * 1024)
    assert doses(s)("init_scale").values["init_scale"] == 2.0 ** 14


def test_no_scale_serves_both_and_it_says_so():
    s = _grads(Synth(40, scaler=False), {"a.weight": 1e-10, "b.weight": 1.0}, absmax=1e3)
    dose = doses(s)("init_scale")
    assert dose.values["init_scale"] == 2.0 ** 6 and "no one scale serves both" in dose.source


def test_without_gradients_the_init_scale_is_the_default_and_says_why():
    ctx = Facts(Synth(40, every=0).run()).fix_context()
    fx = fixes.make(["raise_init_scale"], ctx)[0]
    assert fx.values == {"init_scale": 65536.0} and "no sampled gradient" in fx.source
    assert fx.apply == "init_scale=65536" and "init_scale=2.0**16" in fx.snippet


def test_the_eps_is_the_order_of_the_smallest_gradient_in_fp16_state():
    s = Synth(40, dtype=None, scaler=False, params="float16", optimizer="Adam")
    s.meta["optimizer"][0]["state_dtypes"] = {"exp_avg": "float16", "exp_avg_sq": "float16"}
    _grads(s, {"embed.weight": 4.2e-5, "fc.weight": 2.6e-3}, absmax=0.11)
    dose = doses(s)("eps")
    assert dose.values["eps"] == 1e-5 and "embed.weight's gradient rms 4.2e-05" in dose.source
    # a large gradient raises it: m / eps below 65504
    s2 = Synth(40, dtype=None, scaler=False, params="float16", optimizer="Adam")
    _grads(s2, {"embed.weight": 1e-8}, absmax=10.0)
    dose = doses(s2)("eps")
    assert dose.values["eps"] == 1e-3 and "below 65504" in dose.source
    # fp32 state: nothing to measure; the default says why
    assert doses(_grads(Synth(40), {"a.weight": 1e-4}, absmax=1.0))("eps") is None


def test_max_norm_is_a_high_percentile_of_the_steady_steps():
    s = Synth(40, dtype=None, scaler=False)
    s.set("grad_norm", np.linspace(1.0, 2.0, 40))
    dose = doses(s)("max_norm")
    assert dose.values["max_norm"] == 1.9 and "90th percentile" in dose.source
    s.set("grad_norm", 100.0, steps=range(20, 40))  # a jump at step 20: only the steps before
    assert doses(s)("max_norm").values["max_norm"] == 1.4
    assert doses(Synth(3, dtype=None, scaler=False))("max_norm") is None


def test_a_bare_context_uses_the_documented_defaults():
    for fx in fixes.make(list(fixes.FIX_IDS), fixes.Context(lr=3e-4)):
        for value in fx.values.values():
            assert isinstance(value, float)
        if fx.values:
            assert fx.source, fx.id
    assert fixes.make(["lower_lr"], fixes.Context(lr=3e-4))[0].values["lr"] == 3e-5


# ---------------------------------------------------------------------------------------------
# the cause behind the number: a scheduler stepped per micro-batch


def _warmup_overflow(per_micro: bool) -> Synth:
    s = Synth(60, every=5)
    s.set("lr", np.minimum(1.0, (np.arange(60) + 1) * (8 if per_micro else 1) / 400))
    s.set("micro", 8)
    for name in ("trunk.0", "trunk.2"):
        s.sampled(range(5, 40, 5), Kind.PARAM, f"{name}.weight",
                  norm=lambda i: 5.0 * 2 ** (i / 10), update=0.05)
    s.skip(range(40, 60), loss_nan=True)
    s.snapshot(40, "forward", "trunk.2", "Linear", fp32_finite=0)
    if per_micro:
        s.event(0, Event.SCHEDULER_STEPS, "LambdaLR", value=8)
    return s


def test_a_scheduler_stepped_per_micro_batch_is_named_with_its_fix_first():
    d = engine.diagnose(_warmup_overflow(True).run())
    assert d.verdict == "lr_overflow"
    assert [fx.id for fx in d.fixes][:2] == ["scheduler_per_step", "lower_lr"]
    ev = next(e for e in d.evidence if e.key == "scheduler_per_micro")
    assert "stepped 8 times per optimizer step" in ev.text and "once per micro-batch" in ev.text
    assert "the scheduler stepped 8 times per optimizer step" in d.summary
    assert d.fixes[0].apply == "scheduler_per_step"
    plain = engine.diagnose(_warmup_overflow(False).run())
    assert plain.verdict == "lr_overflow" and plain.fixes[0].id == "lower_lr"


# ---------------------------------------------------------------------------------------------
# a verdict that prescribes an LR rests on the LR


def _constant_lr_growth(weights_grow: bool) -> Synth:
    """fixtures/forecast/attn_logits.py on a CPU whose fp16 kernels overflow: the LR never
    moves (0.001), the attention logits grow with the script's temperature schedule, the
    backward of k goes non-finite, the weights are steady."""
    s = Synth(150, every=5)
    s.sampled(range(0, 95, 5), Kind.OUTPUT, "blocks.0.attn.k",
              absmax=lambda i: 2.0 * 1.05 ** i)
    s.set("grad_norm", np.geomspace(0.1, 50.0, 150))
    factor = 3.0 if weights_grow else 1.0
    s.sampled(range(0, 95, 5), Kind.PARAM, "blocks.0.attn.k.weight",
              norm=lambda i: 4.0 * factor ** (i / 95), update=1e-3)
    s.skip(range(97, 102), loss_nan=False)
    s.skip(range(102, 150), loss_nan=True)
    s.snapshot(97, "backward", "blocks.0.attn.k", "Linear", fp32_finite=1, fp32_absmax=1e3)
    return s


def test_activations_growing_at_a_constant_lr_are_not_the_lr():
    d = engine.diagnose(_constant_lr_growth(weights_grow=False).run())
    assert d.verdict != "lr_overflow", str(d)
    assert "lower_lr" not in [fx.id for fx in d.fixes]
    grown = engine.diagnose(_constant_lr_growth(weights_grow=True).run())
    assert grown.verdict == "lr_overflow"  # the weights grew with it: the LR's doing


def test_a_layer_that_ran_in_fp32_has_no_fp16_underflow():
    """An fp32 island (record --apply fp32_island, or the fix's FP32Island): its output is fp32
    under fp16 autocast, its gradients never passed through fp16. A saturated softmax inside
    it has tiny gradients, accurate in fp32: not masked_underflow."""
    def run(island: bool):
        s = Synth(60)
        for name in ("aux_head.0", "trunk.0"):
            s.sampled(range(10, 60, 10), Kind.OUTPUT, name, absmax=3.0)
            s.tensor_dtypes[(int(Kind.OUTPUT), name)] = DType.FLOAT16
        if island:
            s.tensor_dtypes[(int(Kind.OUTPUT), "aux_head.0")] = DType.FLOAT32
        s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, "aux_head.0.weight", sub16=4000,
                  flush16=1000, zeros=1000, absmax=1e-5, rms=1e-6)
        s.sampled(range(10, 60, 10), Kind.PARAM_GRAD, "trunk.0.weight", absmax=300.0, rms=50.0)
        return engine.diagnose(s.run())
    assert run(island=False).verdict == "masked_underflow"
    assert run(island=True).verdict == "healthy"


def test_a_treated_run_says_what_was_applied_and_what_could_not_be():
    s = Synth(40)
    s.meta["applied"] = [{"fix": "fp32_island", "arg": "fp32_island=blocks.0.attn,blocks.7.attn",
                          "modules": ["blocks.0.attn"], "missing": ["blocks.7.attn"]},
                         {"fix": "adam_eps", "arg": "adam_eps=1e-5", "error": "TypeError: x"}]
    d = engine.diagnose(s.run())
    assert d.run["applied"] == ["fp32_island=blocks.0.attn,blocks.7.attn", "adam_eps=1e-5"]
    notes = " ".join(d.notes)
    assert "treated with --apply fp32_island=blocks.0.attn,blocks.7.attn" in notes
    assert "no module named blocks.7.attn in the model" in notes
    assert "--apply adam_eps=1e-5 could not be applied (TypeError: x)" in notes
    assert not any("treated" in n for n in engine.diagnose(Synth(40).run()).notes)


# ---------------------------------------------------------------------------------------------
# the LR measured by a trial: the recorder's LR range test (diagnosis/lrrange.py)


def _rung(factor: float, losses: list, lr_top: float = 0.1) -> dict:
    return {"factor": factor, "lr": lr_top * factor, "losses": losses,
            "finite": all(isinstance(x, float) for x in losses), "skipped": 0, "seconds": 0.01}


def _tried(*rungs: dict, note: str = "", applied: str = "") -> Synth:
    """_warmup_overflow's run (loss 2 -> 1.3 before the failure at step 40, LR 0.1 there)
    with the LR range test its replay ran."""
    s = _warmup_overflow(False)
    if applied:
        s.meta["applied"] = [{"fix": "lr_factor", "arg": applied}]
    test = {"note": note} if note else {
        "state": "start", "state_step": 0, "event_step": 40, "lr": 0.1, "steps": 4,
        "batch": "the failing step's batch, repeated", "rungs": list(rungs)}
    s.snapshot(40, "forward", "trunk.2", "Linear", fp32_finite=0, lr_range=test)
    return s


FELL = [1.9, 1.7, 1.5, 1.3, 1.2]  # trains
CREPT = [1.9, 1.89, 1.88, 1.88, 1.87]  # finite, barely moves: held, not trained
BLEW = [1.9, 3.0, 40.0, "inf"]


def test_the_lr_is_the_rung_below_the_highest_that_trained_and_quotes_its_trial():
    d = engine.diagnose(_tried(_rung(1.0, BLEW), _rung(0.316, FELL), _rung(0.1, CREPT)).run())
    assert d.verdict == "lr_overflow"
    lower = fix(d, "lower_lr")
    assert lower.values["lr"] == 0.01 and lower.values["lr_factor"] == 0.067  # peak 0.15
    assert lower.source.startswith("lr 0.01: tried: LR 0.01 kept the loss at 1.87 over 4 "
                                   "steps"), lower.source
    assert "LR 0.0316, a rung above, is the highest that trained (the loss 1.9 to 1.2)" \
        in lower.source
    assert "LR 0.1 above it did not (the loss was inf after 3 steps)" in lower.source
    assert lower.apply == "lr_factor=0.067"


def test_a_rung_that_ends_above_the_runs_healthy_range_did_not_train():
    """A rung whose loss fell from its start but ended far above the run's own losses (2 at
    most here) is no LR to prescribe: the one below it is. A spike in its first steps alone
    (Adam's first, sign-sized updates from an empty state) is a transient, not the end."""
    ended = [40.0, 30.0, 28.0, 25.0, 24.0]
    s = _tried(_rung(1.0, BLEW), _rung(0.316, ended), _rung(0.1, FELL), _rung(0.0316, CREPT))
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert lower.values["lr"] == 0.0032 and "LR 0.0316 above it did not" in lower.source, \
        lower.source
    spiked = [1.9, 30.0, 1.5, 1.3, 1.2]  # in range where it ended
    s = _tried(_rung(1.0, BLEW), _rung(0.316, spiked), _rung(0.1, FELL))
    assert fix(engine.diagnose(s.run()), "lower_lr").values["lr"] == 0.01


def test_a_rung_that_ends_above_its_own_start_by_more_than_the_band_did_not_train():
    """The run's range may hold the first steps of the blow-up (diffusers' UNet at LR 10:
    1.1, 1.1, 700 before the NaN): a rung is also held to its own start, a loss of the kept
    healthy state, plus the band (1.9 * 1.5 = 2.85 here, under the run's 3.0)."""
    swung = [1.9, 30.0, 40.0, 2.9, 2.95, 1.2]
    s = _tried(_rung(1.0, BLEW), _rung(0.316, swung), _rung(0.1, FELL))
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert lower.values["lr"] == 0.0032 and "LR 0.01 is the highest that trained" \
        in lower.source, lower.source


def test_the_rungs_are_read_from_the_highest_lr_down_whatever_order_they_ran_in():
    """The recorder goes down a decade at a time, then tries the half-decade above the first
    that trained: the rungs come in that order."""
    s = _tried(_rung(1.0, BLEW), _rung(0.1, CREPT), _rung(0.316, FELL))
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert lower.values["lr"] == 0.01 and "LR 0.0316, a rung above, is the highest" \
        in lower.source


def test_a_margin_rung_not_run_is_a_rung_below_and_says_it_was_not_tried():
    s = _tried(_rung(1.0, BLEW), _rung(0.316, FELL))
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert lower.values["lr"] == 0.01
    assert "LR 0.0316 is the highest that trained in the LR range test" in lower.source
    assert "(not tried itself: the ladder stopped" in lower.source


def test_without_a_trial_the_lr_is_a_bound_and_says_why():
    plain = fix(engine.diagnose(_warmup_overflow(False).run()), "lower_lr")
    assert "lr 0.0" in plain.source and "a bound, not a trial (the recorder ran no LR range " \
        "test on this run" in plain.source, plain.source
    kept = fix(engine.diagnose(_tried(note="no state was kept: the weights and optimizer state "
                                      "were over 256 MiB (812 MiB)").run()), "lower_lr")
    assert "a bound, not a trial (no LR range test ran: no state was kept: the weights and " \
        "optimizer state were over 256 MiB (812 MiB)): " in kept.source
    assert kept.values["lr"] == plain.values["lr"]
    itself = fix(engine.diagnose(_tried(_rung(1.0, FELL)).run()), "lower_lr")
    assert "the failing LR 0.1 itself trained over 4 steps" in itself.source
    none = fix(engine.diagnose(_tried(_rung(1.0, BLEW), _rung(0.316, BLEW)).run()), "lower_lr")
    assert "the LR range test found no LR that trained, down to LR 0.0316" in none.source


def test_where_no_rung_trained_the_bound_lies_a_decade_below_the_lowest_tried():
    """diffusers' train_unconditional.py at LR 10 on a CPU: the ladder stopped at LR 0.01 by
    its time budget with no rung that trained, and the bound from the LR history (0.5) was
    above every LR the trial had proven to fail; applied, it did not train."""
    plain = fix(engine.diagnose(_warmup_overflow(False).run()), "lower_lr").values["lr"]
    low = plain * 0.3
    s = _tried(_rung(1.0, BLEW, lr_top=low * 10), _rung(0.1, BLEW, lr_top=low * 10))
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert lower.values["lr"] == pytest.approx(low / 10, rel=0.05), lower.values
    assert f"a decade below LR {fmt(low)}, the lowest the LR range test tried" in lower.source
    higher = _tried(_rung(1.0, BLEW, lr_top=plain * 1000), _rung(0.1, BLEW, lr_top=plain * 1000))
    assert fix(engine.diagnose(higher.run()), "lower_lr").values["lr"] == plain


def test_a_treated_runs_next_dose_is_against_the_users_own_command():
    """A run treated with --apply lr_factor=0.5 recorded its LRs as the user's times 0.5: the
    next lr_factor multiplies the user's, not the treated run's (issue 40's diffusers run said
    its next dose against the treated LR)."""
    rungs = (_rung(1.0, BLEW), _rung(0.316, FELL), _rung(0.1, CREPT))
    lower = fix(engine.diagnose(_tried(*rungs, applied="lr_factor=0.5").run()), "lower_lr")
    assert lower.values["lr"] == 0.01 and lower.values["lr_factor"] == 0.033  # 0.5 * 0.01/0.15
    assert lower.apply == "lr_factor=0.033"
    assert "against your own command (this run ran with --apply lr_factor=0.5" in lower.source


def test_max_norm_is_the_scripts_own_clip_where_it_clips():
    """Issue 40: diffusers clips at 1.0 and ampdoctor recorded it, yet the fix said
    "max_norm 1: the common default"."""
    s = _tried(_rung(1.0, BLEW), _rung(0.316, FELL), _rung(0.1, CREPT))
    s.meta["clip"] = {"how": "clip_grad_norm_", "max_norm": 0.5, "norm_type": 2.0}
    assert doses(s)("max_norm").values["max_norm"] == 0.5
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert "keep clipping gradients at 0.5 (after unscale_), as the script does" in lower.text
    assert "max_norm 0.5: the script's own clip, clip_grad_norm_(max_norm=0.5)" in lower.source
    assert "common default" not in lower.source
    # accelerate >= 1.16 clips with torch's split API (diffusers' train_unconditional.py)
    s.meta["clip"] = {"how": "clip_grads_with_norm_", "max_norm": 1.0, "norm_type": None}
    lower = fix(engine.diagnose(s.run()), "lower_lr")
    assert "max_norm 1: the script's own clip, clip_grads_with_norm_(max_norm=1)" in lower.source
    assert "keep clipping gradients at 1 (after unscale_), as the script does" in lower.text
