"""Every change ampdoctor makes to torch's globals, each undoable through a handle.

A recorder sees a training loop through these doors, all opened here and nowhere else:

* ``GradScaler`` methods (``scale``, ``unscale_``, ``step``, ``update``, ``__init__``), patched on
  the class so that a scaler created anywhere is seen, including ``torch.cuda.amp.GradScaler``;
  and ``_unscale_grads_``, whose found_inf ShardedGradScaler all-reduces right after;
* ``torch.autograd.backward``, which ``Tensor.backward`` calls: the loss, and micro-batches;
* the clips of ``torch.nn.utils`` (``clip_grad_norm_``, ``get_total_norm`` +
  ``clip_grads_with_norm_``, ``clip_grad_value_``; FSDP1's ``clip_grad_norm_`` method, patched
  once a sharded model is seen; timm's ``adaptive_clip_grad``, once timm is imported): the
  pre-clip norm and the unscale/clip order;
* global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_*_hook``);
  a step given a closure (Lightning, LBFGS) runs forward and backward inside ``step``, so the
  pre-step work waits until the closure has returned; a step inside a compiled region is
  only noted there, and told at the next eager hook, ``Optimizer.zero_grad`` at the latest;
* global module forward hooks, installed only while discovering the model or sampling a step
  (on a sampled step also the op probe's, whose post-hook runs even when a forward raises);
* the root modules' own forward (pre-)hooks, marked as ours, and ``Module.__getstate__``, so
  that a copy or a pickle of a root (an EMA model, ``torch.save(model)``) is made without them;
* ``torch.nn.Module.compile``: a module compiled in place is called through an eager shim, the
  only place its calls can be seen without entering the compiled region (``compiled.py``);
* the loss functions of ``torch.nn.functional`` (``cross_entropy``, ``mse_loss``...: those of
  ``losscall.LOSSES``, which the ``nn.*Loss`` modules call): the loss a replay recomputes.
* ``LRScheduler.step``: the schedulers that step, so that a scheduler stepped once per
  micro-batch is seen (``schedules.py``).

(``record --apply`` treats a run as well: ``treatment.py`` changes what torch computes, on
purpose and only when asked, with the same ``Patch`` handles.)

Each wrapper calls the original unconditionally and hands the listener's work to ``guard``,
which never lets an ampdoctor failure reach the training loop, and does nothing while dynamo
traces it (a hook reached inside a ``torch.compile`` region adds nothing to the graph). The
callbacks are handed over as callables, as torch's ``register_*_hook(fn)`` takes them (their
types: ``listener.py``), never looked up by name.
``PatchSet.remove`` restores every original, is safe to call twice, and leaves alone an
attribute someone else re-patched after us.

The doors are opened through this module (``patches.hook_root``, ``patches.patch_clip``...),
which holds those of GradScaler, backward, ``autograd.grad``, the optimizers, the schedulers
and the losses; the rest live beside it: ``patching`` (``Patch``, ``PatchSet``, ``guard``: the
mechanism), ``clipdoors`` (the clips), ``moduledoors`` (the module hooks, the roots' hooks and
state, ``Module.compile``). The four are the only files that change torch's globals, and
``tests/record/test_host_reads.py`` and ``exits.RECORDING_CODE`` exempt exactly them: their
wrappers call only the user's own GradScaler, clip and loss functions.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as functional
import torch.optim.optimizer as optimizer_hooks

from .clipdoors import (
    CLIPS,
    LIBRARY_CLIPS,
    clip_args,
    clip_config,
    patch_clip,
    patch_clip_method,
    patch_library_clips,
)
from .listener import Fault, OptimizerCall, ScalerDoor
from .moduledoors import (
    hook_module_calls,
    hook_modules,
    hook_root,
    patch_module_compile,
    patch_module_state,
    shim_compiled_call,
)
from .patching import Patch, PatchSet, guard, original, subclasses, wrapped_for

__all__ = [
    "CLIPS", "LIBRARY_CLIPS", "Patch", "PatchSet", "clip_args", "clip_config", "guard",
    "hook_module_calls", "hook_modules", "hook_optimizers", "hook_root", "original",
    "patch_autograd_grad", "patch_backward", "patch_clip", "patch_clip_method",
    "patch_library_clips", "patch_losses", "patch_module_compile", "patch_module_state",
    "patch_own_found_inf", "patch_scaler", "patch_schedulers", "patch_zero_grad",
    "scheduler_classes", "shim_compiled_call", "subclasses",
]

_compiling = torch.compiler.is_compiling


def patch_scaler(patches: PatchSet, door: ScalerDoor) -> None:
    """Wrap GradScaler's public methods on the class and on subclasses that override them."""
    fault = door.fault

    def scale(orig):
        @functools.wraps(orig)
        def wrapper(self, outputs):
            out = orig(self, outputs)
            guard(fault, door.on_scale, self, outputs, out)
            return out
        return wrapper

    def unscale_(orig):
        @functools.wraps(orig)
        def wrapper(self, optimizer):
            guard(fault, door.before_unscale, self, optimizer)
            out = orig(self, optimizer)
            guard(fault, door.after_unscale, self, optimizer)
            return out
        return wrapper

    def step(orig):
        @functools.wraps(orig)
        def wrapper(self, optimizer, *args, **kwargs):
            guard(fault, door.enter_scaler_step, self, optimizer)
            try:
                return orig(self, optimizer, *args, **kwargs)
            finally:
                guard(fault, door.exit_scaler_step, self, optimizer)
        return wrapper

    def update(orig):
        @functools.wraps(orig)
        def wrapper(self, new_scale=None):
            guard(fault, door.before_update, self)
            out = orig(self, new_scale)
            guard(fault, door.after_update, self)
            return out
        return wrapper

    def init(orig):
        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            guard(fault, door.on_scaler_init, self)
        return wrapper

    makers = {"scale": scale, "unscale_": unscale_, "step": step, "update": update,
              "__init__": init}
    for cls in subclasses(torch.amp.GradScaler):
        for name, make in makers.items():
            # Called again once a sharded model is seen: ShardedGradScaler, imported after
            # recording began, gets its overrides patched then (what this listener already
            # wraps is left as it is; another listener's wrapper is wrapped again).
            if name in cls.__dict__ and not wrapped_for(cls.__dict__[name], door):
                patches.add(Patch(cls, name, make, door))


def patch_own_found_inf(patches: PatchSet, fault: Fault,
                        after_unscale_grads: Callable[[Any, Any, Any], None]) -> None:
    """See the found_inf that ``_unscale_grads_`` returns (``after_unscale_grads``),
    on every scaler class that defines it: ShardedGradScaler's ``unscale_`` all-reduces that
    tensor in place right after, so this is the one moment it is still this rank's own.
    Called again, as ``patch_scaler``, once a sharded model is seen."""

    def make(orig):
        @functools.wraps(orig)
        def wrapper(self, optimizer, *args, **kwargs):
            out = orig(self, optimizer, *args, **kwargs)
            guard(fault, after_unscale_grads, self, optimizer, out)
            return out
        return wrapper

    for cls in subclasses(torch.amp.GradScaler):
        method = cls.__dict__.get("_unscale_grads_")
        if method is not None and not wrapped_for(method, after_unscale_grads):
            patches.add(Patch(cls, "_unscale_grads_", make, after_unscale_grads))


def patch_backward(patches: PatchSet, fault: Fault, before_backward: Callable[[Any], None]) -> None:
    """See every backward pass: ``Tensor.backward`` goes through ``torch.autograd.backward``
    (``before_backward(tensors)``)."""

    def make(orig):
        @functools.wraps(orig)
        def wrapper(tensors, *args, **kwargs):
            guard(fault, before_backward, tensors)
            return orig(tensors, *args, **kwargs)
        return wrapper

    patches.add(Patch(torch.autograd, "backward", make))


def patch_autograd_grad(patches: PatchSet, fault: Fault,
                        after_autograd_grad: Callable[[Any, bool], None],
                        on_get_scale: Callable[[Any], None]) -> None:
    """See ``torch.autograd.grad`` (``after_autograd_grad(outputs, create_graph)``: a
    gradient penalty takes it of the scaled loss) and ``GradScaler.get_scale``
    (``on_get_scale(scaler)``: what the AMP docs unscale that penalty's gradients with)."""

    def grad(orig):
        @functools.wraps(orig)
        def wrapper(outputs, *args, **kwargs):
            out = orig(outputs, *args, **kwargs)
            # grad(outputs, inputs, grad_outputs, retain_graph, create_graph, ...)
            create_graph = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
            guard(fault, after_autograd_grad, outputs, bool(create_graph))
            return out
        return wrapper

    def get_scale(orig):
        @functools.wraps(orig)
        def wrapper(self):
            guard(fault, on_get_scale, self)
            return orig(self)
        return wrapper

    patches.add(Patch(torch.autograd, "grad", grad))
    for cls in subclasses(torch.amp.GradScaler):
        if "get_scale" in cls.__dict__ and \
                not wrapped_for(cls.__dict__["get_scale"], on_get_scale):
            patches.add(Patch(cls, "get_scale", get_scale, on_get_scale))


def hook_optimizers(patches: PatchSet, fault: Fault, before_optimizer_step: OptimizerCall,
                    after_optimizer_step: Optional[OptimizerCall],
                    compiled_steps: Optional[list] = None) -> None:
    """Global optimizer step pre/post hooks (every optimizer, including ones made later):
    ``before_optimizer_step(optimizer)``, ``after_optimizer_step(optimizer)``.

    ``optimizer.step(closure)`` computes the gradients inside the step: the pre-step work then
    runs when the closure returns (once, however often the optimizer calls it), not before.
    An optimizer step inside a compiled region (``torch.compile`` around ``optimizer.step()``)
    runs its hooks as dynamo traces them, where the listener may do nothing: the post hook
    then only appends the optimizer to ``compiled_steps``, a list mutation dynamo replays
    after the compiled call, for the listener to take up at its next eager hook.
    """

    def pre(optimizer, args, kwargs):
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure) or _compiling():
            guard(fault, before_optimizer_step, optimizer)
            return None
        wrapped = _after_closure(closure, fault, before_optimizer_step, optimizer)
        if "closure" in kwargs:
            return args, dict(kwargs, closure=wrapped)
        return (wrapped,) + tuple(args[1:]), kwargs

    def post(optimizer, args, kwargs):
        if _compiling():
            if compiled_steps is not None:
                compiled_steps.append(optimizer)
            return
        guard(fault, after_optimizer_step, optimizer)

    patches.add(optimizer_hooks.register_optimizer_step_pre_hook(pre))
    patches.add(optimizer_hooks.register_optimizer_step_post_hook(post))


def patch_zero_grad(patches: PatchSet, fault: Fault, before_zero_grad: OptimizerCall,
                    before_module_zero_grad: Callable[[torch.nn.Module], None]) -> None:
    """See ``Optimizer.zero_grad`` (``before_zero_grad(optimizer)``), on the base class and on
    subclasses that override it, and ``Module.zero_grad`` (``before_module_zero_grad(module)``)."""

    def make(orig):
        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            guard(fault, before_zero_grad, self)
            return orig(self, *args, **kwargs)
        return wrapper

    for cls in subclasses(torch.optim.Optimizer):
        if "zero_grad" in cls.__dict__:
            patches.add(Patch(cls, "zero_grad", make))

    def make_module(orig):
        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            guard(fault, before_module_zero_grad, self)
            return orig(self, *args, **kwargs)
        return wrapper

    patches.add(Patch(torch.nn.Module, "zero_grad", make_module))


def _after_closure(closure: Callable, fault: Fault, before_optimizer_step: OptimizerCall,
                   optimizer: Any) -> Callable:
    """``closure`` that tells ``before_optimizer_step``, after its first call, that the step
    begins."""
    done = []

    @functools.wraps(closure)
    def wrapper(*args, **kwargs):
        out = closure(*args, **kwargs)
        if not done:
            done.append(True)
            guard(fault, before_optimizer_step, optimizer)
        return out
    return wrapper


def scheduler_classes() -> list[type]:
    """torch's LRScheduler and every subclass of it defined so far (the user's included)."""
    return subclasses(torch.optim.lr_scheduler.LRScheduler)


def patch_schedulers(patches: PatchSet, fault: Fault,
                     before_scheduler_step: Callable[[Any], None]) -> None:
    """See every ``LRScheduler.step`` (``before_scheduler_step(scheduler)``), on the
    base class and on subclasses that override ``step`` (ReduceLROnPlateau, SequentialLR...).
    Used by ``ampdoctor.testing.check_amp_step`` and by the recorder (``schedules.py``)."""

    def make(orig):
        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            guard(fault, before_scheduler_step, self)
            return orig(self, *args, **kwargs)
        return wrapper

    for cls in scheduler_classes():
        if "step" in cls.__dict__:
            patches.add(Patch(cls, "step", make))


class _Switch:
    """A flag a wrapper reads at each call, turned off on ``remove``: a wrapper a user imported
    by name while recording (``from torch.nn.functional import cross_entropy``) outlives its
    patch, and must do nothing of ours then."""

    def __init__(self) -> None:
        self.on = True

    def remove(self) -> None:
        self.on = False


def patch_losses(patches: PatchSet, fault: Fault, after_loss: Callable[..., None],
                 names: tuple) -> None:
    """See the loss functions ``names`` of ``torch.nn.functional`` (``after_loss(name,
    original, args, kwargs, result)``, after the call; a loss computed inside another one is
    not told again). TorchScript still compiles the original: the wrapper carries the
    original's globals, and its source is found through ``__wrapped__``."""
    switch = patches.add(_Switch())
    depth = [0]

    def make(_orig: Callable, _name: str) -> Callable:
        # Only closure variables, no globals: the wrapper runs with the original's globals
        # (torch.jit.script compiles the original's source, found through __wrapped__, and
        # resolves its names there). Their names start with _loss_ so as never to shadow one
        # of that source's.
        _loss_switch, _loss_depth, _loss_fault, _loss_call = switch, depth, fault, after_loss
        _loss_guard, _loss_compiling = guard, _compiling

        def _wrapper(*args, **kwargs):
            if _loss_compiling() or not _loss_switch.on or _loss_depth[0]:
                return _orig(*args, **kwargs)
            _loss_depth[0] += 1
            try:
                out = _orig(*args, **kwargs)
            finally:
                _loss_depth[0] -= 1
            _loss_guard(_loss_fault, _loss_call, _name, _orig, args, kwargs, out)
            return out

        wrapper = types.FunctionType(_wrapper.__code__, _orig.__globals__, _orig.__name__,
                                     None, _wrapper.__closure__)
        return functools.update_wrapper(wrapper, _orig)

    for name in names:
        orig = getattr(functional, name, None)
        if callable(orig) and not wrapped_for(orig, after_loss):
            patches.add(Patch(functional, name, functools.partial(make, _name=name),
                              after_loss))
