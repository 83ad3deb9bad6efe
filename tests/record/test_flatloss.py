"""The flat-loss watch (``record/flatloss.py``): when the loss stops falling between sampled
steps, one more sampled step (op probe included) comes, with a back-off, a budget of five per
run, no host read of its own beyond a few documented drains, and it steps aside if it fails.

Unit tests on ``FlatLoss`` with loss sequences, then the recorder on tiny models in the test
process: a flat run gets its probes (``Event.FLAT_LOSS_PROBE`` at sampled steps), a run whose
loss falls gets none, and a watch that raises leaves the recording and the training alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyNet

import ampdoctor
from ampdoctor.diagnosis.events import flat_probes
from ampdoctor.record import flatloss
from ampdoctor.record.flatloss import DRAINS, FIRST, MAX_PROBES, FlatLoss
from ampdoctor.runfile.schema import Event


def _feed(watch: FlatLoss, losses, chunk: int = 7) -> list[tuple[int, dict]]:
    """Feed losses a drain (``chunk`` steps) at a time; after each, take what is due, as the
    next step's start would: [(steps seen when it was taken, its detail)]."""
    taken = []
    for i in range(0, len(losses), chunk):
        watch.see(np.asarray(losses[i:i + chunk], dtype=np.float64))
        due = watch.take()
        if due is not None:
            taken.append((watch.seen, due))
    return taken


def test_a_falling_loss_arms_nothing():
    losses = 2.0 * np.exp(-np.arange(400) / 30.0) + 0.01
    watch = FlatLoss()
    assert _feed(watch, losses) == [] and watch.probes == 0 and watch.flat_steps == 0


def test_a_flat_loss_is_probed_with_a_back_off_and_a_budget():
    rng = np.random.default_rng(0)
    losses = 2.08 + 0.01 * rng.standard_normal(2000)
    taken = _feed(FlatLoss(), losses, chunk=1)
    assert len(taken) == MAX_PROBES
    flat = [d.flat_steps for _, d in taken]
    assert flat[0] == FIRST and all(b >= 2 * a for a, b in zip(flat, flat[1:])), flat
    assert [d.probe for _, d in taken] == list(range(1, MAX_PROBES + 1))
    first = taken[0][1]
    assert first.recent >= 0.9 * first.start and first.start == pytest.approx(2.08, abs=0.02)


def test_a_loss_that_falls_again_starts_the_back_off_again():
    flat = [2.0] * 40  # probes at 20 (and at 40: the stretch doubled)
    fall = list(np.linspace(2.0, 0.5, 30))  # it falls: the count resets
    rise = [2.0] * 30  # back to where it began: the first mark is 20 again
    taken = _feed(FlatLoss(), flat + fall + rise, chunk=1)
    marks = [d.flat_steps for _, d in taken]
    assert marks[:2] == [FIRST, 2 * FIRST] and marks[2] == FIRST, marks


def test_nonfinite_losses_are_skipped_and_a_loss_that_is_not_positive_turns_it_off():
    watch = FlatLoss()
    watch.see(np.array([np.nan] * 5 + [np.inf] * 3))
    assert np.isnan(watch.start) and not watch.spent
    zero = FlatLoss()
    zero.see(np.zeros(50))
    assert zero.spent and zero.take() is None


def test_it_asks_for_a_drain_where_its_mark_could_be_reached_and_no_more_than_drains():
    """A run of fast steps that no timed drain interrupts: the watch's own drains alone."""
    watch, seen, drains = FlatLoss(), 0, []
    for s in range(1, 2000):
        if watch.wants_drain(s):
            watch.see(np.full(s - seen, 2.0))
            seen = s
            drains.append(s)
            watch.take()
    mark = FIRST + flatloss.RECENT_STEPS - 1  # the first step with 20 full flat windows
    assert drains == [mark, mark + 20, mark + 60, mark + 140, mark + 300], drains
    assert watch.probes == MAX_PROBES and watch.asked <= DRAINS


# ---------------------------------------------------------------------------------------------
# the recorder


def _loop(steps: int, lr: float, path: str, every: int = 1000, fail=None) -> list[float]:
    """TinyNet on one fixed batch (a loss that falls with a real LR, flat at lr 0), fp16
    autocast with a GradScaler; returns the losses."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    losses = []
    ctx = ampdoctor.watch(model, opt, scaler, path=path, every=every, flush_seconds=1e9) \
        if path else None
    if ctx is not None:
        ctx.__enter__()
        if fail is not None:
            ctx._hooks.log.flat.see = fail
    try:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            losses.append(loss.item())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses


def _probes(path: str) -> dict:
    return flat_probes(ampdoctor.load(path))


def test_a_flat_run_gets_probes_on_sampled_steps(tmp_path):
    path = str(tmp_path / "flat.h5")
    _loop(80, 0.0, path)
    run = ampdoctor.load(path)
    probes = _probes(path)
    assert 1 <= len(probes) <= MAX_PROBES
    first = min(probes)
    # the first mark: a full window (10 steps) and 20 flat steps; the probe lands on the step
    # after the drain that saw it
    assert FIRST + flatloss.RECENT_STEPS - 1 <= first <= FIRST + flatloss.RECENT_STEPS + 1
    assert probes[first]["probe"] == 1 and probes[first]["flat_steps"] >= FIRST
    sampled = set(np.unique(run.stats["step"]).tolist())
    assert set(probes) <= sampled, (sorted(probes), sorted(sampled))
    ev = run.events[run.events["kind"] == int(Event.FLAT_LOSS_PROBE)]
    assert json.loads(str(ev[0]["text"]))["probe"] == 1


def test_a_falling_run_gets_none_and_an_interval_under_the_first_mark_no_watch(tmp_path):
    falling = str(tmp_path / "falling.h5")
    losses = _loop(80, 0.5, falling)
    assert losses[-1] < 0.5 * losses[0]
    assert _probes(falling) == {}
    short = str(tmp_path / "short.h5")
    _loop(60, 0.0, short, every=10)  # the interval already samples a flat stretch
    assert _probes(short) == {}


def test_the_watch_does_not_change_the_training(tmp_path):
    plain = _loop(50, 0.0, None)
    recorded = _loop(50, 0.0, str(tmp_path / "run.h5"))
    assert plain == recorded


def test_a_failing_watch_steps_aside(tmp_path):
    def broken(losses):
        raise RuntimeError("boom")
    path = str(tmp_path / "run.h5")
    plain = _loop(50, 0.0, None)
    with pytest.warns(RuntimeWarning, match="flat-loss watch stopped"):
        assert _loop(50, 0.0, path, fail=broken) == plain
    run = ampdoctor.load(path)
    assert len(run.steps) == 50 and _probes(path) == {}
