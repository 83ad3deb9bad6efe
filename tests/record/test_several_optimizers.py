"""Several models and optimizers with one GradScaler (the AMP docs' "multiple models, losses
and optimizers" recipe): the grad norm recorded is the unscaled one, whichever optimizer
``unscale_`` was called for."""

import contextlib
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


# ---------------------------------------------------------------------------------------------
# Each loss and each optimizer on its own (/losses, /optimizers, /meta losses: objectives.py)


def _gan(path, steps=6, g_first=False, watch=True, scaler_on=True):
    """A GAN as the AMP docs train it (D's loss and step, then G's, one update), or G first
    with the discriminator's gradients zeroed by ``module.zero_grad()`` before its own
    backward. Returns (D losses, G losses, each step's (D, G) unscaled grad norms, weights)."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    od, og = (torch.optim.Adam(m.parameters(), lr=1e-3) for m in (disc, gen))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=scaler_on)
    bce = torch.nn.BCEWithLogitsLoss()
    d_seen, g_seen, norms = [], [], []

    def norm(m):
        return float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in m.parameters()])))

    def d_step(real, fake):
        disc.zero_grad()
        d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
        scaler.scale(d_loss).backward()
        scaler.unscale_(od)
        d_seen.append(d_loss.item())
        scaler.step(od)
        return norm(disc)

    def g_step(fake):
        og.zero_grad()
        g_loss = bce(disc(fake), torch.ones(8, 1))
        scaler.scale(g_loss).backward()
        scaler.unscale_(og)
        g_seen.append(g_loss.item())
        scaler.step(og)
        return norm(gen)

    ctx = ampdoctor.watch([gen, disc], [od, og], scaler, path=path, strict=True) if watch \
        else contextlib.nullcontext()
    with ctx:
        for _ in range(steps):
            real, fake = torch.randn(8, 2) + 2, gen(torch.randn(8, 2))
            if g_first:
                gn = g_step(fake)
                dn = d_step(real, fake)
            else:
                dn = d_step(real, fake)
                gn = g_step(fake)
            scaler.update()
            norms.append((dn, gn))
    weights = [p.detach().clone() for m in (gen, disc) for p in m.parameters()]
    return d_seen, g_seen, norms, weights


@pytest.mark.parametrize("g_first", [False, True])
def test_each_loss_is_kept_with_the_optimizer_it_feeds(run_path, g_first):
    """The generator's loss reaches the discriminator's parameters too, but their gradients
    are zeroed before the discriminator steps: it feeds the generator's optimizer only. Each
    loss's own curve and each optimizer's unscaled grad norm are recorded per step."""
    d_seen, g_seen, norms, _ = _gan(run_path, g_first=g_first)
    run = ampdoctor.load(run_path)
    sites = run.losses_meta
    assert [s.optimizers for s in sites] == ([[1], [0]] if g_first else [[0], [1]])
    assert [s.reaches for s in sites] == ([[0, 1], [0]] if g_first else [[0], [0, 1]])
    assert all(s.site.startswith("test_several_optimizers.py:") for s in sites)
    d_slot, g_slot = (1, 0) if g_first else (0, 1)
    rows = run.losses
    assert list(rows["step"][rows["slot"] == d_slot]) == list(range(6))
    np.testing.assert_allclose(rows["loss"][rows["slot"] == d_slot], d_seen, rtol=1e-6)
    np.testing.assert_allclose(rows["loss"][rows["slot"] == g_slot], g_seen, rtol=1e-6)
    opt = run.optimizer_steps
    assert list(opt["optimizer"]) == [0, 1] * 6 and set(opt["stepped"]) == {1}
    np.testing.assert_allclose(opt["grad_norm"][opt["optimizer"] == 0],
                               [d for d, _ in norms], rtol=1e-5)
    np.testing.assert_allclose(opt["grad_norm"][opt["optimizer"] == 1],
                               [g for _, g in norms], rtol=1e-5)
    assert set(opt["found_inf"]) == {0} and np.allclose(opt["lr"], 1e-3)


def test_a_recorded_gan_trains_exactly_as_without_ampdoctor(run_path):
    plain = _gan(run_path, watch=False)
    recorded = _gan(run_path)
    assert plain[0] == recorded[0] and plain[1] == recorded[1]
    assert all(torch.equal(a, b) for a, b in zip(plain[3], recorded[3]))


def test_the_docs_two_losses_feed_both_optimizers(run_path):
    """The docs' multi-loss recipe: both losses are computed from both models' outputs, so
    each feeds both optimizers; each optimizer's norm is its own model's."""
    docs_recipe(run_path)
    run = ampdoctor.load(run_path)
    assert [s.optimizers for s in run.losses_meta] == [[0, 1], [0, 1]]
    assert len(run.losses) == 10 and len(run.optimizer_steps) == 10
    total = np.sqrt(np.sum(run.optimizer_steps["grad_norm"].reshape(5, 2) ** 2, axis=1))
    np.testing.assert_allclose(total, run.steps["grad_norm"], rtol=1e-5)


def test_one_loss_and_one_optimizer_write_no_rows_of_their_own(run_path):
    """Micro-batches backwarded from one line are one loss: nothing in /losses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.watch(model, opt, path=run_path, strict=True):
        for _ in range(3):
            for _micro in range(2):
                model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    run = ampdoctor.load(run_path)
    assert list(run.steps["micro"]) == [2, 2, 2]
    assert len(run.losses) == 0 and len(run.optimizer_steps) == 0
    assert "losses" not in run.meta


def test_report_and_top_show_each_loss_and_each_optimizer(run_path):
    """The loss figure has a line per loss (named by its line), the grad-norm figure one per
    optimizer, and ``top`` a sparkline per loss."""
    from ampdoctor.live import follow, frame, top
    from ampdoctor.render import plots

    _gan(run_path)
    with ampdoctor.load(run_path) as run:
        labels = [t.get_text() for t in plots.loss_figure(run).axes[0].get_legend().get_texts()]
        assert labels[0] == "mean of the losses" and len(labels) == 3
        assert all(t.startswith("loss at test_several_optimizers.py:") for t in labels[1:])
        norms = plots.grad_norm_figure(run).axes[0].get_legend().get_texts()
        assert {"Adam #0", "Adam #1"} <= {t.get_text() for t in norms}
    with follow.Follower(run_path) as f:
        f.poll()
        fr = frame.build(f.states)
    lines = top.render(fr, 100, unicode=False)
    each = [line for line in lines if line.startswith(" loss ")]
    assert len(each) == 2 and all("_optimizers.py:" in line for line in each)  # (its end)
    assert all(len(line) <= 100 for line in lines)


def test_a_loss_is_its_line_wherever_the_loop_is_called_from(run_path):
    """A step function called from a warm-up loop, then from the main loop: one loss. A
    helper that backwards, called twice in a step (two models' losses): two, each named by
    the line that called it."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (a, b))

    def backward(loss):
        loss.backward()

    def step():
        backward(a(torch.randn(8, 4)).pow(2).mean())
        opt_a.step()
        backward(b(torch.randn(8, 4)).pow(2).mean())
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()

    with ampdoctor.watch([a, b], [opt_a, opt_b], path=run_path, strict=True):
        for _ in range(2):
            step()  # warm-up
        for _ in range(3):
            step()
    run = ampdoctor.load(run_path)
    sites = run.losses_meta
    # (each call stack is a loss of its own; the diagnosis joins those of one line that follow
    # one another: the warm-up's and the main loop's)
    assert len(sites) == 4 and len({s.frames[0] for s in sites}) == 1, sites
    assert "(from test_several_optimizers.py:" in sites[1].site
    from ampdoctor.diagnosis import objectives
    from ampdoctor.diagnosis.facts import Facts
    objs = objectives.read(Facts(run))
    assert [o.feeds for o in objs] == [(0,), (1,)], [(o.site, o.feeds) for o in objs]
    # the recorder's steps end at opt_a's step: b's first loss comes in step 1, and its
    # last, after the last step ended, is in no recorded step
    assert [list(o.steps) for o in objs] == [[0, 1, 2, 3, 4], [1, 2, 3, 4]]


def test_the_same_loop_from_two_lines_is_one_loss(run_path):
    """A warm-up loop, then the main loop, calling one step function: two call stacks, written
    as two losses of one line, which the diagnosis reads as the one loss they are. With one
    optimizer, each step's row is the step's loss (no value of its own)."""
    from ampdoctor.diagnosis import objectives
    from ampdoctor.diagnosis.facts import Facts

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    with ampdoctor.watch(model, opt, path=run_path, strict=True):
        step()
        for _ in range(3):
            step()
    run = ampdoctor.load(run_path)
    lines = {s.frames[0] for s in run.losses_meta}
    assert len(run.losses_meta) == 2 and len(lines) == 1
    assert list(run.losses["step"]) == [1, 2, 3]  # from the step the second call stack came
    np.testing.assert_array_equal(run.losses["loss"], run.steps["loss"][1:])
    assert objectives.read(Facts(run)) == []  # one loss


def test_a_generator_never_adopted_is_named_after_the_scripts_variable(run_path):
    """WGAN's loop: the critic steps every iteration, the generator every second one, so the
    first step (where models are discovered) runs the generator only under no_grad: it is
    never adopted as a model. Its optimizer steps through the scaler, and its parameters are
    named after the variable that holds it (``gen.0.weight``), not ``param0``."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    critic = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(path=run_path, every=1, strict=True):
        for it in range(4):
            with torch.no_grad():
                fake = gen(torch.randn(16, 4))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_c = critic(fake).mean() - critic(torch.randn(16, 2)).mean()
            opt_c.zero_grad()
            scaler.scale(loss_c).backward()
            scaler.step(opt_c)
            if it % 2:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss_g = -critic(gen(torch.randn(16, 4))).mean()
                opt_g.zero_grad()
                scaler.scale(loss_g).backward()
                scaler.step(opt_g)
            scaler.update()
    run = ampdoctor.load(run_path)
    names = {str(n) for n in run.tensors["name"]}
    assert run.meta["roots"] == ["Sequential"]  # the critic
    assert {"gen.0.weight", "gen.2.bias", "0.weight"} <= names, " ".join(sorted(names))
    assert not any(n.startswith("param") for n in names)
