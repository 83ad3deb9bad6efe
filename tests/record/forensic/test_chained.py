"""Steps of several models, replayed as a chain (``record/forensic/forensics.py``,
``trial.rerun_chain``): a generator feeding a discriminator whose attention overflows fp16, and
neural style transfer, whose only trained tensor is the image, fed to a frozen extractor and
then to a parameter-free Gram matrix (``discovery.RootDiscovery.adopt``). Tiny models under
``ampdoctor.watch`` with no model given, as ``ampdoctor record`` discovers them."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor


class Attention(nn.Module):
    """SAGAN's self-attention: energy = q k^T with no 1/sqrt(d), in fp16 under autocast."""

    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gamma = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        energy = torch.bmm(self.q(x), self.k(x).transpose(1, 2))
        return x + self.gamma * torch.bmm(F.softmax(energy, -1).to(x.dtype), self.v(x))


class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(self.norm(self.attn(x)).mean(1))


def gan(steps: int, big: tuple = (), seed: int = 0):
    """D then G, one GradScaler, the AMP docs' recipe; the real data (and the generator's
    samples, shifted by the training code) reach ~300 at the steps in ``big``, where D's
    attention energy passes 65504. Returns the models, optimizers and the losses."""
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4 * 32))
    disc = Disc()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses = []

    def run(step):
        shift = 300.0 if step in big else 0.0
        real = shift + torch.randn(16, 4, 32)
        z = torch.randn(16, 8)
        opt_d.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            fake = shift + torch.tanh(gen(z).view(16, 4, 32))
            d_real, d_fake = disc(real), disc(fake.detach())
            loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                      + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)
        opt_g.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            d_gen = disc(fake)
            loss_g = F.binary_cross_entropy_with_logits(d_gen, torch.ones_like(d_gen))
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
        losses.append((loss_d.item(), loss_g.item()))

    return (gen, disc, opt_g, opt_d), run, losses


def _details(path):
    run = ampdoctor.load(path)
    return run, [json.loads(s["detail"]) for s in run.snapshots]


def _bits(parts):
    gen, disc, opt_g, opt_d = parts
    out = [p.detach().clone() for m in (gen, disc) for p in m.parameters()]
    out += [v.clone() for o in (opt_g, opt_d) for s in o.state.values() for v in s.values()
            if torch.is_tensor(v)]
    return [t.reshape(-1).view(torch.uint8) for t in out]


def test_a_failure_in_the_second_model_is_located_there(run_path):
    """The generator's replay finds its output finite and the gradient into it not: that
    gradient came through the discriminator, which is replayed next and located (not 'the
    loss's backward'). The island tried on the chain makes the step finite with the run's own
    losses (D's two and G's), and nothing of it shows in the run."""
    parts, run, losses = gan(4, big=(1,))
    with ampdoctor.watch(path=run_path, every=0, strict=True) as rec:
        for step in range(4):
            run(step)
    assert [(e.step, e.phase, e.module) for e in rec.events][:1] == \
        [(1, "forward", "Disc.attn")]
    _, details = _details(run_path)
    assert details[0]["fed_by"] == "Sequential"
    island = details[0]["trials"]["fp32_island"]
    assert island["tried"] and island["finite"] and island["modules"] == ["Disc.attn"]
    # D's loss on real and fake samples (an earlier call's output) and G's, recomputed
    assert island["loss_fns"] == ["binary_cross_entropy_with_logits"]
    assert 1.0 < island["loss"] < 3.0, island  # ~ln 2 each, at these logits
    assert "not re-run" in island["note"]  # the generator's samples: shifted by the loop

    watched = _bits(parts)
    parts, run, plain = gan(4, big=(1,))
    for step in range(4):
        run(step)
    assert repr(plain) == repr(losses)  # (NaN at step 1 in both)
    assert all(torch.equal(a, b) for a, b in zip(watched, _bits(parts)))


class Features(nn.Module):
    """A frozen per-pixel extractor standing in for VGG's first layers."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Linear(3, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.conv1.weight.mul_(6.0)
            self.conv2.weight.mul_(12.0)

    def forward(self, img):
        return torch.relu(self.conv2(torch.relu(self.conv1(img))))


class Gram(nn.Module):
    def __init__(self, fp32: bool = False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, f):
        if self.fp32:
            with torch.autocast("cpu", enabled=False):
                f = f.float()
                return f.transpose(1, 2) @ f / f.shape[1]
        return f.transpose(1, 2) @ f / f.shape[1]


def style_transfer(steps: int, fp32_gram: bool = False):
    torch.manual_seed(0)
    feats, gram = Features().requires_grad_(False), Gram(fp32_gram)
    content, style = torch.rand(1, 4096, 3), torch.rand(1, 4096, 3) ** 2
    image = nn.Parameter(content.clone())
    opt = torch.optim.Adam([image], lr=2e-2)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            f_img = feats(image)
            with torch.no_grad():
                g_style, f_content = gram(feats(style)), feats(content)
            loss = F.mse_loss(gram(f_img).float(), g_style.float()) \
                + 0.1 * F.mse_loss(f_img.float(), f_content.float())
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            image.clamp_(0, 1)
    return image


@pytest.mark.parametrize("fp32_gram", [False, True])
def test_a_trained_image_makes_its_frozen_models_the_ones_replayed(run_path, fp32_gram):
    """No module owns a trained parameter: the frozen extractor and the Gram matrix, through
    which the image's gradient flows, are adopted and replayed; the fp16 Gram matrix is
    located. A trial cannot judge bf16 there: the style's Gram matrix, the loss's target, was
    computed under no_grad in fp16 and is inf as the step had it, and it says so."""
    with ampdoctor.watch(path=run_path, every=0, strict=True) as rec:
        style_transfer(3, fp32_gram)
    run, details = _details(run_path)
    assert run.meta["roots"] == ["Features", "Gram"]
    if fp32_gram:
        assert not rec.events and not details
        return
    assert (rec.events[0].phase, rec.events[0].module) == ("forward", "Gram")
    # the island goes around Gram itself (one model of several, with no submodule), and
    # neither trial can judge the loss whose target the failing code made
    for fix in ("fp32_island", "use_bf16"):
        trial = details[0]["trials"][fix]
        assert not trial["tried"] and "target holds NaN/inf as the step had it" in \
            trial["note"], trial
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "unstable_op" and d.fixes[0].apply == "fp32_island=Gram"


def test_a_loss_module_beside_a_model_is_not_adopted(run_path):
    """A frozen or parameter-free module is adopted only for a trained tensor that no model
    owns: nn.MSELoss called on a model's output is not a root."""
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 1), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(path=run_path, every=0, strict=True):
        for _ in range(3):
            loss = loss_fn(model(torch.randn(8, 4)), torch.randn(8, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert ampdoctor.load(run_path).meta["roots"] == ["Linear"]


def test_the_optimizer_of_a_trained_input_is_recorded_without_a_scaler(run_path):
    """No GradScaler to say which optimizer is the run's: the optimizer of the image, a tensor
    outside the frozen modules adopted for it, is the one whose steps end the run's steps."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 8), nn.Linear(8, 8)]).requires_grad_(False)
    img = torch.rand(64, 3).requires_grad_(True)
    opt = torch.optim.Adam([img], lr=1e-2)
    with ampdoctor.watch(path=run_path, every=1, strict=True):
        for _ in range(4):
            opt.zero_grad()
            layers[1](torch.relu(layers[0](img))).square().mean().backward()
            opt.step()
    run = ampdoctor.load(run_path)
    assert len(run.steps) == 4 and run.meta["roots"] == ["Linear", "Linear"]


class Exp(torch.autograd.Function):
    """A hand-written op with no custom_fwd: under autocast it runs on the fp16 it is given."""

    @staticmethod
    def forward(ctx, x):
        y = torch.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_a_nonfinite_input_computed_between_two_model_calls_is_the_op_not_the_data(run_path):
    """Two roots a step (``enc(x)``, then ``head(Exp(h))``): the second root's input holds inf,
    made by a custom Function between them in fp16, with a grad_fn: the op is the culprit
    (forward, outside any module), never the batch, and the fix is custom_fwd in fp32."""
    torch.manual_seed(0)
    enc, head = nn.Linear(4, 4), nn.Linear(4, 2)
    with torch.no_grad():
        enc.weight.fill_(3.0)  # h ~ 12 * |x|: exp passes 65504 past 11.1
    params = list(enc.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.ones(8, 4), torch.zeros(8, dtype=torch.long)
    with ampdoctor.watch(path=run_path, every=0, strict=True) as rec:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                h = enc(x)
                loss = F.cross_entropy(head(Exp.apply(h)).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    event = next(e for e in rec.events if e.phase is not None)
    assert (event.phase, event.module) == ("forward", "Exp")
    _, details = _details(run_path)
    made = details[0]["computed"]
    assert made["function"] and made["dtype"] == "float16" and made["autocast"] == "float16"
    assert not details[0]["trials"]["fp32_island"]["tried"]  # the calls' input is the bad one
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "unstable_op", d.verdict
    assert "custom_fwd(device_type=\"cpu\", cast_inputs=torch.float32)" in d.fixes[0].snippet
    assert "check_data" not in [fx.id for fx in d.fixes]
