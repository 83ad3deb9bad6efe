"""A replay leaves no trace on the run: ``preserved`` forks the RNG of the CPU and of the
listed CUDA devices and puts every module buffer back bit for bit (BatchNorm's running
statistics, which a replayed forward updates). ``.grad`` and the optimizer are never touched by
a replay in the first place (gradients are read with ``torch.autograd.grad``).

Example (what ``Forensics`` wraps every replay and re-run in)::

    with preserved(roots, devices=[0]):
        trace.run()
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def preserved(roots: list, devices: list) -> Iterator[None]:
    """Fork the RNG of the CPU and the listed CUDA devices; restore module buffers."""
    saved = saved_buffers([m for root in roots for m in root.modules()])
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            restore_buffers(saved)


def saved_buffers(modules: list, *, empty: bool = False) -> list:
    """``(module, name, buffer, copy)`` for each buffer of ``modules`` (``empty``: the None
    ones too), for ``restore_buffers``; preflight's ``Snapshot`` keeps its buffers so too."""
    return [(m, name, b, b.detach().clone() if b is not None else None)
            for m in modules for name, b in m._buffers.items() if b is not None or empty]


def restore_buffers(saved: list) -> None:
    """Put back each buffer object (a forward may have replaced the attribute) with its saved
    values bit for bit, written only where they differ; one that changed shape, dtype or
    device in place, or was None, gets the saved copy instead."""
    with torch.no_grad():
        for m, name, b, value in saved:
            if b is None or value is None or not _same_kind(b, value):
                m._buffers[name] = value
                continue
            m._buffers[name] = b
            if not same_bits(b, value):
                b.copy_(value)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:
        return False
