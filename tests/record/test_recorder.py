"""watch(): what is recorded, that it matches what the loop saw, and that it changes nothing."""


import os
import sys

import numpy as np
import pytest
import torch
from helpers import fresh, train

import ampdoctor
from ampdoctor.runfile.schema import Event, Kind, Source, flag


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bit_identical(a, b):
    """Same bits, NaN payloads included (torch.equal says NaN != NaN)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype,use_scaler", [(torch.float16, True), (torch.bfloat16, False)])
def test_observer_effect_is_zero(run_path, dtype, use_scaler):
    def run(record):
        model, opt = fresh()
        scaler = torch.amp.GradScaler("cpu") if use_scaler else None
        ctx = ampdoctor.watch(model, opt, scaler, path=run_path, every=1, strict=True) \
            if record else None
        losses = train(model, opt, scaler, steps=8, dtype=dtype, clip=1.0, recorder_ctx=ctx,
                       bad_step=4)
        return losses, weights(model), (scaler.get_scale() if scaler else None)

    plain = run(False)
    recorded = run(True)
    np.testing.assert_array_equal(np.array(plain[0]), np.array(recorded[0]))
    assert_bit_identical(plain[1], recorded[1])
    assert plain[2] == recorded[2]


def test_readback_matches_the_loop(run_path):
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    seen_scales, seen_losses = [], []
    with ampdoctor.watch(model, opt, scaler, path=run_path, every=2, strict=True):
        for i, (x, y) in enumerate(__import__("helpers").batches(7)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            seen_losses.append(loss.item())
            seen_scales.append(scaler.get_scale() if i else 2.0**16)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert run.status == "finished"
    assert list(run.steps["step"]) == list(range(7))
    np.testing.assert_allclose(run.steps["loss"], seen_losses, rtol=1e-6)
    np.testing.assert_array_equal(run.steps["scale"], seen_scales)
    # growth_interval=3: the scale doubles after every third clean step.
    assert run.steps["scale_after"][2] == 2.0**17 and run.steps["scale_after"][5] == 2.0**18
    assert run.steps["skipped"].sum() == 0
    assert np.all(run.steps["lr"] == np.float32(1e-3))
    assert np.all(run.steps["micro"] == 1)
    assert list(run.steps["sampled"]) == [1, 0, 1, 0, 1, 0, 1]
    assert run.meta["autocast"]["dtype"] == "float16"
    assert run.meta["scaler"]["init_scale"] == 2.0**16
    assert run.meta["optimizer"][0]["class"] == "AdamW"
    assert run.meta["optimizer"][0]["hyper"]["eps"] == 1e-8
    assert run.meta["optimizer"][0]["state_dtypes"]["exp_avg_sq"] == "float32"

    stats = run.stats.read()
    kinds = {int(i): int(k) for i, k in zip(run.tensors["id"], run.tensors["kind"])}
    names = {int(i): n for i, n in zip(run.tensors["id"], run.tensors["name"])}
    sampled = stats[stats["source"] == Source.SAMPLED]
    assert set(sampled["step"]) == {0, 2, 4, 6}
    step0 = sampled[sampled["step"] == 0]
    outputs = [names[int(t)] for t in step0["tensor"] if kinds[int(t)] == Kind.OUTPUT]
    # Execution order; the containers (block, the root) hand on a child's tensor and are
    # not measured twice.
    assert outputs == ["fc1", "act", "block.0", "block.1", "head"]
    grads = [names[int(t)] for t in step0["tensor"] if kinds[int(t)] == Kind.GRAD_OUTPUT]
    assert grads[0] == "head" and set(grads) == set(outputs)
    params = {names[int(t)] for t in step0["tensor"] if kinds[int(t)] == Kind.PARAM_GRAD}
    assert params == {n for n, _ in model.named_parameters()}
    # Parameter grads are in scaled space: about 2**16 times the unscaled gradient norm.
    grad_rows = step0[[kinds[int(t)] == Kind.PARAM_GRAD for t in step0["tensor"]]]
    assert grad_rows["rms"].max() > 10
    upd = step0[[kinds[int(t)] == Kind.PARAM for t in step0["tensor"]]]
    assert len(upd) == len(list(model.parameters())) and np.all(upd["norm"] > 0)
    assert np.all((upd["update"] > 1e-5) & (upd["update"] < 0.1))
    assert np.all(upd["unchanged"] == 0)
    inputs = [names[int(t)] for t in step0["tensor"] if kinds[int(t)] == Kind.INPUT]
    assert inputs == ["TinyNet:args.0"]


def test_gradient_accumulation_counts_micro_batches(run_path):
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    rec = ampdoctor.watch(model, opt, scaler, path=run_path, every=0, strict=True)
    losses = train(model, opt, scaler, steps=3, accum=4)
    rec.close()
    run = ampdoctor.load(run_path)
    assert len(run.steps) == 3
    assert np.all(run.steps["micro"] == 4)
    np.testing.assert_allclose(run.steps["loss"], np.array(losses).reshape(3, 4).mean(1),
                               rtol=1e-6)


def _scheduled(run_path, per_micro: bool, record: bool):
    """A loop of 4 micro-batches per step with a warm-up stepped per micro-batch (the bug) or
    per optimizer step; returns the weights and the run file's events (None: not recorded)."""
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 40))
    ctx = ampdoctor.watch(model, opt, scaler, path=run_path, every=0, strict=True) if record \
        else None
    for step in range(5):
        for micro in range(4):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y) / 4
            scaler.scale(loss).backward()
            if per_micro:
                sched.step()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if not per_micro:
            sched.step()
    if ctx is not None:
        ctx.close()
    events = ampdoctor.load(run_path).events if record else None
    return weights(model), events


def test_a_scheduler_stepped_per_micro_batch_is_an_event(run_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: scheduler.step before optimizer
        torch.manual_seed(3)
        plain, _ = _scheduled(run_path, True, record=False)
        torch.manual_seed(3)
        recorded, events = _scheduled(run_path, True, record=True)
    assert_bit_identical(plain, recorded)  # seeing the scheduler changes nothing
    rows = events[events["kind"] == int(Event.SCHEDULER_STEPS)]
    assert rows["value"].tolist() == [4.0] and str(rows["text"][0]) == "LambdaLR"
    assert int(rows["step"][0]) == 0  # the constructor's own first step is not counted
    _, events = _scheduled(run_path, False, record=True)
    assert not (events["kind"] == int(Event.SCHEDULER_STEPS)).any()


def test_without_scaler_boundaries_come_from_the_optimizer(run_path):
    model, opt = fresh()
    with ampdoctor.watch(model, path=run_path, every=3, strict=True):  # optimizer discovered
        train(model, opt, None, steps=5, dtype=torch.bfloat16, clip=0.5)
    run = ampdoctor.load(run_path)
    assert len(run.steps) == 5
    assert np.all(np.isnan(run.steps["scale"]))
    assert np.all(run.steps["skipped"] == 0)
    # grad_norm is measured before clipping, and equals what clip_grad_norm_ returned.
    np.testing.assert_allclose(run.steps["grad_norm"], run.steps["clip_norm"], rtol=1e-5)
    assert run.meta["autocast"]["dtype"] == "bfloat16"
    assert run.meta["optimizer"][0]["class"] == "AdamW"


def test_skipped_step_and_nonfinite_flags(run_path):
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=run_path, every=1, strict=True,
                         forensics=False):
        train(model, opt, scaler, steps=5, bad_step=2)
    run = ampdoctor.load(run_path)
    assert list(run.steps["skipped"]) == [0, 0, 1, 0, 0]
    assert run.steps["scale_after"][2] == run.steps["scale"][2] / 2
    flags = run.steps["flags"]
    assert flags[2] & flag(Event.SKIPPED) and flags[2] & flag(Event.NONFINITE_LOSS)
    assert not flags[1] & flag(Event.SKIPPED)
    d = ampdoctor.diagnose(run_path)
    assert d.first_bad["step"] == 2


@pytest.mark.parametrize("use_scaler", [False, True])
def test_fp16_without_scaler_is_an_event_once(run_path, use_scaler):
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True, forensics=False):
        train(model, opt, scaler, steps=3, unscale=False)
    run = ampdoctor.load(run_path)
    steps = list(run.events["step"][run.events["kind"] == Event.FP16_WITHOUT_SCALER])
    assert steps == ([] if use_scaler else [0])
    assert bool(run.steps["flags"][0] & flag(Event.FP16_WITHOUT_SCALER)) != use_scaler


def test_clip_config_is_recorded_without_reading_a_tensor_max_norm(run_path):
    model, opt = fresh()
    with ampdoctor.watch(model, opt, path=run_path, strict=True):
        for x, y in __import__("helpers").batches(2):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=torch.tensor(0.5),
                                           norm_type=1.0, foreach=True)
            opt.step()
            opt.zero_grad()
    clip = ampdoctor.load(run_path).meta["clip"]
    assert clip == {"how": "clip_grad_norm_", "max_norm": "tensor", "norm_type": 1.0,
                    "foreach": True}


def _split_clip(params, max_norm):
    """The split API as accelerate >= 1.16 and torchtitan clip: the norm, then the clip."""
    params = list(params)
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# each looked up at the call, as a training loop does (a reference taken at import time
# would be torch's own function, not the one recording patched)
CLIP_PATHS = {"clip_grad_norm_": lambda params, v: torch.nn.utils.clip_grad_norm_(params, v),
              "clip_grads_with_norm_": _split_clip,
              "clip_grad_value_": lambda params, v: torch.nn.utils.clip_grad_value_(params, v)}


def _norm(params) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))


@pytest.mark.parametrize("how", list(CLIP_PATHS))
def test_each_clip_records_the_pre_clip_norm(run_path, how):
    """Every clip of torch.nn.utils, the split API of torch >= 2.6 included: the recorded
    grad norm is the one before the clip (what the loop measured itself), never the clipped
    one, and /meta clip names the function."""
    if not hasattr(torch.nn.utils, how):
        pytest.skip(f"this torch has no torch.nn.utils.{how}")
    model, opt = fresh()
    before = []
    with ampdoctor.watch(model, opt, path=run_path, strict=True):
        for x, y in __import__("helpers").batches(4):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            before.append(_norm(model.parameters()))
            CLIP_PATHS[how](model.parameters(), 1e-3)  # cuts every step
            after = _norm(model.parameters())
            opt.step()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert after < min(before) / 5  # the clip did cut
    np.testing.assert_allclose(run.steps["grad_norm"], before, rtol=1e-5)
    assert run.meta["clip"]["how"] == how
    if how == "clip_grad_value_":
        assert run.meta["clip"]["clip_value"] == 1e-3
        assert np.all(np.isnan(run.steps["clip_norm"]))  # it returns no norm
    else:
        assert run.meta["clip"]["max_norm"] == 1e-3
        np.testing.assert_allclose(run.steps["clip_norm"], before, rtol=1e-5)


@pytest.mark.parametrize("how", list(CLIP_PATHS))
def test_each_clip_before_unscale_is_an_event(run_path, how):
    """The unscale -> clip -> step order is checked on every clip path."""
    if not hasattr(torch.nn.utils, how):
        pytest.skip(f"this torch has no torch.nn.utils.{how}")
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True):
        for x, y in __import__("helpers").batches(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            CLIP_PATHS[how](model.parameters(), 1.0)  # before unscale_
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert list(run.events["kind"]).count(Event.CLIP_BEFORE_UNSCALE) == 3
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "clip_order" and "before scaler.unscale_" in d.summary, str(d)
    assert how in d.summary and any(how in e.text for e in d.evidence), str(d)
    if how == "clip_grad_norm_":
        # What the clip saw was the scaled norm: the scale times the true one; its max_norm
        # is recorded (issue 16) and the diagnosis says how much the clip cut.
        ratio = run.steps["clip_norm"] / run.steps["grad_norm"]
        np.testing.assert_allclose(ratio, run.steps["scale"], rtol=1e-3)
        assert run.meta["clip"] == {"how": "clip_grad_norm_", "max_norm": 1.0,
                                    "norm_type": 2.0, "foreach": None}
        cut = next(e for e in d.evidence if e.key == "clip_cut")
        assert "max_norm=1" in cut.text and cut.value > 1000


def test_a_clip_inside_a_clip_is_told_once(run_path, monkeypatch):
    """A clip that calls another (here a clip_grad_value_ that some library replaced with a
    norm clip; torch versions whose clip_grad_norm_ calls the public split API) is one clip:
    the outer call's settings, its pre-clip norm, the inner call not told again."""
    plain = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_value_",
                        lambda params, clip_value, foreach=None: (plain(params, clip_value),
                                                                  None)[1])
    model, opt = fresh()
    before = []
    with ampdoctor.watch(model, opt, path=run_path, strict=True):
        for x, y in __import__("helpers").batches(2):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            before.append(_norm(model.parameters()))
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert run.meta["clip"]["how"] == "clip_grad_value_"
    np.testing.assert_allclose(run.steps["grad_norm"], before, rtol=1e-5)
    assert np.all(np.isnan(run.steps["clip_norm"]))  # the inner clip_grad_norm_ not told


def _unitwise_clip(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    """Adaptive gradient clipping (Brock et al. 2021) with timm's signature: each
    parameter's gradient is cut to clip_factor times its weight's norm."""
    for p in parameters:
        if p.grad is None:
            continue
        bound = p.detach().norm().clamp_min(eps) * clip_factor
        norm = p.grad.detach().norm().clamp_min(1e-6)
        p.grad.detach().mul_(torch.where(norm > bound, bound / norm, torch.ones_like(norm)))


@pytest.mark.parametrize("when", ["before_watch", "before_first_loss"])
def test_timms_adaptive_clipping_is_seen(run_path, monkeypatch, when):
    """timm's --clip-mode agc calls timm.utils.agc.adaptive_clip_grad, re-exported by
    timm.utils and imported by timm.utils.clip_grad: each name is seen (a script imports timm
    before watch() or, under ``record``, after recording began and before its first loss).
    timm itself needs torchvision, which this CPU build of torch cannot load: the module is
    stood for here by one with timm's module names and signature."""
    import types

    def install():
        for name in ("timm", "timm.utils", "timm.utils.agc", "timm.utils.clip_grad"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for name in ("timm.utils", "timm.utils.agc", "timm.utils.clip_grad"):
            sys.modules[name].adaptive_clip_grad = _unitwise_clip

    if when == "before_watch":
        install()
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    before = []
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True):
        if when == "before_first_loss":
            install()
        for x, y in __import__("helpers").batches(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            before.append(_norm(model.parameters()) / scaler.get_scale())
            sys.modules["timm.utils.clip_grad"].adaptive_clip_grad(model.parameters(), 1e-4)
            scaler.step(opt)  # the clip ran before unscale_: a misuse
            scaler.update()
            opt.zero_grad()
    assert sys.modules["timm.utils.agc"].adaptive_clip_grad is _unitwise_clip  # put back
    run = ampdoctor.load(run_path)
    assert run.meta["clip"]["how"] == "adaptive_clip_grad"
    assert run.meta["clip"]["clip_factor"] == 1e-4
    np.testing.assert_allclose(run.steps["grad_norm"], before, rtol=1e-3)  # before the clip
    assert list(run.events["kind"]).count(Event.CLIP_BEFORE_UNSCALE) == 3
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "clip_order" and "adaptive_clip_grad" in d.summary, str(d)
    fix = next(f for f in d.fixes if f.id == "unscale_before_clip")
    assert "timm.utils.adaptive_clip_grad(model.parameters(), 1e-4)" in fix.snippet


def _compiled_step_run(run_path, record: bool):
    """A loop whose optimizer step is compiled (the PyTorch tutorial's form); no scaler."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, opt = fresh()

    @torch.compile(backend="eager")
    def step():
        opt.step()

    losses, norms = [], []
    ctx = ampdoctor.watch(model, opt, path=run_path, strict=True) if record else \
        __import__("contextlib").nullcontext()
    with ctx:
        for x, y in __import__("helpers").batches(4):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            norms.append(_norm(model.parameters()))
            step()
            opt.zero_grad(set_to_none=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return losses, norms, [p.detach().clone() for p in model.parameters()], frames


def test_a_compiled_optimizer_step_is_recorded(run_path):
    """torch.compile around optimizer.step(): its step hooks run as dynamo traces them, where
    the recorder does nothing; the step is told at the next eager hook (zero_grad here), with
    the gradient norm the step used. Nothing recompiles, and training is unchanged."""
    plain_losses, _, plain_weights, plain_graphs = _compiled_step_run(run_path, record=False)
    losses, norms, weights, graphs = _compiled_step_run(run_path, record=True)
    assert losses == plain_losses and graphs == plain_graphs
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    run = ampdoctor.load(run_path)
    assert len(run.steps) == 4
    np.testing.assert_array_equal(run.steps["loss"], np.float32(losses))
    np.testing.assert_allclose(run.steps["grad_norm"], norms, rtol=1e-5)


class TwoHeads(torch.nn.Module):
    """A multi-task model: a main head and an auxiliary one on a shared trunk."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(8, 16)
        self.main = torch.nn.Linear(16, 4)
        self.aux = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.main(h), self.aux(h).squeeze(-1)


def _two_losses(run_path, how: str, steps: int = 6):
    """The AMP docs' recipes with two losses and one scaler: ``how`` = "sum" (scale the sum),
    "each" (scale each, two backwards), "accumulate" (scale each micro-batch), or the misuse
    "aux_unscaled" (the auxiliary loss's own .backward())."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True, forensics=False):
        for _ in range(steps):
            for part in ((x[:32], y[:32]), (x[32:], y[32:])) if how == "accumulate" else \
                    ((x, y),):
                with torch.autocast("cpu", dtype=torch.float16):
                    logits, guess = model(part[0])
                    loss = torch.nn.functional.cross_entropy(logits, part[1])
                    aux = torch.nn.functional.mse_loss(guess, part[1].float())
                if how == "sum" or how == "accumulate":
                    scaler.scale(loss + aux).backward()
                elif how == "each":
                    scaler.scale(loss).backward(retain_graph=True)
                    scaler.scale(aux).backward()
                else:
                    aux.backward(retain_graph=True)  # the misuse: not through the scaler
                    scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return ampdoctor.load(run_path)


@pytest.mark.parametrize("how", ["sum", "each", "accumulate"])
def test_every_loss_through_the_scaler_is_the_docs_recipe(run_path, how):
    run = _two_losses(run_path, how)
    assert not (run.events["kind"] == Event.BACKWARD_UNSCALED).any()
    d = ampdoctor.diagnose(run_path)
    assert d.verdict != "clip_order", str(d)


def test_a_loss_backwarded_without_the_scaler_is_a_misuse(run_path):
    """An auxiliary loss's own .backward() beside a scaled main loss: scaler.step divides its
    gradients by the scale too, so it barely trains (it was diagnosed healthy 0.90)."""
    run = _two_losses(run_path, "aux_unscaled")
    rows = run.events[run.events["kind"] == Event.BACKWARD_UNSCALED]
    assert len(rows) == 6 and set(rows["value"]) == {1.0}
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "backward_unscaled", str(d)
    assert d.fixes[0].id == "scale_every_loss" and "scaler.scale(loss + aux)" in \
        d.fixes[0].snippet
    assert "divided by the loss scale (65536 at step 0)" in d.evidence[0].text


def test_a_sparse_gradient_is_recorded_around(run_path):
    """nn.Embedding(sparse=True) with SparseAdam beside a dense optimizer: the sampled step
    measures the dense parameters and passes the sparse gradient by (it stopped the recorder
    at step 0: torch.take has no sparse kernel)."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 3)
    sparse, dense = torch.optim.SparseAdam(emb.parameters()), torch.optim.Adam(head.parameters())
    model = torch.nn.Sequential(emb, head)
    with ampdoctor.watch(model, [sparse, dense], path=run_path, every=1, strict=True):
        for _ in range(3):
            idx = torch.randint(0, 50, (16,))
            loss = torch.nn.functional.cross_entropy(model(idx), idx % 3)
            loss.backward()
            sparse.step()
            dense.step()
            sparse.zero_grad()
            dense.zero_grad()
    run = ampdoctor.load(run_path)
    assert len(run.steps) == 3 and run.status == "finished"
    assert np.isfinite(run.steps["loss"]).all()


def test_context_manager_puts_everything_back(run_path):
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo

    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    before = {
        "scale": torch.amp.GradScaler.__dict__["scale"],
        "update": torch.amp.GradScaler.__dict__["update"],
        "backward": torch.autograd.backward,
        "clip": torch.nn.utils.clip_grad_norm_,
    }
    n_fwd, n_pre = len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks)
    n_opt = len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks)
    with ampdoctor.watch(model, opt, scaler, path=run_path, every=1, strict=True):
        train(model, opt, scaler, steps=2)
        assert torch.autograd.backward is not before["backward"]
    after = {
        "scale": torch.amp.GradScaler.__dict__["scale"],
        "update": torch.amp.GradScaler.__dict__["update"],
        "backward": torch.autograd.backward,
        "clip": torch.nn.utils.clip_grad_norm_,
    }
    assert after == before
    assert (len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks)) == (n_fwd, n_pre)
    assert (len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks)) == n_opt
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize("args, kwargs, words", [
    (("model",), {}, "model must be a torch.nn.Module"),
    ((None, "sgd"), {}, "optimizer must be a torch.optim.Optimizer"),
    ((None, None, "scaler"), {}, "scaler must be a torch.amp.GradScaler"),
    ((), {"every": "x"}, "every must be 0"),
])
def test_a_watch_given_a_wrong_argument_says_so_and_leaves_nothing_armed(run_path, tmp_path,
                                                                         args, kwargs, words):
    """One sentence for the wrong argument; the next watch() in the same process works (a
    notebook needs no kernel restart)."""
    before = (torch.autograd.backward, torch.nn.utils.clip_grad_norm_)
    with pytest.raises(ampdoctor.AmpDoctorError, match=words):
        ampdoctor.watch(*args, path=str(tmp_path / "bad.h5"), **kwargs)
    assert (torch.autograd.backward, torch.nn.utils.clip_grad_norm_) == before
    model, opt = fresh()
    with ampdoctor.watch(model, opt, path=run_path):
        train(model, opt, None, steps=2)
    assert len(ampdoctor.load(run_path).steps) == 2


def test_a_start_that_fails_inside_is_undone(run_path, tmp_path, monkeypatch):
    """Whatever fails while a recorder starts, nothing of it stays armed."""
    from ampdoctor.record import hooks as hooks_module

    def broken(self):
        hooks_module.patches.patch_backward(self.flow.patches, self.fault,
                                            self.loss.before_backward)  # half attached
        raise RuntimeError("injected")

    before = torch.autograd.backward
    monkeypatch.setattr(hooks_module.Hooks, "attach", broken)
    model, opt = fresh()
    with pytest.raises(RuntimeError, match="injected"):
        ampdoctor.watch(model, opt, path=str(tmp_path / "bad.h5"))
    assert torch.autograd.backward is before and ampdoctor.record.recorder.active() is None
    monkeypatch.undo()
    with ampdoctor.watch(model, opt, path=run_path):
        train(model, opt, None, steps=2)
    assert len(ampdoctor.load(run_path).steps) == 2


def test_only_one_recorder_at_a_time(run_path, tmp_path):
    model, opt = fresh()
    with ampdoctor.watch(model, opt, path=run_path):
        with pytest.raises(ampdoctor.AmpDoctorError, match="already recording"):
            ampdoctor.watch(model, opt, path=str(tmp_path / "b.h5"))
    rec = ampdoctor.watch(model, opt, path=str(tmp_path / "c.h5"))
    rec.close()
    rec.close()  # twice is harmless


def test_exception_in_the_loop_is_recorded(run_path):
    model, opt = fresh()
    with pytest.raises(ZeroDivisionError):
        with ampdoctor.watch(model, opt, path=run_path):
            train(model, opt, None, steps=2, dtype=None)
            1 / 0
    run = ampdoctor.load(run_path)
    assert run.status == "exception:ZeroDivisionError"
    assert len(run.steps) == 2
    assert Event.EXCEPTION in list(run.events["kind"])


def test_internal_fault_steps_aside_and_training_continues(run_path, monkeypatch):
    model, opt = fresh()
    ref_model, ref_opt = fresh()
    ref_losses = train(ref_model, ref_opt, None, steps=4, dtype=torch.bfloat16)

    from ampdoctor.record import stepflow

    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(stepflow.StepFlow, "end_step", broken)
    with pytest.warns(RuntimeWarning, match="recording stopped"):
        with ampdoctor.watch(model, opt, path=run_path):
            losses = train(model, opt, None, steps=4, dtype=torch.bfloat16)
    assert losses == ref_losses
    assert_bit_identical(weights(model), weights(ref_model))
    run = ampdoctor.load(run_path)
    assert Event.RECORDER_ERROR in list(run.events["kind"])


def test_strict_mode_raises(run_path, monkeypatch):
    from ampdoctor.errors import RecorderFault
    from ampdoctor.record import stepflow

    monkeypatch.setattr(stepflow.StepFlow, "end_step", lambda self: 1 / 0)
    model, opt = fresh()
    with pytest.raises(RecorderFault):
        with ampdoctor.watch(model, opt, path=run_path, strict=True):
            train(model, opt, None, steps=1, dtype=None)


def test_exotic_module_outputs_are_skipped(run_path):
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"y": y, "c": torch.ones(2, dtype=torch.complex64), "none": None,
                    "gen": (i for i in range(3)), "sparse": torch.eye(3).to_sparse(),
                    "ints": torch.arange(3)}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.odd = Odd()

        def forward(self, x):
            return self.odd(x)["y"].sum()

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ampdoctor.watch(net, opt, path=run_path, every=1, strict=True):
        for _ in range(2):
            net(torch.randn(3, 4)).backward()
            opt.step()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert len(run.steps) == 2
    names = set(run.tensors["name"])
    assert "odd.lin" in names  # "odd" hands on odd.lin's tensor: measured once


def test_record_peak_memory_and_time(run_path):
    model, opt = fresh()
    with ampdoctor.watch(model, opt, path=run_path, every=0):
        train(model, opt, None, steps=3, dtype=None)
    run = ampdoctor.load(run_path)
    assert np.all(run.steps["peak_mem"] > 10 << 20)
    assert np.all(run.steps["dt"] > 0)
    assert np.all(np.diff(run.steps["time"]) >= 0)


def test_no_reference_kept_to_past_steps(run_path):
    """Hooks and captures must not keep a step's outputs (and so its autograd graph) alive."""
    import gc
    import weakref

    model, opt = fresh()
    refs = []
    with ampdoctor.watch(model, opt, path=run_path, every=2, strict=True):
        for x, y in __import__("helpers").batches(6):
            out = model(x)
            refs.append(weakref.ref(out))
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            del out, loss
    gc.collect()
    assert [r() is None for r in refs] == [True] * 6


def test_sampled_step_keeps_no_activation_alive(run_path):
    """Within a sampled step, an output that autograd does not save (consumed by an add) is
    freed as it would be without ampdoctor: measuring it keeps no reference."""
    import weakref

    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), AddOne())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    with ampdoctor.watch(model, opt, path=run_path, every=1, strict=True):
        for _ in range(3):
            loss = model(torch.randn(4, 8)).sum()
            assert seen[-1]() is None  # the Linear's output is gone before backward
            loss.backward()
            opt.step()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    grad_rows = run.stats.read()
    kinds = {int(run.tensors["kind"][run.tensors["id"] == t][0]) for t in grad_rows["tensor"]}
    assert int(Kind.GRAD_OUTPUT) in kinds  # gradients of the freed outputs still measured


def test_scaled_steps_without_update_still_end(run_path):
    """A loop that scales the loss but calls optimizer.step() itself (no scaler.update()):
    every step is recorded, each with a bypass event, and the optimizer is still known."""
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True):
        for x, y in __import__("helpers").batches(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            opt.step()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert list(run.steps["step"]) == [0, 1, 2, 3, 4]
    assert np.all(run.steps["scale"] == 2.0**16)
    assert list(run.events["kind"]).count(Event.STEP_BYPASSES_SCALER) == 5
    assert run.meta["optimizer"][0]["class"] == "AdamW"


# ---------------------------------------------------------------------------------------------
# The hook callbacks: handed to their doors as callables (record/listener.py), never by name


def _named_dispatch(source: str) -> list[str]:
    """The string constants a module's source hands to ``guard(...)`` or ``hook_modules`` as
    the callback (what a dispatch by name would look like)."""
    import ast

    names = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else \
            getattr(node.func, "id", "")
        args = {"guard": node.args[1:2], "hook_modules": node.args[2:4],
                "hook_module_calls": node.args[2:4]}.get(func, [])
        names += [a.value for a in args if isinstance(a, ast.Constant) and a.value is not None]
    return names


def test_no_callback_is_dispatched_by_name():
    """Each door calls the callable it was handed, so that mypy and a code walk follow it."""
    import pathlib

    from ampdoctor.record import listener

    record = pathlib.Path(listener.__file__).parent
    sources = list(record.glob("*.py")) + list((record.parent / "preflight").glob("*.py"))
    assert [n for path in sources for n in _named_dispatch(path.read_text())] == []
    assert _named_dispatch("patches.guard(fault, 'before_clip', parameters)") == ["before_clip"]


def test_a_door_calls_what_it_was_handed_and_names_it_in_a_fault():
    """``patch_backward`` calls the function given (a bound method, as torch's hooks take
    one); its failure goes to ``fault`` under its own name, never to the training loop."""
    from ampdoctor.record import patches

    faults, seen = [], []

    def before_backward(tensors):
        seen.append(tensors)
        raise ValueError("inside")

    original = torch.autograd.backward
    x = torch.ones(2, requires_grad=True)
    with patches.PatchSet() as ps:
        patches.patch_backward(ps, lambda exc, where: faults.append((where, str(exc))),
                               before_backward)
        x.sum().backward()  # the hook's failure does not reach the caller
    assert len(seen) == 1 and faults == [("before_backward", "inside")]
    assert torch.autograd.backward is original and x.grad.tolist() == [1.0, 1.0]


def test_a_misspelt_callback_is_caught_where_it_is_handed_over():
    from ampdoctor.record.listener import ScalerDoor

    def fault(exc, where):
        raise AssertionError(where)

    with pytest.raises(TypeError, match="befor_update"):
        ScalerDoor(fault=fault, befor_update=lambda scaler: None)  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------
# the sampled step's op probe: an overflow hidden inside a module (opprobe.StepProbe)


class _HandNorm(torch.nn.Module):
    """x * rsqrt(mean(x * x)): in fp16, x * x is inf past 256 and the output exactly 0."""

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True).float() + 1e-6)


class _Masked(torch.nn.Module):
    """Non-finite values made on purpose and taken by softmax: an explicit -inf, a buffer
    that holds one, and an in-place product that a clamp brings back (that one counts)."""

    def __init__(self, inplace_overflow: bool = False):
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))
        self.inplace_overflow = inplace_overflow

    def forward(self, x):
        s = x[:, :4, None] * x[:, None, :4]
        s = s.masked_fill(s > 1e30, float("-inf")) + self.mask
        out = torch.softmax(s, -1).sum(-1)
        if self.inplace_overflow:
            out = out.half().mul_(1e5).mul_(1e5).clamp_(max=1.0).float()
        return out


def _probe_net(scale: float, inplace_overflow: bool = False):
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"inp": torch.nn.Linear(8, 16), "norm": _HandNorm(),
                               "mask": _Masked(inplace_overflow), "head": torch.nn.Linear(20, 4)})
    with torch.no_grad():
        net["inp"].weight.mul_(scale)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            h = self.net["inp"](x)
            return self.net["head"](torch.cat([self.net["norm"](h),
                                               self.net["mask"](torch.tanh(h))], -1))

    return Net()


def _probe_train(run_path, model, steps=3, every=1, **options):
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    losses = []
    options.setdefault("strict", True)
    with ampdoctor.watch(model, opt, path=run_path, every=every, **options):
        for _ in range(steps):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert torch.overrides._get_current_function_mode() is None  # the mode is gone
    return losses


def _hidden(run_path):
    from ampdoctor.diagnosis.events import hidden_nonfinite

    with ampdoctor.load(run_path) as run:
        return hidden_nonfinite(run)


def test_the_op_probe_names_an_overflow_that_no_output_shows(run_path):
    _probe_train(run_path, _probe_net(scale=200.0), steps=3, every=2)
    hits = _hidden(run_path)
    assert [(h["step"], h["module"], h["op"], h["dtype"], h["created"]) for h in hits] == \
        [(0, "net.norm", "mul", "float16", 2), (2, "net.norm", "mul", "float16", 2)]
    assert hits[0]["type"] == "_HandNorm" and hits[0]["inner"] == "net.norm"


def test_non_finite_values_made_on_purpose_are_not_an_overflow(run_path):
    """Small values: the norm is fine; the mask's -inf (explicit, or held by a buffer) is no
    overflow. An in-place fp16 product that passes 65504 inside the module is."""
    _probe_train(run_path, _probe_net(scale=1.0), steps=2)
    assert _hidden(run_path) == []
    _probe_train(run_path, _probe_net(scale=1.0, inplace_overflow=True), steps=1)
    assert [(h["module"], h["op"], h["created"]) for h in _hidden(run_path)] == \
        [("net.mask", "mul", 2)]


def test_the_op_probe_changes_nothing_and_can_be_turned_off(run_path, tmp_path):
    def weights_after(**options):
        model = _probe_net(scale=200.0)
        losses = _probe_train(str(tmp_path / f"{len(options)}.h5"), model, steps=3,
                              **options)
        return losses, weights(model)

    on, off = weights_after(), weights_after(op_probe=False)
    np.testing.assert_array_equal(on[0], off[0])
    assert_bit_identical(on[1], off[1])
    with ampdoctor.load(str(tmp_path / "1.h5")) as run:
        assert run.recorder_settings["op_probe"] is False
        assert not (run.events["kind"] == int(Event.HIDDEN_NONFINITE)).any()


def test_a_forward_that_raises_on_a_sampled_step_leaves_no_mode_behind(run_path):
    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Boom())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, path=run_path, every=1, strict=True):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 8))
        assert torch.overrides._get_current_function_mode() is None
        model[0](torch.randn(2, 8)).sum().backward()  # the loop goes on
        opt.step()


def test_a_failure_inside_the_op_probe_never_reaches_the_loop(run_path, monkeypatch):
    from ampdoctor.errors import RecorderFault
    from ampdoctor.record import opprobe

    def broken(self, *args):
        raise RuntimeError("probe bug")

    monkeypatch.setattr(opprobe.StepProbe, "_record", broken)
    with pytest.warns(RuntimeWarning, match="the op probe stopped .RuntimeError: probe bug"):
        losses = _probe_train(run_path, _probe_net(scale=200.0), steps=3, strict=False)
    assert len(losses) == 3 and _hidden(run_path) == []
    with ampdoctor.load(run_path) as run:
        assert len(run.steps) == 3 and run.steps["sampled"].all()  # the sampled tier went on
    with pytest.raises(RecorderFault, match="probe bug"):
        _probe_train(run_path, _probe_net(scale=200.0), steps=1)


def test_lazy_recorder_creates_its_file_when_training_begins(tmp_path):
    import torch
    from helpers import TinyNet, batches

    named = []

    def name(rank, world):
        named.append((rank, world))
        return str(tmp_path / "run.h5")

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ampdoctor.watch(path=name, lazy=True, strict=True)
    try:
        with torch.no_grad():
            model(torch.ones(2, 16))  # inference is not training
        assert not os.path.exists(tmp_path / "run.h5") and named == []
        for x, y in batches(3):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            assert os.path.exists(tmp_path / "run.h5")
            opt.step()
            opt.zero_grad()
    finally:
        rec.close()
    assert named == [(0, 1)]  # once, when the file was created
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 3 and run.meta["roots"] == ["TinyNet"]


def test_lazy_recorder_that_never_trains_writes_nothing_unless_kept(tmp_path):
    import torch

    path = str(tmp_path / "run.h5")
    rec = ampdoctor.watch(path=path, lazy=True, strict=True)
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
    rec.close()
    assert not os.path.exists(path)
    rec = ampdoctor.watch(path=path, lazy=True, strict=True)
    rec.close(keep_empty=True)
    with ampdoctor.load(path) as run:
        assert len(run.steps) == 0 and run.status == "finished"
