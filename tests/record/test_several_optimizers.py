"""Several models and optimizers with one GradScaler (the AMP docs' "multiple models, losses
and optimizers" recipe): the grad norm recorded is the unscaled one, whichever optimizer
``unscale_`` was called for."""

import os

import numpy as np
import pytest
import torch

import ampdoctor


def docs_recipe(path, steps=5, unscale_first=True):
    """The AMP docs' example: two models, two losses, ``unscale_`` of optimizer0 only, a
    ``step`` per optimizer and one ``update``. Returns the unscaled global grad norm of each
    step as the loop measures it (after both steps, every gradient unscaled in place)."""
    torch.manual_seed(0)
    model0, model1 = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.01)
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    norms = []
    with ampdoctor.watch([model0, model1], [opt0, opt1], scaler, path=path, strict=True):
        for _ in range(steps):
            x, target = torch.randn(8, 4), torch.randn(8, 3)
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = torch.nn.functional.mse_loss(2 * out0 + 3 * out1, target)
            loss1 = torch.nn.functional.mse_loss(3 * out0 - 5 * out1, target)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if unscale_first:
                scaler.unscale_(opt0)
            scaler.step(opt0)
            scaler.step(opt1)
            grads = [p.grad for m in (model0, model1) for p in m.parameters()]
            norms.append(float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
            scaler.update()
    return norms


@pytest.mark.parametrize("unscale_first", [True, False])
def test_grad_norm_is_unscaled_for_every_optimizer(run_path, unscale_first):
    norms = docs_recipe(run_path, unscale_first=unscale_first)
    run = ampdoctor.load(run_path)
    assert list(run.steps["skipped"]) == [0] * 5
    # Before: optimizer1's gradients entered the norm still multiplied by the scale (1024).
    np.testing.assert_allclose(run.steps["grad_norm"], norms, rtol=1e-5)
    assert len(run.meta["optimizer"]) == 2


def test_a_gan_loop_is_one_step_per_update(run_path):
    """The discriminator's loss, backward and step, then the generator's, then one update():
    one recorded step per update (before: one per optimizer step, the D and G losses
    alternating in one curve), both losses counted in it, both optimizers listed."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    og, od = (torch.optim.Adam(m.parameters(), lr=1e-3) for m in (gen, disc))
    scaler = torch.amp.GradScaler("cpu")
    bce = torch.nn.BCEWithLogitsLoss()
    seen = []
    with ampdoctor.watch([gen, disc], [od, og], scaler, path=run_path, strict=True):
        for _ in range(4):
            real, fake = torch.randn(8, 2) + 2, gen(torch.randn(8, 2))
            od.zero_grad()
            og.zero_grad()
            d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()),
                                                            torch.zeros(8, 1))
            scaler.scale(d_loss).backward()
            scaler.step(od)
            g_loss = bce(disc(fake), torch.ones(8, 1))
            scaler.scale(g_loss).backward()
            scaler.step(og)
            scaler.update()
            seen.append((d_loss.item() + g_loss.item()) / 2)
    run = ampdoctor.load(run_path)
    assert list(run.steps["step"]) == [0, 1, 2, 3]
    assert list(run.steps["micro"]) == [2] * 4
    np.testing.assert_allclose(run.steps["loss"], seen, rtol=1e-6)
    assert [o["class"] for o in run.meta["optimizer"]] == ["Adam", "Adam"]


@pytest.mark.slow
def test_a_recorded_gan_script_is_one_step_per_iteration_and_healthy(tmp_path):
    """`ampdoctor record` on fixtures/examples/train_gan.py (no code change): 120 iterations,
    120 steps of two losses each, both optimizers, finite unscaled grad norms, and healthy."""
    from recording import record
    from testenv import ROOT

    out = str(tmp_path / "gan.h5")
    script = os.path.join(ROOT, "fixtures", "examples", "train_gan.py")
    proc = record(script, out, ["--steps", "120"])
    assert proc.returncode == 0, proc.stderr
    run = ampdoctor.load(out)
    assert len(run.steps) == 120 and np.all(run.steps["micro"] == 2)
    assert [o["class"] for o in run.meta["optimizer"]] == ["Adam", "Adam"]
    norms = run.steps["grad_norm"]
    assert np.all(np.isfinite(norms)) and norms.max() < 100  # unscaled: the scale is 65536
    assert ampdoctor.diagnose(out).verdict == "healthy"


def test_a_step_whose_update_never_came_still_ends_at_close(run_path):
    """scaler.step, then the recorder closes before update(): the step is kept."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True):
        for i in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            scaler.step(opt)
            if i < 2:
                scaler.update()
    run = ampdoctor.load(run_path)
    assert list(run.steps["step"]) == [0, 1, 2]
