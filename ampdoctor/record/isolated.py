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
    saved = []
    for root in roots:
        for m in root.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    saved.append((m, name, b, b.detach().clone()))
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for m, name, b, value in saved:
                    if m._buffers.get(name) is not b:
                        m._buffers[name] = b  # the forward replaced the attribute: put it back
                    if not same_bits(b, value):
                        b.copy_(value)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:
        return False
