"""The doors' callback types: what ``patches`` calls when torch runs one of its doors.

A door is registered as torch registers a hook: by handing over the callable it calls (a
bound method of one of the hook groups, ``hooks.py``), as ``register_forward_hook(fn)``
does. ``patches`` never looks a callback up by name, so mypy checks each one's signature
where it is handed over, and a code walk follows ``GradScaler.update`` from its wrapper in
``patches.patch_scaler`` to ``ScalerDoor.before_update``, and from there to the method the
recorder handed over (``scalerhooks.ScalerHooks.before_update``).

Each wrapper calls its callback through ``patches.guard(fault, fn, ...)``: an exception goes
to ``fault(exc, fn.__name__)`` (the recorder steps aside), never to the training loop.

The doors that take several callbacks at once (GradScaler's methods; the model's, which
``watched.Watched`` hooks as roots are found) are declared here as frozen dataclasses of
callables; the others take their one or two callables as arguments (``patch_backward``,
``patch_clip``, ``hook_optimizers``...). A callback left ``None`` is not called.

The listeners: ``hooks.Hooks`` (the recorder's) and ``check_amp_step``'s
``preflight.amp_step._StepWatch``.

Example::

    seen, faults = [], []
    with patches.PatchSet() as ps:
        patches.patch_backward(ps, lambda exc, where: faults.append(where), seen.append)
        loss.backward()                                  # seen == [loss]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

Fault = Callable[[BaseException, str], None]
"""Where ``patches.guard`` sends a callback's exception (``where``: the callback's name)."""

ModulePre = Callable[[torch.nn.Module, tuple], None]
ModulePost = Callable[[torch.nn.Module, tuple, Any], None]
ScalerCall = Callable[[Any], None]  # (scaler)
ScalerOptimizerCall = Callable[[Any, Any], None]  # (scaler, optimizer)
OptimizerCall = Callable[[Any], None]  # (optimizer)
BeforeClip = Callable[[Any, Optional[dict]], None]  # (parameters, the call's config)
AfterClip = Callable[[Any, bool], None]  # (the pre-clip norm, combined: a global one)


@dataclass(frozen=True, eq=False)
class ScalerDoor:
    """GradScaler's public methods (``patches.patch_scaler``): each callback is told before
    or after the method of its name (``on_init``: after ``__init__``)."""

    fault: Fault
    on_scale: Optional[Callable[[Any, Any, Any], None]] = None  # (scaler, outputs, out)
    before_unscale: Optional[ScalerOptimizerCall] = None
    after_unscale: Optional[ScalerOptimizerCall] = None
    enter_scaler_step: Optional[ScalerOptimizerCall] = None
    exit_scaler_step: Optional[ScalerOptimizerCall] = None
    before_update: Optional[ScalerCall] = None
    after_update: Optional[ScalerCall] = None
    on_scaler_init: Optional[ScalerCall] = None


@dataclass(frozen=True, eq=False)
class ModelDoor:
    """What ``watched.Watched`` hooks as it finds the model: the global discovery hooks
    (``patches.hook_modules``), each root's own (``patches.hook_root``) or a compiled root's
    eager shim (``patches.shim_compiled_call``); and, once a sharded model is seen, the
    scaler's doors again (ShardedGradScaler), its own found_inf and FSDP1's clip method."""

    fault: Fault
    discover_pre: ModulePre
    discover_post: Callable[[torch.nn.Module, tuple, dict, Any], None]
    root_pre: Callable[[torch.nn.Module, tuple, dict], None]
    root_post: Callable[[torch.nn.Module, tuple, Any, Optional[dict]], None]
    compiled_pre: Callable[[torch.nn.Module, tuple, dict], None]
    compiled_post: ModulePost
    scaler: ScalerDoor
    after_unscale_grads: Callable[[Any, Any, Any], None]  # (scaler, optimizer, found)
    before_clip: BeforeClip
    after_clip: AfterClip
