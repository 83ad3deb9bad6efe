"""The LR range test (``record/forensic/lrrange.py``): at the first non-finite loss the
recorder trains copies of the run's first weights and optimizer state again on the failing
step's batch at a ladder of LRs; the run itself trains bit for bit as without ampdoctor, and
the LR the diagnosis prescribes from the trial trains when applied. A tiny fp32 MLP with SGD
at an LR that makes its loss inf at step 8."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.diagnosis import proofs
from ampdoctor.diagnosis.facts import Facts
from ampdoctor.record.forensic import lrrange
from ampdoctor.runfile.payloads import LrRange, SnapshotDetail

FAILING_LR = 0.3  # the loss is inf at step 8 (momentum 0.9)


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(32, 1, generator=g)))
    return out


class WithLoss(nn.Module):
    """A model that returns its own loss, as a Hugging Face model given labels does."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, y):
        return ((self.net(x) - y) ** 2).mean()


def _train(lr, path=None, steps=30, loss_fn=None, inside=False, make=None):
    """SGD with momentum under a GradScaler, so that the steps from the first inf loss on are
    skipped and the weights stay finite (what the range test must leave as they are)."""
    torch.manual_seed(0)
    model = make() if make else WithLoss() if inside else nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    watch = ampdoctor.watch(model, opt, scaler, path=str(path), strict=True) if path else \
        contextlib.nullcontext()
    losses = []
    with watch:
        for x, y in _data(steps):
            if inside:
                loss = model(x, y)
            else:
                out = model(x)
                loss = F.mse_loss(out, y) if loss_fn is None else loss_fn(out, y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()], opt


def _lr_range(path):
    found = [SnapshotDetail.from_json(s["detail"]).lr_range
             for s in Facts(ampdoctor.load(str(path))).snapshots]
    return next(x for x in found if x is not None)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("lrrange") / "run.h5"
    return path, _train(FAILING_LR, path)


def test_the_range_test_leaves_the_run_bit_identical(recorded):
    _, (losses, weights, opt) = recorded
    plain_losses, plain_weights, plain_opt = _train(FAILING_LR)
    assert np.isinf(plain_losses[8]), "the LR must make the loss inf for the test to mean it"
    assert all(torch.isfinite(w).all() for w in weights)  # kept by the skipped steps
    assert np.array_equal(np.array(plain_losses), np.array(losses), equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights))
    for a, b in zip(plain_opt.state.values(), opt.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_the_ladder_goes_down_by_decades_then_finds_the_highest_that_trains_and_a_margin(
        recorded):
    path, _ = recorded
    test = _lr_range(path)
    assert test.state == "start" and test.state_step == 0 and test.event_step == 8
    assert test.lr == pytest.approx(FAILING_LR) and test.optimizer == "SGD"
    rungs = test.rungs
    assert not rungs[0].finite and rungs[0].factor == 1.0  # fails in the trial too
    halves = [round(-2 * np.log10(r.lr / test.lr), 6) for r in rungs]
    assert all(h == int(h) for h in halves), halves  # half-decades of the failing LR
    decades = [h // 2 for h in halves if h % 2 == 0]
    assert decades == list(range(len(decades)))  # a decade at a time, from the top
    by_lr = sorted(rungs, key=lambda r: -r.lr)
    trained = [LrRange.trains(r) for r in by_lr]
    top = trained.index(True)
    assert not any(trained[:top]) and top + 1 < len(by_lr)  # above it none; below, a margin
    assert by_lr[top + 1].finite
    assert by_lr[top - 1].lr / by_lr[top].lr == pytest.approx(10 ** 0.5)
    for r in rungs:
        assert r.losses[0] == pytest.approx(rungs[0].losses[0])  # from one state
        if r.finite:
            assert len(r.losses) == test.steps + 1


def test_the_lr_the_trial_prescribes_trains_when_applied(recorded):
    """The diagnosis quotes the trial, and ``--apply lr_factor=F`` (every LR times F) trains:
    no non-finite loss, and it ends well below where the run started and inside the range
    the failing run had while healthy."""
    path, (losses, _, _) = recorded
    d = ampdoctor.diagnose(str(path))
    fx = next(fx for fx in d.fixes if fx.id == "lower_lr")
    assert fx.source.startswith(f"lr {fx.values['lr']:g}: tried: LR "), fx.source
    assert "over 12 steps" in fx.source and "above it did not" in fx.source
    assert fx.apply == f"lr_factor={fx.values['lr_factor']:g}"
    treated, _, _ = _train(FAILING_LR * fx.values["lr_factor"])
    assert np.isfinite(treated).all()
    lo, _ = proofs.healthy_range(Facts(ampdoctor.load(str(path))), 8)
    assert np.median(treated[-5:]) < min(lo, treated[0] / 4), treated


def test_a_state_too_big_to_keep_makes_the_dose_a_bound_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(lrrange, "STATE_BYTES", 0)
    _train(FAILING_LR, tmp_path / "run.h5", steps=12)
    assert "over 0 MiB" in _lr_range(tmp_path / "run.h5").note
    fx = next(fx for fx in ampdoctor.diagnose(str(tmp_path / "run.h5")).fixes
              if fx.id == "lower_lr")
    assert "a bound, not a trial (no LR range test ran: no state was kept: the weights and " \
        "optimizer state were over 0 MiB" in fx.source, fx.source


def test_a_loss_written_by_hand_is_not_tried(tmp_path):
    _train(FAILING_LR, tmp_path / "run.h5", steps=12,
           loss_fn=lambda out, y: ((out - y) ** 2).mean())
    assert "written by hand" in _lr_range(tmp_path / "run.h5").note


def test_a_loss_the_model_returns_is_trained_on(tmp_path):
    """A model that computes its loss inside (Hugging Face's, given labels): the trial
    backwards from the loss it returns, as the step did."""
    _, weights, _ = _train(FAILING_LR, tmp_path / "run.h5", inside=True)
    plain = _train(FAILING_LR, inside=True)[1]
    assert all(torch.equal(a, b) for a, b in zip(plain, weights))
    test = _lr_range(tmp_path / "run.h5")
    assert not test.note, test.note
    assert not test.rungs[0].finite and any(LrRange.trains(r) for r in test.rungs)


class Frozen(dict):
    """A mapping that refuses every write, as diffusers' ``FrozenDict`` (a model's
    ``config``) does: its ``update`` raises, but ``clear`` is dict's own."""

    def _refuse(self, *args, **kwargs):
        raise Exception(f"You cannot use this on a {type(self).__name__} instance.")

    update = __setitem__ = __delitem__ = pop = setdefault = _refuse


class WithConfig(nn.Module):
    """A model that reads a frozen config in its forward (diffusers' UNets read
    ``self.config``), so that the replay and the trial save and put back its namespace."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.config = Frozen(scale=1.0)

    def forward(self, x):
        return self.net(x) * self.config["scale"]


def test_a_frozen_config_is_left_as_it_is_and_the_trial_runs(tmp_path):
    """diffusers' train_unconditional.py at LR 10: the trial failed ("You cannot use
    ``update`` on a FrozenDict instance") after emptying the model's config; a container the
    replay did not change is not written back."""
    models = []

    def make():
        models.append(WithConfig())
        return models[-1]

    _, weights, _ = _train(FAILING_LR, tmp_path / "run.h5", make=make)
    assert dict(models[0].config) == {"scale": 1.0}
    test = _lr_range(tmp_path / "run.h5")
    assert not test.note, test.note
    assert any(LrRange.trains(r) for r in test.rungs)
    plain = _train(FAILING_LR, make=make)[1]
    assert all(torch.equal(a, b) for a, b in zip(plain, weights))


# -- a divergence with no non-finite value ---------------------------------------------------

RISING_LR = 1.0  # Adam, no scaler: the loss 10.6, then 101 at step 1, 1669 at step 2, finite


class TwoNames(nn.Module):
    """The model held under two names, as Lightning Fabric's ``_FabricModule`` holds it
    (``_forward_module`` and ``_original_module``): litgpt's model."""

    def __init__(self, inner):
        super().__init__()
        self.forward_module = inner
        self.original_module = inner

    def forward(self, x):
        return self.forward_module(x)


def _train_rising(lr, path=None, steps=30, wrap=False):
    """Adam in fp32 with no scaler: at ``RISING_LR`` the loss blows up and never goes inf or
    NaN (litgpt's finetune_full at LR 10 does the same)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    model = TwoNames(model) if wrap else model
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    watch = ampdoctor.watch(model, opt, path=str(path), strict=True) if path else \
        contextlib.nullcontext()
    losses = []
    with watch:
        for x, y in _data(steps):
            loss = F.mse_loss(model(x), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()], opt


@pytest.fixture(scope="module")
def rising(tmp_path_factory):
    path = tmp_path_factory.mktemp("rising") / "run.h5"
    return path, _train_rising(RISING_LR, path)


def test_a_loss_that_rises_with_no_nan_is_tried_and_the_run_stays_bit_identical(rising):
    path, (losses, weights, opt) = rising
    plain_losses, plain_weights, plain_opt = _train_rising(RISING_LR)
    assert np.isfinite(plain_losses).all() and max(plain_losses) > 100 * plain_losses[0]
    assert plain_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights))
    for a, b in zip(plain_opt.state.values(), opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
    with ampdoctor.load(str(path)) as run:
        assert not [s for s in run.snapshots if SnapshotDetail.from_text(s["detail"]).lr_range]
        test = run.lr_range
    assert test is not None
    first = next(i for i, x in enumerate(losses) if x >= lrrange.RISE * losses[0])
    assert test.event_step == first and test.state == "start"
    assert test.trigger.startswith(f"the loss rose to {losses[first]:.4g}")
    assert test.lr == pytest.approx(RISING_LR) and not test.note
    assert any(LrRange.trains(r) for r in test.rungs)


def test_the_lr_tried_at_a_rise_is_quoted_and_trains_when_applied(rising):
    path, (losses, _, _) = rising
    fx = next(fx for fx in ampdoctor.diagnose(str(path)).fixes if fx.id == "lower_lr")
    assert "tried: LR " in fx.source and "over 12 steps" in fx.source, fx.source
    treated, _, _ = _train_rising(RISING_LR * fx.values["lr_factor"])
    assert np.isfinite(treated).all() and max(treated) < lrrange.RISE * treated[0]
    assert np.median(treated[-5:]) < treated[0] / 4, treated


def test_a_healthy_loss_runs_no_trial(tmp_path):
    losses, _, _ = _train_rising(0.01, tmp_path / "run.h5", steps=12)
    assert max(losses) < lrrange.RISE * losses[0]
    with ampdoctor.load(str(tmp_path / "run.h5")) as run:
        assert run.lr_range is None


def test_a_model_held_under_two_names_keeps_its_own_tensors_after_the_trial(tmp_path):
    """``functional_call`` swapped the copies of a module reached by two names in twice and
    left them in the model: litgpt at LR 10 (Fabric's wrapper) then trained tensors its
    optimizer never stepped, its loss stuck at the untrained level from the trial on."""
    losses, weights, _ = _train_rising(RISING_LR, tmp_path / "run.h5", steps=12, wrap=True)
    plain_losses, plain_weights, _ = _train_rising(RISING_LR, steps=12, wrap=True)
    with ampdoctor.load(str(tmp_path / "run.h5")) as run:
        assert run.lr_range and not run.lr_range.note
    assert plain_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights))
