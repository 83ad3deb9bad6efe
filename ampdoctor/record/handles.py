"""The script's own names for the recorded modules, so that a fix's snippet runs against them.

A snippet says ``model.blocks[0].attn = FP32Island(model.blocks[0].attn)``; ``model`` must be
what the script calls that module. The recorder names modules from the root it hooked (a DDP
wrapper, a timm task around the network, a LightningModule, two roots of a GAN), which is not
always the object the script holds. So once, at the end of the first step, the recorder looks
at the frames of the code that is training (the user's loop: every frame outside torch,
ampdoctor and installed packages, innermost first) for locals and globals whose value is a
recorded module or a wrapper around a root, and keeps {recorded path: expression}::

    {"": "model.module"}              # model = DDP(net): the root's names hang off .module
    {"trainable_module": "model"}     # model is the network inside timm's training task
    {"Generator": "netG", "Discriminator": "netD"}

in /meta ``handles``. Names only: no reference to a frame or a value outlives the call.
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import types
from typing import Any, Iterator, Optional

import torch

from . import torchcompat

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {_PACKAGE, _TORCH}
    found.update(os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib",
                                                      "platlib") if paths.get(k))
    return tuple(sorted(found))


def find(roots: list[torch.nn.Module], prefixes: list[str],
         names: dict[torch.nn.Module, str], frame: Optional[types.FrameType]) -> dict[str, str]:
    """{recorded path: the script's expression} from ``frame`` and the frames below it.

    ``prefixes``: each root's prefix in the recorded names ("" for a single root); ``names``:
    the recorded name of every module (``Watched.names``)."""
    targets = _targets(roots, prefixes, names)
    found: dict[str, str] = {}
    for var, value in _user_names(frame):
        expr, hit = var, targets.get(id(value))
        for _ in range(4):  # a wrapper the script made around a root (DDP(model))
            attr = None if hit is not None else _inner_attr(value)
            if attr is None:
                break
            expr, value = f"{expr}.{attr}", getattr(value, attr)
            hit = targets.get(id(value))
        if hit is not None and hit[0] not in found:
            found[hit[0]] = expr + hit[1]
    return found


def held(modules: list[torch.nn.Module], frame: Optional[types.FrameType]) -> dict[int, str]:
    """{id(module): the variable the script holds it in} for ``modules`` (innermost first)."""
    wanted = {id(m) for m in modules}
    found: dict[int, str] = {}
    for var, value in _user_names(frame):
        if id(value) in wanted and "." not in var:
            found.setdefault(id(value), var)
    return found


def stray_names(wanted: set[int], skip: set[int],
                frame: Optional[types.FrameType]) -> dict[int, str]:
    """{id(parameter): "<variable>.<parameter path>"} for the parameters in ``wanted`` owned
    by a module the script holds in ``frame`` or the frames below it (the modules in
    ``skip``, already named, left out): a GAN's generator never adopted, ``gen.0.weight``."""
    found: dict[int, str] = {}
    for var, value in _user_names(frame):
        if not isinstance(value, torch.nn.Module) or id(value) in skip:
            continue
        for name, p in value.named_parameters():
            if id(p) in wanted and id(p) not in found:
                found[id(p)] = f"{var}.{name}"
        if len(found) == len(wanted):
            break
    return found


def _targets(roots: list[torch.nn.Module], prefixes: list[str],
             names: dict[torch.nn.Module, str]) -> dict[int, tuple[str, str]]:
    """id(object) -> (recorded path, the attributes from it to that path's module): a root
    through each of its wrappers (``.module`` of DDP/FSDP1, ``._orig_mod`` of a compiled
    module), and every named submodule."""
    targets: dict[int, tuple[str, str]] = {}
    root_ids = {id(r) for r in roots}
    for m, name in names.items():
        if id(m) not in root_ids:
            targets.setdefault(id(m), (name, ""))
    for root, prefix in zip(roots, prefixes):
        path = prefix.rstrip(".")
        chain, obj = [], root
        while True:
            chain.append(obj)
            attr = _inner_attr(obj)
            if attr is None:
                break
            obj = getattr(obj, attr)
        inner = chain[-1]
        for i, obj in enumerate(chain):
            accessor = "".join("." + _inner_attr(o) for o in chain[i:-1])  # type: ignore
            targets[id(obj)] = (path, accessor)
        targets[id(inner)] = (path, "")
    return targets


def _inner_attr(module: Any) -> Optional[str]:
    """The attribute of a wrapper that holds the wrapped module (None: not a wrapper)."""
    inner = torchcompat.unwrap_once(module)
    if inner is None:
        return None
    return "_orig_mod" if getattr(module, "_orig_mod", None) is inner else "module"


def _user_names(frame: Optional[types.FrameType]) -> Iterator[tuple[str, Any]]:
    """(name, value) of the locals, then the globals, of each frame of the user's code,
    innermost first; ``self``'s attributes follow its frame's locals."""
    skip = _library_dirs()
    seen_globals: set[int] = set()
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not frame.f_code.co_filename.startswith("<frozen") and not filename.startswith(skip):
            local = _locals(frame)
            yield from _public(local)
            owner = local.get("self")
            if owner is not None and hasattr(owner, "__dict__"):
                yield from (("self." + k, v) for k, v in _public(vars(owner)))
            if id(frame.f_globals) not in seen_globals:
                seen_globals.add(id(frame.f_globals))
                yield from _public(dict(frame.f_globals))
        frame = frame.f_back


def _locals(frame: types.FrameType) -> dict:
    """A copy of a frame's locals. Before Python 3.13, ``f_locals`` of a function's frame is
    a snapshot the frame keeps until it returns: it would hold the step's tensors (the
    batch, the output) past the step, so it is emptied again (it holds copies only; the
    frame's own variables are untouched). From 3.13 it is a view that holds nothing."""
    local = frame.f_locals
    copied = dict(local)
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED and \
            local is not frame.f_globals:
        local.clear()
    return copied


def _public(scope: dict) -> Iterator[tuple[str, Any]]:
    for name, value in scope.items():
        if isinstance(name, str) and name.isidentifier() and not name.startswith("_") and \
                isinstance(value, torch.nn.Module):
            yield name, value


def here() -> Optional[types.FrameType]:
    """The caller's caller's frame: where ``find`` starts from inside a hook."""
    return sys._getframe(2)
