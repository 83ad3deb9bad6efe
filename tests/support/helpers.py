"""Small models, batches and the training loop the recorder tests share (torch: recorder side)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyNet(nn.Module):
    def __init__(self, width: int = 32, inplace: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.act = nn.ReLU(inplace=inplace)
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.block(self.act(self.fc1(x))))


def batches(n: int, seed: int = 0, bad_step: int | None = None):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        if i == bad_step:
            x[0, 0] = float("nan")
        yield x, y


def train(model, opt, scaler=None, steps: int = 6, dtype=torch.float16, accum: int = 1,
          bad_step=None, clip: float | None = None, recorder_ctx=None, on_step=None,
          unscale: bool = True, device: str = "cpu"):
    """A plain user loop; returns the list of losses (python floats).

    The loop the recorder tests share (``culprits.train`` is another, over batches it is given,
    for the forensic tests): ``steps`` optimizer steps of ``accum`` micro-batches
    from ``batches`` (seed 0, a NaN in micro-batch ``bad_step``), the forward under autocast to
    ``dtype`` (``None``: no autocast), the loss divided by ``accum``. With a ``scaler``:
    ``unscale_``, then the clip, then ``step`` and ``update`` (``unscale=False``: no
    ``unscale_`` call, ``step`` unscales by itself); ``on_step(i)`` runs after optimizer step
    ``i``'s ``zero_grad``. Example (test_recorder's observer-effect test)::

        losses = train(model, opt, scaler, steps=8, clip=1.0, bad_step=4,
                       recorder_ctx=ampdoctor.watch(model, opt, scaler, path=path))
    """
    losses = []
    ctx = recorder_ctx if recorder_ctx is not None else contextlib.nullcontext()
    with ctx:
        data = list(batches(steps * accum, bad_step=bad_step))
        for i, (x, y) in enumerate(data):
            if device != "cpu":  # on the CPU no .to() call at all, as a CPU loop has none
                x, y = x.to(device), y.to(device)
            with torch.autocast(torch.device(device).type, dtype=dtype,
                                enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y) / accum
            losses.append(loss.detach().float().item())
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % accum:
                continue
            if scaler is not None:
                if unscale:
                    scaler.unscale_(opt)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(opt)
                scaler.update()
            else:
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
            opt.zero_grad(set_to_none=True)
            if on_step is not None:
                on_step(i // accum)
    return losses


def fresh(seed: int = 0, lr: float = 1e-3, **kw):
    torch.manual_seed(seed)
    model = TinyNet(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt
