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

Why one module: it is the one place that changes torch's globals (the doors listed above), so
that every change is read, undone and audited in one file; ``tests/record/test_host_reads.py``
exempts exactly this file from ampdoctor's host reads, its wrappers calling only the user's
own GradScaler and clip functions. Each door's wrapper is short; split by door, the one list
of what ampdoctor patches would be scattered.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as functional
import torch.nn.modules.module as module_hooks
import torch.nn.utils.clip_grad as clip_grad
import torch.optim.optimizer as optimizer_hooks

from .listener import (
    AfterClip,
    BeforeClip,
    Fault,
    ModelDoor,
    ModulePost,
    ModulePre,
    OptimizerCall,
    ScalerDoor,
)

_MARK = "__ampdoctor_original__"
_LISTENER = "__ampdoctor_listener__"
_OURS = "__ampdoctor_hook__"  # on a hook function of ours that a module holds
_compiling = torch.compiler.is_compiling


class Patch:
    """One attribute of ``owner`` replaced by ``wrapper``; ``remove`` puts the original back."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable], Callable],
                 listener: Any = None):
        self.owner = owner
        self.name = name
        self.original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        self.wrapper = make(self.original)
        setattr(self.wrapper, _MARK, self.original)
        setattr(self.wrapper, _LISTENER, listener)
        setattr(owner, name, self.wrapper)

    def remove(self) -> None:
        if self.owner is None:
            return
        if getattr(self.owner, self.name, None) is self.wrapper:
            setattr(self.owner, self.name, self.original)
        self.owner = None


class _Entry:
    """A key of a dict, deleted on ``remove`` (if still there)."""

    def __init__(self, table: dict, key: Any):
        self.table, self.key = table, key

    def remove(self) -> None:
        self.table.pop(self.key, None)


class PatchSet:
    """Patches and hook handles that go away together. A context manager."""

    def __init__(self) -> None:
        self._items: list[Any] = []

    def add(self, item: Any) -> Any:
        self._items.append(item)
        return item

    def remove(self) -> None:
        while self._items:
            self._items.pop().remove()

    def __enter__(self) -> "PatchSet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def guard(fault: Fault, fn: Optional[Callable[..., Any]], *args: Any) -> Any:
    """Call ``fn(*args)`` (nothing when ``fn`` is None); an exception goes to ``fault(exc,
    fn.__name__)``, not the caller.

    Under dynamo's tracing ``is_compiling()`` is a constant True: the call is left out of the
    graph (no graph break, nothing traced of the recorder's state).
    """
    if fn is None or _compiling():
        return None
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a debugger must never break the run it watches
        fault(exc, getattr(fn, "__name__", type(fn).__name__))
        return None


def subclasses(base: type) -> list[type]:
    """``base`` and every subclass of it defined so far, at any depth (the user's included),
    each once: the classes whose own methods a patch on ``base`` must wrap too."""
    classes, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes.append(cls)
            todo.extend(cls.__subclasses__())
    return classes


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
            if name in cls.__dict__ and not _wrapped_for(cls.__dict__[name], door):
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
        if method is not None and not _wrapped_for(method, after_unscale_grads):
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


# The clip functions and how each is seen: ``clip_grad_norm_`` computes the norm and clips;
# the split API of torch >= 2.6 (accelerate >= 1.16, torchtitan) computes it with
# ``get_total_norm`` and hands it to ``clip_grads_with_norm_``, whose ``total_norm`` is the
# pre-clip norm; ``clip_grad_value_`` and timm's adaptive clipping (``adaptive_clip_grad``,
# ``--clip-mode agc``) clip each element or parameter and return no norm. Each name maps to
# its arguments after ``parameters``.
CLIPS = {
    "clip_grad_norm_": ("max_norm", "norm_type", "error_if_nonfinite", "foreach"),
    "clip_grads_with_norm_": ("max_norm", "total_norm", "foreach"),
    "clip_grad_value_": ("clip_value", "foreach"),
    "adaptive_clip_grad": ("clip_factor", "eps", "norm_type"),
}
# clips of other libraries, by the modules that hold them once those are imported
LIBRARY_CLIPS = {"adaptive_clip_grad": ("timm.utils.agc", "timm.utils.clip_grad", "timm.utils")}


def _clip_maker(fault: Fault, before_clip: BeforeClip,
                after_clip: AfterClip) -> Callable[[Callable, str], Callable]:
    """``make(orig, name)``: a clip's wrapper, telling ``listener`` the parameters and the
    call's settings before it (``before_clip``), the pre-clip norm after it (``after_clip``:
    ``clip_grad_norm_``'s result, the ``total_norm`` handed to ``clip_grads_with_norm_``). A
    clip called inside another (torch versions whose ``clip_grad_norm_`` calls the public
    split functions, a library's clip built on torch's) is the outer one's, told once."""
    depth = [0]

    def make(orig: Callable, name: str) -> Callable:
        @functools.wraps(orig)
        def wrapper(parameters, *args, **kwargs):
            if depth[0] or _compiling():
                return orig(parameters, *args, **kwargs)
            if not isinstance(parameters, torch.Tensor):
                parameters = list(parameters)  # a generator can be read only once
            given = clip_args(name, args, kwargs)
            guard(fault, before_clip, parameters, clip_config(name, given))
            depth[0] += 1
            try:
                out = orig(parameters, *args, **kwargs)
            finally:
                depth[0] -= 1
            total = {"clip_grad_norm_": out, "clip_grads_with_norm_": given.get("total_norm")}
            guard(fault, after_clip, total.get(name), False)  # (the others: no norm)
            return out
        return wrapper
    return make


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
                not _wrapped_for(cls.__dict__["get_scale"], on_get_scale):
            patches.add(Patch(cls, "get_scale", get_scale, on_get_scale))


def patch_clip(patches: PatchSet, fault: Fault, before_clip: BeforeClip,
               after_clip: AfterClip) -> Callable[[Callable, str], Callable]:
    """See every clip of ``torch.nn.utils`` (``CLIPS``), patched in
    ``torch.nn.utils.clip_grad`` and under the same name in ``torch.nn.utils``. Returns the
    wrapper maker, for ``patch_library_clips``."""
    make = _clip_maker(fault, before_clip, after_clip)
    for name in CLIPS:
        public = getattr(torch.nn.utils, name, None)
        if public is None:  # (the split API is torch >= 2.6; adaptive_clip_grad is timm's)
            continue
        inner = None  # torch 2.13 keeps the split API private there: clip_grad_norm_'s own
        if name in clip_grad.__dict__:
            inner = patches.add(Patch(clip_grad, name, _named(make, name)))
        if inner is not None and public is inner.original:
            patches.add(Patch(torch.nn.utils, name, _same(inner.wrapper)))
        else:
            patches.add(Patch(torch.nn.utils, name, _named(make, name)))
    return make


def patch_library_clips(patches: PatchSet, make: Callable[[Callable, str], Callable]) -> None:
    """See the clips of ``LIBRARY_CLIPS`` in the modules already imported (called again
    when a run's first loss is seen: a training script imports its libraries first). A
    function held under several names is wrapped once, and each name gets that wrapper.
    ``make``: ``patch_clip``'s wrapper maker (what marks a function wrapped already)."""
    for name, modules in LIBRARY_CLIPS.items():
        made: dict[int, Callable] = {}
        for module_name in modules:
            module = sys.modules.get(module_name)
            fn = getattr(module, name, None) if module is not None else None
            if not callable(fn) or _wrapped_for(fn, make):
                continue
            wrapper = made.get(id(fn))
            if wrapper is None:
                patch = patches.add(Patch(module, name, _named(make, name), make))
                made[id(fn)] = patch.wrapper
            else:
                patches.add(Patch(module, name, _same(wrapper), make))


def _named(make: Callable[[Callable, str], Callable], name: str) -> Callable[[Callable], Callable]:
    """A ``Patch`` maker: ``make``'s wrapper for the clip ``name``."""
    return lambda orig: make(orig, name)


def _same(wrapper: Callable) -> Callable[[Callable], Callable]:
    """A ``Patch`` maker that puts an existing wrapper under a second name."""
    return lambda _orig: wrapper


def clip_args(name: str, args: tuple, kwargs: dict) -> dict:
    """A clip's arguments after ``parameters``, by name (``CLIPS``)."""
    names = CLIPS[name]
    given = dict(zip(names, args))
    given.update((k, kwargs[k]) for k in names if k in kwargs)
    return given


def clip_config(name: str, given: dict) -> dict:
    """What /meta ``clip`` keeps of a call: the function, max_norm (or clip_value), norm_type
    and foreach as called. A tensor argument is recorded as "tensor": reading its value would
    be a host sync."""
    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return "tensor"
        return value if value is None or isinstance(value, (bool, int, float, str)) else \
            str(value)

    config = {"how": name, "max_norm": plain(given.get("max_norm")),
              "norm_type": plain(given.get("norm_type", 2.0)),
              "foreach": plain(given.get("foreach"))}
    if name == "clip_grads_with_norm_":  # the norm's type is get_total_norm's, not seen here
        config["norm_type"] = None
    if name == "clip_grad_value_":
        config.update(max_norm=None, norm_type=None, clip_value=plain(given.get("clip_value")))
    if name == "adaptive_clip_grad":  # timm's default factor is 0.01
        config.update(max_norm=None, clip_factor=plain(given.get("clip_factor", 0.01)))
    return config


def patch_clip_method(patches: PatchSet, fault: Fault, before_clip: BeforeClip,
                      after_clip: AfterClip, cls: Optional[type]) -> None:
    """See a wrapper's own ``clip_grad_norm_`` method (FSDP1's, which combines the shards
    with a collective): ``after_clip`` is told the norm it returns is global."""
    if cls is None or "clip_grad_norm_" not in cls.__dict__:
        return

    def make(orig):
        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            config = clip_config("clip_grad_norm_", clip_args("clip_grad_norm_", args, kwargs))
            guard(fault, before_clip, list(self.parameters()), config)
            out = orig(self, *args, **kwargs)
            guard(fault, after_clip, out, True)
            return out
        return wrapper

    patches.add(Patch(cls, "clip_grad_norm_", make))


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


def hook_modules(patches: PatchSet, fault: Fault, pre: Optional[ModulePre],
                 post: Optional[Callable[..., None]], post_kwargs: bool = False) -> None:
    """Global forward (pre-)hooks on every module; used only while discovering or sampling.

    ``post_kwargs``: the post-hook also gets the call's kwargs (``post(module, args, kwargs,
    output)``) and runs even when the forward raises, so that call depth stays balanced.
    """
    if pre is not None:
        def pre_hook(module, args):
            guard(fault, pre, module, args)
        patches.add(module_hooks.register_module_forward_pre_hook(pre_hook))
    if post is not None and post_kwargs:
        def post_kw_hook(module, args, kwargs, output):
            guard(fault, post, module, args, kwargs, output)
        handle = patches.add(module_hooks.register_module_forward_hook(
            post_kw_hook, with_kwargs=True, always_call=True))
        # torch's handle forgets its with_kwargs mark, which would leave torch believing a
        # global hook exists (torch.compile'd modules then warn on every call): ours goes too.
        patches.add(_Entry(module_hooks._global_forward_hooks_with_kwargs, handle.id))
    elif post is not None:
        def post_hook(module, args, output):
            guard(fault, post, module, args, output)
        patches.add(module_hooks.register_module_forward_hook(post_hook))


def hook_module_calls(patches: PatchSet, fault: Fault, pre: ModulePre,
                      post: ModulePost) -> None:
    """Global forward pre-hook and hook on every module, the hook run even when the forward
    raises (``always_call``): a call opened by ``pre`` is always closed by ``post`` (the
    sampled step's op probe, ``opprobe.StepProbe``, keeps the calls open on a stack)."""
    def pre_hook(module, args):
        guard(fault, pre, module, args)

    def post_hook(module, args, output):
        guard(fault, post, module, args, output)
    patches.add(module_hooks.register_module_forward_pre_hook(pre_hook))
    patches.add(module_hooks.register_module_forward_hook(post_hook, always_call=True))


def _wrapped_for(fn: Any, key: Any) -> bool:
    """Is ``key`` (the door or callback a wrapper was made for) already behind ``fn`` (a chain
    of wrappers made here)? A bound method is made anew at each access: compared by ``==``."""
    while hasattr(fn, _MARK):
        mark = getattr(fn, _LISTENER, None)
        if mark is not None and mark == key:
            return True
        fn = getattr(fn, _MARK)
    return False


def patch_module_compile(patches: PatchSet, fault: Fault,
                         on_module_compile: Callable[[torch.nn.Module], None]) -> None:
    """See modules compiled in place (``module.compile()``): their calls go through
    ``shim_compiled_call``, made by ``on_module_compile(module)``."""

    def make(orig):
        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            guard(fault, on_module_compile, self)
            return out
        return wrapper

    patches.add(Patch(torch.nn.Module, "compile", make))


def hook_root(patches: PatchSet, door: ModelDoor, root: torch.nn.Module) -> None:
    """The root's forward pre-hook and hook (``root_pre``, ``root_post``, kwargs included),
    marked as ours: a copy or a pickle of the root leaves them behind (``patch_module_state``)."""
    def pre(module, args, kwargs):
        return guard(door.fault, door.root_pre, module, args, kwargs)

    def post(module, args, kwargs, output):
        return guard(door.fault, door.root_post, module, args, output, kwargs)

    for fn in (pre, post):
        setattr(fn, _OURS, True)
    patches.add(root.register_forward_pre_hook(pre, with_kwargs=True))
    patches.add(root.register_forward_hook(post, with_kwargs=True))


def patch_module_state(patches: PatchSet) -> None:
    """``Module.__getstate__``, what ``copy.deepcopy``, ``copy.copy`` and pickle (``torch.save``)
    read: a module carrying ``hook_root``'s hooks gives its state without them, so that an EMA
    or evaluation copy is not recorded as the model, and the model still pickles (a local
    function would not)."""
    def make(orig):
        @functools.wraps(orig)
        def wrapper(self):
            state = orig(self)
            try:
                return _without_our_hooks(state)
            except Exception:  # noqa: BLE001 - the state as torch gives it, then
                return state
        return wrapper

    patches.add(Patch(torch.nn.Module, "__getstate__", make))


# The hook tables of a module (by hook id), and the sets of ids that mark a hook's kind.
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_MARKS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def _without_our_hooks(state: Any) -> Any:
    """A module's state (a shallow copy of its ``__dict__``) less ``hook_root``'s hooks: the
    tables are new dicts, the module's own are left as they are."""
    if not isinstance(state, dict):
        return state
    ours = {key for name in _HOOK_TABLES for key, fn in (state.get(name) or {}).items()
            if getattr(fn, _OURS, False)}
    if not ours:
        return state
    state = dict(state)
    for name in _HOOK_TABLES + _HOOK_MARKS:
        table = state.get(name)
        if isinstance(table, dict):
            state[name] = type(table)((k, v) for k, v in table.items() if k not in ours)
    return state


def shim_compiled_call(patches: PatchSet, door: ModelDoor, module: torch.nn.Module) -> None:
    """Call ``module``'s compiled ``__call__`` (``module.compile()``) through an eager shim that
    tells ``door`` before and after (``compiled_pre``/``compiled_post``), as a forward
    pre-hook and hook would, outside the compiled region. Undone with ``patches``."""

    def make(compiled):
        @functools.wraps(compiled)
        def shim(*args, **kwargs):
            guard(door.fault, door.compiled_pre, module, args, kwargs)
            out = compiled(*args, **kwargs)
            guard(door.fault, door.compiled_post, module, args, out)
            return out
        return shim

    if module.__dict__.get("_compiled_call_impl") is not None and \
            getattr(module._compiled_call_impl, _MARK, None) is None:
        patches.add(Patch(module, "_compiled_call_impl", make))


def original(fn: Any) -> Any:
    """The unpatched function behind a wrapper made here (or ``fn`` itself)."""
    return getattr(fn, _MARK, fn)


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
        if callable(orig) and not _wrapped_for(orig, after_loss):
            patches.add(Patch(functional, name, functools.partial(make, _name=name),
                              after_loss))
