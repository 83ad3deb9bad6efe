"""Models whose culprit is known, and the plain user loop the forensic tests train them in.

``ExpNet`` fails in one known place (``FastExp``: an exp that runs in its input's dtype and
overflows fp16 above 11.09); ``train`` is a user's loop over batches it is given (autocast
forward, scaled backward, step), unlike ``helpers.train``, which makes its own. Shared by
``record/forensic/test_forensics.py`` (whose other scenario models live there),
``record/test_host_reads.py`` and ``record/test_gpu.py``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FastExp(nn.Module):
    """A hand-written exp that runs in its input's dtype, as custom kernels do (autocast does
    not promote it to fp32): exp(x) overflows fp16 above 11.09 and fp32/bf16 above 88.7."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return torch.exp(x)


class ExpNet(nn.Module):
    def __init__(self, shift: float = 0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), FastExp())
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.body[0].bias.fill_(shift)

    def forward(self, x):
        return self.head(self.body(x))


# ---------------------------------------------------------------------------------------------
# a plain user loop


def batches(n, seed=0, shape=(8, 8)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 4, (shape[0],), generator=g))
            for _ in range(n)]


def train(model, data, *, dtype=torch.float16, scaler=None, accum=1, loss_fn=None,
          rec=None, zero_grad_after_skip=True, on_step=None):
    """A user's loop: autocast forward, (scaled) backward, step; returns the losses."""
    opt = model.opt
    device = next(model.parameters()).device
    data = [(x.to(device), y.to(device)) for x, y in data]
    losses = []
    loss_fn = loss_fn or (lambda out, y: F.cross_entropy(out, y))
    outside = getattr(loss_fn, "outside_autocast", False)
    for i, (x, y) in enumerate(data):
        with torch.autocast(device.type, dtype=dtype or torch.float16, enabled=dtype is not None):
            out = model(x)
            if not outside:
                loss = loss_fn(out, y) / accum
        if outside:
            loss = loss_fn(out, y) / accum
        losses.append(loss.detach().float().item())
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if (i + 1) % accum:
            continue
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if zero_grad_after_skip or scaler.get_scale() >= before:
                opt.zero_grad(set_to_none=True)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(i // accum)
    return losses


def make(cls, *args, lr=1e-3, seed=0, **kw):
    torch.manual_seed(seed)
    model = cls(*args, **kw)
    model.opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model


def scaler(init=2.0**16, device="cpu"):
    return torch.amp.GradScaler(device, init_scale=init)
