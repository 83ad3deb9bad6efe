"""The module doors of ``patches``: global forward (pre-)hooks while discovering or sampling,
the roots' own hooks marked as ours and ``Module.__getstate__`` that leaves them out of a copy,
and ``Module.compile``, whose modules are called through an eager shim.

Like ``patches``, its code only passes calls through: ``exits.RECORDING_CODE`` and
``tests/record/test_host_reads.py`` leave it out.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.modules.module as module_hooks

from .listener import Fault, ModelDoor, ModulePost, ModulePre
from .patching import MARK, Entry, Patch, PatchSet, guard

_OURS = "__ampdoctor_hook__"  # on a hook function of ours that a module holds


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
        patches.add(Entry(module_hooks._global_forward_hooks_with_kwargs, handle.id))
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
            getattr(module._compiled_call_impl, MARK, None) is None:
        patches.add(Patch(module, "_compiled_call_impl", make))
