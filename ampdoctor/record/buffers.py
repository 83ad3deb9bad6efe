"""Module buffers the sampled steps cannot tell apart alone: whether a buffer was finite when
the recording began, and the buffers of frozen models the training step runs beside the
trained one.

A BatchNorm ``running_var`` already inf at the first sampled step is a poisoned statistic if
it was finite before that step's forward, and a constant (a causal mask filled with -inf) if
it was not. One look at every floating-point buffer when a model is first seen, before its
forward runs, tells them apart: one host read per model, once per run, into /meta
``buffers``::

    {"nonfinite_at_start": ["mask"], "unchecked": []}

``unchecked`` names the models whose buffers could not be read (on ``meta`` or fake tensors,
on several devices): for their buffers the start is unknown.

A frozen model the step calls at the top (a feature extractor left in ``train()``, whose
BatchNorm keeps updating fp16 statistics; a frozen VAE) owns no parameter an optimizer trains,
so it is not a root. Its buffers are still the run's state: ``SideModels`` keeps the frozen
models called during the first step that hold floating-point buffers, names them as the
script does (``backbone``), and hands their buffers to each sampled step's drain.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from ..runfile.meta import BuffersInfo
from .sampler import tensors_in
from .torchcompat import placeholder_call

MAX_NAMED = 64  # non-finite buffers named in /meta (the rest counted)


def nonfinite_at_start(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[list[str]]:
    """The names of the floating-point buffers in ``named`` that hold inf/NaN now (one host
    read); None where they cannot be read (meta or fake tensors, several devices)."""
    found = [(n, b) for n, b in named if isinstance(b, torch.Tensor) and b.is_floating_point()
             and b.numel()]
    if not found:
        return []
    try:
        if any(b.device.type == "meta" for _, b in found):
            return None
        with torch.no_grad():
            ok = torch.stack([torch.isfinite(b).all() for _, b in found]).cpu().tolist()
    except Exception:  # fake tensors, DTensors, buffers on several devices
        return None
    return [n for (n, _), fine in zip(found, ok) if not fine]


def module_buffers(names: dict[torch.nn.Module, str],
                   modules: Iterable[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Each buffer held directly by one of ``modules``, named ``<module's name>.<buffer>``
    (the name the sampled steps' /stats rows give it)."""
    return [(f"{names[m]}.{n}", b) for m in modules if m in names
            for n, b in m.named_buffers(recurse=False)]


class BufferStart:
    """/meta ``buffers``: what was non-finite when each model was first seen."""

    def __init__(self) -> None:
        self.nonfinite: list[str] = []
        self.unchecked: list[str] = []

    def check(self, label: str, named: list[tuple[str, torch.Tensor]]) -> None:
        bad = nonfinite_at_start(named)
        if bad is None:
            self.unchecked.append(label)
        else:
            self.nonfinite += [n for n in bad if n not in self.nonfinite]

    def meta(self) -> BuffersInfo:
        return BuffersInfo(nonfinite_at_start=self.nonfinite[:MAX_NAMED],
                           more_nonfinite=max(0, len(self.nonfinite) - MAX_NAMED),
                           unchecked=self.unchecked[:MAX_NAMED])


class SideModels:
    """Frozen models called at the top during the first step, beside the roots: their
    buffers are sampled with the roots' (``buffers``)."""

    def __init__(self) -> None:
        self._seen: dict[int, weakref.ref] = {}
        self._start: dict[int, Optional[list[str]]] = {}  # id -> its buffers bad at start
        self.models: list[torch.nn.Module] = []
        self.names: dict[torch.nn.Module, str] = {}  # every module of a side model, named

    def note(self, module: torch.nn.Module, args: tuple) -> None:
        """A top-level call of a module that is not a root (discovery is open): kept when it
        is frozen and holds floating-point buffers; its buffers are checked now, before its
        forward changes them."""
        if id(module) in self._seen or placeholder_call(module, tensors_in(args)) or \
                any(p.requires_grad for p in module.parameters()) or \
                not any(b.is_floating_point() for b in module.buffers()):
            return
        self._seen[id(module)] = weakref.ref(module)
        self._start[id(module)] = nonfinite_at_start(module.named_buffers())

    def settle(self, roots: list[torch.nn.Module]) -> None:
        """End of the first step: the side models are those seen that no root holds."""
        inside = {id(m) for r in roots for m in r.modules()}
        alive = [(key, ref()) for key, ref in self._seen.items() if key not in inside]
        self.models = [m for _, m in alive if m is not None]
        self._seen = {}

    def name(self, held: dict[int, str], taken: Iterable[str], start: BufferStart) -> None:
        """Names each side model as the script holds it (``held``: id -> variable), else by
        its class, never one of ``taken``; its start check goes into ``start``."""
        used = set(taken)
        for model in self.models:
            base = held.get(id(model)) or type(model).__name__
            label, i = base, 2
            while label in used:
                label, i = f"{base}{i}", i + 1
            used.add(label)
            for path, m in model.named_modules():
                self.names.setdefault(m, f"{label}.{path}" if path else label)
            bad = self._start.pop(id(model), None)
            if bad is None:
                start.unchecked.append(label)
            else:
                start.nonfinite += [f"{label}.{n}" for n in bad]
        self._start = {}

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The side models' buffers, named, for a sampled step's drain."""
        return module_buffers(self.names, list(self.names))
