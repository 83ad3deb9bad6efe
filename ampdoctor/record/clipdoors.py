"""The clip doors of ``patches``: every clip of ``torch.nn.utils`` (``CLIPS``), the clips of
other libraries once imported (``LIBRARY_CLIPS``: timm's ``adaptive_clip_grad``) and a wrapper's
own ``clip_grad_norm_`` method (FSDP1's): the pre-clip norm and the call's settings.

Like ``patches``, its code only passes calls through: ``exits.RECORDING_CODE`` and
``tests/record/test_host_reads.py`` leave it out.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.utils.clip_grad as clip_grad

from .listener import AfterClip, BeforeClip, Fault
from .patching import Patch, PatchSet, guard, wrapped_for

_compiling = torch.compiler.is_compiling


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
            if not callable(fn) or wrapped_for(fn, make):
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
