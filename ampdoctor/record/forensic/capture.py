"""The forensic tier's capture, every step, references only (``forensics`` docstring: "Every
step" and "Nothing kept past the step"): each root call's arguments, RNG and autocast state, a
tensor hook on each root output keeping the gradient that reaches it, the loss and the torch
loss functions called after the model; dropped at the step's end unless its skip is still
undecided (``held``).

Example::

    capture = StepCapture(forensics)
    capture.inputs(root, args, kwargs)   # the root's pre-hook
    capture.output(root, output)         # its post-hook
    capture.end_step(hold=False)         # hooks removed, references dropped
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Optional

import torch

from ..sampler import tensors_in
from . import losscall
from .isolated import rng_devices, rng_state
from .kept import versions
from .trace import Capture, Gone, outputs_of

GRAD_BYTES = 256 << 20  # output gradients held for earlier micro-batches of one step
MAX_CAPTURES = 64  # root calls held per step (oldest dropped beyond)
MAX_LOSS_CALLS = 8  # torch loss function calls held per root call


class StepCapture:
    """The captures of one step of a ``Forensics`` (``f``: its ``replaying``, ``watched``,
    ``log`` and ``prover``)."""

    def __init__(self, forensics: Any):
        self.f = forensics
        self.captures: list[Capture] = []
        self.dropped = 0  # root calls dropped this step (MAX_CAPTURES)
        self.devices: list = rng_devices()
        self._hooks: list = []  # handles of this step's output-gradient hooks
        self.held: Optional[tuple] = None  # (captures, dropped) of a step not decided yet
        self._loss_budget = [losscall.HELD_BYTES]  # loss arguments held by reference

    def begin_step(self) -> None:
        self._unhook()
        self.captures = []
        self.dropped = 0
        self.devices = rng_devices()
        self._loss_budget = [losscall.HELD_BYTES]

    def end_step(self, hold: bool = False) -> None:
        """The step is over: its output-gradient hooks go, and its captures with them, unless
        ``hold`` (its skip is decided at the next step's start; ``release_held`` then)."""
        self._unhook()
        self.held = (self.captures, self.dropped) if hold and self.captures else None
        self.begin_step()

    def keep_roots(self, root_ids: set[int]) -> None:
        """The first step's discovery dropped a root (no optimizer trains it): its calls are
        not the step's, nor replayed with it."""
        self.captures = [c for c in self.captures if id(c.root) in root_ids]

    def release_held(self) -> None:
        self.held = None

    def _unhook(self) -> None:
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()

    def inputs(self, root: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.f.replaying or not torch.is_grad_enabled():
            return
        if len(self.captures) >= MAX_CAPTURES:
            self.captures.pop(0)
            self.dropped += 1
        if self.captures:  # a new micro-batch: the previous ones' backward is done
            self._bound_held_grads()
        watched = self.f.watched
        device = watched.device.type if watched.device is not None else "cpu"
        seen = watched.autocast.seen  # (enabled, dtype), just read by the recorder
        enabled, dtype = seen if seen is not None else (False, None)
        st = self.f.log.step
        self.captures.append(Capture(root, args, dict(kwargs), rng_state(self.devices),
                                     (device, enabled, dtype, torch.is_autocast_cache_enabled()),
                                     micro=st.micro if st else 0,
                                     versions=versions((args, kwargs)), open=True))

    def kwargs(self, root: torch.nn.Module, kwargs: dict) -> None:
        """Keyword arguments of the latest root call, known only after it (discovery mode:
        a global forward pre-hook gets no kwargs)."""
        cap = self.captures[-1] if self.captures else None
        if cap is not None and cap.root is root:
            cap.kwargs = dict(kwargs)
            cap.versions = versions((cap.args, cap.kwargs))

    def output(self, root: torch.nn.Module, output: Any) -> None:
        if self.f.replaying or not self.captures or self.captures[-1].root is not root or \
                not self.captures[-1].open:
            return  # (a call under no_grad after it was not captured: it is not this one)
        cap = self.captures[-1]
        cap.open = False
        outs = list(tensors_in(output))
        cap.outputs = [weakref.ref(t) for t in outs]  # measured on the event only
        if self.f.watched.sharding is not None:
            return  # never replayed: its output gradients would be held for nothing
        # Each output's node (the loss's graph's end, what a later model's input may be made
        # from: trace.feeds), dropped with the capture at the end of the step.
        cap.output_meta = [Gone(t.grad_fn, t.output_nr, t.shape) if t.grad_fn is not None
                           else None for t in outs]
        grads = cap.grads
        for i, t in enumerate(outs):
            # A leaf (a parameter handed back) would keep the hook after the step: skip it.
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                # The hook holds the dict and nothing else: a hook that reached the output
                # tensor (through the capture, or this recorder and the step's loss) would
                # make a cycle through autograd's C++ hook table that Python's collector
                # cannot see, and leak each step's graph.
                self._hooks.append(t.register_hook(partial(_keep_grad, grads, i)))

    def loss(self, loss: torch.Tensor, scaled: bool) -> None:
        """The loss of the latest root call (a reference), and whether GradScaler scaled it:
        the gradient reaching it is then the scale, in the loss's dtype."""
        if self.f.replaying or not self.captures or loss.grad_fn is None:
            return
        cap = self.captures[-1]
        cap.losses.append((loss.detach(), {"scaled": scaled}))
        if self.f.prover.watching(self.f.log.step):
            self.f.prover.read(cap, loss)

    def loss_call(self, name: str, fn: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A torch loss function's call after the latest root call, held for a replay to
        compute it again (``losscall.capture``: references only). One made while the root
        call is still running is the model's own, replayed with it."""
        if self.f.replaying or not self.captures or not torch.is_grad_enabled() or \
                self.f.watched.sharding is not None:  # (never replayed)
            return
        cap = self.captures[-1]
        if cap.open or len(cap.loss_calls) >= MAX_LOSS_CALLS:
            return
        calls = [outputs_of(c) for c in self.captures[::-1][:losscall.EARLIER_CALLS + 1]]
        call = losscall.capture(name, fn, args, kwargs, out, calls, self._loss_budget,
                                self._hooks)
        if call is not None:
            cap.loss_calls.append(call)

    def _bound_held_grads(self) -> None:
        """Earlier micro-batches' output gradients are what accumulation would have freed:
        keep them within GRAD_BYTES, oldest dropped first (the step's last is always kept)."""
        held = sum(nbytes(c.grads.values()) for c in self.captures)
        for old in self.captures:
            if held <= GRAD_BYTES:
                break
            if old.grads:
                held -= nbytes(old.grads.values())
                old.grads.clear()
                old.grads_dropped = True


def _keep_grad(grads: dict, index: int, grad: torch.Tensor) -> None:
    """Tensor hook on a root output: keep a reference to the gradient arriving there."""
    if grad is None:  # an output of a compiled (AOT autograd) region that no loss reached
        return
    if grad.requires_grad:  # create_graph=True: keep the value, not its graph
        grad = grad.detach()
    prev = grads.get(index)
    grads[index] = grad if prev is None else prev + grad


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
