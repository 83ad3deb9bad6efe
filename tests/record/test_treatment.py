"""``ampdoctor record --apply FIX[=VALUE]``: the forms it takes and the one sentence a bad one
gets (prescription.py), what each treatment does to a run in this process (treatment.py, on
tiny models), that ``remove`` puts torch back, and that a recorder inside a treatment records
what the run really did (the LR the steps ran with, /meta ``applied``)."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import fresh, train
from torch.optim.optimizer import register_optimizer_step_post_hook

import ampdoctor
from ampdoctor.errors import RecordError
from ampdoctor.record.apply import prescription
from ampdoctor.record.apply.treatment import Treatment


def treated(*args):
    notes = []
    t = Treatment(prescription.parse_all(list(args)), note=notes.append).install()
    return t, notes


# ---------------------------------------------------------------------------------------------
# the forms


@pytest.mark.parametrize("text,name,value", [
    ("use_bf16", "use_bf16", None),
    ("adam_eps=1e-5", "adam_eps", 1e-5),
    ("init_scale=65536", "init_scale", 65536.0),
    ("growth_interval=200", "growth_interval", 200),
    ("lr_factor=4.7e-6", "lr_factor", 4.7e-6),
    ("fp32_island=blocks.0.attn, blocks.1.attn", "fp32_island", ("blocks.0.attn",
                                                                   "blocks.1.attn")),
])
def test_the_forms(text, name, value):
    p = prescription.parse(text)
    assert (p.name, p.value) == (name, value)
    assert prescription.parse(p.arg) == p or prescription.parse(p.arg).value == p.value


@pytest.mark.parametrize("args,message", [
    (["bogus"], "unknown fix 'bogus'; record can apply fp32_island=NAME[,NAME...], use_bf16"),
    (["adam_eps=abc"], "--apply adam_eps=abc: EPS must be a positive number"),
    (["lr_factor=-1"], "F must be a positive number"),
    (["growth_interval=0.5"], "N must be a whole number of steps"),
    (["use_bf16=1"], "use_bf16 takes no value"),
    (["init_scale"], "init_scale needs a value: --apply init_scale=S"),
    (["fp32_island=a,,b"], "module names separated by commas"),
    (["lr=1", "lr_factor=2"], "both set the learning rate"),
    (["use_bf16", "use_bf16"], "use_bf16 is given 2 times"),
])
def test_a_bad_form_gets_one_sentence(args, message):
    with pytest.raises(RecordError, match=None) as err:
        prescription.parse_all(args)
    assert message in str(err.value) and "\n" not in str(err.value)


# The values the issue found reaching the command (issue 37): each killed, crashed or silently
# spoiled the run; each is now one sentence before the command starts.
OUT_OF_RANGE = [
    ("lr_factor=1e300", "F must lie between 1e-12 and 1000"),  # killed the run at step 2
    ("lr_factor=1e-300", "F must lie between 1e-12 and 1000"),
    ("lr=1e4", "LR must lie between 1e-12 and 1000"),
    ("init_scale=1e39", "S must lie between 2^-24 and 2^32"),  # inf in fp32: crashed at step 0
    ("init_scale=1e-50", "S must lie between 2^-24 and 2^32"),  # 19 of 20 steps skipped
    ("growth_interval=99999999999999999999", "N must lie between 1 and 2^31 - 1"),  # overflow
    ("growth_interval=2147483648", "N must lie between 1 and 2^31 - 1"),
    ("growth_interval=0", "N must lie between 1 and 2^31 - 1"),
    # isdigit() took a superscript two, then int() raised: a traceback
    ("growth_interval=\u00b2", "N must be a whole number of steps in ASCII digits"),
    ("growth_interval=\u0661\u0662", "N must be a whole number of steps in ASCII digits"),
    ("adam_eps=2", "EPS must lie between 2^-126 and 1"),
    ("adam_eps=1e-40", "EPS must lie between 2^-126 and 1"),
    ("lr_factor=nan", "F must be a positive number"),
    ("lr_factor=inf", "F must be a positive number"),
    ("lr_factor=1_0", "F must be a positive number"),  # float() takes the underscore
    ("init_scale=\u0661\u0662", "S must be a positive number"),
]


@pytest.mark.parametrize("arg,message", OUT_OF_RANGE)
def test_a_value_outside_what_the_optimizer_or_scaler_takes_is_one_sentence(arg, message):
    with pytest.raises(RecordError) as err:
        prescription.parse(arg)
    assert str(err.value).startswith(f"--apply {arg}: {message}"), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arg,value", [
    ("init_scale=16777216", 2.0 ** 24), ("init_scale=4294967296", 2.0 ** 32),
    ("init_scale=5.960464477539063e-08", 2.0 ** -24), ("growth_interval=2147483647", 2 ** 31 - 1),
    ("growth_interval=+7", 7), ("lr_factor=1000", 1e3), ("lr_factor=1e-12", 1e-12),
    ("adam_eps=1", 1.0), ("adam_eps=.5", 0.5), ("lr=3E-4", 3e-4),
])
def test_the_edges_of_each_range_are_accepted(arg, value):
    assert prescription.parse(arg).value == value


def test_a_bad_value_stops_record_before_the_command_starts(tmp_path):
    """Through the real CLI: exit 2, one line, no traceback, the command never ran."""
    import subprocess

    from conftest import PYTHON, python_env

    started = tmp_path / "started"
    for arg, message in (OUT_OF_RANGE[3], OUT_OF_RANGE[8]):
        proc = subprocess.run(
            [PYTHON, "-m", "ampdoctor", "record", "--apply", arg, "-o", str(tmp_path / "r.h5"),
             "--", PYTHON, "-c", f"open({str(started)!r}, 'w')"],
            env=python_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"ampdoctor: --apply {arg}: {message}"), proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
        assert not started.exists() and not (tmp_path / "r.h5").exists()


def test_the_forms_travel_through_the_environment():
    ps = prescription.parse_all(["lr_factor=4.7e-6", "fp32_island=a.b,c"])
    assert prescription.from_env(prescription.to_env(ps)) == ps
    assert [p.arg for p in ps] == ["lr_factor=4.7e-6", "fp32_island=a.b,c"]
    with pytest.raises(RecordError):
        prescription.from_env("not json")


# ---------------------------------------------------------------------------------------------
# what each does


def test_use_bf16_turns_fp16_autocast_into_bf16_and_disables_the_scaler():
    t, notes = treated("use_bf16")
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            y = nn.Linear(4, 4)(torch.randn(2, 4))
        assert y.dtype == torch.bfloat16
        assert not torch.amp.GradScaler("cpu").is_enabled()
        assert [e.to_json() for e in notes[-1]] == [
            {"fix": "use_bf16", "arg": "use_bf16", "scaler": "disabled"}]
    finally:
        t.remove()
    with torch.autocast("cpu", dtype=torch.float16):
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
    assert torch.amp.GradScaler("cpu").is_enabled()


def test_init_scale_and_growth_interval():
    t, _ = treated("init_scale=1024", "growth_interval=7")
    try:
        scaler = torch.amp.GradScaler("cpu")
        assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 7
    finally:
        t.remove()
    assert torch.amp.GradScaler("cpu").get_scale() == 65536.0


def test_adam_eps_reaches_every_group():
    t, _ = treated("adam_eps=1e-5")
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.AdamW([{"params": [model.weight], "eps": 1e-8},
                                 {"params": [model.bias]}], lr=1e-3)
        assert [g["eps"] for g in opt.param_groups] == [1e-5, 1e-5]
        assert torch.optim.SGD(model.parameters(), lr=0.1).defaults.get("eps") is None
    finally:
        t.remove()
    assert torch.optim.Adam(nn.Linear(2, 2).parameters()).defaults["eps"] == 1e-8


def test_lr_factor_steps_with_the_lower_lr_and_puts_it_back():
    """The treated run equals the run at LR * F, the schedule untouched in between."""
    def run(lr, *apply):
        t, _ = treated(*apply) if apply else (None, None)
        try:
            model, opt = fresh(lr=lr)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            seen = []
            for x, y in [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(4)]:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                seen.append(opt.param_groups[0]["lr"])
            return [p.detach().clone() for p in model.parameters()], seen
        finally:
            if t is not None:
                t.remove()
    torch.manual_seed(1)
    w_low, lr_low = run(1e-4)
    torch.manual_seed(1)
    w_treated, lr_treated = run(1e-2, "lr_factor=0.01")
    for a, b in zip(w_low, w_treated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert lr_treated == pytest.approx([x * 100 for x in lr_low])  # the user's LR, put back
    torch.manual_seed(1)
    w_abs, _ = run(1e-2, "lr=1e-4")  # lr=X: F = X / the constructor's LR
    for a, b in zip(w_low, w_abs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_recorder_writes_the_lr_the_steps_ran_with(tmp_path):
    t, _ = treated("lr_factor=0.5")
    try:
        model, opt = fresh(lr=1e-3)
        with ampdoctor.watch(model, opt, path=str(tmp_path / "run.h5"), every=0):
            train(model, opt, steps=3, dtype=None)
    finally:
        t.remove()
    with ampdoctor.load(str(tmp_path / "run.h5")) as run:
        assert run.steps["lr"].tolist() == pytest.approx([5e-4] * 3)


def test_loss_in_fp32_runs_torch_losses_in_fp32():
    x = torch.randn(8, 4)
    t, _ = treated("loss_in_fp32")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = nn.Linear(4, 4)(x)
            assert out.dtype == torch.bfloat16
            assert F.mse_loss(out, torch.zeros(8, 4)).dtype == torch.float32
            assert nn.CrossEntropyLoss()(out, torch.zeros(8, dtype=torch.long)).dtype == \
                torch.float32
            half = F.l1_loss(out.half(), torch.zeros(8, 4, dtype=torch.float16))
            assert half.dtype == torch.float32
    finally:
        t.remove()
    assert F.l1_loss(x.half(), x.half()).dtype == torch.float16


def test_scheduler_per_step_steps_once_per_optimizer_step():
    def warmup(*apply):
        t, _ = treated(*apply) if apply else (None, None)
        try:
            model, opt = fresh(lr=1.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
            for _ in range(3):
                for _ in range(4):  # per micro-batch: the bug
                    F.cross_entropy(model(torch.randn(2, 16)), torch.zeros(2, dtype=torch.long)
                                    ).backward()
                    sched.step()
                opt.step()
                opt.zero_grad()
            return opt.param_groups[0]["lr"]
        finally:
            if t is not None:
                t.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: scheduler before optimizer
        assert warmup() == pytest.approx(13 / 100)
        assert warmup("scheduler_per_step") == pytest.approx(3 / 100)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_fp32_island_runs_the_named_modules_in_fp32():
    model = _Blocks()
    dtypes = {}
    for name in ("blocks.0", "blocks.1", "head"):
        model.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: dtypes.__setitem__(name, o.dtype))
    t, notes = treated("fp32_island=blocks.1")
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 8)).float().sum().backward()
        opt.step()
        assert dtypes == {"blocks.0": torch.bfloat16, "blocks.1": torch.float32,
                          "head": torch.bfloat16}
        assert notes[-1][0].modules == ["blocks.1"] and notes[-1][0].missing == []
        copy = __import__("copy").deepcopy(model)  # an EMA copy keeps working, on its own
        with torch.autocast("cpu", dtype=torch.bfloat16):
            copy(torch.randn(4, 8))
    finally:
        t.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8))
    assert dtypes["blocks.1"] == torch.bfloat16  # removed


def test_an_island_that_is_not_in_the_model_is_warned_and_noted():
    model = _Blocks()
    t, notes = treated("fp32_island=blocks.7.attn,head")
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 8)).sum().backward()
        with pytest.warns(RuntimeWarning, match="no module named blocks.7.attn"):
            opt.step()
        assert notes[-1][0].modules == ["head"] and notes[-1][0].missing == \
            ["blocks.7.attn"]
    finally:
        t.remove()


class Gram(nn.Module):
    def forward(self, f):
        return f.transpose(0, 1) @ f


def test_an_island_named_by_class_reaches_every_call_from_the_first():
    """The names a run of several models is recorded with (``Disc.attn``, a parameter-free
    ``Gram``) find their modules, and the first call of ``Gram``, under no_grad (a style's Gram
    matrix), already runs in fp32. With another optimizer hook beside it, the search ends at
    the first step without breaking the optimizer's loop over its hooks."""
    gram, disc = Gram(), nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    disc.__class__ = type("Disc", (nn.Sequential,), {})
    seen = []
    gram.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    disc[0].register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    t, notes = treated("fp32_island=Gram,Disc.0")
    extra = register_optimizer_step_post_hook(lambda *a: None)  # after it, as the recorder's
    try:
        opt = torch.optim.SGD(disc.parameters(), lr=0.1)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.no_grad():
                    gram(torch.randn(4, 8))
                gram(disc(torch.randn(4, 8))).float().sum().backward()
            opt.step()
        assert seen == [torch.float32] * 6
        assert notes[-1][0].modules == ["Gram", "Disc.0"] and notes[-1][0].missing == []
    finally:
        t.remove()
        extra.remove()


def test_an_island_with_half_weights_is_left_alone():
    """Its inputs would have to match its fp16 weights: only model.float() in the code helps."""
    model = _Blocks()
    model.head.half()
    t, notes = treated("fp32_island=head")
    try:
        with pytest.raises(RuntimeError):  # the script's own mismatch, untouched
            model(torch.randn(4, 8))
        assert notes[-1][0].skipped == {"head": "its weights are float16"}
        assert notes[-1][0].modules == []
    finally:
        t.remove()


def test_every_apply_a_fix_prints_is_one_record_accepts():
    """diagnose's `try it: --apply X` must parse: the two sides share no code (the analysis
    side never imports record/), so this test holds them together."""
    from ampdoctor.diagnosis import fixes

    ctx = fixes.Context(lr=3e-4, module="blocks.0.attn", module_type="Attention",
                        siblings=["blocks.0.attn", "blocks.1.attn"])
    applies = [fx.apply for fx in fixes.make(list(fixes.FIX_IDS), ctx) if fx.apply]
    assert len(applies) >= 7
    for arg in applies:
        assert prescription.parse(arg).arg == arg


def test_each_form_is_declared_once_and_every_list_of_forms_follows_it():
    from ampdoctor import cli
    from ampdoctor.record.apply import treatment

    forms = set(prescription.FORMS)
    assert set(treatment.INSTALL) == forms, "an --apply form without its installer, or the reverse"
    assert treatment.INSTALL["init_scale"] is treatment.INSTALL["growth_interval"]
    option = next(o for o in cli.record.params if o.name == "apply")
    assert option.help == prescription.help_text()
    assert prescription.usage() in option.help
    shown = [form.split("=")[0] for form in prescription.usage().split(", ")]
    assert sorted(shown) == sorted(forms), shown
    # (docs/commands.md's --apply table is written from FORMS: tests/project/test_doctables.py)


def test_a_form_without_its_installer_fails_the_import(monkeypatch):
    """INSTALL is derived from FORMS: a form declared with no ``_install_<form>`` is named
    when treatment.py is imported, not when someone first applies it."""
    from ampdoctor.record.apply import treatment

    monkeypatch.setitem(treatment.FORMS, "new_fix", prescription.Form("", "does it"))
    with pytest.raises(ImportError, match="no _install_<form> for new_fix"):
        treatment._installers()


# ---------------------------------------------------------------------------------------------
# fp8 (issue 36): torchao's Float8Linear, emulated on the CPU


@pytest.mark.parametrize("text,value", [
    ("fp8", None),
    ("fp8=rowwise", ("rowwise",)),
    ("fp8=tensorwise:keep=head,blocks.0", ("tensorwise", "head", "blocks.0")),
    ("fp8=keep=head", ("tensorwise", "head")),
])
def test_the_fp8_forms(text, value):
    p = prescription.parse(text)
    assert p.value == value and prescription.parse(p.arg) == p


@pytest.mark.parametrize("text,message", [
    ("fp8=e4m3", "unknown fp8 recipe 'e4m3'; torchao's are tensorwise, rowwise"),
    ("fp8=rowwise:kep=a", "name the modules to keep in high precision"),
    ("fp8=", "fp8 needs a value"),
])
def test_a_bad_fp8_form_gets_one_sentence(text, message):
    with pytest.raises(RecordError) as err:
        prescription.parse_all([text])
    assert message in str(err.value)


def test_fp8_without_torchao_is_one_sentence_before_the_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(RecordError, match=r"pip install 'ampdoctor\[fp8\]'"):
        prescription.parse_all(["fp8"])


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.out = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)  # 4 outputs: not a multiple of 16

    def forward(self, x):
        return self.head(self.out(self.down(F.gelu(self.up(x)))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_fp8_converts_the_trained_model_and_trains_under_cpu_autocast(dtype):
    """The model's Linears become Float8Linear at its first call with grad (a meta-device
    copy run first, as a FLOP counter does, is not it); keep= and sizes that are not multiples
    of 16 stay; under CPU bf16 autocast the converted model trains (torchao's backward alone
    fails there), its parameters still the optimizer's."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    t, notes = treated("fp8=tensorwise:keep=out")
    try:
        with torch.device("meta"):
            Blocks()(torch.randn(2, 32)).sum().backward()  # a FLOP count's throwaway copy
        torch.manual_seed(0)
        model = Blocks()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        params = [id(p) for p in model.parameters()]
        x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
        losses = []
        for _ in range(12):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        t.remove()
    assert [type(m).__name__ for m in (model.up, model.down, model.out, model.head)] == \
        ["Float8Linear", "Float8Linear", "Linear", "Linear"]
    assert isinstance(model.up, Float8Linear)
    assert [id(p) for p in model.parameters()] == params
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]
    applied = notes[-1][0]
    assert applied.converted == ["up", "down"] and applied.emulated is True
    assert applied.kept == {"out": "named with keep=",
                               "head": "its sizes are not multiples of 16"}
