"""check_amp_step and the amp_contract fixture: one step per misuse, correct steps in fp16 and
bf16, and the caller's objects bit-identical afterwards."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ampdoctor.testing import AmpContractError, check_amp_step

DEV = "cpu"


def make(scaler: bool = True, init_scale: float = 2.0 ** 16, adam: bool = False,
         half: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if half:
        model.half()
    opt = (torch.optim.AdamW if adam else torch.optim.SGD)(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler(DEV, init_scale=init_scale) if scaler else None
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    return model, opt, sc, batch


def fp16_loss(model, batch):
    x, y = batch
    with torch.autocast(DEV, dtype=torch.float16):
        return F.cross_entropy(model(x), y)


def good_fp16(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def good_bf16(model, opt, scaler, batch):
    x, y = batch
    with torch.autocast(DEV, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def good_accumulating(model, opt, scaler, batch):
    """Two micro-batches into one optimizer step: the second backward adds on purpose."""
    opt.zero_grad(set_to_none=True)
    for half in (slice(0, 2), slice(2, 4)):
        part = (batch[0][half], batch[1][half])
        scaler.scale(fp16_loss(model, part) / 2).backward()
    scaler.step(opt)
    scaler.update()


def clip_before_unscale(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def backward_after_unscale(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    scaler.unscale_(opt)  # SAM's ascent on true gradients ...
    scaler.scale(fp16_loss(model, batch)).backward()  # ... then its second pass, never unscaled
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def backward_unscaled(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    (fp16_loss(model, batch) * 0.1).backward()  # a second loss, not through the scaler
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def step_bypasses_scaler(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    opt.step()
    opt.zero_grad()


def step_without_update(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    scaler.step(opt)
    opt.zero_grad()


def unscale_twice(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def scaler_recreated(model, opt, scaler, batch):
    scaler = torch.amp.GradScaler(DEV)
    good_fp16(model, opt, scaler, batch)


def never_zeroed(model, opt, scaler, batch):
    scaler.scale(fp16_loss(model, batch)).backward()
    scaler.step(opt)
    scaler.update()


def zeroed_only_when_applied(model, opt, scaler, batch):
    scale = scaler.get_scale()
    never_zeroed(model, opt, scaler, batch)
    if scaler.get_scale() >= scale:
        opt.zero_grad()


def fp16_without_scaler(model, opt, scaler, batch):
    fp16_loss(model, batch).backward()
    opt.step()
    opt.zero_grad()


def loss_outside_autocast(model, opt, scaler, batch):
    x, y = batch
    with torch.autocast(DEV, dtype=torch.float16):
        out = model(x)
    loss = (out - F.one_hot(y, 4).to(out.dtype)).pow(2).mean()  # fp16: outside autocast
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def penalty_of_scaled_grads(model, opt, scaler, batch):
    x, y = batch
    with torch.autocast(DEV, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
    with torch.autocast(DEV, dtype=torch.float16):  # no 1 / scaler.get_scale() first
        loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def with_scheduler(guarded: bool):
    state = {}

    def step(model, opt, scaler, batch):
        if "s" not in state:
            state["s"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 10))
        scale = scaler.get_scale()
        scaler.scale(fp16_loss(model, batch)).backward()
        scaler.step(opt)
        scaler.update()
        if not guarded or scaler.get_scale() >= scale:
            state["s"].step()
        opt.zero_grad()
    return step


@pytest.mark.parametrize("step,kw", [
    (good_fp16, {}),
    (good_fp16, {"init_scale": 2.0 ** 40}),  # GradScaler calibrating: real skips, still correct
    (good_fp16, {"adam": True}),
    (good_bf16, {"scaler": False}),
    (good_accumulating, {}),
    (with_scheduler(guarded=True), {}),
], ids=["fp16", "fp16-calibrating", "fp16-adamw", "bf16", "accumulating", "scheduler-guarded"])
def test_a_correct_step_passes(step, kw):
    model, opt, scaler, batch = make(**kw)
    check_amp_step(step, model, opt, scaler, batch)


MISUSES = [
    (penalty_of_scaled_grads, {}, "scaled_grads_in_loss", "unscale_autograd_grad"),
    (clip_before_unscale, {}, "clip_before_unscale", "unscale_before_clip"),
    (step_bypasses_scaler, {}, "step_bypasses_scaler", "use_scaler_step"),
    (step_without_update, {}, "step_without_update", "fix_scaler_calls"),
    (unscale_twice, {}, "unscale_twice", "fix_scaler_calls"),
    (backward_unscaled, {}, "backward_unscaled", "scale_every_loss"),
    (backward_after_unscale, {}, "backward_after_unscale", "unscale_after_last_backward"),
    (scaler_recreated, {}, "scaler_recreated", "create_scaler_once"),
    (never_zeroed, {}, "grad_not_zeroed", "zero_grad_every_step"),
    # At a scale of 1 nothing overflows: the skip these two need is check_amp_step's own.
    (zeroed_only_when_applied, {"init_scale": 1.0}, "grad_not_zeroed", "zero_grad_every_step"),
    (with_scheduler(guarded=False), {"init_scale": 1.0}, "scheduler_on_skipped_step",
     "scheduler_after_real_step"),
    (fp16_without_scaler, {"scaler": False}, "fp16_without_scaler", "add_grad_scaler"),
    (loss_outside_autocast, {}, "fp16_loss", "loss_in_fp32"),
    # GradScaler's own error, named as diagnose names it
    (good_fp16, {"half": True}, "fp16_params_with_scaler", "fp32_master_weights"),
]


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
@pytest.mark.parametrize("step,kw,vid,fix", MISUSES, ids=[m[2] for m in MISUSES])
def test_each_misuse_is_named_with_its_fix(step, kw, vid, fix):
    model, opt, scaler, batch = make(**kw)
    with pytest.raises(AssertionError) as info:
        check_amp_step(step, model, opt, scaler, batch)
    err = info.value
    assert isinstance(err, AmpContractError)
    assert [v.id for v in err.violations] == [vid]
    lines = str(err).splitlines()
    assert lines[0] == f"AMP step contract broken (1): {vid}"
    assert lines[1].startswith(f"{vid}: ")
    assert any(line.startswith(f"  fix [{fix}]: ") for line in lines)
    snippet = err.violations[0].fixes[0].snippet
    assert snippet and "      " + snippet.splitlines()[0] in lines


def test_a_step_that_only_zeroes_after_applied_steps_is_told_why():
    model, opt, scaler, batch = make(init_scale=1.0)
    with pytest.raises(AssertionError, match="it was skipped"):
        check_amp_step(zeroed_only_when_applied, model, opt, scaler, batch)


def test_several_violations_are_all_named_on_the_first_line():
    def step(model, opt, scaler, batch):
        scaler = torch.amp.GradScaler(DEV)
        scaler.scale(fp16_loss(model, batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    model, opt, scaler, batch = make()
    with pytest.raises(AssertionError) as info:
        check_amp_step(step, model, opt, scaler, batch)
    head = str(info.value).splitlines()[0]
    for vid in ("clip_before_unscale", "scaler_recreated", "grad_not_zeroed"):
        assert vid in head


def test_an_error_of_the_step_itself_is_raised_as_it_is():
    def step(model, opt, scaler, batch):
        good_fp16(model, opt, scaler, batch)
        raise KeyError("the user's own bug")

    model, opt, scaler, batch = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyError, match="the user's own bug"):
        check_amp_step(step, model, opt, scaler, batch)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _state(model, opt, scaler, sched):
    """Everything the step may change, as plain copies."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()],
            "training": [m.training for m in model.modules()],
            "opt": {k: v.clone() for p in model.parameters() for k, v in opt.state[p].items()},
            "lr": [g["lr"] for g in opt.param_groups],
            "scaler": scaler.state_dict(), "scale_obj": scaler._scale,
            "sched": dict(sched.state_dict()),
            "rng": torch.get_rng_state(), "py": random.getstate(),
            "np": np.random.get_state()[1].copy()}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("step", [good_fp16, never_zeroed, clip_before_unscale, unscale_twice])
def test_the_callers_objects_are_bit_identical_afterwards(step):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(DEV, init_scale=1024.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    for _ in range(2):  # real state: Adam moments, a grown scaler, .grad left in place
        scaler.scale(fp16_loss(model, batch)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    model.eval()
    model[2].train()
    def stepping(m, o, s, b):
        step(m, o, s, b)
        sched.step()
        random.random(), np.random.rand()

    before = _state(model, opt, scaler, sched)
    grad_objects = [p.grad for p in model.parameters()]
    try:
        check_amp_step(stepping, model, opt, scaler, batch)
    except AssertionError:
        pass
    after = _state(model, opt, scaler, sched)
    for key in before:
        assert _same(before[key], after[key]), key
    assert after["scale_obj"] is before["scale_obj"]
    assert all(a is p.grad for a, p in zip(grad_objects, model.parameters()))


def test_the_fixture_is_registered_by_the_plugin(pytester):
    pytester.makepyfile("""
        import torch

        def step(model, opt, scaler, batch):
            model(batch).sum().backward()
            opt.step()

        def test_step(amp_contract):
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            amp_contract(step, model, opt, None, torch.randn(4, 3))
    """)
    result = pytester.runpytest_inprocess("-p", "ampdoctor.testing")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*AMP step contract broken (1): grad_not_zeroed*"])


def test_importing_the_testing_module_needs_neither_torch_nor_pytest():
    import subprocess
    import sys

    code = ("import sys; import ampdoctor.testing as t; "
            "assert 'torch' not in sys.modules and 'pytest' not in sys.modules; "
            "assert not hasattr(t, 'amp_contract'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_step_that_cannot_survive_a_skip_is_told_so():
    def step(model, opt, scaler, batch):
        scaler.scale(fp16_loss(model, batch)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    model, opt, scaler, batch = make()
    with pytest.raises(RuntimeError, match="non-finite") as info:
        check_amp_step(step, model, opt, scaler, batch)
    assert any("this first call was made to skip" in n for n in info.value.__notes__)


@pytest.mark.gpu
def test_on_cuda_a_correct_fp16_step_passes_and_a_misuse_is_named():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(4, 8, device="cuda"), torch.randint(0, 4, (4,), device="cuda"))

    def step(model, opt, scaler, batch, clip_first=False):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if not clip_first:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    scaler = torch.amp.GradScaler("cuda")
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.cuda.get_rng_state()
    check_amp_step(step, model, opt, scaler, batch)
    with pytest.raises(AssertionError, match="clip_before_unscale"):
        check_amp_step(lambda *a: step(*a, clip_first=True), model, opt, scaler, batch)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert torch.equal(rng, torch.cuda.get_rng_state())
