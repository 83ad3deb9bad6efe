"""The hook callbacks, declared once: what ``patches`` may call on a listener.

``patches`` calls a listener through ``guard(listener, "before_backward", tensors)``: by name,
looked up at each call (a test may replace one callback on the instance), with any exception
handed to ``listener.fault(exc, name)``. A name is checked three ways, so that a misspelt one
fails a check rather than a hook that silently never runs:

* ``guard`` takes a ``Callback``, the literal of every name below, so mypy rejects one that is
  not declared here;
* each ``patches`` function declares the door it opens (``TrainingListener``, ``Listener``,
  ``SchedulerListener``) and calls ``require`` when it patches: a listener that lacks a
  callback of that door raises ``TypeError`` then, not at the hook;
* tests/record/test_recorder.py checks that every name dispatched in record/ is a ``Callback``, that
  ``Callback`` is exactly the protocols' methods, and that the listeners define them all.

The listeners: ``hooks.Hooks`` (the recorder's, a ``Listener``) and ``check_amp_step``'s
``preflight.amp_step._StepWatch`` (a ``TrainingListener`` and a ``SchedulerListener``).

Example::

    class Counter:                     # a TrainingListener: every method below, fault too
        def before_backward(self, tensors): self.backward += 1
        ...
    with patches.PatchSet() as ps:
        patches.patch_backward(ps, Counter())   # TypeError here if a callback is missing
        loss.backward()
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Protocol, get_args

import torch


class Faults(Protocol):
    """Where ``guard`` sends a callback's exception (``where``: the callback's name)."""

    def fault(self, exc: BaseException, where: str) -> None: ...


class TrainingListener(Faults, Protocol):
    """The doors of every training loop: GradScaler's methods, backward, the optimizer step
    (``patches.patch_scaler``, ``patch_backward``, ``hook_optimizers``)."""

    def on_scale(self, scaler: Any, outputs: Any, out: Any) -> None: ...
    def before_unscale(self, scaler: Any, optimizer: Any) -> None: ...
    def after_unscale(self, scaler: Any, optimizer: Any) -> None: ...
    def enter_scaler_step(self, scaler: Any, optimizer: Any) -> None: ...
    def exit_scaler_step(self, scaler: Any, optimizer: Any) -> None: ...
    def before_update(self, scaler: Any) -> None: ...
    def after_update(self, scaler: Any) -> None: ...
    def on_scaler_init(self, scaler: Any) -> None: ...
    def before_backward(self, tensors: Any) -> None: ...
    def before_optimizer_step(self, optimizer: Any) -> None: ...
    def after_optimizer_step(self, optimizer: Any) -> None: ...


class SchedulerListener(Faults, Protocol):
    """``LRScheduler.step`` (``patches.patch_schedulers``: ``check_amp_step``, and the
    recorder, which counts a scheduler's steps per optimizer step)."""

    def before_scheduler_step(self, scheduler: Any) -> None: ...


class Listener(TrainingListener, SchedulerListener, Protocol):
    """The recorder's doors besides: the clips of ``torch.nn.utils`` (``patch_clip``,
    ``patch_clip_method``), module calls (the root's own hooks, ``hook_modules`` while
    discovering or sampling, ``hook_module_calls`` for the sampled step's op probe),
    ``module.compile()`` (``patch_module_compile``, ``shim_compiled_call``), the torch loss
    functions (``patch_losses``), ``Optimizer.zero_grad`` and ``Module.zero_grad``
    (``patch_zero_grad``: a step taken inside a compiled region is told there at the latest;
    gradients zeroed between a loss's backward and an optimizer's step), ``LRScheduler.step``
    (``patch_schedulers``) and GradScaler's ``_unscale_grads_`` (``patch_own_found_inf``: a
    rank's own found_inf, before ShardedGradScaler all-reduces it)."""

    def before_clip(self, parameters: Any, config: Optional[dict] = None) -> None: ...
    def after_clip(self, total_norm: Any, combined: bool = False) -> None: ...
    def root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None: ...
    def root_post(self, module: torch.nn.Module, args: tuple, output: Any,
                  kwargs: Optional[dict] = None) -> None: ...
    def discover_pre(self, module: torch.nn.Module, args: tuple) -> None: ...
    def discover_post(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None: ...
    def sample_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None: ...
    def probe_pre(self, module: torch.nn.Module, args: tuple) -> None: ...
    def probe_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None: ...
    def on_module_compile(self, module: torch.nn.Module) -> None: ...
    def compiled_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None: ...
    def compiled_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None: ...
    def after_loss(self, name: str, fn: Any, args: tuple, kwargs: dict, out: Any) -> None: ...
    def before_zero_grad(self, optimizer: Any) -> None: ...
    def before_module_zero_grad(self, module: torch.nn.Module) -> None: ...
    def after_autograd_grad(self, outputs: Any, create_graph: bool) -> None: ...
    def on_get_scale(self, scaler: Any) -> None: ...
    def after_unscale_grads(self, scaler: Any, optimizer: Any, found: Any) -> None: ...


Callback = Literal[
    "on_scale", "before_unscale", "after_unscale", "enter_scaler_step", "exit_scaler_step",
    "before_update", "after_update", "on_scaler_init", "before_backward",
    "before_optimizer_step", "after_optimizer_step",
    "before_clip", "after_clip", "root_pre", "root_post", "discover_pre", "discover_post",
    "sample_post", "probe_pre", "probe_post", "on_module_compile", "compiled_pre",
    "compiled_post", "after_loss", "before_zero_grad", "before_module_zero_grad",
    "after_autograd_grad", "on_get_scale", "after_unscale_grads", "before_scheduler_step"]
CALLBACKS: tuple[str, ...] = get_args(Callback)


def callbacks(door: type) -> list[str]:
    """The methods a protocol declares, its bases' included (``fault`` too)."""
    names: list[str] = []
    for cls in reversed(door.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        names += [n for n, v in vars(cls).items()
                  if callable(v) and not n.startswith("_") and n not in names]
    return names


def require(listener: Any, door: type) -> None:
    """Raise ``TypeError`` unless ``listener`` has every callback of ``door`` (at patch time:
    a misspelt or missing callback fails here, not silently at the hook)."""
    missing = [n for n in callbacks(door) if not callable(getattr(listener, n, None))]
    if missing:
        raise TypeError(f"{type(listener).__name__} is not a {door.__name__}: it has no "
                        f"{', '.join(missing)}")
