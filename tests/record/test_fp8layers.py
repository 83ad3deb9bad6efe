"""Runs that already train in fp8 (torchao's ``Float8Linear``, emulated on the CPU), recorded:
the op probe steps over fp8 tensors, /meta ``fp8_layers`` names each fp8 layer with its
recipe, and the diagnosis reads the casts those layers made (``diagnosis/fp8.py``): the
fixtures of ``fp8_flushed``, ``fp8_grad_underflow`` and ``fp8_drift``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import ROOT, python_env

import ampdoctor

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402


def converted(model: nn.Module, recipe: str, keep: tuple = ()) -> nn.Module:
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: fqn not in keep)
    return model


class Mlp(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(width, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train(model, path, steps=4, every=1, batch=None, **watch):
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 32), torch.randint(0, 16, (32,))
    losses = []
    ctx = ampdoctor.watch(model, opt, path=path, every=every, **watch) if path else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for step in range(steps):
            xb = batch(step, x) if batch else x
            loss = F.cross_entropy(model(xb), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses


def _model(recipe="tensorwise", keep=()):
    torch.manual_seed(0)
    return converted(Mlp(), recipe, keep)


def test_the_op_probe_steps_over_fp8_tensors_and_the_run_is_unchanged(tmp_path):
    """The op probe measured every op's result with aminmax, which the CPU lacks for float8:
    it stopped on the first fp8 run (strict raised). Now it skips fp8 tensors, keeps probing
    the rest, and the recorded run trains bit for bit as the unrecorded one."""
    path = str(tmp_path / "fp8.h5")
    recorded = train(_model(), path, strict=True)
    assert recorded == train(_model(), None)
    with ampdoctor.load(path) as run:
        assert run.recorder_settings["op_probe"] is True
        assert len(run.fp8) > 0


@pytest.mark.parametrize("recipe,granularity,grad_dtype,hp", [
    ("tensorwise", "tensorwise", "float8_e5m2", False),
    ("rowwise_with_gw_hp", "axiswise", "float8_e4m3fn", True),
])
def test_each_fp8_layer_is_named_with_its_recipe(tmp_path, recipe, granularity, grad_dtype, hp):
    path = str(tmp_path / "fp8.h5")
    train(_model(recipe, keep=("head",)), path, steps=2, strict=True)
    with ampdoctor.load(path) as run:
        layers = run.fp8_layers
    assert sorted(layers) == ["fc1", "fc2"]  # head kept in high precision: not listed
    fc1 = layers["fc1"]
    assert fc1["library"] == "torchao" and fc1["recipe"] == recipe and fc1["emulate"] is True
    assert fc1["input"] == {"scaling": "dynamic", "granularity": granularity,
                            "dtype": "float8_e4m3fn"}
    assert fc1["grad_output"]["dtype"] == grad_dtype
    assert fc1["grad_weight_in_high_precision"] is hp


def test_a_run_without_fp8_layers_has_none(tmp_path):
    path = str(tmp_path / "bf16.h5")
    torch.manual_seed(0)
    train(Mlp(), path, steps=2, strict=True)
    with ampdoctor.load(path) as run:
        assert run.fp8_layers == {} and len(run.fp8) > 0


# -- the fixtures of the fp8 verdicts -----------------------------------------------------------


class Gate(nn.Module):
    """Passes its input on, or zeros on the steps in ``closed`` (a branch some batches skip:
    an expert that got no token, a masked modality)."""

    def __init__(self, closed=()):
        super().__init__()
        self.closed, self.step = set(closed), 0

    def forward(self, x):
        return x * 0 if self.step in self.closed else x


def test_a_layer_fed_zeros_on_some_steps_is_flushed_whole(tmp_path):
    """Layer 3's input is zero on steps 1 and 3: torchao clamps the zero amax at 1e-12 and
    casts with the scale 448 / 1e-12, finite, so the run goes on without a NaN; the diagnosis
    names the layer (not layer 0, whose output gradient is zero behind it), the step, and
    keeping it in bf16, as `record --apply` takes it."""
    torch.manual_seed(0)
    gate = Gate(closed={1, 3})
    model = converted(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), gate, nn.Linear(64, 32),
                                    nn.ReLU(), nn.Linear(32, 16)), "tensorwise")
    path = str(tmp_path / "gated.h5")

    def batch(step, x):
        gate.step = step
        return x

    losses = train(model, path, steps=5, batch=batch, strict=True)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    d = ampdoctor.diagnose(path)
    assert d.verdict == "fp8_flushed", d.summary
    assert d.first_bad == {"step": 1, "module": "3", "phase": "forward"}
    assert "was entirely zero" in d.summary and "sampled steps 1, 3 of 5" in d.evidence[0].text
    assert d.evidence[-1].text == "the same in 0 (output gradient)"  # fc1's, zero behind it
    fix = d.fixes[0]
    assert fix.id == "fp8_keep_layer" and fix.apply == "fp8=tensorwise:keep=3"
    assert {p.name: p.status for p in d.premises} == {"layer_in_fp8": "held",
                                                       "not_always_zero": "held"}


class Outlier(nn.Module):
    def forward(self, x):
        gain = torch.ones_like(x)
        gain[..., 3] = 3e4
        return x * gain


def _outlier_run(tmp_path, recipe):
    """The readiness's outlier channel (tests/release/test_fp8_readiness.py), in fp8: a
    squared output as the loss (a softmax saturated by the outlier would underflow the last
    layer's gradient in any format: another finding)."""
    torch.manual_seed(0)
    model = converted(nn.Sequential(nn.Linear(32, 256), Outlier(), nn.Linear(256, 64),
                                    nn.ReLU(), nn.Linear(64, 16)), recipe)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    path = str(tmp_path / f"{recipe}.h5")
    with ampdoctor.watch(model, opt, path=path, every=1, strict=True):
        for _ in range(3):
            model(torch.randn(64, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return path


def test_a_gradient_that_underflows_e4m3_rowwise_is_diagnosed_with_its_layer(tmp_path):
    """One channel 3000x the others: its gradient flows back into the first layer's output
    gradient. Row-wise in e4m3 (torchao's rowwise) it loses its small values; per tensor in
    e5m2 (tensorwise) it keeps them, so the fix is the tensorwise recipe; under tensorwise
    itself there is no fp8_grad_underflow (the neighbour it must not be confused with)."""
    d = ampdoctor.diagnose(_outlier_run(tmp_path, "rowwise"))
    assert d.verdict == "fp8_grad_underflow", d.summary
    assert d.first_bad["module"] == "0" and d.first_bad["phase"] == "backward"
    assert [f.id for f in d.fixes] == ["fp8_tensorwise", "fp8_keep_layer"]
    assert d.fixes[0].apply == "fp8=tensorwise"
    e4m3, e5m2 = d.evidence[0], d.evidence[1]
    assert "row-wise in e4m3" in e4m3.text and e4m3.module == "0"
    assert e5m2.key == "fp8_grad_e5m2" and e5m2.value < 0.01 < e4m3.value + 0.1
    tensorwise = ampdoctor.diagnose(_outlier_run(tmp_path, "tensorwise"))
    assert tensorwise.verdict != "fp8_grad_underflow"
    assert all(c["verdict"] != "fp8_grad_underflow" for c in tensorwise.causes)


# -- the early warning in fp8 terms: headroom in `ampdoctor export` ----------------------------


class Growing(nn.Module):
    """One channel that grows ``factor`` x per step: an outlier on its way to saturating."""

    def __init__(self, factor: float):
        super().__init__()
        self.step, self.factor = 0, factor

    def forward(self, x):
        gain = torch.ones_like(x)
        gain[..., 3] = 30.0 * self.factor ** self.step
        return x * gain


def _headroom(tmp_path, factor):
    from tensorboard.backend.event_processing import event_accumulator as ea

    from ampdoctor.live import tensorboard

    torch.manual_seed(0)
    grow = Growing(factor)
    model = converted(nn.Sequential(nn.Linear(32, 64), grow, nn.Linear(64, 32), nn.ReLU(),
                                    nn.Linear(32, 16)), "tensorwise", keep=("4",))
    path = str(tmp_path / f"x{factor}.h5")

    def batch(step, x):
        grow.step = step
        return x

    train(model, path, steps=4, batch=batch, strict=True)
    tensorboard.export(path, str(tmp_path / f"tb{factor}"))
    acc = ea.EventAccumulator(str(tmp_path / f"tb{factor}"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_export_writes_each_layers_fp8_headroom_falling_under_a_growing_outlier(tmp_path):
    """The outlier's layer loses about 2 binades of headroom per step (its amax grows 4x over
    the scale delayed scaling would have kept from the earlier steps: log2(1/4)), and so does
    every layer its values or gradients reach; with the outlier steady each layer keeps about
    0. The share its own cast flushed is written for the layers in fp8 only."""
    pytest.importorskip("tensorboard")
    growing, steady = _headroom(tmp_path, 4.0), _headroom(tmp_path, 1.0)
    outlier = growing["ampdoctor-fp8-headroom/2"]
    assert sorted(outlier) == [0, 1, 2, 3]
    assert outlier[0] == pytest.approx(0.0, abs=0.01)  # the first sample: current scaling
    assert all(-2.3 < outlier[s] < -1.5 for s in (1, 2, 3)), outlier  # (the weights move)
    for name in ("0", "2", "4"):
        kept = steady[f"ampdoctor-fp8-headroom/{name}"]
        assert all(abs(kept[s]) < 0.5 for s in (1, 2, 3)), (name, kept)
    assert "ampdoctor-fp8-flushed/2" in growing and "ampdoctor-fp8-flushed/4" not in growing
    assert "ampdoctor-fp8-headroom/4" in growing  # kept in bf16, still a Linear with a headroom


def _regression(path, fp8: bool):
    """Three Linears fitting a linear map from inputs whose channel 5 is 3000x the others
    (docs/fp8.md's example, 100x stronger): the same seed, data and steps with or without
    fp8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    if fp8:
        converted(model, "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g)
    x[:, 5] *= 3000
    y = x @ torch.randn(32, 16, generator=g) / 3000
    with ampdoctor.watch(model, opt, path=path, every=5, strict=True):
        for _ in range(40):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def test_an_fp8_run_that_drifts_from_its_baseline_names_the_layer(tmp_path):
    """The fp8 run's loss leaves the fp32 baseline's (compare: diverged) with no NaN;
    diagnose --baseline names the drift, from the step compare names, and the layer whose
    casts lose the most; without the baseline, the fp8 trial's high-precision re-run of the
    saved step says it, kind ``self``, with less confidence."""
    base, fp8 = str(tmp_path / "base.h5"), str(tmp_path / "fp8.h5")
    _regression(base, False)
    _regression(fp8, True)
    c = ampdoctor.compare(base, fp8)
    d = ampdoctor.diagnose(fp8, baseline=base)
    assert c.verdict == "diverged" and d.verdict == "fp8_drift", d.summary
    assert d.first_bad["step"] == c.divergence_step
    assert d.first_bad["module"] == "0"  # its input holds the 3000x channel
    assert d.evidence[1].module == "0" and "18." in d.evidence[1].text  # % subnormal
    assert d.fixes[0].id == "fp8_keep_layer" and d.fixes[0].apply == "fp8=tensorwise:keep=0"
    assert {p.name: p.status for p in d.premises} == {"baseline_not_fp8": "held",
                                                       "same_training": "held"}
    alone = ampdoctor.diagnose(fp8)
    assert alone.verdict == "fp8_drift" and alone.causes[0]["kind"] == "self", alone.summary
    assert alone.confidence < d.confidence
    # a baseline that is itself in fp8 is none: the premise fails
    again = ampdoctor.diagnose(fp8, baseline=fp8)
    assert again.verdict != "fp8_drift"
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", fp8, "--baseline",
                          base, "--format", "json"], capture_output=True, text=True,
                         env=python_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["verdict"] == "fp8_drift"


def test_export_writes_each_layers_input_kurtosis(tmp_path):
    """``ampdoctor-fp8-kurtosis/{layer}``: the Linear fed the 30x channel (one in 64) reads far
    past the early warning's 50; the first Linear, fed Gaussian inputs, about 3."""
    pytest.importorskip("tensorboard")
    found = _headroom(tmp_path, 1.0)
    outlier, gauss = found["ampdoctor-fp8-kurtosis/2"], found["ampdoctor-fp8-kurtosis/0"]
    assert sorted(outlier) == sorted(gauss) == [0, 1, 2, 3]
    assert all(v > 50 for v in outlier.values()), outlier
    assert all(2 < v < 4.5 for v in gauss.values()), gauss
