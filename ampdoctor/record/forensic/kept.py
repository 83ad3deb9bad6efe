"""What ``rec.replay(step)`` needs after the step is gone: CPU copies of a replayed event's
micro-batches (``offload``), put back on their devices for a replay (``reload``), and the
weights' versions to say whether that replay is still faithful.

Example::

    kept = Kept([offload(c) for c in captures], weight_versions, scale)
    captures = [reload(c) for c in kept.captures]      # fresh tensors on the devices
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..sampler import tensors_in
from .losscall import LossCall, Weak
from .trace import Capture


@dataclass
class Kept:
    """What rec.replay needs after the step is gone: CPU copies and the weights' versions."""

    captures: list
    versions: tuple
    scale: Optional[float]


def versions(value: Any) -> tuple:
    """The version counters of the tensors in ``value``: an in-place change shows."""
    out = []
    for t in tensors_in(value):
        try:
            out.append(t._version)
        except RuntimeError:  # inference tensors have no version counter
            out.append(-1)
    return tuple(out)


@dataclass
class _Offloaded:
    tensor: torch.Tensor
    device: torch.device
    requires_grad: bool


def _offload_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return _Offloaded(value.detach().to("cpu", copy=True), value.device,
                          value.requires_grad and value.is_leaf)
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_offload_value(v, depth + 1) for v in value)
    if depth < 4 and type(value) is dict:
        return {k: _offload_value(v, depth + 1) for k, v in value.items()}
    return value


def _reload_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, _Offloaded):
        t = value.tensor.to(value.device, copy=True)
        return t.requires_grad_(True) if value.requires_grad else t
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_reload_value(v, depth + 1) for v in value)
    if depth < 4 and type(value) is dict:
        return {k: _reload_value(v, depth + 1) for k, v in value.items()}
    return value


def offload(cap: Capture, grads: bool = True) -> Capture:
    """CPU copies of a capture (its output gradients too, if ``grads``); its torch loss
    calls with the arguments they hold (those made from the model's output are rebuilt from
    the replayed one)."""
    return Capture(cap.root, _offload_value(cap.args), _offload_value(cap.kwargs),
                   {k: v.clone() for k, v in cap.rng.items()}, cap.autocast, cap.micro,
                   (), {i: _offload_value(g) for i, g in cap.grads.items()} if grads else {},
                   [(_offload_value(loss), {k: _offload_value(v) for k, v in h.items()})
                    for loss, h in cap.losses], cap.grads_dropped or not grads,
                   loss_calls=[_moved(c, _offload_value) for c in cap.loss_calls])


def reload(cap: Capture) -> Capture:
    """A capture back on its devices, fresh tensors, ready for a replay."""
    args, kwargs = _reload_value(cap.args), _reload_value(cap.kwargs)
    return Capture(cap.root, args, kwargs, cap.rng, cap.autocast, cap.micro,
                   versions((args, kwargs)), {i: _reload_value(g) for i, g in cap.grads.items()},
                   [(_reload_value(loss), {k: _reload_value(v) for k, v in h.items()})
                    for loss, h in cap.losses], cap.grads_dropped,
                   loss_calls=[_moved(c, _reload_value) for c in cap.loss_calls])


def _moved(call: LossCall, move: Any) -> LossCall:
    """A loss call with its held tensors moved by ``move`` (a weakly held one is dropped:
    a later re-run says it is missing)."""
    def one(value: Any) -> Any:
        return Weak(_dead) if isinstance(value, Weak) else move(value)

    return LossCall(call.name, call.fn, tuple(one(a) for a in call.args),
                    {k: one(v) for k, v in call.kwargs.items()}, call.autocast,
                    move(call.value), {k: move(g) for k, g in call.grads.items()})


def _dead() -> None:
    return None
