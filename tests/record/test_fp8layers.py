"""Runs that already train in fp8 (torchao's ``Float8Linear``, emulated on the CPU), recorded:
the op probe steps over fp8 tensors, /meta ``fp8_layers`` names each fp8 layer with its
recipe, and the diagnosis reads the casts those layers made (``diagnosis/fp8.py``): the
fixtures of ``fp8_flushed``, ``fp8_grad_underflow`` and ``fp8_drift``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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
