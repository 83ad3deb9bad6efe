"""The replay is invisible to the user's code: user code that keeps Python-side state or hooks
of its own trains the same under ampdoctor as without it.

A forensic replay and each fix trial run the user's modules again. User code that counts its
calls, keeps an EMA in a Python attribute, schedules a warm-up by its call count, collects
statistics from a hook into a list or prints from a backward hook would see those extra calls,
and the run would train differently under ``record``. Each test trains the same model twice,
plainly and under ``ampdoctor.watch``, on batches with an fp16 overflow at one step (so the
replay, the culprit's re-runs and the fix trials all run), and compares the losses, weights,
loss scale, user state and printed output.
"""

import contextlib
import io
import logging
import signal
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from culprits import FastExp, batches, make, scaler

import ampdoctor
from ampdoctor.record.forensic.isolated import preserved

SEEN: list = []  # a module-level list a user's hook appends to
CALLS = 0  # a module-level counter the model's forward rebinds (``global``)


class Counting(nn.Module):
    """Counts its forward calls and scales its output by a warm-up keyed on them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.calls = 0
        self.history = []

    def forward(self, x):
        self.calls += 1
        self.history.append(self.calls)
        warm = min(1.0, self.calls / 6)
        return self.lin(x) * warm


class Ema(nn.Module):
    """Normalises by a Python-side EMA of its input's scale (a float, and a plain tensor
    attribute updated in place: neither is a buffer)."""

    def __init__(self):
        super().__init__()
        self.ema = None
        self.seen = torch.zeros(())

    def forward(self, x):
        global CALLS
        CALLS += 1
        m = float(x.detach().float().abs().mean())
        self.ema = m if self.ema is None else 0.9 * self.ema + 0.1 * m
        self.seen.add_(1)
        if self.ema > 1.0:
            warnings.warn("activations are large", UserWarning, stacklevel=2)
        return x / (1.0 + self.ema)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = Counting()
        self.norm = Ema()
        self.exp = FastExp()
        self.head = nn.Linear(16, 4)
        self.grads = []

    def forward(self, x):
        h = self.exp(self.norm(self.count(x)) * 4)
        # a tensor hook registered in the forward: it collects the gradient's norm
        h.register_hook(lambda g: self.grads.append(float(g.float().norm())))
        return self.head(h)


def _hooked(model, out):
    """A user's hooks: a forward hook that appends to a list, a backward hook that prints,
    a global forward hook that counts, a tensor hook on a parameter that logs."""
    handles = [
        model.count.register_forward_hook(
            lambda m, a, o: SEEN.append(float(o.detach().float().sum()))),
        model.head.register_full_backward_hook(
            lambda m, gi, go: print(f"head grad {float(go[0].float().norm()):.4f}", file=out)),
        torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: None if m is not model else print(".", end="", file=out)),
        model.head.weight.register_hook(lambda g: logging.getLogger("user").warning("w grad")),
    ]
    return handles


def _train(recorded, tmp_path, steps=14, bad=(5, 9)):
    global CALLS
    SEEN.clear()
    CALLS = 0
    model = make(Net, seed=3)
    sc = scaler(2.0**10)
    out = io.StringIO()
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("user").addHandler(handler)
    handles = _hooked(model, out)
    data = batches(steps, seed=2)
    for i in bad:  # an fp16 overflow inside FastExp at these steps only
        data[i] = (data[i][0] * 40, data[i][1])
    watch = ampdoctor.watch(model, model.opt, sc, path=str(tmp_path / "run.h5"), every=3,
                            strict=True) if recorded else contextlib.nullcontext()
    losses, scales = [], []
    try:
        with watch as rec, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for x, y in data:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                losses.append(loss.item())
                sc.scale(loss).backward()
                sc.step(model.opt)
                sc.update()
                model.opt.zero_grad(set_to_none=True)
                scales.append(sc.get_scale())
    finally:
        for h in handles:
            h.remove()
        logging.getLogger("user").removeHandler(handler)
    state = dict(calls=model.count.calls, history=list(model.count.history),
                 ema=model.norm.ema, seen=float(model.norm.seen), grads=list(model.grads),
                 hooked=list(SEEN), global_calls=CALLS, printed=out.getvalue(),
                 logged=log.getvalue(), warned=[str(w.message) for w in caught])
    weights = [p.detach().clone() for p in model.parameters()]
    return losses, scales, weights, state, rec


def test_user_state_hooks_and_output_are_the_same_under_record(tmp_path):
    plain_losses, plain_scales, plain_weights, plain, _ = _train(False, tmp_path)
    losses, scales, weights, state, rec = _train(True, tmp_path)
    replayed = [e for e in rec.events if e.replayed]
    assert replayed, "the overflow must be replayed for this test to mean anything"
    assert replayed[0].module == "exp"
    assert np.array_equal(np.array(plain_losses), np.array(losses), equal_nan=True)
    assert plain_scales == scales
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights))
    for key in plain:  # repr: a NaN the plain run saw equals the recorded run's
        assert repr(state[key]) == repr(plain[key]), key
    assert plain["printed"].count("head grad") == len(plain_losses)
    assert "w grad" in plain["logged"] and plain["warned"] == ["activations are large"]


def test_a_replay_sets_user_hooks_aside_and_puts_them_back():
    """Inside ``preserved``: no user hook runs, module state written by the forward is put
    back, printed output is not shown; afterwards every hook is where it was."""
    model = make(Net, seed=1)
    out = io.StringIO()
    handles = _hooked(model, out)
    SEEN.clear()
    before = (model.count.calls, list(model.count.history), model.norm.ema,
              model.norm.seen.clone(), CALLS)
    try:
        with preserved([model], devices=[]) as isolation:
            x = torch.randn(4, 8)
            print("from the replay")
            loss = model(x).sum()
            torch.autograd.grad(loss, list(model.parameters()))
        assert SEEN == [] and out.getvalue() == ""
        assert (model.count.calls, model.count.history, model.norm.ema, CALLS) == \
            (before[0], before[1], before[2], before[4])
        assert torch.equal(model.norm.seen, before[3]) and model.grads == []
        assert isolation.hooks_set_aside >= 4
        # the hooks are back: a real call runs them
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        assert len(SEEN) == 1 and "head grad" in out.getvalue()
    finally:
        for h in handles:
            h.remove()


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
def test_torch_s_own_hooks_still_run_in_a_replay():
    """torch's own hooks compute the values the module uses (weight_norm recomputes its weight
    in a forward pre-hook): they are not the user's side effects, and keep running."""
    torch.manual_seed(0)
    lin = torch.nn.utils.weight_norm(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    expected = lin(x)
    with torch.no_grad():
        lin.weight_g.mul_(2)  # the pre-hook must recompute weight from weight_g
    with preserved([lin], devices=[]):
        again = lin(x)
    assert not torch.allclose(expected, again)


class Logging(nn.Module):
    """Writes a line to its own log file on every call: a replay cannot put that back."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.body = nn.Sequential(nn.Linear(8, 16), FastExp())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        with open(self.path, "a") as f:
            f.write("call\n")
        return self.head(self.body(x))


def test_a_replay_that_would_write_a_file_is_refused_and_says_so(tmp_path):
    log = tmp_path / "model.log"
    model = make(Logging, str(log), seed=0)
    sc = scaler(2.0**10)
    data = batches(6, seed=1)
    data[3] = (data[3][0] * 40, data[3][1])
    with ampdoctor.watch(model, model.opt, sc, path=str(tmp_path / "run.h5"), every=0) as rec:
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            sc.scale(loss).backward()
            sc.step(model.opt)
            sc.update()
            model.opt.zero_grad(set_to_none=True)
    assert log.read_text().count("call") == len(data)  # the real calls only
    event = next(e for e in rec.events if e.step == 3)
    error = event.result.detail.replay_error
    assert "SideEffect" in error and "model.log" in error and "not replayed" in error
    notes = ampdoctor.diagnose(str(tmp_path / "run.h5")).notes
    assert any(n.startswith("Step 3 was not replayed: the model's code tried to open")
               for n in notes), notes
    # other threads are not the replay's: they write as they like meanwhile
    assert isolated_thread_writes(tmp_path)


def isolated_thread_writes(tmp_path):
    """A thread other than the replay's writes a file while a replay runs."""
    import threading

    done = []

    def write():
        (tmp_path / "other.txt").write_text("ok")
        done.append(True)

    with preserved([nn.Linear(2, 2)], devices=[]):
        t = threading.Thread(target=write)
        t.start()
        t.join()
        with pytest.raises(RuntimeError, match="for writing"):
            open(tmp_path / "refused.txt", "w")
    return done == [True] and not (tmp_path / "refused.txt").exists()


TALLY: dict = {"calls": 0}
LOG: list = []


def log_activation(h):
    """A helper the forward calls: it keeps state of its own, in the module's globals."""
    global LAST
    LAST = float(h.detach().abs().mean())
    TALLY["calls"] += 1
    LOG.append(LAST)


class Meter:
    """A plain object (not a module) whose method the forward calls: a running count."""

    def __init__(self):
        self.n, self.seen = 0, []

    def update(self, h):
        self.n += 1
        self.seen.append(h.shape[0])


class Helped(nn.Module):
    def __init__(self, meter):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.meter = meter

    def forward(self, x):
        h = self.lin(x)
        log_activation(h)
        self.meter.update(h)
        return h


def test_state_that_the_forwards_helpers_keep_is_put_back():
    """What a function the forward calls changes (a global it assigns, a global list or dict
    it fills) and the attributes of a plain object whose method it calls come back as they
    were: each is saved when first called in the replay, before its body runs."""
    global LAST
    LAST = None
    meter = Meter()
    model = Helped(meter)
    model(torch.randn(2, 4))  # the real call
    before = (LAST, dict(TALLY), list(LOG), meter.n, list(meter.seen))
    with preserved([model], devices=[]):
        model(torch.randn(3, 4))
        model(torch.randn(5, 4))
    assert (LAST, TALLY, LOG, meter.n, meter.seen) == before
    model(torch.randn(6, 4))  # and the real run goes on counting from there
    assert meter.n == before[3] + 1 and TALLY["calls"] == before[1]["calls"] + 1


class Job:
    """A trainer that stops cleanly on a signal: its handler sets a flag the loop reads."""

    def __init__(self):
        self.stop_requested = False

    def on_signal(self, signum, frame):
        self.stop_requested = True


class Signalled(nn.Module):
    """A forward during which a signal lands (sent from inside it, so it lands there)."""

    def __init__(self, job):
        super().__init__()
        self.job = job
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        signal.raise_signal(signal.SIGUSR1)
        return self.lin(x)


def test_what_a_signal_handler_changes_during_a_replay_is_kept():
    """A signal is not the replay: a SIGTERM that lands while a step is replayed sets the
    trainer's stop flag, and the flag stays set (the profile function that saves what the
    user's functions change skips the handler), as ampdoctor's own held-back SIGTERM does."""
    job = Job()
    model = Signalled(job)
    previous = signal.getsignal(signal.SIGUSR1)
    # the handler as a bound method, then as a plain function
    for handler in (job.on_signal, lambda s, f: setattr(job, "stop_requested", True)):
        job.stop_requested = False
        signal.signal(signal.SIGUSR1, handler)
        try:
            with preserved([model], devices=[]):
                model(torch.randn(2, 4))
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert job.stop_requested
