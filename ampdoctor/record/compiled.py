"""What ``torch.compile`` changes for the recorder: where the compiled regions are, and how to
stay out of them.

A model reaches dynamo in three ways, and each moves the line between eager Python (where the
recorder's hooks may run) and the compiled region (which they must never enter):

* ``torch.compile(model)``, an ``OptimizedModule``: the wrapper's own hooks, and those of the
  module it wraps, run eagerly; everything the wrapped ``forward`` calls is compiled;
* ``model.forward = torch.compile(model.forward)``: the module's hooks run eagerly, its
  submodules' inside the compiled region;
* ``model.compile()``: the module's whole ``__call__``, its own hooks included, is compiled;
  the recorder sees the call through a shim on ``_compiled_call_impl`` (``patches``).

A hook traced by dynamo would be compiled into the graph, break it, or crash the trace (the
recorder's Python state is not traceable), and merely *having* global module hooks while a
region is traced makes dynamo guard on them, so that removing them later recompiles. So with a
compiled model the recorder installs no global module hook: discovery ends at the root, and
sampled steps hook only the modules that run eagerly (``eager_modules``). Module outputs inside
a compiled region are not measured; gradients, weights, the loss and forensic replays (run
eagerly, ``eager``) are. Every hook body also returns at once when dynamo traces it
(``patches.guard``), so one that is reached anyway adds nothing to the graph.

Example::

    parts = compiled.regions(model)       # [('', 'wrapper')] for torch.compile(model)
    with compiled.eager():                # compiled code runs as plain eager PyTorch
        model(x)
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, Iterator, Optional

import torch

WRAPPER = "wrapper"  # an OptimizedModule: torch.compile(module)
FORWARD = "forward"  # an instance whose forward attribute is a compiled function
CALL = "call"  # module.compile(): its __call__ is compiled, hooks included


def is_compiled_function(fn: Any) -> bool:
    """Is ``fn`` what ``torch.compile`` returned for a function or method?"""
    return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")


def kind(module: torch.nn.Module) -> Optional[str]:
    """How ``module`` itself is compiled: WRAPPER, FORWARD, CALL, or None."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        return WRAPPER
    call = module.__dict__.get("_compiled_call_impl")
    if call is not None:
        return CALL
    if is_compiled_function(module.__dict__.get("forward")):
        return FORWARD
    return None


def regions(root: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, kind) of every compiled module under ``root``, ``root`` itself included ('')."""
    return [(name, k) for name, m in root.named_modules() for k in [kind(m)] if k is not None]


def eager_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules under ``root`` whose forward hooks run eagerly: outside every compiled
    region, or the edge of one (an ``OptimizedModule``, a module with a compiled forward)."""
    out: list[torch.nn.Module] = []
    todo = [root]
    while todo:
        m = todo.pop()
        k = kind(m)
        if k == CALL:
            continue  # its own hooks are compiled with it
        out.append(m)
        if k is None:
            todo.extend(reversed(list(m.children())))
    return out


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled functions and modules as plain eager code inside the block (forensic
    replays: instrumented with hooks, and never a recompile). A no-op where torch has no
    ``torch.compiler.set_stance`` (before 2.6)."""
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None:
        yield
        return
    with stance("force_eager"):
        yield


# OptimizedModule.__call__ warns whenever global module hooks exist; the recorder's own hooks
# (first step only) are looked through, so that warning is not the user's to read.
_GLOBAL_HOOK_WARNING = re.escape("Using `torch.compile(module)` when there are global hooks")


class QuietGlobalHookWarning:
    """While it is installed, torch's warning about global hooks on a compiled module is not
    shown. ``remove()`` puts the display back (safe to call twice).

    It screens what ``warnings.showwarning`` is handed instead of adding a filter: adding or
    removing a filter resets every module's once-only warning memory, so the user's own
    warnings (a DataLoader's, shown once) would print a second time after recording began.
    """

    def __init__(self) -> None:
        self._shown = warnings.showwarning
        previous = self._shown

        def screened(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, UserWarning) and re.match(_GLOBAL_HOOK_WARNING,
                                                              str(message)):
                return None
            return previous(message, category, filename, lineno, file, line)

        self._screen: Optional[Any] = screened
        warnings.showwarning = screened

    def remove(self) -> None:
        if self._screen is None:
            return
        if warnings.showwarning is self._screen:  # (someone who replaced it since keeps theirs)
            warnings.showwarning = self._shown
        self._screen = None
