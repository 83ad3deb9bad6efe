"""A step's backward calls against GradScaler's (``record/callorder.py``): a scaled loss
backwarded after ``scaler.unscale_`` in the same step, as SAM's second pass is, is an event,
and the diagnosis names the misuse with its fix."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampdoctor
from ampdoctor.runfile.schema import Event


def _sam(run_path, unscale_first: bool, steps: int = 4):
    """SAM's two passes around SGD with one scaler; ``unscale_first``: the misuse (unscale_
    after the first backward, for the ascent), else the fix (unscale_ after the last)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with ampdoctor.watch(model, opt, scaler, path=run_path, strict=True, forensics=False):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            with torch.no_grad():
                old = [p.detach().clone() for p in model.parameters()]
                norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                if torch.isfinite(norm):
                    for p in model.parameters():
                        p.add_(p.grad * (0.05 / (norm + 1e-12)))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss2 = F.cross_entropy(model(x), y)
            scaler.scale(loss2).backward()
            with torch.no_grad():
                for p, o in zip(model.parameters(), old):
                    p.copy_(o)
            if not unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return ampdoctor.load(run_path)


@pytest.mark.parametrize("unscale_first", [True, False])
def test_a_backward_after_unscale_is_an_event(run_path, unscale_first):
    run = _sam(run_path, unscale_first)
    rows = run.events[run.events["kind"] == Event.BACKWARD_AFTER_UNSCALE]
    if unscale_first:
        assert list(rows["step"]) == [0, 1, 2, 3] and set(rows["value"]) == {1.0}
    else:
        assert not len(rows)


def test_sam_with_unscale_before_its_second_pass_is_clip_order(run_path):
    """It was lr_overflow 0.6 with lower_lr at 5e-8 (blind6 sam_unscale_first_pass)."""
    _sam(run_path, unscale_first=True)
    d = ampdoctor.diagnose(run_path)
    assert d.verdict == "clip_order" and d.causes[0]["kind"] == "backward_after_unscale", str(d)
    assert [fx.id for fx in d.fixes] == ["unscale_after_last_backward"]
    assert "scaler.unscale_(optimizer)  # once, after the last backward" in d.fixes[0].snippet
