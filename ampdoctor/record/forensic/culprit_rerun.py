"""The culprit alone: its call re-run in the run's precision and in fp32.

``check_culprit`` re-runs the culprit a replay named twice, from the inputs, RNG and
autocast state it ran in (a lean second pass of the step keeps only those: ``_Target``): once
as it ran, whose exact statistics replace the replay's sampled rows, and once in fp32
(autocast off, inputs ``.float()``, an fp32 copy of the module if its parameters are half);
for a backward culprit, its backward from the same grad_output. Finite in fp32 means an fp32
island around the module fixes the step; non-finite in fp32 too means the values themselves
are too large. ``opprobe`` then names the first non-finite op inside it.

Example (what ``replay.explain`` does once a culprit is named)::

    check_culprit(trace, finding)
    finding.fp32_finite, finding.fp32_absmax
"""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import Any

import torch

from ...runfile.detail import Fp32Rerun
from ...runfile.schema import Kind, Phase
from .. import patches, stats, torchcompat
from ..sampler import tensors_in
from .culprit import Culprit
from .isolated import rng_state, set_rng
from .trace import Call, Slot, Trace, autocast, labeled, row_summary, to_fp32


class _Target:
    """A lean second pass: re-run the step, keep only the culprit call's inputs (and the
    grad_output it receives), the RNG and autocast state it ran in."""

    def __init__(self, trace: Trace, call: Call, backward: bool):
        self.trace = trace
        self.module = call.module
        self.nth = call.nth
        self.backward = backward
        self.seen = 0
        self.reached = False  # the culprit's call was seen: what follows is set
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.rng: dict = {}
        self.autocast: tuple = ()
        self.grad_out: dict[int, torch.Tensor] = {}
        self.requires_grad: set[int] = set()

    def run(self) -> "_Target":
        cap = self.trace.cap
        set_rng(cap.rng)
        with patches.PatchSet() as handles:
            self.handles = handles
            handles.add(self.module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.add(self.module.register_forward_hook(self._post, with_kwargs=True))
            with torch.enable_grad(), autocast(cap.autocast):
                output = self.trace.root(*cap.args, **cap.kwargs)
            if self.backward:
                outs = list(tensors_in(output))
                pairs = [(t, cap.grads[i]) for i, t in enumerate(outs)
                         if i in cap.grads and isinstance(t, torch.Tensor) and t.requires_grad]
                params = [p for p in self.trace.root.parameters() if p.requires_grad]
                if pairs and params:
                    torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs],
                                        allow_unused=True)
        if not self.reached:
            raise RuntimeError("the second pass did not reach the culprit (the replay diverged)")
        return self

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.seen == self.nth and not self.reached:
            self.reached = True
            self.args, self.kwargs = args, kwargs
            self.rng = rng_state(self.trace.devices)
            device = self.trace.cap.autocast[0]
            enabled, dtype = _autocast_now(device)
            self.autocast = (device, enabled, dtype, torch.is_autocast_cache_enabled())
            self.requires_grad = {id(t) for _, t in labeled(args, kwargs)
                                  if isinstance(t, torch.Tensor) and t.requires_grad}
        self.seen += 1

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.seen - 1 != self.nth or not self.backward or self.grad_out:
            return
        for i, t in enumerate(tensors_in(output)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self.handles.add(t.register_hook(partial(self._grad, i)))

    def _grad(self, index: int, grad: torch.Tensor) -> None:
        prev = self.grad_out.get(index)
        self.grad_out[index] = grad.detach() if prev is None else prev + grad.detach()


def check_culprit(trace: Trace, f: Culprit) -> None:
    """Re-run the culprit alone, as it ran and in fp32; exact statistics of both.

    The run-precision re-run (same inputs, RNG, autocast state and grad_output) reproduces
    the replay's numbers and replaces the culprit's sampled rows with exact ones; the fp32
    re-run (autocast off, inputs ``.float()``, an fp32 copy of a half module) gives the
    verdict: finite means an fp32 island around the module fixes the step.
    """
    call, backward = f.call, f.phase == Phase.BACKWARD
    if call is None:
        return
    try:
        target = _Target(trace, call, backward).run()
        f.culprit_inputs = list(labeled(target.args, target.kwargs))
        prefix = "" if call.module is trace.root else f"{call.name}."
        qualified = {n: trace.param_names.get(id(p), prefix + n)
                     for n, p in call.module.named_parameters()}
        run = _Local(target, qualified, backward)
        measured = run.measure(call.module, target.args, target.kwargs, target.autocast)
        _replace_rows(trace, call, measured)
        module = _fp32_module(call.module)
        off = (target.autocast[0], False, None, False)
        fp32 = run.measure(module, to_fp32(target.args), to_fp32(target.kwargs), off, fp32=True)
    except Exception as exc:  # noqa: BLE001 - some modules refuse fp32 inputs; say so
        f.detail.fp32_error = f"{type(exc).__name__}: {exc}"
        return
    f.fp32_finite, f.fp32_absmax = _finite(run.results), _absmax(run.results)
    if not backward:
        _probe_ops(f, call.module, target)
    owner = type(call.module).__name__
    positions = {label: i for i, (label, _, _) in enumerate(call.inputs)}
    rows = []
    for kind, label, index, row in fp32:
        if kind in (Kind.INPUT, Kind.GRAD_INPUT):  # the replay's /tensors id for it
            index = positions.get(label, index)
        name = label if kind == Kind.PARAM_GRAD else call.name
        rows.append((Slot(kind, name, index, owner, call.nth, label, call.index), row))
    f.fp32_rows = rows
    into = (Kind.INPUT, Kind.GRAD_OUTPUT)
    f.detail.fp32 = Fp32Rerun(
        inputs=[row_summary(r, s.label) for s, r in rows if s.kind in into][:16],
        outputs=[row_summary(r, s.label) for s, r in rows if s.kind not in into][:16],
        copied_module=module is not call.module)


def _probe_ops(f: Culprit, module: torch.nn.Module, target: _Target) -> None:
    """Which op inside a forward culprit went non-finite first (``opprobe``): tells a mask
    constant that fp16 cannot hold from a product that overflows."""
    from ..opprobe import first_nonfinite_op

    set_rng(target.rng)
    try:
        op = first_nonfinite_op(module, target.args, target.kwargs, autocast(target.autocast))
    except Exception as exc:  # noqa: BLE001 - the probe only adds detail; it must not fail
        f.detail.op_error = f"{type(exc).__name__}: {exc}"[:300]
        return
    if op is not None:
        f.detail.op = op


class _Local:
    """The culprit module alone: forward, or forward and backward from its grad_output."""

    def __init__(self, target: _Target, qualified: dict, backward: bool):
        self.target = target
        self.qualified = qualified
        self.backward = backward
        self.results: list = []  # outputs (forward) or gradients (backward) of the last run

    def measure(self, module: torch.nn.Module, args: Any, kwargs: Any, state: tuple,
                fp32: bool = False) -> list:
        """[(kind, label, index, exact stats row)] of what went in and came out."""
        set_rng(self.target.rng)
        with autocast(state), torch.autograd.set_detect_anomaly(False):
            if self.backward:
                measured = self._backward(module, args, kwargs, fp32)
            else:
                with torch.no_grad():
                    out = module(*args, **kwargs)
                self.results = [t for t in tensors_in(out) if stats.measurable(t)]
                measured = [(Kind.INPUT, label, i, t) for i, (label, t) in enumerate(
                    (lab, t) for lab, t in labeled(args, kwargs) if stats.measurable(t))]
                measured += [(Kind.OUTPUT, f"out.{i}", i, t) for i, t in enumerate(self.results)]
        return [(kind, label, i, row) for kind, label, i, t in measured
                for row in [stats.exact(t)] if row is not None]

    def _backward(self, module: torch.nn.Module, args: Any, kwargs: Any, fp32: bool) -> list:
        wanted = self.target.requires_grad

        def leaf(original: Any, t: Any) -> Any:
            if isinstance(t, torch.Tensor) and id(original) in wanted and t.is_floating_point():
                t = t.detach().requires_grad_(True)
            return t

        args = _zip_map(self.target.args, args, leaf)
        kwargs = _zip_map(self.target.kwargs, kwargs, leaf)
        leaves = [(label, t) for label, t in labeled(args, kwargs) if t.requires_grad]
        with torch.enable_grad():
            out = module(*args, **kwargs)
        outs = list(tensors_in(out))
        pairs = [(i, outs[i], g.float() if fp32 else g)
                 for i, g in sorted(self.target.grad_out.items())
                 if i < len(outs) and isinstance(outs[i], torch.Tensor) and outs[i].requires_grad]
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not pairs or not (leaves or params):
            raise RuntimeError("the culprit's backward could not be re-run (no gradient "
                               "reached it)")
        wrt = [t for _, t in leaves] + [p for _, p in params]
        grads = torch.autograd.grad([t for _, t, _ in pairs], wrt, [g for _, _, g in pairs],
                                    allow_unused=True)
        self.results = [g for g in grads if g is not None]
        measured = [(Kind.GRAD_OUTPUT, f"out.{i}", i, g) for i, _, g in pairs]
        measured += [(Kind.GRAD_INPUT, label, i, g)
                     for i, ((label, _), g) in enumerate(zip(leaves, grads)) if g is not None]
        measured += [(Kind.PARAM_GRAD, self.qualified.get(n, n), 0, g)
                     for (n, _), g in zip(params, grads[len(leaves):]) if g is not None]
        return measured


def _replace_rows(trace: Trace, call: Call, measured: list) -> None:
    """Swap the culprit's sampled rows for the exact ones of its run-precision re-run."""
    exact = {(int(kind), label): row for kind, label, _, row in measured}
    prefix = "" if call.module is trace.root else f"{call.name}."
    params = {trace.param_names.get(id(p), prefix + n) for n, p in call.module.named_parameters()}
    for slot, meta in enumerate(trace.slots):
        if meta.call == call.index or (meta.kind == Kind.PARAM_GRAD and meta.label in params):
            row = exact.get((int(meta.kind), meta.label))
            if row is not None and int(row["numel"]) == int(trace.rows[slot]["numel"]):
                trace.rows[slot] = row


def _fp32_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module itself if it is fp32 already, else an fp32 copy (the original is untouched)."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        return module
    return copy.deepcopy(module).float()


def _zip_map(original: Any, converted: Any, fn: Any, depth: int = 0) -> Any:
    if isinstance(converted, torch.Tensor):
        return fn(original, converted)
    if depth < 4 and type(converted) in (tuple, list):
        return type(converted)(_zip_map(o, c, fn, depth + 1) for o, c in zip(original, converted))
    if depth < 4 and type(converted) is dict:
        return {k: _zip_map(original[k], v, fn, depth + 1) for k, v in converted.items()}
    return converted


def _autocast_now(device_type: str) -> tuple:
    return torchcompat.autocast_state(device_type)


def _finite(tensors: list) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if stats.measurable(t))


def _absmax(tensors: list) -> float:
    mags = [float(t.detach().abs().float().nan_to_num(nan=math.inf).max())
            for t in tensors if stats.measurable(t)]
    return max(mags, default=math.nan)
