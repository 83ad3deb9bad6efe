"""Forensic replay: models whose culprit is known, the snapshot, rate limits, no observer effect.

Each scenario model below fails in one known place. The tests run a plain training loop under
``ampdoctor.watch`` and assert what the replay names: module, phase and fp32 verdict, with a
GradScaler (fp16) and without one (the NaN then reaches the weights).
"""

import contextlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from culprits import ExpNet, FastExp, batches, make, scaler, train

import ampdoctor
from ampdoctor.record.forensic import capture, forensics, losscall, policy, snapshot, trial
from ampdoctor.record.forensic.trial import Trial
from ampdoctor.runfile.schema import Event, Kind, Phase, Source

# ---------------------------------------------------------------------------------------------
# models with a known culprit


class Attention(nn.Module):
    """Self-attention that forgets the 1/sqrt(d) scaling: q @ k^T passes 65504 in fp16."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).transpose(1, 3).unbind(2)
        scores = q @ k.transpose(-2, -1)  # the culprit: this module's own code
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class AttnNet(nn.Module):
    def __init__(self, dim: int = 32, qk_std: float = 20.0):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.ln = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.head = nn.Linear(dim, 4)
        with torch.no_grad():  # "pretrained" large query/key projections
            self.attn.qkv.weight[: 2 * dim].normal_(0, qk_std)

    def forward(self, x):
        h = self.ln(self.embed(x))
        h = h + self.attn(h)
        return self.head(h).mean(1)


class Complement(nn.Module):
    """log(1 - p) where ``keep``, else 0, with p clamped below 1 so that 1 - p stays positive.

    In fp16 the bound 1 - 1e-4 rounds to 1.0: where p saturates to 1.0 the forward is still
    finite (``where`` picks 0) but the backward of log1p divides 0 by 1 - p = 0: NaN.
    """

    def forward(self, p, keep):
        return torch.where(keep, torch.log1p(-p.clamp(max=1 - 1e-4)), torch.zeros_like(p))


class ClampNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.comp = Complement()
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.lin.bias[:8].fill_(12.0)  # sigmoid saturates to exactly 1.0 in fp16

    def forward(self, x):
        p = torch.sigmoid(self.lin(x))
        return self.head(self.comp(p, p < 0.99))


class DropBN(nn.Module):
    """Dropout and BatchNorm (RNG and buffers a replay must leave as it found them), with an
    exp that overflows when a batch is too large."""

    def __init__(self):
        super().__init__()
        self.drop_in = nn.Dropout(0.2)
        self.lin1 = nn.Linear(8, 32)
        self.exp = FastExp()
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.lin2 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.exp(0.3 * self.lin1(self.drop_in(x)))
        return self.lin2(self.drop(torch.relu(self.bn(h))))


class NegOverflow(nn.Module):
    """A linear layer whose output overflows to -inf only, which LayerNorm turns into NaN."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.ln(self.lin(x)))


# ---------------------------------------------------------------------------------------------
# recording (the plain user loop, ``train``, is support/culprits.py's)


def record(path, model, sc=None, **options):
    options.setdefault("every", 0)
    return ampdoctor.watch(model, model.opt, sc, path=path, strict=True, **options)


def first_snapshot(path):
    run = ampdoctor.load(path)
    assert len(run.snapshots), "no forensic snapshot was written"
    return run, run.snapshots[0], json.loads(run.snapshots[0]["detail"])


def outside_autocast(fn):
    fn.outside_autocast = True
    return fn


# ---------------------------------------------------------------------------------------------
# culprits


@pytest.mark.parametrize("use_scaler", [True, False])
def test_attention_without_scaling_is_a_forward_culprit_fixed_by_fp32(run_path, use_scaler):
    model = make(AttnNet)
    sc = scaler(2.0**10) if use_scaler else None
    data = batches(2, shape=(4, 6, 8))
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc)
    ev = rec.events[0]
    assert ev.step == 0 and ev.replayed
    assert ev.trigger == ("skipped" if use_scaler else "nonfinite_loss")
    # The parent's own q @ k^T overflowed: not its finite children (qkv), nor proj, which
    # only received the NaN.
    assert (ev.phase, ev.module, ev.fp32) == ("forward", "attn", "finite")
    r = ev.result
    assert math.isfinite(r.fp32_absmax) and r.fp32_absmax > 0
    assert "own code" in r.summary and "fp32 island" in r.summary
    # Execution order of what went non-finite: the culprit, then whatever consumed it.
    assert r.detail.chain == ["AttnNet", "attn", "attn.proj", "head"]
    qkv = [t for t in r.trace if t.module == "attn.qkv" and t.kind == "output"]
    assert qkv and not qkv[0].nonfinite
    run, snap, detail = first_snapshot(run_path)
    assert (snap["step"], snap["phase"], snap["module"]) == (0, Phase.FORWARD, "attn")
    assert snap["module_type"] == "Attention" and snap["fp32_finite"] == 1
    assert snap["trigger"] == (Event.SKIPPED if use_scaler else Event.NONFINITE_LOSS)


@pytest.mark.parametrize("dtype,use_scaler,shift,fp32", [
    (torch.float16, True, 20.0, "finite"),  # exp(20) overflows fp16 only: an fp32 island
    (torch.bfloat16, False, 100.0, "non-finite"),  # exp(100) overflows fp32 too: too large
])
def test_custom_exp_is_the_innermost_forward_culprit(run_path, dtype, use_scaler, shift, fp32):
    model = make(ExpNet, shift)
    sc = scaler(2.0**10) if use_scaler else None
    with record(run_path, model, sc) as rec:
        train(model, batches(2), dtype=dtype, scaler=sc)
    ev = rec.events[0]
    # body (a Sequential) hands on body.1's output: the innermost module is named.
    assert (ev.phase, ev.module, ev.fp32) == ("forward", "body.1", fp32)
    assert ev.result.module_type == "FastExp"
    if fp32 == "finite":
        assert 65504 < ev.result.fp32_absmax < 1e10
        assert "fp32 island" in ev.result.summary
    else:
        assert "too large" in ev.result.summary
    run, snap, detail = first_snapshot(run_path)
    assert snap["fp32_finite"] == (1 if fp32 == "finite" else 0)
    assert detail["fp32"]["copied_module"] is False


@pytest.mark.parametrize("dtype,use_scaler", [(torch.float16, True), (torch.bfloat16, False)])
def test_nonfinite_input_is_a_bad_batch(run_path, dtype, use_scaler):
    model = make(ExpNet)
    sc = scaler(2.0**10) if use_scaler else None
    data = batches(4)
    data[2][0][1, 3] = float("nan")
    with record(run_path, model, sc) as rec:
        train(model, data, dtype=dtype, scaler=sc)
    ev = rec.events[0]
    assert (ev.phase, ev.module, ev.fp32) == ("input", "ExpNet", "not run")
    assert ev.result.detail.bad_inputs[0].label == "args.0"
    assert ev.result.detail.bad_inputs[0].nan == 1
    run, snap, _ = first_snapshot(run_path)
    assert snap["phase"] == Phase.INPUT and snap["fp32_finite"] == -1
    assert list(run.events["step"][run.events["kind"] == Event.NONFINITE_INPUT]) == [2]
    culprit = run.tensors[run.tensors["id"] == snap["culprit"]][0]
    assert culprit["kind"] == Kind.INPUT
    if use_scaler:  # the step was skipped: nothing else happens
        assert [e.step for e in rec.events] == [2]
    else:  # the NaN reached the weights: the next step's culprit is the first poisoned layer
        assert [e.step for e in rec.events] == [2, 3]
        poisoned = rec.events[1].result
        assert (poisoned.phase, poisoned.module) == ("forward", "body.0")
        assert poisoned.detail.weights_nonfinite == ["weight", "bias"]
        assert "poisoned" in poisoned.summary and poisoned.fp32 == "non-finite"


def test_fp16_loss_overflowing_when_scaled_is_the_loss(run_path):
    model = make(ExpNet)
    sc = scaler()  # 65536 > fp16 max: the gradient reaching an fp16 loss is inf

    @outside_autocast
    def fp16_loss(out, y):  # computed in fp16, outside autocast
        return (out - F.one_hot(y, 4).half()).pow(2).mean()

    with record(run_path, model, sc) as rec:
        train(model, batches(2), scaler=sc, loss_fn=fp16_loss)
    ev = rec.events[0]
    assert (ev.step, ev.phase, ev.module) == (0, "loss", None)
    assert ev.fp32 == "finite" and ev.result.fp32_absmax == 65536.0
    loss = ev.result.detail.loss
    assert loss.dtype == "float16" and math.isfinite(loss.value)
    assert loss.grad_nonfinite is True
    run, snap, _ = first_snapshot(run_path)
    assert snap["phase"] == Phase.LOSS and snap["module"] == "" and snap["fp32_finite"] == 1


class Saturated(nn.Module):
    """Returns probabilities that fp16 rounds to exactly 1.0 (logits near +50)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.prob = nn.Sigmoid()
        with torch.no_grad():
            self.fc.bias.fill_(50.0)

    def forward(self, x):
        return self.prob(self.fc(x)).squeeze(-1)


def test_loss_backward_singularity_is_replayed_after_the_calibration_skip(run_path):
    """Issue 16: step 0's calibration skip (an fp16 loss at 65536) does not use up the replay
    of the first finite-loss skip; the later skip (after 8 applied steps), where sqrt(1 - p)
    has an infinite derivative at p == 1.0, is replayed and says what it saw."""
    model = make(Saturated)
    sc = scaler()
    calls = []

    @outside_autocast
    def loss_fn(out, y):
        calls.append(1)
        if len(calls) == 1:
            return out.mean()  # fp16: 65536 does not fit it (calibration)
        if len(calls) <= 9:
            return out.float().mean()  # applied: the scale holds
        return (1 - out.float()).sqrt().mean()  # d/dp sqrt(1 - p) = inf at p == 1.0

    with record(run_path, model, sc) as rec:
        train(model, batches(13), scaler=sc, loss_fn=loss_fn)
    assert [e.step for e in rec.events if e.replayed] == [0, 9]
    detail = [e for e in rec.events if e.step == 9][0].result.detail
    assert detail.output_grad_nonfinite and not detail.loss_nonfinite
    assert detail.output_grad.nonfinite == 8 and detail.output_grad.numel == 8
    assert detail.output_grad.output_values == [1.0]
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "fp16_loss" and d.causes[0]["kind"] == "loss_backward"
    assert d.first_bad == {"step": 9, "module": None, "phase": "loss"}


def test_loss_value_overflowing_fp16_without_scaler_is_the_loss(run_path):
    model = make(ExpNet)

    @outside_autocast
    def fp16_loss(out, y):
        return (out * 1000).pow(2).sum()  # > 65504 in fp16

    with record(run_path, model) as rec:
        train(model, batches(2), loss_fn=fp16_loss)
    ev = rec.events[0]
    assert (ev.step, ev.trigger, ev.phase, ev.fp32) == (0, "nonfinite_loss", "loss", "not run")
    assert ev.result.detail.loss_nonfinite is True
    assert "loss computation" in ev.result.summary


@pytest.mark.parametrize("use_scaler", [True, False])
def test_clamp_rounding_to_one_is_a_backward_culprit(run_path, use_scaler):
    model = make(ClampNet)
    sc = scaler(2.0**8) if use_scaler else None
    with record(run_path, model, sc) as rec:
        losses = train(model, batches(2), scaler=sc)
    assert all(math.isfinite(v) for v in losses)  # the forward stays finite
    ev = rec.events[0]
    assert ev.trigger == ("skipped" if use_scaler else "nonfinite_grad")
    assert (ev.phase, ev.module, ev.fp32) == ("backward", "comp", "finite")
    r = ev.result
    assert r.module_type == "Complement" and math.isfinite(r.fp32_absmax)
    assert "args.0" in r.detail.how
    run, snap, detail = first_snapshot(run_path)
    assert snap["phase"] == Phase.BACKWARD and snap["fp32_finite"] == 1
    culprit = run.tensors[run.tensors["id"] == snap["culprit"]][0]
    assert (culprit["kind"], culprit["name"]) == (Kind.GRAD_INPUT, "comp")
    # The fp32 backward's rows are in the file, finite, for the same tensor.
    stats = run.stats.read()
    stats = stats[(stats["snapshot"] == snap["id"]) & (stats["tensor"] == snap["culprit"])]
    fp32 = stats[stats["source"] == Source.REPLAY_FP32]
    replayed = stats[stats["source"] == Source.REPLAY]
    assert len(fp32) == 1 and fp32["nonfinite"][0] == 0
    assert replayed["nonfinite"].max() > 0


def test_minus_inf_overflow_is_traced_to_its_producer(run_path):
    model = make(NegOverflow)
    with torch.no_grad():  # rows of growing magnitude: some outputs pass -65504, not all
        model.lin.weight.copy_(-500.0 * torch.arange(1.0, 17.0)[:, None].expand(16, 8))
    sc = scaler(2.0**8)
    data = [(x.abs() + 1, y) for x, y in batches(2)]
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc)
    ev = rec.events[0]
    # lin makes -inf only; LayerNorm turns it into NaN. The producer is named.
    assert (ev.phase, ev.module, ev.fp32) == ("forward", "lin", "finite")
    assert "ln turned into NaN" in ev.result.detail.how


class ResidualBlock(nn.Module):
    """A pre-LN block whose own code adds -3e4 to a residual stream holding -4e4: -inf in fp16
    made between its submodules, which ln2 then turns into NaN (issue 16)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(8), nn.LayerNorm(8)
        self.mlp, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        with torch.no_grad():
            self.mlp.bias[0] = -30000.0

    def forward(self, x):
        h = x + self.mlp(self.ln1(x))  # the residual add, in the block's own code
        return h + self.out(self.ln2(h))


class ResidualNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.block = ResidualBlock()
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.embed.bias[0] = -40000.0

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def test_minus_inf_made_by_a_parents_own_code_is_traced_to_the_parent(run_path):
    model = make(ResidualNet)
    sc = scaler(2.0**8)
    with record(run_path, model, sc) as rec:
        train(model, batches(2), scaler=sc)
    ev = rec.events[0]
    assert (ev.phase, ev.module, ev.fp32) == ("forward", "block", "finite")
    assert "its own code" in ev.result.detail.how and "block.ln2" in ev.result.detail.how
    op = ev.result.detail.op
    assert op.op == "add" and op.created == ["neginf"] and op.mask_operand is False
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "unstable_op" and d.first_bad["module"] == "block"


class MaskedNet(nn.Module):
    """An additive attention mask (0 / -inf) given as a keyword argument, then an exp."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.exp = FastExp()
        self.head = nn.Linear(8, 4)

    def forward(self, x, mask):
        h, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(self.exp(h * x.abs().amax())).mean(1)


def test_additive_mask_is_not_mistaken_for_a_bad_batch(run_path):
    model = make(MaskedNet)
    sc = scaler(2.0**8)
    mask = torch.full((5, 5), float("-inf")).triu(1)
    data = batches(3, shape=(2, 5, 8))
    data[1] = (data[1][0] * 30, data[1][1])  # exp(large) overflows fp16 at step 1
    with record(run_path, model, sc) as rec:
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x, mask=mask), y[:2] if y.ndim else y)
            sc.scale(loss).backward()
            sc.step(model.opt)
            sc.update()
            model.opt.zero_grad()
    assert [e.step for e in rec.events] == [1]
    assert (rec.events[0].phase, rec.events[0].module) == ("forward", "exp")


# ---------------------------------------------------------------------------------------------
# gradient accumulation, stale gradients


def test_gradient_accumulation_names_the_failing_micro_batch(run_path):
    model = make(ExpNet)
    sc = scaler(2.0**10)
    data = batches(6)
    data[4] = (data[4][0] * 40, data[4][1])  # step 1, micro-batch 1: exp overflows fp16
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc, accum=3)
    ev = rec.events[0]
    assert (ev.step, ev.result.micro) == (1, 1)
    assert (ev.phase, ev.module) == ("forward", "body.1")
    assert ev.result.detail.micro_batches == 3
    assert "micro-batch 1" in ev.result.summary
    run, snap, _ = first_snapshot(run_path)
    assert snap["micro"] == 1


def test_gradients_left_non_finite_by_a_skipped_zero_grad_are_named(run_path):
    model = make(ExpNet)
    sc = scaler(2.0**10)
    data = batches(5)
    data[1][0][0, 0] = float("inf")
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc, zero_grad_after_skip=False)
    steps = [e.step for e in rec.events]
    assert steps == [1, 2, 3, 4]  # every step after is skipped: .grad stays inf
    first, second = rec.events[0], rec.events[1]
    assert first.phase == "input"
    assert second.replayed and second.phase == "none"
    assert "zero_grad" in second.result.summary
    assert "head.weight" in second.result.detail.stale_grads
    assert not rec.events[2].replayed  # 3rd event of the episode: rate-limited
    run = ampdoctor.load(run_path)  # stale, and said so as an event (issue 16)
    assert list(run.events["step"][run.events["kind"] == Event.GRAD_NOT_ZEROED]) == [2]


def test_finite_micro_batches_overflowing_an_fp16_grad_are_an_accumulation(run_path):
    """Issue 16: fp16 parameters, 12 micro-batches whose bias gradient is 8000 each: finite
    one by one, inf once .grad sums 9 of them. Not stale gradients, and no GRAD_NOT_ZEROED."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).half()
    model.opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with record(run_path, model) as rec:
        for _ in range(2):
            for _ in range(12):
                x = torch.full((8, 8), 0.01, dtype=torch.float16)
                (model(x).sum() * 1000).backward()  # d/d bias of the last layer: 8000
            model.opt.step()
            model.opt.zero_grad(set_to_none=True)
    ev = rec.events[0]
    assert ev.step == 0 and (ev.phase, ev.module) == ("backward", "1")
    acc = ev.result.detail.accum_overflow
    assert acc.param == "1.bias" and acc.micro == 8 and acc.micro_batches == 12
    assert acc.dtype == "float16" and 65504 < acc.fp32_absmax <= 72000
    assert "stale_grads" not in ev.result.detail.to_json()
    run = ampdoctor.load(run_path)
    assert not (run.events["kind"] == Event.GRAD_NOT_ZEROED).any()
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "accum_overflow" and d.first_bad == {"step": 0, "module": "1",
                                                             "phase": "backward"}
    assert [fx.id for fx in d.fixes][:2] == ["fp32_master_weights", "divide_loss_by_accum"]


def test_earlier_micro_batch_gradients_are_bounded(run_path, monkeypatch):
    monkeypatch.setattr(capture, "GRAD_BYTES", 0)  # only the latest micro-batch's is held
    model = make(ClampNet)
    sc = scaler(2.0**8)
    with record(run_path, model, sc) as rec:
        train(model, batches(3), scaler=sc, accum=3)
    r = rec.events[0].result
    # Micro-batches 0 and 1 replay forward only (finite); micro-batch 2 names the culprit.
    assert (r.micro, r.phase, r.module) == (2, "backward", "comp")
    assert r.detail.micro_batches_forward_only == [0, 1]


# ---------------------------------------------------------------------------------------------
# models the replay must handle


def test_pure_half_model_is_checked_on_an_fp32_copy(run_path):
    model = make(NegOverflow)
    with torch.no_grad():
        model.lin.weight.mul_(40000.0)  # fp16 weights near the top of the range
    model.half()
    model.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(x.half(), y) for x, y in batches(2)]
    with record(run_path, model) as rec:  # no autocast, no scaler: a .half() model
        train(model, data, dtype=None)
    ev = rec.events[0]
    assert (ev.phase, ev.module, ev.fp32) == ("forward", "lin", "finite")
    assert ev.result.detail.fp32.copied_module is True
    assert model.lin.weight.dtype == torch.float16  # the model itself is left in half


class Fussy(nn.Module):
    """A model whose forward refuses to run twice in one step (some assert on their state)."""

    def __init__(self):
        super().__init__()
        self.inner = ExpNet(20.0)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("forward called twice in one step")
        return self.inner(x)


def test_a_replay_that_fails_in_user_code_is_reported_and_training_goes_on(run_path):
    def run(recorded):
        model = make(Fussy)
        sc = scaler(2.0**10)
        ctx = ampdoctor.watch(model, model.opt, sc, path=run_path, every=0) if recorded \
            else None

        def reset(step):
            model.calls = 0

        if ctx is None:
            return train(model, batches(3), scaler=sc, on_step=reset), None, model
        with ctx as rec:
            return train(model, batches(3), scaler=sc, on_step=reset), rec, model

    plain, _, m1 = run(False)
    losses, rec, m2 = run(True)
    assert np.array_equal(np.array(plain), np.array(losses), equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(),
                                                  m2.state_dict().values()))
    ev = rec.events[0]
    assert ev.replayed and ev.phase == "unknown"
    assert "called twice" in ev.result.detail.replay_error
    assert len(ampdoctor.load(run_path).snapshots) >= 1


class Wrapper(nn.Module):
    """Stands for DDP or torch.compile: the replay must run the module inside it."""

    def __init__(self, module):
        super().__init__()
        self._orig_mod = module
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self._orig_mod(x)


def test_replay_runs_the_module_inside_a_wrapper(run_path):
    inner = make(ExpNet, 20.0)
    model = Wrapper(inner)
    model.opt = inner.opt
    sc = scaler(2.0**10)
    with record(run_path, model, sc, max_replays=1) as rec:
        train(model, batches(2), scaler=sc)
    assert model.calls == 2  # the training steps only: the replay bypassed the wrapper
    ev = rec.events[0]
    assert (ev.phase, ev.module) == ("forward", "body.1")


class FullyShardedDataParallel(Wrapper):
    """Stands for FSDP: its forward would gather parameters from every rank."""


def test_a_sharded_model_is_not_replayed(run_path):
    inner = make(ExpNet, 20.0)
    model = FullyShardedDataParallel(inner)
    model.opt = inner.opt
    sc = scaler(2.0**10)
    with record(run_path, model, sc) as rec:
        train(model, batches(2), scaler=sc)
    assert [e.replayed for e in rec.events] == [False, False]
    assert "collectives" in rec.events[0].note and rec.replays == 0
    assert len(ampdoctor.load(run_path).snapshots) == 0


# ---------------------------------------------------------------------------------------------
# rate limit


def test_a_run_skipping_every_step_stays_within_the_replay_budget(run_path):
    model = make(ExpNet, 20.0)
    sc = scaler(2.0**10)
    with record(run_path, model, sc, max_replays=8) as rec:
        train(model, batches(20), scaler=sc)
    run = ampdoctor.load(run_path)
    assert run.steps["skipped"].all()
    # One episode: the 1st, 2nd, 4th, 8th and 16th events are replayed.
    assert [e.step for e in rec.events if e.replayed] == [0, 1, 3, 7, 15]
    assert len(run.snapshots) == 5 == rec.replays
    assert list(run.events["kind"]).count(Event.FORENSICS) == 5


def test_replays_stop_at_max_replays_and_capture_stops_with_them(run_path):
    model = make(ExpNet, 20.0)
    sc = scaler(2.0**10)
    seen = []
    with record(run_path, model, sc, max_replays=2) as rec:
        train(model, batches(6), scaler=sc,
              on_step=lambda i: seen.append((rec.forensics.armed, len(rec.events))))
    run = ampdoctor.load(run_path)
    assert len(run.snapshots) == 2
    assert [e.step for e in rec.events] == [0, 1]  # disarmed: no sync, nothing caught
    assert seen[-1] == (False, 2)
    assert rec.forensics.captures == []


def test_separate_episodes_each_get_a_replay(run_path):
    model = make(ExpNet)
    sc = scaler(2.0**10)
    data = batches(2 + policy.EPISODE_GAP + 3)
    bad = [1, 2 + policy.EPISODE_GAP + 1]
    for i in bad:
        data[i] = (data[i][0] * 40, data[i][1])
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc)
    assert [e.step for e in rec.events if e.replayed] == bad


# ---------------------------------------------------------------------------------------------
# the snapshot


def test_snapshot_keeps_history_statistics_and_the_batch(run_path):
    model = make(ExpNet)
    sc = scaler(2.0**10)
    data = batches(6)
    data[4] = (data[4][0] * 40, data[4][1])
    seen = {}

    def after(step):
        if step == 4:  # read the file while the run goes on: the event is already there
            run = ampdoctor.load(run_path)
            seen["steps"] = list(run.steps["step"])
            seen["snapshots"] = len(run.snapshots)

    with record(run_path, model, sc):
        train(model, data, scaler=sc, on_step=after)
    assert seen == {"steps": [0, 1, 2, 3, 4], "snapshots": 1}
    run, snap, detail = first_snapshot(run_path)
    assert snap["step"] == 4 and snap["scale"] == 1024.0
    assert snap["lr"] == np.float32(1e-3)
    assert snap["autocast"] == 2  # DType.FLOAT16
    hist = detail["history"]
    assert hist["step"] == [0, 1, 2, 3, 4]
    assert hist["scale"] == [1024.0] * 5
    assert all(math.isfinite(v) for v in hist["grad_norm"][:4]) and hist["found_inf"][4] == 1
    assert np.allclose(hist["loss"][:4], run.steps["loss"][:4])
    # The culprit's statistics in both precisions: non-finite in fp16, finite in fp32.
    assert detail["run"]["outputs"][0]["posinf"] > 0
    assert detail["fp32"]["outputs"][0]["posinf"] == 0
    assert detail["fp32"]["inputs"][0]["absmax"] == pytest.approx(snap["in_absmax"], rel=1e-3)
    stats = run.stats.read()
    mine = stats[stats["snapshot"] == snap["id"]]
    assert set(mine["source"]) == {Source.REPLAY, Source.REPLAY_FP32}
    assert (mine["step"] == 4).all()
    culprit = mine[mine["tensor"] == snap["culprit"]]
    assert sorted(culprit["source"]) == [Source.REPLAY, Source.REPLAY_FP32]
    # The batch, the culprit's input and the output gradient, as arrays.
    names = list(run.arrays["name"])
    assert {"args.0", "culprit.args.0", "grad_output.0", "rng.cpu"} <= set(names)
    batch = run.array(names.index("args.0"))
    np.testing.assert_array_equal(batch, data[4][0].numpy())
    assert run.array(names.index("culprit.args.0")).dtype == np.float16
    rng = run.array(names.index("rng.cpu"))
    assert rng.dtype == np.uint8 and rng.size == torch.get_rng_state().numel()


def test_saved_arrays_are_size_capped(run_path, monkeypatch):
    monkeypatch.setattr(snapshot, "BATCH_BYTES", 6000)
    model = make(ExpNet, 20.0)
    sc = scaler(2.0**10)
    data = batches(1, shape=(64, 8))
    with record(run_path, model, sc):
        train(model, data, scaler=sc)
    run, snap, detail = first_snapshot(run_path)
    assert sum(int(n) for n in run.arrays["data_len"]) <= 6000
    names = list(run.arrays["name"])
    row = names.index("args.0")
    assert run.arrays["numel"][row] == 64 * 8 and 0 < run.arrays["saved"][row] < 64 * 8
    part = run.array(row)
    np.testing.assert_array_equal(part, data[0][0].numpy()[: len(part)])
    assert detail["arrays"]["args.0"] == "truncated"


# ---------------------------------------------------------------------------------------------
# no observer effect


def _bits(tensors):
    return [t.detach().clone().reshape(-1).view(torch.uint8) for t in tensors]


def _observe(model, sc, dtype, recorder):
    """Train DropBN for 8 steps, event at step 4; everything that could be disturbed."""
    data = batches(8, seed=3)
    data[4] = (data[4][0] * (100 if dtype == torch.float16 else 3000), data[4][1])
    rng, bufs = [], []

    def after(step):
        rng.append(torch.get_rng_state().clone())
        bufs.append(_bits(model.buffers()))

    if recorder is not None:
        with recorder:
            losses = train(model, data, dtype=dtype, scaler=sc, on_step=after)
    else:
        losses = train(model, data, dtype=dtype, scaler=sc, on_step=after)
    state = [v for s in model.opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return losses, rng, bufs, _bits(model.parameters()), _bits(state)


@pytest.mark.parametrize("dtype,use_scaler", [(torch.float16, True), (torch.bfloat16, False)])
def test_forensics_leave_no_trace_on_the_run(run_path, dtype, use_scaler):
    def run(recorded):
        model = make(DropBN, seed=1)
        sc = scaler(2.0**8) if use_scaler else None
        rec = record(run_path, model, sc, every=2) if recorded else None
        return _observe(model, sc, dtype, rec), rec

    (plain, _), (watched, rec) = run(False), run(True)
    assert rec.events and rec.events[0].step == 4 and rec.events[0].replayed
    assert rec.events[0].module == "exp"
    losses_a, rng_a, bufs_a, params_a, state_a = plain
    losses_b, rng_b, bufs_b, params_b, state_b = watched
    assert np.array_equal(np.array(losses_a), np.array(losses_b), equal_nan=True)
    for a, b in zip(rng_a, rng_b):
        assert torch.equal(a, b)
    for step_a, step_b in zip(bufs_a, bufs_b):  # BatchNorm running stats, every step
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    assert all(torch.equal(x, y) for x, y in zip(state_a, state_b))


def test_a_replay_leaves_grads_buffers_and_rng_exactly_as_it_found_them(run_path, monkeypatch):
    model = make(DropBN, seed=4)
    sc = scaler(2.0**8)
    data = batches(3, seed=6)
    data[1] = (data[1][0] * 100, data[1][1])
    checked = []
    original = forensics.Forensics.on_event

    def on_event(self, step, why, **kw):
        state = lambda: (_bits([p.grad for p in model.parameters()] + list(model.buffers())),
                         torch.get_rng_state(), torch.is_grad_enabled())
        before = state()
        out = original(self, step, why, **kw)
        after = state()
        checked.append(all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
                       and torch.equal(before[1], after[1]) and before[2] == after[2])
        return out

    monkeypatch.setattr(forensics.Forensics, "on_event", on_event)
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc)
    assert rec.events[0].replayed and checked == [True]


def test_replay_reproduces_the_real_step_dropout_masks_included(run_path):
    model = make(DropBN, seed=2)
    sc = scaler(2.0**8)
    data = batches(3, seed=5)
    data[2] = (data[2][0] * 100, data[2][1])
    seen = []  # a user's hook: it sees the real steps only, never a replay
    model.drop_in.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc)
    assert rec.events[0].step == 2
    again = rec.replay(2)
    assert len(seen) == 3
    real = seen[2]
    zeros = int((real == 0).sum())
    assert 0 < zeros < real.numel()
    for trace in (rec.events[0].result.trace, again.trace):  # the same dropout mask's zeros
        drop = [t for t in trace if t.module == "drop_in" and t.kind == "output"]
        assert drop[0].zeros == zeros


# ---------------------------------------------------------------------------------------------
# in a notebook


def test_events_and_replay_on_demand(run_path):
    model = make(AttnNet)
    sc = scaler(2.0**10)
    data = batches(3, shape=(4, 6, 8))
    with torch.no_grad():
        model.attn.qkv.weight[: 64].mul_(0.01)  # healthy at first
    with record(run_path, model, sc) as rec:
        train(model, data[:1], scaler=sc)
        with torch.no_grad():
            model.attn.qkv.weight[: 64].mul_(100.0)  # then the weights "grow"
        train(model, data[1:], scaler=sc)
    assert [e.step for e in rec.events] == [1, 2]
    assert "phase='forward', module='attn', fp32='finite'" in repr(rec.events[0])
    # After the recorder closed, the event replays again (nothing is written).
    r = rec.replay(2)
    assert (r.phase, r.module, r.fp32) == ("forward", "attn", "finite")
    assert r.faithful  # step 2 was skipped and was the last: the weights are those of the event
    assert any(t.nonfinite and t.module == "attn" for t in r.trace)
    assert str(r).startswith("step 2: attn (Attention) went non-finite in forward")
    with pytest.raises(ampdoctor.AmpDoctorError, match="replayed events: 1, 2"):
        rec.replay(0)
    assert len(ampdoctor.load(run_path).snapshots) == 2


def test_replay_on_demand_says_when_the_weights_moved_on(run_path):
    model = make(ExpNet, 100.0)
    with record(run_path, model) as rec:  # bf16, no scaler: the step applies the NaN
        train(model, batches(3), dtype=torch.bfloat16)
    r = rec.replay(0)
    assert not r.faithful and "current weights" in r.summary


def test_forensics_off_catches_nothing(run_path):
    model = make(ExpNet, 20.0)
    sc = scaler(2.0**10)
    with record(run_path, model, sc, forensics=False) as rec:
        train(model, batches(2), scaler=sc)
    assert rec.events == []
    with pytest.raises(ampdoctor.AmpDoctorError, match="forensics=False"):
        rec.replay(0)
    assert len(ampdoctor.load(run_path).snapshots) == 0


def test_a_batch_edited_in_place_after_the_step_is_flagged(run_path):
    model = make(ExpNet, 20.0)
    sc = scaler(2.0**10)
    x, y = batches(1)[0]
    with record(run_path, model, sc) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        sc.scale(loss).backward()
        x.mul_(0.0)  # the loader reuses its buffer before the step ends
        sc.step(model.opt)
        sc.update()
    r = rec.events[0].result
    assert r.detail.input_modified is True and not r.faithful


def test_capture_holds_references_not_copies(run_path):
    model = make(ExpNet)
    x, y = batches(1)[0]
    with record(run_path, model) as rec:
        out = model(x)
        cap = rec.forensics.captures[-1]
        assert cap.args[0] is x
        F.cross_entropy(out, y).backward()
        assert cap.grads[0].shape == out.shape
        model.opt.step()
        assert rec.forensics.captures == []  # dropped at the step boundary


def test_a_discovered_model_is_replayed_from_its_first_step(run_path):
    model = make(MaskedNet)
    sc = scaler(2.0**8)
    mask = torch.full((5, 5), float("-inf")).triu(1)
    data = batches(2, shape=(2, 5, 8))
    data[0] = (data[0][0] * 30, data[0][1])
    with ampdoctor.watch(path=run_path, every=0, strict=True) as rec:  # nothing given
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x, mask=mask), y[:2])
            sc.scale(loss).backward()
            sc.step(model.opt)
            sc.update()
            model.opt.zero_grad()
    ev = rec.events[0]  # the keyword argument arrived after the call: replayed with it
    assert (ev.step, ev.phase, ev.module) == (0, "forward", "exp")
    assert not ev.result.detail.input_modified


# ---------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("culprit", ["attn", "exp"])
def test_cuda_replay_names_the_culprit_and_leaves_every_rng_alone(tmp_path, culprit):
    def run(recorded):
        torch.manual_seed(1)
        torch.cuda.manual_seed_all(1)
        model = make(AttnNet if culprit == "attn" else DropBN, seed=1).cuda()
        sc = scaler(2.0**8, "cuda")
        shape = (4, 6, 8) if culprit == "attn" else (8, 8)
        data = batches(6, seed=3, shape=shape)
        if culprit == "exp":
            data[3] = (data[3][0] * 100, data[3][1])
        rng = []
        path = str(tmp_path / f"run{int(recorded)}.h5")
        rec = record(path, model, sc) if recorded else None

        def after(step):
            rng.append((torch.get_rng_state(), torch.cuda.get_rng_state()))

        if rec is None:
            losses = train(model, data, scaler=sc, on_step=after)
        else:
            with rec:
                losses = train(model, data, scaler=sc, on_step=after)
        return losses, rng, _bits(list(model.parameters()) + list(model.buffers())), rec

    plain, watched = run(False), run(True)
    rec = watched[3]
    ev = rec.events[0]
    assert ev.replayed and (ev.phase, ev.module, ev.fp32) == ("forward", culprit, "finite")
    assert np.array_equal(np.array(plain[0]), np.array(watched[0]), equal_nan=True)
    for (cpu_a, gpu_a), (cpu_b, gpu_b) in zip(plain[1], watched[1]):
        assert torch.equal(cpu_a, cpu_b) and torch.equal(gpu_a, gpu_b)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(plain[2], watched[2]))


def test_no_reference_kept_to_past_steps_or_replays(run_path):
    """Captures, kept events and replays must not keep any step's graph alive."""
    import gc
    import weakref

    model = make(ExpNet, 20.0)
    sc = scaler(2.0**10)
    refs = []
    with record(run_path, model, sc) as rec:
        for i, (x, y) in enumerate(batches(8)):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = F.cross_entropy(out, y) / 2
            refs.append(weakref.ref(out))
            sc.scale(loss).backward()
            if i % 2:
                sc.step(model.opt)
                sc.update()
                model.opt.zero_grad()
            del out, loss
    assert sum(e.replayed for e in rec.events) >= 2
    rec.replay(rec.events[0].step)
    gc.collect()
    assert [r() is None for r in refs] == [True] * 8


# ---------------------------------------------------------------------------------------------
# the numbers or the machine: what the real step saw, the loss recomputed, trials


class FaultyDevice:
    """A forward hook that writes a NaN into one output element on the first call of each
    faulty step (the loop sets ``step``): a device fault the replay's second call does not
    repeat."""

    def __init__(self, steps):
        self.steps, self.step, self.done = set(steps), -1, set()

    def __call__(self, module, args, output):
        if self.step in self.steps and self.step not in self.done:
            self.done.add(self.step)
            output = output.clone()
            output[0, 0] = float("nan")
            return output
        return None


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))


def faulty(steps):
    model = make(Plain)
    fault = FaultyDevice(steps)
    model.body[0].register_forward_hook(fault)
    return model, fault


@pytest.mark.parametrize("dtype,use_scaler", [(torch.float16, True), (torch.bfloat16, False)])
def test_a_fault_the_replay_does_not_repeat_is_not_reproducible(run_path, dtype, use_scaler):
    model, fault = faulty([2, 5])
    sc = scaler(2.0**10) if use_scaler else None
    with record(run_path, model, sc) as rec:
        train(model, batches(7), dtype=dtype, scaler=sc,
              on_step=lambda i: setattr(fault, "step", i + 1))
    ev = rec.events[0]
    assert (ev.step, ev.phase, ev.module) == (2, "none", None)
    d = ev.result.detail
    assert d.reproduced is False and d.loss_recomputed is True
    assert d.recorded.loss_nonfinite and d.recorded.output_nonfinite
    assert d.rerun.finite and d.rerun.loss_fns == ["cross_entropy"]
    assert d.rerun.backward_from == "loss" and d.rerun.grads == "finite"
    assert "did not reproduce" in ev.result.summary
    diag = ampdoctor.diagnose(run_path)
    assert diag.verdict == "not_reproducible" and diag.first_bad["step"] == 2
    assert [fx.id for fx in diag.fixes][:1] == ["test_device"]
    if use_scaler:  # skipped twice, the weights protected: both replays say it
        assert [e.step for e in rec.events if e.replayed] == [2, 5]


def test_targets_all_ignore_index_are_the_loss_not_the_precision(run_path):
    """Issue 23: every target ignore_index gives a NaN loss with zero gradients, so GradScaler
    skips nothing; caught before optimizer.step, recomputed in fp32 (NaN too), targets read."""
    model = make(Plain)
    sc = scaler(2.0**10)
    data = batches(4)
    data[2] = (data[2][0], torch.full_like(data[2][1], -100))
    with record(run_path, model, sc) as rec:
        train(model, data, scaler=sc)
    ev = rec.events[0]
    assert (ev.step, ev.trigger, ev.phase, ev.fp32) == (2, "nonfinite_loss", "loss",
                                                        "non-finite")
    d = ev.result.detail
    assert d.reproduced is True and d.loss_fp32.loss_finite is False
    assert d.loss_fp32.grads == "zero" and d.rerun.grads == "zero"
    assert d.targets[0].all_ignored and d.targets[0].ignored == 8
    assert not ampdoctor.load(run_path).steps["skipped"].any()
    diag = ampdoctor.diagnose(run_path)
    assert (diag.verdict, diag.causes[0]["kind"]) == ("bad_input", "targets")
    assert diag.first_bad == {"step": 2, "module": None, "phase": "loss"}
    fix = diag.fixes[0]
    assert fix.id == "check_data" and "(y != -100).sum() == 0" in fix.snippet
    assert "step 2: every target was -100" in fix.snippet


def test_loss_calls_are_held_by_reference_and_dropped_at_the_step_end(run_path):
    """The loss input made from the model's output is not held at all (rebuilt from the
    replayed output); the targets are held by reference; a loss computed inside the model is
    the model's own; the gradient hook goes with the step."""
    model = make(Plain)
    x, y = batches(1)[0]
    with record(run_path, model) as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = F.cross_entropy(out.float().view(-1, 4), y)  # a cast, then a view
        cap = rec.forensics.captures[-1]
        call = cap.loss_calls[0]
        assert call.args[1] is y and call.name == "cross_entropy"
        made = call.args[0]
        assert isinstance(made, losscall.FromOutput) and made.index == 0
        assert made.cast[0] == torch.float32 and made.view is not None
        rebuilt = made.rebuild([out])
        assert torch.equal(rebuilt, out.float().view(-1, 4))
        hooks = len(rec.forensics.capture._hooks)
        loss.backward()
        assert call.grads[0].shape == ()  # the gradient that reached the loss
        model.opt.step()
        assert rec.forensics.captures == [] and len(rec.forensics.capture._hooks) < hooks


class LossInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y)


def test_a_loss_inside_the_model_is_not_captured_as_its_loss(run_path):
    model = make(LossInside)
    x, y = batches(1)[0]
    with record(run_path, model) as rec:
        loss = model(x, y)
        assert rec.forensics.captures[-1].loss_calls == []
        loss.backward()
        model.opt.step()


def test_relation_of_a_loss_input_to_the_output():
    leaf = torch.randn(4, 6, requires_grad=True)
    out = leaf * 2
    outputs = [out]
    assert losscall.relation(out, outputs) == losscall.FromOutput(0)
    # (the last two through a copy: done again from the autograd nodes, losscall.rearranged)
    for made in (out[:, 1:], out.t(), out.view(-1), out.half(), out.double()[1:].view(-1),
                 out[1:].double(), out[:, 1:].t().reshape(-1).split(5)[1]):
        rel = losscall.relation(made, outputs)
        assert rel is not None and torch.equal(rel.rebuild([out * 1]), made), made.shape
    # a (log-)softmax along one dim, in the dtype it returned: a function of the output alone
    for made in (out.log_softmax(-1).t(), out.softmax(0)[1:],
                 out.log_softmax(1, dtype=torch.float64)):
        rel = losscall.relation(made, outputs)
        assert rel is not None and torch.equal(rel.rebuild([out * 1]), made), made.shape
    assert losscall.relation(out * 3, outputs) is None  # computed from it: not rebuildable
    assert losscall.relation((out[1:] * 3).reshape(-1), outputs) is None
    assert losscall.relation(torch.randn(4, 6), outputs) is None
    a, b = (leaf * 1).unbind(0)[:2]
    assert losscall.relation(b.float(), [a, b]).index == 1  # the right one of two outputs


class Frames(nn.Module):
    """A CTC model's output: 6 frames of 5 symbols (blank 0) per sample."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6 * 5)

    def forward(self, x):
        return self.lin(x).view(-1, 6, 5)


def test_ctc_targets_that_cannot_be_aligned_are_the_data_not_the_precision(run_path):
    """CTC's loss is +inf in any precision for a label sequence that needs more frames than
    the input has (its labels, a blank between repeats): the loss call rebuilt through the
    log_softmax and transpose from the replayed output, recomputed in fp32 (inf too), its
    targets read; ``bad_input`` with the sequences to drop."""
    model = make(Frames)
    sc = scaler(2.0**10)
    ok, long = torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2, 2, 3])  # 3 frames; 5 + 2 > 6
    data = [(x, torch.tensor(int(i == 2))) for i, (x, _) in enumerate(batches(4))]
    ctc = nn.CTCLoss(blank=0)

    def loss_fn(out, bad):  # the last four samples' labels too long on the bad batch
        labels = [ok] * 4 + [long if bool(bad) else ok] * 4
        lp = out.log_softmax(-1).transpose(0, 1)
        return ctc(lp, torch.cat(labels), torch.full((8,), 6, dtype=torch.long),
                   torch.tensor([len(lab) for lab in labels]))

    with record(run_path, model, sc) as rec:
        losses = train(model, data, scaler=sc, loss_fn=loss_fn)
    assert math.isinf(losses[2]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != 2)
    ev = rec.events[0]
    assert (ev.step, ev.phase) == (2, "loss")
    (t,) = ev.result.detail.targets
    assert t.fn == "ctc_loss" and t.unalignable == 4 and "needs 7 frames" in t.problem
    assert ev.result.detail.loss_fp32.loss_finite is False
    diag = ampdoctor.diagnose(run_path)
    assert (diag.verdict, diag.causes[0]["kind"]) == ("bad_input", "targets")
    assert diag.fixes[0].id == "check_data" and "zero_infinity=True" in diag.fixes[0].snippet


def test_ctc_targets_checked_by_their_lengths():
    """Padded (2-D) and concatenated (1-D) targets alike; zero_infinity makes none a problem."""
    call = losscall.LossCall("ctc_loss", F.ctc_loss, (), {}, ("cpu", False, None, False),
                             torch.zeros(()))
    lp = torch.randn(4, 2, 5).log_softmax(-1)
    frames = torch.tensor([4, 4])
    for targets, lengths in ((torch.tensor([[1, 1, 1, 0], [1, 2, 0, 0]]), torch.tensor([3, 2])),
                             (torch.tensor([1, 1, 1, 1, 2]), torch.tensor([3, 2]))):
        got = losscall.check_targets(call, (lp, targets, frames, lengths), {})
        assert got.unalignable == 1 and "needs 5 frames" in got.problem  # 3 labels + 2 blanks
        kept = losscall.check_targets(call, (lp, targets, frames, lengths), {"zero_infinity": True})
        assert kept.unalignable == 1 and kept.problem is None


class HandSoftmax(nn.Module):
    """exp(x) / sum(exp(x)) by hand, in its input's dtype: inf / inf = NaN in fp16, a finite
    probability in fp32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        with torch.no_grad():
            self.lin.bias.fill_(14.0)  # exp(14) > 65504

    def forward(self, x):
        h = self.lin(x)  # fp16 under autocast (or in a .half() model)
        with torch.autocast(x.device.type, enabled=False):  # a custom op: its input's dtype
            e = torch.exp(h)
            return e / e.sum(-1, keepdim=True)


class SoftNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.soft = HandSoftmax()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.soft(x))


@pytest.mark.parametrize("half", [False, True])
def test_trials_rerun_the_saved_step(run_path, half):
    """The trial API (``trial.py``): the saved step re-run as recorded (non-finite),
    with an fp32 island around the culprit, in bf16, and with the loss in fp32."""
    model = make(SoftNet)
    sc = None if half else scaler()
    if half:  # a .half() model, no autocast: the island runs on fp32 casts of its weights
        model.half()
        model.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = [(x.half(), y) for x, y in batches(2)]
    else:
        data = batches(2)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with record(run_path, model, sc) as rec:
        train(model, data, dtype=None if half else torch.float16, scaler=sc)
    ev = rec.events[0]
    assert (ev.phase, ev.module) == ("forward", "soft")
    model.load_state_dict(weights)  # no GradScaler skipped step 0 of the half model
    as_ran = rec.forensics.rerun(0)
    assert not as_ran.finite and as_ran.first == "forward" and as_ran.loss_finite is False
    island = rec.forensics.rerun(0, Trial("island", fp32_modules=("soft",)))
    assert island.finite and island.grads == "finite", island
    assert island.loss_fns == ["cross_entropy"] and math.isfinite(island.loss)
    assert model.soft.lin.weight.dtype == (torch.float16 if half else torch.float32)
    if not half:
        bf16 = rec.forensics.rerun(0, Trial("bf16", autocast="bfloat16", scale=1.0))
        assert bf16.finite and bf16.loss_dtype == "float32"
        assert not rec.forensics.rerun(0, trial.LOSS_FP32).finite  # not the loss's fault
    with pytest.raises(KeyError, match="nowhere"):
        rec.forensics.rerun(0, Trial(fp32_modules=("nowhere",)))


@pytest.mark.parametrize("dtype,use_scaler", [(torch.float16, True), (torch.bfloat16, False)])
def test_the_comparison_and_its_rerun_leave_no_trace_on_the_run(run_path, dtype, use_scaler):
    """The replay that finds no culprit re-runs the step with its loss recomputed (and in
    fp32 when non-finite again): dropout's RNG, BatchNorm's statistics, the weights and the
    optimizer state come out bit for bit as without ampdoctor."""
    def run(recorded):
        model = make(DropBN, seed=1)
        fault = FaultyDevice([4])
        model.lin1.register_forward_hook(fault)
        sc = scaler(2.0**8) if use_scaler else None
        rec = record(run_path, model, sc, every=2) if recorded else None
        data = batches(8, seed=3)
        rng, bufs = [], []

        def after(step):
            fault.step = step + 1
            rng.append(torch.get_rng_state().clone())
            bufs.append(_bits(model.buffers()))

        with rec if rec is not None else contextlib.nullcontext():
            losses = train(model, data, dtype=dtype, scaler=sc, on_step=after)
        state = [v for s in model.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return (losses, rng, bufs, _bits(model.parameters()), _bits(state)), rec

    (plain, _), (watched, rec) = run(False), run(True)
    ev = rec.events[0]
    assert ev.step == 4 and ev.result.detail.reproduced is False
    assert ev.result.detail.rerun.finite
    assert np.array_equal(np.array(plain[0]), np.array(watched[0]), equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    for step_a, step_b in zip(plain[2], watched[2]):
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))
    for a, b in zip(plain[3:], watched[3:]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_saved_buffers_come_back_bit_for_bit_the_same_objects():
    from ampdoctor.preflight.snapshot import Snapshot
    from ampdoctor.record.forensic.isolated import preserved

    for keep in ("replay", "snapshot"):
        bn = nn.BatchNorm1d(3)
        bn.register_buffer("extra", None)
        mean, var, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
        before = [t.clone() for t in (mean, var, count)]
        snap = Snapshot(bn, params=False) if keep == "snapshot" else None
        with contextlib.ExitStack() as stack:
            if snap is None:
                stack.enter_context(preserved([bn], devices=[]))
            bn(torch.randn(8, 3) * 5 + 2)  # updates the statistics in place
            bn.running_var = torch.full((3,), float("nan"))  # replaces the attribute
            assert not torch.equal(bn.running_mean, before[0])
        if snap is not None:
            snap.restore()
        assert bn.running_mean is mean and bn.running_var is var, keep
        assert bn.num_batches_tracked is count
        for now, was in zip((mean, var, count), before):
            assert torch.equal(now, was), keep
        assert bn.extra is None


def test_a_trial_outcome_is_the_run_file_s_declaration():
    """The re-run fills in the record the snapshot's detail holds (``rerun``, ``loss_fp32``):
    one declaration, read back as written, a non-finite loss included."""
    import json

    from ampdoctor.runfile.detail import TrialOutcome
    from ampdoctor.runfile.payloads import SnapshotDetail

    assert trial.Outcome is TrialOutcome
    out = trial.Outcome("bf16", loss=float("inf"), loss_fns=["cross_entropy"], micro=1)
    text = SnapshotDetail(rerun=out).to_text()
    assert json.loads(text)["rerun"]["loss"] == "inf"
    assert SnapshotDetail.from_text(text).rerun == out


def test_a_fault_at_a_loss_scale_that_overflows_every_backward_is_not_reproducible(run_path):
    # At this scale a finite step's gradients overflow fp16 too (GradScaler's own calibration):
    # the replay's forward and loss are finite, so the real step's NaN loss did not reproduce,
    # said of the backward at loss scale 1, not read as the loss's precision.
    model, fault = faulty([1])
    sc = scaler(2.0**22)
    with record(run_path, model, sc) as rec:
        train(model, batches(10), dtype=torch.float16, scaler=sc,
              on_step=lambda i: setattr(fault, "step", i + 1))
    ev = next(e for e in rec.events if e.step == 1)
    d = ev.result.detail
    assert d.recorded.loss_nonfinite and ev.phase == "none"
    assert d.reproduced is False and d.rerun_scale == 1.0
    assert d.rerun.finite and d.rerun.grads == "finite"
    assert "at loss scale 1" in ev.result.summary
