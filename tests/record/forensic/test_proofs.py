"""The fixes tried on the saved failing step at the event (``record/forensic/proofs.py``) and
the loss's backward checked in fp32 (``record/forensic/singular.py``), under ``ampdoctor.watch``
on tiny models in the test process: what each trial found, what the singular op's input held,
and that none of it leaves a trace on the run (RNG, buffers, weights, optimizer state and
``.grad`` bit for bit as without ampdoctor)."""

import json
import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.record.forensic import singular
from ampdoctor.runfile.schema import Event


class FastExp(nn.Module):
    """exp in its input's dtype, as a custom kernel runs: past 11.09 it overflows fp16."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return torch.exp(x)


class ExpNet(nn.Module):
    """A Linear into FastExp, normalised (with dropout and BatchNorm around it when ``noisy``:
    RNG and buffers the trials must leave as they were)."""

    def __init__(self, shift=0.0, noisy=False):
        super().__init__()
        self.drop = nn.Dropout(0.2) if noisy else nn.Identity()
        self.lin = nn.Linear(8, 16)
        self.exp = FastExp()
        self.norm = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16) if noisy else nn.Identity()
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.lin.bias.fill_(shift)

    def forward(self, x):
        return self.head(self.bn(self.norm(self.exp(self.lin(self.drop(x))))))


class Probs(nn.Module):
    """A classifier returning probabilities, whose Sigmoid saturates to exactly 1.0 in fp16;
    a hand-written sqrt inside its forward (a finite derivative: not the loss's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.prob = nn.Sigmoid()
        with torch.no_grad():
            self.lin.bias.fill_(10.0)

    def forward(self, x):
        h = self.lin(x)
        return self.prob(torch.sqrt(h * h + 1.0)).squeeze(-1)


def soft_loss(p, y):
    """(1 - p_t) ** 0.5 by hand: its derivative is infinite where p_t is exactly 1."""
    p_t = torch.where(y > 0.5, p, 1 - p)
    return ((1 - p_t) ** 0.5).mean()


def loop(model, data, *, dtype=torch.float16, loss_fn=None, outside=False, after=None):
    """A user's loop under GradScaler; ``after(model)`` runs after each update, before
    zero_grad (where a trial at the event would have left its mark on ``.grad``)."""
    opt = model.opt
    sc = torch.amp.GradScaler("cpu")
    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out, y))
    losses = []
    for x, y in data:
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
            loss = None if outside else loss_fn(out, y)
        if outside:
            loss = loss_fn(out.float(), y)
        losses.append(float(loss.detach().float()))
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        if after is not None:
            after(model)
        opt.zero_grad(set_to_none=True)
    return losses, sc


def make(cls, *args, seed=0, **kw):
    torch.manual_seed(seed)
    model = cls(*args, **kw)
    model.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model


def batches(n, seed=0, big=(), classes=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(8, 8, generator=g) * (40.0 if i in big else 1.0)
        y = torch.randint(0, 4, (8,), generator=g) if classes else \
            torch.full((8,), float(i % 2 == 0))
        out.append((x, y))
    return out


def watch(path, model):
    return ampdoctor.watch(model, model.opt, None, path=path, every=0, strict=True)


def trials_of(path):
    run = ampdoctor.load(path)
    details = [json.loads(s["detail"]) for s in run.snapshots]
    return run, [d.get("trials") for d in details], details


@pytest.mark.parametrize("dtype,shift,island", [
    (torch.float16, 20.0, True),  # exp(20) overflows fp16 only: the island makes it finite
    (torch.bfloat16, 100.0, False),  # exp(100) overflows fp32 too: the island is not enough
])
def test_the_fixes_of_a_located_culprit_are_tried_on_its_step(run_path, dtype, shift, island):
    model = make(ExpNet, shift)
    with watch(run_path, model) as rec:
        loop(model, batches(2), dtype=dtype)
    assert (rec.events[0].phase, rec.events[0].module) == ("forward", "exp")
    run, trials, details = trials_of(run_path)
    t = trials[0]
    assert t["fp32_island"]["tried"] and t["fp32_island"]["modules"] == ["exp"]
    assert t["fp32_island"]["finite"] is island and t["fp32_island"]["step"] == 0
    if dtype == torch.float16:  # bf16 instead of fp16: exp(20) fits
        assert t["use_bf16"]["tried"] and t["use_bf16"]["finite"]
    else:
        assert "use_bf16" not in t  # the run is bf16 already
    assert details[0]["trials_seconds"] > 0 and rec.forensics.prover.watch is None
    if island:
        d = ampdoctor.diagnose(run)
        assert d.fixes[0].id == "fp32_island" and d.fixes[0].tried and d.fixes[0].finite


def _bits(tensors):
    return [t.detach().clone().reshape(-1).view(torch.uint8) for t in tensors if t is not None]


def test_trials_leave_no_trace_on_the_run(run_path):
    """Dropout's RNG, BatchNorm's statistics, the weights, the optimizer state and .grad
    after every step come out bit for bit as without ampdoctor, with the trials run."""
    def run(path):
        model = make(ExpNet, noisy=True)
        seen = []

        def after(m):
            seen.append((torch.get_rng_state().clone(), _bits(m.buffers()),
                         _bits(p.grad for p in m.parameters())))

        data = batches(6, seed=3, big={2})
        if path is None:
            losses, _ = loop(model, data, after=after)
        else:
            with watch(path, model):
                losses, _ = loop(model, data, after=after)
        state = [v for s in model.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return losses, seen, _bits(model.parameters()), _bits(state)

    plain, watched = run(None), run(run_path)
    _, trials, _ = trials_of(run_path)
    assert trials[0] and all(t["tried"] for t in trials[0].values())  # they did run
    assert np.array_equal(np.array(plain[0]), np.array(watched[0]), equal_nan=True)
    for (rng_a, buf_a, grad_a), (rng_b, buf_b, grad_b) in zip(plain[1], watched[1]):
        assert torch.equal(rng_a, rng_b)
        assert all(torch.equal(a, b) for a, b in zip(buf_a, buf_b))
        assert len(grad_a) == len(grad_b) and all(torch.equal(a, b)
                                                  for a, b in zip(grad_a, grad_b))
    for a, b in zip(plain[2:], watched[2:]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_handwritten_losss_singular_op_is_read_before_its_backward(run_path, monkeypatch):
    """(1 - p_t) ** 0.5 on a Sigmoid saturated to 1.0: the replay of step 0 arms the watch;
    step 2's loss graph is walked before its backward (the model's own sqrt is not the
    loss's), its pow input held until the step ends and measured at its event."""
    held = []
    walk = singular.inputs

    def spy(loss, stop, ops=None):
        found = walk(loss, stop, ops)
        held.extend(weakref.ref(r.value) for r in found if r.value is not None)
        return found

    monkeypatch.setattr(singular, "inputs", spy)

    def run(path):
        model = make(Probs)
        data = batches(5, classes=False)  # y = 1 on even steps: p_t = 1, the backward NaN
        if path is None:
            return loop(model, data, loss_fn=soft_loss)[0], _bits(model.parameters())
        with watch(path, model) as rec:
            losses = loop(model, data, loss_fn=soft_loss)[0]
        return losses, _bits(model.parameters()), rec

    plain, (losses, weights, rec) = run(None), run(run_path)
    assert losses == plain[0] and all(torch.equal(a, b) for a, b in zip(plain[1], weights))
    run = ampdoctor.load(run_path)
    rows = run.events[run.events["kind"] == int(Event.LOSS_SINGULAR)]
    assert list(rows["step"]) == [2]
    ops = json.loads(str(rows["text"][0]))["ops"]
    assert [m["op"] for m in ops] == ["pow"]  # not the sqrt inside the model
    pow_ = ops[0]
    assert pow_["exponent"] == 0.5 and pow_["dtype"] == "float16" and pow_["numel"] == 8
    assert pow_["at_point"] == 8 and pow_["fp32"]["nonfinite"] == 8
    assert pow_["eps"] is None and "clamped" not in pow_  # every value at the point
    assert float(rows["value"][0]) == 8.0
    assert held and all(r() is None for r in held)  # released with the step
    assert rec.forensics.prover.watch is None
    _, trials, _ = trials_of(run_path)
    assert trials[0]["use_bf16"] == {"tried": False, "note": trials[0]["use_bf16"]["note"]}
    assert "written by hand" in trials[0]["loss_in_fp32"]["note"]


def masked_mean(out, y):
    """A hand-written masked mean of the per-row loss over the rows whose label is not -1:
    0/0 on a batch with no labelled row, in any precision."""
    mask = (y >= 0).float()
    nll = -F.log_softmax(out.float(), -1).gather(-1, y.clamp(min=0)[:, None]).squeeze(-1)
    return (nll * mask).sum() / mask.sum()


def test_a_handwritten_loss_divided_by_a_count_of_zero_is_the_batch(run_path):
    """Batches 1 and 3 have no labelled row: the loss is 0/0. The replay of step 1 finds
    every output finite and the loss written by hand; the watch it arms reads the loss's
    division at step 3, before its backward: a denominator of exactly 0, from the batch (no
    gradient reaches it). The diagnosis says bad_input (kind targets), no precision fix; the
    run is the run without ampdoctor, bit for bit."""
    def run(path):
        model = make(nn.Linear, 8, 4)
        data = [(x, torch.full_like(y, -1) if i in (1, 3) else y)
                for i, (x, y) in enumerate(batches(5))]
        if path is None:
            return loop(model, data, loss_fn=masked_mean)[0], _bits(model.parameters())
        with watch(path, model):
            losses = loop(model, data, loss_fn=masked_mean)[0]
        return losses, _bits(model.parameters())

    plain, recorded = run(None), run(run_path)
    assert np.isnan(plain[0][1]) and np.isnan(plain[0][3])
    assert np.array_equal(plain[0], recorded[0], equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(plain[1], recorded[1]))
    run = ampdoctor.load(run_path)
    rows = run.events[run.events["kind"] == int(Event.LOSS_SINGULAR)]
    assert list(rows["step"]) == [3]
    (div,) = json.loads(str(rows["text"][0]))["ops"]
    assert div["op"] == "div" and div["constant"] is True and div["at_point"] == 1
    assert div["dtype"] == "float32"
    d = ampdoctor.diagnose(run_path)
    assert (d.verdict, d.first_bad["step"]) == ("bad_input", 1)
    assert [fx.id for fx in d.fixes] == ["check_data"]
    assert any(e.key == "zero_count" for e in d.evidence)


def test_a_division_by_the_models_own_value_is_not_a_count():
    """A denominator a gradient reaches from the model is not a count from the batch."""
    out = torch.randn(4, 3, requires_grad=True)
    y = torch.tensor([0, 1, -1, 2])
    mask = (y >= 0).float()
    counted = masked_mean(out, y)
    own = (out * mask[:, None]).sum() / out.abs().sum()
    stop = [out.grad_fn] if out.grad_fn is not None else []
    assert singular.inputs(counted, stop or [object()]) == []  # OPS alone: no division
    (a,) = [r for r in singular.inputs(counted, stop or [object()], singular.DIVISIONS)]
    (b,) = [r for r in singular.inputs(own, stop or [object()], singular.DIVISIONS)]
    assert a.constant and not b.constant


def test_a_torch_loss_is_checked_in_fp32_at_once(run_path):
    """BCELoss on fp16 probabilities saturated to 1.0: its derivative, recomputed in fp32 at
    the replayed outputs, is large but finite (torch clamps it); the logits form and bf16
    make the step finite, the loss in fp32 alone does not (it already is)."""
    model = make(Probs)
    data = [(x, torch.zeros(8)) for x, _ in batches(2)]
    with watch(run_path, model) as rec:
        loop(model, data, loss_fn=lambda p, y: nn.BCELoss()(p, y), outside=True)
    assert rec.events[0].phase == "loss"
    _, trials, details = trials_of(run_path)
    check = details[0]["loss_singular_fp32"]
    assert check["nonfinite"] == 0 and check["loss_fns"] == ["binary_cross_entropy"]
    assert check["largest"] > 1e9  # 1 / (64 * 1e-12): BCE's own clamp
    t = trials[0]
    assert t["loss_on_logits"]["finite"] and t["use_bf16"]["finite"]
    assert t["loss_in_fp32"]["tried"] and not t["loss_in_fp32"]["finite"]
    assert rec.forensics.prover.watch is None  # a torch loss: nothing to watch


def test_measure_says_where_an_ops_derivative_is_infinite():
    half = torch.tensor([0.0, 2.0 ** -11, 0.5, 0.0], dtype=torch.float16)
    pow_ = singular.measure([singular.Read("PowBackward0", singular.OPS["PowBackward0"], 0.5,
                                           half)])[0]
    assert (pow_.at_point, pow_.fp32.nonfinite, pow_.run.nonfinite) == (2, 2, 2)
    assert pow_.nearest == pow_.eps_nearest == 2.0 ** -11 and pow_.eps == 4.9e-4
    assert pow_.clamped.nonfinite == 0 and 22 < pow_.clamped.largest < 23
    # log(x + 1e-6) in fp16: 1e-6 is subnormal, 1 / 1e-6 overflows fp16 but not fp32
    tiny = torch.tensor([1e-6, 0.5], dtype=torch.float16)
    log = singular.measure([singular.Read("LogBackward0", singular.OPS["LogBackward0"], None,
                                          tiny)])[0]
    assert log.at_point == 0 and log.fp32.nonfinite == 0
    assert log.run.nonfinite == 1 and log.fp32.largest > 65504
    # acos at +-1: two singular points, a two-sided clamp
    edge = torch.tensor([1.0, -1.0, 0.999], dtype=torch.float32)
    acos = singular.measure([singular.Read("AcosBackward0", singular.OPS["AcosBackward0"], None,
                                           edge)])[0]
    assert acos.at_point == 2 and acos.clamped.nonfinite == 0
    # most singular first
    both = singular.measure([singular.Read("LogBackward0", singular.OPS["LogBackward0"], None,
                                           tiny),
                             singular.Read("PowBackward0", singular.OPS["PowBackward0"], 0.5,
                                           half)])
    assert [m.op for m in both] == ["pow", "log"]


def test_a_power_of_one_or_more_is_not_singular():
    x = torch.zeros(3, requires_grad=True)
    out = torch.zeros(3, requires_grad=True) * 1
    y = out + x
    loss = (y ** 2).mean() + (y.clamp(min=0) ** 0.5).mean()
    ops = singular.inputs(loss, [out.grad_fn])
    assert [(r.op.name, r.exponent) for r in ops] == [("pow", 0.5)]
    assert singular.inputs(loss.detach(), [out.grad_fn]) == []  # no graph
    assert singular.inputs(loss, []) == []  # the model's end unknown: nothing read


def test_a_loss_argument_made_from_the_outputs_by_other_ops_is_not_held():
    """open_clip's contrastive loss takes ``scale * image @ text.T`` of the model's outputs:
    neither held (it carries the real step's graph, freed by its backward: every trial on
    open_clip failed with 'Trying to backward through the graph a second time') nor rebuilt;
    a re-run starts its backward from the outputs instead."""
    from ampdoctor.record.forensic import losscall

    image = torch.randn(4, 8, requires_grad=True) * 1.0
    text = torch.randn(4, 8, requires_grad=True) * 1.0
    logits = 10.0 * image @ text.T
    labels = torch.arange(4)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    outputs = [[image, text]]
    call = losscall.capture("cross_entropy", torch.nn.functional.cross_entropy,
                            (logits, labels), {}, loss, outputs, [1 << 20], [])
    assert isinstance(call.args[0], losscall.Derived) and call.args[1] is labels
    with pytest.raises(losscall.Missing, match="computed from the model's outputs"):
        call.arguments([image, text])
    # a view of an output is still rebuilt from the replayed one
    call = losscall.capture("cross_entropy", torch.nn.functional.cross_entropy,
                            (image.view(4, 8), labels % 8), {}, loss, outputs, [1 << 20], [])
    replayed = torch.zeros(4, 8)
    assert call.arguments([replayed, text])[0][0].data_ptr() == replayed.data_ptr()
