"""Recorder-side signals the diagnosis relies on: the op probe inside a culprit, and a replay
budget that GradScaler's calibration does not use up."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import batches, fresh, train

import ampdoctor
from ampdoctor.record.opprobe import first_nonfinite_op


def _fp16():
    return torch.autocast("cpu", dtype=torch.float16)


class Scores(nn.Module):
    def __init__(self, mask_value=None, prescale=False):
        super().__init__()
        self.mask_value, self.prescale = mask_value, prescale

    def forward(self, q, k, keep):
        if self.prescale:
            q = q * q.shape[-1] ** -0.5
        scores = q @ k.transpose(-2, -1)
        if self.mask_value is not None:
            scores = scores + (1.0 - keep.to(scores.dtype)) * self.mask_value
        return scores.softmax(-1)


def _qk(scale):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, generator=g) * scale
    k = torch.randn(2, 8, 64, generator=g) * scale
    keep = torch.ones(2, 8, 8, dtype=torch.bool).tril()
    keep[:, :2] = False  # fully masked rows (left padding)
    return q, k, keep


def test_probe_names_the_overflowing_product():
    op = first_nonfinite_op(Scores(), _qk(60.0), context=_fp16())
    assert op.op == "matmul" and set(op.created) == {"posinf", "neginf"}
    assert op.dtype == "float16" and op.in_absmax > 100


def test_probe_tells_a_mask_constant_from_a_product():
    op = first_nonfinite_op(Scores(mask_value=-1e9, prescale=True), _qk(1.0), context=_fp16())
    assert op.op == "mul" and op.created == ["neginf"] and op.big_scalar == 1e9


def test_probe_ignores_an_explicit_inf_mask_but_sees_the_nan_it_makes():
    op = first_nonfinite_op(Scores(mask_value=-math.inf, prescale=True), _qk(1.0), context=_fp16())
    # (1 - keep) * -inf gives NaN where keep is 1 (0 * -inf): an explicit inf constant,
    # so the first created kind is that NaN, from the mul, not a finite constant overflowing.
    assert op is None or "neginf" not in op.created


def test_probe_is_quiet_when_everything_is_finite():
    assert first_nonfinite_op(Scores(prescale=True), _qk(1.0), context=_fp16()) is None


def test_calibration_skips_leave_the_replay_budget_for_the_failure(run_path):
    model, opt = fresh()
    # init_scale 2**22: steps 0-2, 4 and 7 overflow in backward (finite loss) while the scale
    # calibrates; the NaN batch comes after. Replaying every skip would spend the budget of 2
    # on steps 0 and 1.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    with ampdoctor.watch(model, opt, scaler, path=run_path, every=0, max_replays=2):
        train(model, opt, scaler, steps=30, bad_step=25, unscale=False)
    run = ampdoctor.load(run_path)
    assert run.steps["skipped"][:3].all()  # calibrating
    snaps = run.snapshots
    assert 25 in set(int(s) for s in snaps["step"]), snaps["step"]
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "bad_input" and d.first_bad["step"] == 25


def test_a_failing_step_audits_the_buffers(run_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=run_path, every=0):
        for i, (x, y) in enumerate(batches(12)):
            if i == 5:
                x[0, 0] = math.inf  # one corrupt sample: BatchNorm's statistics take it
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    run = ampdoctor.load(run_path)
    audit = run.events[run.events["kind"] == int(ampdoctor.runfile.schema.Event.NONFINITE_BUFFER)]
    names = {run.tensor_name(int(t)) for t in audit["tensor"]}
    assert set(audit["step"].tolist()) == {5} and "1.running_mean" in names
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "state_poisoning" and d.first_bad["module"] == "1"
