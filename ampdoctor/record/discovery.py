"""The first step's search for a watched model's roots, where ``watch()`` was given none.

Global module hooks (installed by ``start``, removed by ``finish``) see every call: the
outermost module called with grad enabled that owns trainable parameters (or carries the
gradient of a trained input) is adopted as a root before its forward runs, DDP/DataParallel
wrappers looked through. At the end of the first step only the roots an optimizer trains (or
whose master copies it trains: ``mirrors.py``) are kept (with the micro-batches only they ran).
Never adopted: a module run on meta or fake tensors, a module already left out because
recording it failed (``skip``). The roots themselves, their names and hooks, are the
``Watched``'s (``watched.py``), which adopts them.

Example::

    watched.discovery.start(door)                  # no model given to watch()
    watched.discovery.enter(module, step, args)    # True: adopted as a root by this call
    dropped = watched.discovery.finish()           # end of the first step
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from . import compiled, patches
from .listener import ModelDoor
from .sampler import tensors_in
from .steps import Step
from .torchcompat import is_wrapper, placeholder_call


class RootDiscovery:
    """The discovery of the roots of ``watched`` (a ``watched.Watched``): its hooks, the call
    depth, the roots adopted by it and the modules left out."""

    def __init__(self, watched: Any):
        self.w = watched
        self.depth = 0  # module calls open, while discovering
        self.open = False  # global module hooks looking for roots (first step)
        self._discovering: Optional[torch.nn.Module] = None  # root adopted in this very call
        self.by_input: set[int] = set()  # frozen roots adopted for a trained input's gradient
        self._hooked = False  # the global discovery hooks are installed
        self._hooks = patches.PatchSet()
        self.called: set[int] = set()  # roots called since the last backward (discovery)
        # modules whose recording failed while discovered: left out, the rest recorded
        self.left_out: weakref.WeakSet = weakref.WeakSet()
        self.left_out_why: list[dict] = []  # ... what each was and why (/meta skipped_modules)

    def start(self, door: ModelDoor) -> None:
        """Install the global module hooks that look for the roots."""
        self._hooks.add(compiled.QuietGlobalHookWarning())
        patches.hook_modules(self._hooks, door.fault, door.discover_pre,
                             door.discover_post, post_kwargs=True)
        self.open = self._hooked = True

    def remove(self) -> None:
        self._hooks.remove()

    def enter(self, module: torch.nn.Module, step: Step, args: tuple = ()) -> bool:
        """A module is called (discovery's global pre-hook): True when it is adopted as a root
        by this call, the outermost one called with grad enabled that owns trainable
        parameters (or carries the gradient of a trained input: ``adopt``).
        DDP/DataParallel wrappers are looked through: the module they wrap is the root, so
        that a forensic replay never runs the wrapper's collectives on one rank alone."""
        w = self.w
        if is_wrapper(module):
            w.replicas.saw(module)  # a DDP wrapper: which ranks hold its weights whole
            return False
        self.depth += 1
        if self.depth > 1:
            w.autocast.note_inner(step, bool(w.roots))
        if self.depth != 1:
            return False
        if module in w.names:
            if torch.is_grad_enabled():
                self.called.add(id(module))
            return False
        if not torch.is_grad_enabled() or module in self.left_out or \
                placeholder_call(module, tensors_in(args)):
            self._note_side(module, args)
            return False  # a copy on meta or fake tensors is measured, not trained
        adopted = self.adopt(module, args)
        if not adopted:
            self._note_side(module, args)
        return adopted

    def _note_side(self, module: torch.nn.Module, args: tuple) -> None:
        """A top-level call that adopts no root: a frozen model beside the trained one?
        (``buffers.SideModels``; a failure here only loses the side model)."""
        try:
            self.w.side.note(module, args)
        except Exception:
            pass

    def leave(self, module: torch.nn.Module) -> None:
        if not is_wrapper(module):
            self.depth = max(0, self.depth - 1)

    def may_adopt(self, module: torch.nn.Module, args: tuple = ()) -> bool:
        """Is this top-level call of a ``module.compile()``'d module a root to discover?"""
        return self.open and self.depth == 0 and module not in self.w.names and \
            torch.is_grad_enabled() and module not in self.left_out and \
            not placeholder_call(module, tensors_in(args))

    def adopt(self, module: torch.nn.Module, args: tuple = ()) -> bool:
        """A module called at the top with grad enabled becomes a root (unless it trains
        nothing); this call is seen by the caller, the root's own hooks see the next ones.
        A frozen or parameter-free module is adopted only when it carries the gradient of a
        trained input (``_carries_input_grad``)."""
        w = self.w
        if not any(p.requires_grad for p in module.parameters()):
            if not self._carries_input_grad(args):
                return False  # a loss module, a frozen model, a parameter-free transform
            self.by_input.add(id(module))
        before = w.roots
        w.root_hooks.remove()
        try:
            w.adopt_roots(before + [module])
        except Exception:
            w.readopt(before)  # as it was: the caller skips this module
            raise
        self.called.add(id(module))
        # A global pre-hook gets no kwargs: the root's own post-hook fills them in.
        self._discovering = module
        if w.regions and self._hooked:
            # Global hooks must not exist while a compiled region is traced: discovery ends
            # at this root (its own hooks run outside the compiled region).
            self._hooks.remove()
            self._hooked = False
        return True

    def _carries_input_grad(self, args: tuple) -> bool:
        """Is a frozen module's call the model of the run? Where the trained tensor is an
        input (neural style transfer's image, fed to a frozen extractor, then to a Gram
        matrix), the modules it flows through are all there is to replay: an input that is a
        leaf requiring grad and owned by no root, or one computed through a module adopted so
        already. ``finish`` keeps them only if an optimizer trains such a tensor."""
        grads = [t for t in tensors_in(args) if t.requires_grad]
        if any(not t.is_leaf for t in grads) and self.by_input:
            return True
        leaves = {id(t) for t in grads if t.is_leaf}
        return bool(leaves) and not leaves <= {id(p) for r in self.w.roots
                                                for p in r.parameters()}

    def ends_call(self, module: torch.nn.Module) -> bool:
        """The root's post-hook: True when this was the call that discovered it (its kwargs
        are known only now)."""
        if module is not self._discovering:
            return False
        self._discovering = None
        if not self._hooked:
            self.depth = 0  # nothing counted the calls inside it
        return True

    def skip(self, module: torch.nn.Module, where: str, exc: BaseException) -> None:
        """Recording ``module`` failed while it was being discovered: it is left out (and never
        tried again), named in /meta ``skipped_modules``; the rest is recorded. A root adopted
        from it is dropped, so a failure on a copy or a side model never stops the
        recording."""
        w = self.w
        self.left_out.add(module)
        self.left_out_why.append({"module": type(module).__name__, "where": where,
                                  "why": f"{type(exc).__name__}: {exc}"[:300]})
        w.journal.meta("skipped_modules", self.left_out_why)
        if module is self._discovering:
            self._discovering = None
        if any(r is module for r in w.roots):
            w.root_hooks.remove()
            w.readopt([r for r in w.roots if r is not module])

    def take_called(self) -> frozenset:
        """ids of the roots called (at the top, grad enabled) since the last time asked: a
        backward's, while discovering (``finish`` drops a root nothing trains, and the
        micro-batches that only it ran)."""
        called, self.called = frozenset(self.called), set()
        return called

    def finish(self) -> frozenset:
        """End of the first step (once its optimizers are known): keep the roots whose
        parameters an optimizer trains; the ids of those dropped (a model built, run and
        dropped before the real one)."""
        w = self.w
        self._hooks.remove()
        self.open = self._hooked = False
        self._discovering = None
        self.called = set()
        # (a master copy of a parameter trains that parameter: watched.py, mirrors.py)
        trained = {w.mirror_of.get(id(p), id(p)) for opt in w.optimizers
                   for g in opt.param_groups for p in g["params"]}
        keep = [m for m in w.roots if any(id(p) in trained for p in m.parameters())]
        owned = {id(p) for m in keep for p in m.parameters()}
        if trained - owned:  # an optimizer trains a tensor outside every model: an input
            keep = [m for m in w.roots if m in keep or id(m) in self.by_input]
        w.side.settle(keep or w.roots)
        if not (trained and keep):
            return frozenset()
        dropped = frozenset(id(m) for m in w.roots if m not in keep)
        # Named again when a root was dropped, or when a parameter it holds now is not the one
        # named (adopted inside torch.func.functional_call, whose tensors stood in for them).
        if dropped or any(id(p) not in w.param_names for m in keep for p in m.parameters()):
            w.root_hooks.remove()
            w.adopt_roots(keep)
        return dropped
