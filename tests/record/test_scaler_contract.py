"""GradScaler's contract as the AMP docs write it (pytorch.org/docs/stable/notes/amp_examples):
the docs' recipes done right record no misuse (several optimizers, a scaled loss divided, the
gradient penalty unscaled), and a gradient penalty built from torch.autograd.grad's still-scaled
gradients is the ``scaled_grads_in_loss`` misuse, with the docs' fix.

(The auxiliary loss backwarded without the scaler, and accumulation: ``test_recorder.py``.)"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyNet, batches, fresh

import ampdoctor
from ampdoctor.runfile.schema import Event, flag


def _events(run_path, kind):
    run = ampdoctor.load(run_path)
    return run.events[run.events["kind"] == int(kind)]


def _misuses(run_path):
    run = ampdoctor.load(run_path)
    return {Event(k).name for k in run.events["kind"].tolist()} & {
        "BACKWARD_UNSCALED", "SCALED_GRADS_IN_LOSS", "UNSCALE_TWICE", "CLIP_BEFORE_UNSCALE",
        "STEP_BYPASSES_SCALER"}


def test_several_optimizers_step_each_update_once_is_healthy(run_path):
    torch.manual_seed(0)
    a, b = TinyNet(), TinyNet()
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(a, opt_a, scaler, path=run_path, strict=True):
        for x, y in batches(6):
            with torch.autocast("cpu", dtype=torch.float16):
                out_a, out_b = a(x), b(x)
                loss0 = F.cross_entropy(out_a + out_b, y)
                loss1 = F.cross_entropy(out_a - out_b, y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.unscale_(opt_a)  # once per optimizer per step, before its clip
            scaler.unscale_(opt_b)
            torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
            torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()  # once, after every optimizer stepped
            opt_a.zero_grad()
            opt_b.zero_grad()
    assert _misuses(run_path) == set()
    assert ampdoctor.diagnose(run_path).verdict == "healthy"


def _penalty(run_path, unscale, steps=6, read_first=False):
    """The AMP docs' gradient penalty: torch.autograd.grad of the scaled loss, the norm of
    those gradients added to the loss; unscaled first (the recipe) or not."""
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    params = list(model.parameters())
    seen = []
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True):
        for x, y in batches(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaled = scaler.scale(loss)
            if read_first:
                inv_scale = 1.0 / scaler.get_scale()  # read before autograd.grad: as good
            # create_graph given by position, as grad(outputs, inputs, None, None, True)
            grads = torch.autograd.grad(scaled, params, None, None, True)
            if unscale:
                if not read_first:
                    inv_scale = 1.0 / scaler.get_scale()
                grads = [g * inv_scale for g in grads]
            with torch.autocast("cpu", dtype=torch.float16):
                norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
                loss = loss + norm
            seen.append(loss.item())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return seen


@pytest.mark.parametrize("read_first", [False, True], ids=["docs", "scale-read-first"])
def test_a_gradient_penalty_unscaled_as_the_docs_do_is_healthy(run_path, read_first):
    seen = _penalty(run_path, unscale=True, read_first=read_first)
    assert _misuses(run_path) == set()
    assert ampdoctor.diagnose(run_path).verdict == "healthy"
    run = ampdoctor.load(run_path)
    # the scaled output taken only through autograd.grad is not a loss of the step: the one
    # recorded is the one backwarded, and the step says a penalty was built at the scale
    assert list(run.steps["micro"]) == [1] * 6
    np.testing.assert_allclose(run.steps["loss"], seen, rtol=1e-6)
    assert all(run.steps["flags"] & flag(Event.PENALTY_AT_SCALE))


def test_a_gradient_penalty_of_scaled_gradients_is_a_misuse(run_path):
    _penalty(run_path, unscale=False)
    assert _events(run_path, Event.SCALED_GRADS_IN_LOSS)["step"].tolist() == list(range(6))
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "scaled_grads_in_loss"
    assert d.fixes[0].id == "unscale_autograd_grad"
    assert "inv_scale = 1. / scaler.get_scale()" in d.fixes[0].snippet


def test_a_scaled_loss_divided_before_its_backward_is_healthy(run_path):
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True):
        for x, y in batches(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            (scaler.scale(loss) / 2).backward()  # an op after scale(): still the scaled loss
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert _misuses(run_path) == set()
