"""``record/engines.py`` without the engines installed: a stand-in for Megatron-core's grad
scaler module (the classes as ``megatron.core.optimizer.grad_scaler`` names them, on the CPU),
trained under ``watch()`` in this process. Its steps fill the GradScaler's columns, its
patches are gone once the recorder closes, and a failure of ours never reaches the loop.
The real engines are run by tests/integration/test_engines_recorded.py.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ampdoctor

NAME = "megatron.core.optimizer.grad_scaler"


class MegatronGradScaler:
    def __init__(self, scale: float):
        self._scale = torch.tensor([scale])

    @property
    def scale(self):
        return self._scale

    def update(self, found_inf: bool):
        raise NotImplementedError


class DynamicGradScaler(MegatronGradScaler):
    def update(self, found_inf: bool):  # halve on inf, as Megatron's does at hysteresis 1
        if found_inf:
            self._scale = self._scale * 0.5


@pytest.fixture
def megatron_module(monkeypatch):
    module = types.ModuleType(NAME)
    module.MegatronGradScaler = MegatronGradScaler
    module.DynamicGradScaler = DynamicGradScaler
    monkeypatch.setitem(sys.modules, NAME, module)
    return module


def train(steps: int = 6, bad: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicGradScaler(1024.0)
    losses = []
    for step in range(steps):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        loss = F.mse_loss(model(x), y) * (float("inf") if step == bad else 1.0)
        (loss * scaler.scale).backward()
        found = not all(torch.isfinite(p.grad).all() for p in model.parameters())
        for p in model.parameters():
            p.grad.mul_(1 / scaler.scale)
        scaler.update(found)
        if not found:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_megatron_scalers_steps_fill_the_scale_and_skip_columns(tmp_path, megatron_module):
    path = str(tmp_path / "run.h5")
    with ampdoctor.watch(path=path, every=0, strict=True):
        losses = train()
    assert "__ampdoctor_original__" not in vars(DynamicGradScaler.update)  # put back
    with ampdoctor.load(path) as run:
        s = run.steps
        assert len(s) == len(losses) == 6
        assert s["skipped"].tolist() == [0, 0, 0, 1, 0, 0]
        assert s["found_inf"].tolist() == [0, 0, 0, 1, 0, 0]
        np.testing.assert_array_equal(s["scale"], [1024.0] * 4 + [512.0] * 2)
        np.testing.assert_array_equal(s["scale_after"], [1024.0] * 3 + [512.0] * 3)
        assert np.all(np.isfinite(s["grad_norm"][s["skipped"] == 0]))


def test_a_failure_in_an_engines_callback_steps_aside(tmp_path, megatron_module, monkeypatch):
    """Reading the scale fails inside ampdoctor: the run trains as without it, warned."""
    plain = train()
    from ampdoctor.record import engines
    monkeypatch.setattr(engines, "_scale_of", lambda scaler: 1 / 0)
    with pytest.warns(Warning, match="ZeroDivisionError"):
        with ampdoctor.watch(path=str(tmp_path / "run.h5"), every=0):
            recorded = train()
    assert recorded == plain
