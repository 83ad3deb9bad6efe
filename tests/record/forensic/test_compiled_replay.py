"""A NaN only the compiled model makes (``record/forensic/compiled_replay.py``): the fixture's
custom op, whose eager kernel is stable and whose inductor decomposition overflows, trained
under ``torch.compile`` (inductor, on CPU) with and without ``ampdoctor.watch``. The step's
eager replay is finite, its compiled replay names the region and the op and tries the fixes;
the run is bit-identical to the same run without ampdoctor and never recompiles; which
modules count as compiled regions."""

import contextlib
import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import ROOT

import ampdoctor
from ampdoctor.record.forensic import compiled_replay
from ampdoctor.record.forensic.culprit import Culprit
from ampdoctor.runfile.schema import Phase


def _fixture():
    path = os.path.join(ROOT, "fixtures", "verdicts", "compile_nan.py")
    spec = importlib.util.spec_from_file_location("compile_nan_fixture", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo imports the forward's module by name
    spec.loader.exec_module(module)  # registers fxops::logcosh and its decomposition
    return module


FX = _fixture()
STEPS, AT, BATCH = 11, 8, 16


def _train(path=None):
    """The fixture's run, compiled; every step after the first under fail_on_recompile (a
    recompile of the user's code raises). Losses, final weights, the recorder. The recorded
    run reuses the plain run's compiled graphs (the same code, the same guards): ampdoctor
    must not make it compile again, even at the first step."""
    if path is None:
        torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), FX.LogCosh(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    compiled = torch.compile(model)
    x_all, y_all = FX.make_data(STEPS * BATCH)
    x_all[AT * BATCH] *= 80
    losses = []
    watch = ampdoctor.watch(compiled, opt, path=path, strict=True) if path else \
        contextlib.nullcontext()
    with watch as rec:
        for step in range(STEPS):
            stance = torch.compiler.set_stance("fail_on_recompile") if step or path else \
                contextlib.nullcontext()
            with stance:
                sl = slice(step * BATCH, (step + 1) * BATCH)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(compiled(x_all[sl]).float(), y_all[sl])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], rec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("compiled") / "run.h5")
    plain = _train()
    recorded = _train(path)
    return plain, recorded, path


def _bits(t):
    return t.view(torch.int32)


def test_the_compiled_run_is_bit_identical_with_ampdoctor_and_never_recompiles(runs):
    (losses, weights, _), (rlosses, rweights, rec), _ = runs
    assert not bool(torch.isfinite(losses[AT]))  # the compiled step failed, in both runs
    assert bool(torch.isfinite(losses[:AT]).all())
    assert torch.equal(_bits(losses), _bits(rlosses))
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(weights, rweights))
    assert rec.forensics.recompiled == 1  # the compiled replay ran (under fail_on_recompile)


def test_the_eager_replay_is_finite_and_the_compiled_replay_names_region_and_op(runs):
    *_, path = runs
    snap = next(s for s in ampdoctor.load(path).snapshots if s["step"] == AT)
    d = json.loads(snap["detail"])
    assert d["reproduced"] is False and d["rerun"]["finite"] is True  # eagerly: finite
    got = d["compiled"]
    assert got["reproduced"] is True and got["region"] == "Sequential"
    rungs = {r["backend"]: r["finite"] for r in got["rungs"]}
    assert rungs == {"aot_eager": True, "decomposed": False, "inductor": False}
    assert got["backend"] == "decomposed"
    op = got["op"]
    assert (op["graph"], op["op"], op["decomposed_from"], op["module"]) == \
        ("forward", "aten.cosh", "fxops.logcosh", "1")
    assert "compile_nan.py" in op["source"]
    trials = d["trials"]
    assert trials["compiler_disable"]["finite"] is True
    assert trials["compile_backend"]["backend"] == "aot_eager"
    assert trials["compile_backend"]["finite"] is True


def test_the_diagnosis_is_compiler_with_its_fixes_proven(runs):
    *_, path = runs
    d = ampdoctor.diagnose(path)
    assert d.verdict == "compiler", str(d)
    assert d.first_bad["step"] == AT and d.first_bad["module"] == "Sequential"
    assert "not_reproducible" not in {c["verdict"] for c in d.causes}
    assert d.fixes[0].id == "compiler_disable" and d.fixes[0].proven is True
    assert {fx.id for fx in d.fixes} >= {"compile_backend", "report_compiler_bug"}
    assert "aten.cosh" in d.summary


# ---------------------------------------------------------------------------------------------
# what counts as a region, and when a compiled replay runs (no compiling)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class _Cap:
    def __init__(self, root, scale=None):
        self.root = root
        self.losses = [(torch.zeros(()), {"scaled": True, "scale": scale})] if scale else []


def test_regions_are_the_outermost_compiled_modules_of_each_kind():
    net = Net()
    net.a = torch.compile(net.a)  # a wrapper
    net.b.forward = torch.compile(net.b.forward)  # a compiled forward
    net.c.compile()  # a compiled __call__
    names = {m: n for n, m in net.named_modules() if n}
    found = compiled_replay.regions([_Cap(net)], names)
    assert [(r.name, r.module is m) for r, m in zip(found, (net.a._orig_mod, net.b, net.c))] \
        == [("a", True), ("b", True), ("c", True)]
    assert found[1].forward.__func__ is Block.forward  # the forward as the user wrote it
    whole = torch.compile(net)  # a region inside the compiled root is compiled with it
    outer = compiled_replay.regions([_Cap(whole)], {whole: "Net"})
    assert [r.name for r in outer] == ["Net"] and outer[0].module is net


def test_no_compiled_replay_where_the_eager_replay_reproduced_or_nothing_is_compiled():
    net = Net()
    f = Culprit(Phase.NONE)
    f.detail.reproduced = False
    assert compiled_replay.examine([_Cap(net)], f, {}) is False  # nothing compiled
    assert f.detail.compiled is None
    g = Culprit(Phase.FORWARD)
    g.detail.reproduced = True
    assert compiled_replay.examine([_Cap(torch.compile(net))], g, {}) is False
    assert g.detail.compiled is None


def test_the_compiled_replay_runs_the_backward_at_the_scale_the_eager_replay_was_judged_at(
        monkeypatch):
    # At GradScaler's first steps the recorded scale overflows a finite step's gradients: the
    # eager replay was judged at scale 1 (reproduced.py's rerun_scale), and so is every rung.
    from ampdoctor.record.forensic.trial import Outcome
    scales = []

    def run(captures, names, regs, rung, probe, t):
        scales.append(t.scale)
        finite = rung != "inductor"
        return Outcome(t.name, finite=finite, first="" if finite else "forward",
                       loss=1.5 if finite else float("nan")), ""

    monkeypatch.setattr(compiled_replay, "_run", run)
    f = Culprit(Phase.NONE)
    f.detail.reproduced, f.detail.rerun_scale = False, 1.0
    assert compiled_replay.examine([_Cap(torch.compile(Net()), 65536.0)], f, {}, step=0)
    got = f.detail.compiled
    assert got.reproduced is True and got.backend == "inductor"
    assert scales == [1.0, 1.0, 1.0]
    for trial in f.detail.trials.values():
        assert (trial.at_scale, trial.recorded_scale) == (1.0, 65536.0)


def test_module_paths_from_dynamo_sources():
    path = compiled_replay._module_path
    assert path("L['forward'].__self__.blocks[0].attn") == "blocks.0.attn"
    assert path("L['self']._modules['a b']") == "a b"
    assert path("L['forward'].__self__") == ""


class Act(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.lin, self.op = nn.Linear(16, 16), op

    def forward(self, x):
        return self.op(self.lin(x))


def test_of_several_compiled_regions_the_one_that_makes_the_nan_is_named(tmp_path):
    """Two compiled blocks, one with the custom op: each compiled alone, only it fails; the
    fix tried runs it eagerly with the other still compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Act(torch.relu), Act(FX.LogCosh()), nn.LayerNorm(16),
                          nn.Linear(16, 4))
    model[0] = torch.compile(model[0])
    model[1] = torch.compile(model[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = FX.make_data(3 * BATCH)
    x[2 * BATCH] *= 1000  # an outlier: the second block's pre-activations pass 89
    with ampdoctor.watch(model, opt, path=str(tmp_path / "r.h5"), strict=True):
        for step in range(3):
            sl = slice(step * BATCH, (step + 1) * BATCH)
            loss = F.cross_entropy(model(x[sl]), y[sl])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    snap = next(s for s in ampdoctor.load(str(tmp_path / "r.h5")).snapshots if s["step"] == 2)
    d = json.loads(snap["detail"])
    got = d["compiled"]
    assert got["regions"] == ["0", "1"] and got["alone"] == ["1"] and got["region"] == "1"
    assert got["op"]["op"] == "aten.cosh" and got["op"]["module"] == "1.op"
    assert d["trials"]["compiler_disable"]["finite"] is True
