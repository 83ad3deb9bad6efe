"""Always-on means no sync of ampdoctor's own on a steady step, and nothing kept past the step.

**Host reads.** ``HostReads`` is a ``TorchFunctionMode`` that sees every tensor method that
reads a value on the host (``item``, ``tolist``, ``cpu``, ``numpy``, ``bool()``, ``float()``,
``.to("cpu")``...) and counts those made by ampdoctor's own code: the first Python frame
outside torch that led to the call lies in the ampdoctor package (``patches.py`` and the doors
beside it excepted: their wrappers only call the user's own GradScaler or clip function, whose
reads are theirs).
The recorder's host mirrors are told apart honestly: a mirror (``readback.HostMirror``) is a
host buffer the recorder allocated and filled with a non-blocking copy; reading it once that
copy has landed reads host memory and syncs nothing. The mode checks each such read is of a
mirror whose copy had landed. On CPU every tensor is a host tensor, so this counts what would
be a device read on a GPU; ``test_gpu.py`` runs the same loops under
``torch.cuda.set_sync_debug_mode``. What a CPU run cannot see is a device-to-host ``copy_``
into a plain host tensor (every tensor here is one): the GPU tests cover it.

The expected count per steady step, with the forensic tier armed (the whole of a healthy run):
0 with a GradScaler (foreach or fused optimizer, with or without ``unscale_`` + clipping), and
1 without a scaler (the documented read before ``optimizer.step``); 0 everywhere with
``forensics=False``; 1 per device at a flush. A sampled step adds 1 per device: its drain
(``readback.HostRead``) reads the statistics of its tensors, its parameter probe and the op
probe's measurements in one copy (it was 3 copies, each read again as numpy, before they
were folded together).

**Lifetimes.** In an ordinary loop the user's ``logits`` stays bound until the next forward
returns; once the step has ended, nothing of ampdoctor's may reach the gradient that arrived at
it, nor the step's inputs.

About 10 s on one core.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyNet
from torch.overrides import TorchFunctionMode

import ampdoctor
from ampdoctor.record import readback

PACKAGE = os.path.dirname(os.path.abspath(ampdoctor.__file__))
PASS_THROUGH = {os.path.join(PACKAGE, "record", name)
                for name in ("patches.py", "patching.py", "clipdoors.py", "moduledoors.py")}
TORCH = os.path.dirname(os.path.abspath(torch.__file__))
T = torch.Tensor
READS = {T.item, T.tolist, T.cpu, T.numpy, T.__bool__, T.__float__, T.__int__, T.__index__,
         T.__complex__, T.__array__, T.__format__, T.__repr__, T.equal, T.allclose,
         T.is_nonzero, torch.equal, torch.allclose, torch.is_nonzero}


def _to_host(func, args, kwargs) -> bool:
    """``t.to("cpu")``: a device-to-host copy. Only the string counts: on CPU every tensor's
    ``.device`` is the CPU, and ``t.to(other.device)`` is the same-device no-op that keeps
    values on the accelerator on a GPU."""
    if func is not T.to:
        return False
    return "cpu" in list(args[1:]) + [kwargs.get("device")]


def _origin(frame):
    """The first frame outside torch and this file: who asked for the read."""
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame


def _ours(frame) -> bool:
    name = os.path.abspath(frame.f_code.co_filename) if frame is not None else ""
    return name.startswith(PACKAGE + os.sep) and name not in PASS_THROUGH


class HostReads(TorchFunctionMode):
    """Counts host reads made by ampdoctor while ``on``: ``device`` (where, as file:line) and
    ``mirror`` (reads of a landed host mirror). Also counts ``torch.cuda`` synchronize calls
    made by ampdoctor (on CUDA; never called on CPU)."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.device: list[str] = []
        self.mirror = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and (func in READS or _to_host(func, args, kwargs)):
            origin = _origin(sys._getframe(1))
            if _ours(origin):
                mirror = readback.mirror_of(args[0]) if args else None
                if mirror is not None:
                    assert mirror.landed, "a host mirror was read before its copy landed"
                    self.mirror += 1
                else:
                    where = f"{os.path.basename(origin.f_code.co_filename)}:{origin.f_lineno}"
                    self.device.append(f"{getattr(func, '__name__', func)} at {where}")
        return func(*args, **kwargs)

    def watch_cuda(self, monkeypatch) -> None:
        """Calls into torch.cuda that block the host, counted like reads when ampdoctor makes
        them (the mirror's own documented wait goes through ``HostMirror.wait``)."""
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            original = getattr(owner, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                caller = _origin(sys._getframe(1))
                if self.on and _ours(caller) and \
                        not caller.f_code.co_name == "wait":  # HostMirror.wait: counted apart
                    self.device.append(f"cuda {_name} at {caller.f_code.co_filename}")
                return _original(*args, **kwargs)
            monkeypatch.setattr(owner, name, counted)


# ---------------------------------------------------------------------------------------------
# the loops users write


PATHS = {
    # name: (GradScaler, fused AdamW, unscale_ + clip, autocast dtype, device reads per step)
    "scaler-foreach": (True, False, False, torch.float16, 0),
    "scaler-foreach-clip": (True, False, True, torch.float16, 0),
    "scaler-fused": (True, True, False, torch.float16, 0),
    "scaler-fused-clip": (True, True, True, torch.float16, 0),
    "clip-no-scaler": (False, False, True, torch.bfloat16, 1),
    "no-scaler": (False, False, False, torch.bfloat16, 1),
    "no-scaler-fused": (False, True, False, torch.bfloat16, 1),
}


def make(path: str, seed: int = 0, device: str = "cpu", width: int = 32):
    use_scaler, fused, clip, dtype, _ = PATHS[path]
    torch.manual_seed(seed)
    model = TinyNet(width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
    sc = torch.amp.GradScaler(torch.device(device).type) if use_scaler else None
    return model, opt, sc, clip, dtype


def step(model, opt, sc, clip, dtype, x, y):
    with torch.autocast(x.device.type, dtype=dtype):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    (sc.scale(loss) if sc is not None else loss).backward()
    if sc is not None:
        if clip:
            sc.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        sc.step(opt)
        sc.update()
    else:
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    opt.zero_grad(set_to_none=True)
    return logits, loss


def batch(i: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    return x.to(device), y.to(device)


WARMUP, STEADY = 3, 6  # steady: not the first steps (discovery, metadata), none sampled


def count_reads(path: str, tmp_path, monkeypatch, **options) -> tuple[HostReads, object]:
    model, opt, sc, clip, dtype = make(path)
    reads = HostReads()
    reads.watch_cuda(monkeypatch)
    rec = ampdoctor.watch(model, opt, sc, path=str(tmp_path / "run.h5"), strict=True,
                          flush_seconds=1e9, **options)
    with rec, reads:
        for i in range(WARMUP + STEADY):
            reads.on = i >= WARMUP
            step(model, opt, sc, clip, dtype, *batch(i))
        reads.on = False
    assert not rec.faulted and rec.steps == WARMUP + STEADY
    return reads, rec


# ---------------------------------------------------------------------------------------------
# host reads


@pytest.mark.parametrize("path", list(PATHS))
def test_steady_steps_read_nothing_but_what_is_documented(path, tmp_path, monkeypatch):
    reads, rec = count_reads(path, tmp_path, monkeypatch)
    per_step = PATHS[path][-1]
    assert rec.forensics.armed  # the tier is armed all along: this is a healthy run's cost
    assert len(reads.device) == per_step * STEADY, reads.device
    if PATHS[path][0]:  # GradScaler: found_inf and the loss come through one mirror per step
        assert reads.mirror == STEADY
        assert all(p.blocked == 0 for p in rec._skips.pools.values())  # CPU copies never wait
    else:
        assert reads.mirror == 0
        assert all("_check_before_step" in where or "skips.py" in where
                   for where in reads.device)
    run = ampdoctor.load(str(tmp_path / "run.h5"))
    assert len(run.steps) == WARMUP + STEADY and np.isfinite(run.steps["loss"]).all()
    assert not run.steps["skipped"][WARMUP:].any()


@pytest.mark.parametrize("path", ["scaler-fused", "no-scaler", "clip-no-scaler"])
def test_forensics_off_reads_nothing(path, tmp_path, monkeypatch):
    reads, _ = count_reads(path, tmp_path, monkeypatch, forensics=False)
    assert reads.device == [] and reads.mirror == 0


def test_a_flush_reads_once(tmp_path, monkeypatch):
    """The flush is the one read of the sentinel's values: one per device, however many
    steps are pending."""
    model, opt, sc, clip, dtype = make("scaler-fused")
    reads = HostReads()
    with ampdoctor.watch(model, opt, sc, path=str(tmp_path / "run.h5"), strict=True,
                         flush_seconds=1e9) as rec, reads:
        for i in range(5):
            step(model, opt, sc, clip, dtype, *batch(i))
        reads.on = True
        rec.flush()
        reads.on = False
    # the one documented read of a drain: steps.fetch (the step buffer, moved out of recorder.py)
    assert len(reads.device) == 1 and "steps.py" in reads.device[0], reads.device


SAMPLED_READS = 1  # per device: the sampled step's drain, one copy (readback.HostRead.run)


@pytest.mark.parametrize("path", ["scaler-foreach", "no-scaler"])
def test_a_sampled_step_reads_its_device_values_in_one_copy_per_device(path, tmp_path,
                                                                       monkeypatch):
    """Every step sampled, the op probe on: the statistics of all its tensors (counts, sums,
    abs min/max, the full-tensor minmax), the parameter probe's norms and update ratios and
    every op's min and max cross to the host in one copy, from one place, at the step's end,
    never inside a hook."""
    reads, rec = count_reads(path, tmp_path, monkeypatch, every=1)
    assert rec._hooks.sampled.probe is not None  # the op probe ran and was read in that copy
    drain = [w for w in reads.device if "readback.py" in w]
    assert len(drain) == SAMPLED_READS * STEADY and len(set(drain)) == 1, reads.device
    assert drain[0].startswith("numpy at"), drain  # numpy(force=True): the copy itself
    # The fp8 trial keeps each sampled step's batch on the host for its re-run at close
    # (forensic/fp8trial.py: kept.offload, after the drain's sync): its copies, and nothing
    # else beside the drain; without the trial there are none.
    kept = [w for w in reads.device if "kept.py" in w]
    assert kept and len(kept) % STEADY == 0, reads.device
    assert len(reads.device) - len(kept) == (SAMPLED_READS + PATHS[path][-1]) * STEADY, \
        reads.device
    (tmp_path / "no-trial").mkdir()
    without, _ = count_reads(path, tmp_path / "no-trial", monkeypatch, every=1, fp8_trial=0)
    assert not [w for w in without.device if "kept.py" in w], without.device
    assert not [w for w in reads.device if "hooks.py" in w or "opprobe.py" in w
                or "sampler.py" in w or "stats.py" in w], reads.device
    run = ampdoctor.load(str(tmp_path / "run.h5"))
    assert (run.stats["step"] >= WARMUP).any() and np.isfinite(run.stats["norm"]).any()


# ---------------------------------------------------------------------------------------------
# a GPU that is still running the step: the fused path's deferred decision, forced on CPU


@pytest.fixture
def device_behind(monkeypatch):
    """Every mirror looks in flight until waited for, as when the host has finished a step
    that a GPU is still running (on CPU the copy lands at once)."""
    original = readback.HostMirror.stage

    def stage(self, values):
        original(self, values)
        self.landed = False

    def wait(self):
        if not self.landed:
            self.blocked += 1
            self.landed = True

    monkeypatch.setattr(readback.HostMirror, "stage", stage)
    monkeypatch.setattr(readback.HostMirror, "wait", wait)


@pytest.mark.parametrize("path", ["scaler-fused", "scaler-foreach"])
def test_a_decision_in_flight_reads_nothing_more(path, tmp_path, monkeypatch, device_behind):
    reads, rec = count_reads(path, tmp_path, monkeypatch)
    assert reads.device == [] and reads.mirror == STEADY
    # decided at each next step's start, after one wait for its own copy
    assert sum(p.blocked for p in rec._skips.pools.values()) == WARMUP + STEADY


@pytest.mark.parametrize("kind", ["foreach", "fused", "fused, device behind", "no scaler"])
def test_a_failing_step_is_replayed_on_every_path(kind, tmp_path, request):
    """The right step, trigger and culprit on every path, and no observer effect. "device
    behind": the step is skipped on a GPU still running it; the replay at the next step's first
    forward names the same culprit, from the weights the skip left alone."""
    from culprits import ExpNet, batches, scaler, train
    from culprits import make as make_model

    if kind.endswith("behind"):
        request.getfixturevalue("device_behind")
    use_scaler = kind != "no scaler"

    def run(path):
        model = make_model(ExpNet)
        model.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=kind.startswith("fused"))
        sc = scaler(2.0**10) if use_scaler else None
        data = batches(5)
        data[2] = (data[2][0] * (40 if use_scaler else 4000), data[2][1])
        dtype = torch.float16 if use_scaler else torch.bfloat16
        if path is None:
            return train(model, data, scaler=sc, dtype=dtype), list(model.parameters()), None, []
        seen = []
        with ampdoctor.watch(model, model.opt, sc, path=path, every=0, strict=True) as rec:
            # after the recorder's own pre-hook: what it had decided when this forward began
            model.register_forward_pre_hook(lambda m, a: seen.append([e.step for e in rec.events]))
            losses = train(model, data, scaler=sc, dtype=dtype)
        return losses, list(model.parameters()), rec, seen

    plain = run(None)
    losses, weights, rec, seen = run(str(tmp_path / "run.h5"))
    assert np.array_equal(np.array(plain[0]), np.array(losses), equal_nan=True)
    assert all(torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8))
               for a, b in zip(plain[1], weights))  # bits: NaN where the step applied NaN
    ev = rec.events[0]
    trigger = "skipped" if use_scaler else "nonfinite_loss"
    assert (ev.step, ev.trigger, ev.phase, ev.module) == (2, trigger, "forward", "body.1")
    assert ev.result.faithful
    assert seen[3][:1] == [2]  # decided before the next step's forward ran
    run = ampdoctor.load(str(tmp_path / "run.h5"))
    assert int(run.snapshots[0]["step"]) == 2
    if use_scaler:
        assert list(run.steps["skipped"]) == [0, 0, 1, 0, 0]


# ---------------------------------------------------------------------------------------------
# nothing kept past the step


def _lifetimes(path: str, run_path: str, device: str = "cpu"):
    """A loop that keeps its own ``logits`` and ``loss`` bound, as users' loops do; weak
    references say whether the output gradient and the batch are still alive after each step
    and when the next step's forward begins (after the recorder's own pre-hook)."""
    model, opt, sc, clip, dtype = make(path, device=device)
    grads, inputs, at_next_forward = [], [], []

    def check(module, args):
        gc.collect()
        if grads:  # the previous step's (this step's batch is in inputs[-1] already)
            at_next_forward.append((grads[-1]() is None, inputs[len(grads) - 1]() is None))

    with ampdoctor.watch(model, opt, sc, path=run_path, strict=True):
        model.register_forward_pre_hook(check)  # after the recorder's own
        after_step = []
        for i in range(4):
            x, y = batch(i, device)
            inputs.append(weakref.ref(x))
            logits = model(x)  # noqa: F841 - kept bound, as in a user's loop
            logits.register_hook(lambda g: grads.append(weakref.ref(g)))
            with torch.autocast(x.device.type, dtype=dtype):
                loss = F.cross_entropy(logits, y)
            (sc.scale(loss) if sc is not None else loss).backward()
            if sc is not None:
                sc.step(opt)
                sc.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            del x, y
            gc.collect()
            after_step.append((grads[-1]() is None, inputs[-1]() is None))
    gc.collect()
    closed = (grads[-1]() is None, inputs[-1]() is None)
    return after_step, at_next_forward, closed


@pytest.mark.parametrize("path", ["scaler-foreach", "scaler-fused", "no-scaler"])
def test_output_gradient_and_inputs_are_released_when_the_step_ends(path, run_path):
    after_step, _, _ = _lifetimes(path, run_path)
    assert after_step == [(True, True)] * 4


def test_a_deferred_decision_releases_them_before_the_next_forward(run_path, device_behind):
    after_step, at_next_forward, closed = _lifetimes("scaler-fused", run_path)
    assert after_step == [(False, False)] * 4  # held while undecided
    assert at_next_forward == [(True, True)] * 3  # released before the next forward ran
    assert closed == (True, True)  # the last one, when the recorder closes


def test_parameter_list_follows_add_param_group(run_path):
    model, opt, sc, clip, dtype = make("no-scaler")
    extra = torch.nn.Linear(4, 4)
    with ampdoctor.watch(model, opt, path=run_path, strict=True) as rec:
        step(model, opt, sc, clip, dtype, *batch(0))
        first = rec._watched.trained_params()
        assert rec._watched.trained_params() is first  # cached, not rebuilt
        opt.add_param_group({"params": list(extra.parameters())})
        again = rec._watched.trained_params()
        assert len(again) == len(first) + 2 and again[-1] is extra.bias
        step(model, opt, sc, clip, dtype, *batch(1))
