"""The module-call hooks: the model found (discovery), each root's own forward hooks, and
``module.compile()``'d roots seen through an eager shim.

``root_pre`` is a step's first hook: the autocast state, the batch (the sampled tier, the
forensic capture); a step taken inside a compiled region is told there at the latest. A
module that raises while the model is discovered (no optimizer seen training it yet) is
skipped, not the recording (``StepFlow.skip``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .optimizerhooks import OptimizerHooks
from .stepflow import StepFlow


class ModuleHooks:
    """The module-call callbacks of one recorder."""

    def __init__(self, flow: StepFlow, optimizer: OptimizerHooks):
        self.flow = flow
        self.optimizer = optimizer

    # -- discovery ----------------------------------------------------------------------------

    def discover_pre(self, module: torch.nn.Module, args: tuple) -> None:
        """First step of a recorder given no model: the outermost module called with grad
        enabled that owns trainable parameters becomes a root (``RootDiscovery.enter``). A module
        whose recording fails here is skipped, not the recording (``StepFlow.skip``)."""
        try:
            if self.flow.watched.discovery.enter(module, self.flow.log.step, args):
                self._discovered(module, args, {})
        except Exception as exc:  # noqa: BLE001 - one module's failure is not the run's
            self.flow.skip(module, "discover_pre", exc)

    def discover_post(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        self.flow.watched.discovery.leave(module)

    def _discovered(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A root adopted in its own call: this call is seen from here."""
        self.flow.engines.attach(self.flow.patches)  # (an engine's backward comes next)
        self.flow.sampled.maybe_sample()  # the first step is sampled, as with a model given
        self.root_pre(module, args, kwargs)  # to watch()

    # -- module.compile() ---------------------------------------------------------------------

    def on_module_compile(self, module: torch.nn.Module) -> None:
        """``module.compile()``: its calls (hooks included) are compiled from now on, so the
        recorder sees them through an eager shim."""
        self.flow.watched.on_module_compile(module)

    def compiled_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a ``module.compile()``'d call (its forward pre-hooks would be compiled)."""
        watched = self.flow.watched
        if self.flow.replaying():
            return
        if id(module) in watched.root_ids:
            self.root_pre(module, args, kwargs)
        elif watched.discovery.may_adopt(module, args) and watched.discovery.adopt(module):
            self._discovered(module, args, kwargs)

    def compiled_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if id(module) not in self.flow.watched.root_ids or self.flow.replaying():
            return
        sampler = self.flow.sampled.sampler
        if self.flow.log.step.sampled and sampler is not None and sampler.active:
            sampler.on_forward(module, output, args)
        self.root_post(module, args, output)

    # -- a root's own hooks -------------------------------------------------------------------

    def root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) not in self.flow.watched.root_ids or self.flow.replaying():
            return  # a copy of a root that kept our hooks (not copied by deepcopy): not it
        try:
            self._root_pre(module, args, kwargs)
        except Exception as exc:
            if not self.flow.watched.discovery.open:
                raise
            # a root no optimizer was seen training yet: skipped, the recording goes on
            self.flow.skip(module, "root_pre", exc)

    def _root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        flow = self.flow
        if flow.compiled_steps and torch.is_grad_enabled():
            self.optimizer.catch_up()
        if flow.skips.undecided is not None and torch.is_grad_enabled():
            flow.skips.settle()  # before this forward allocates, or changes a BatchNorm buffer
        if torch.is_grad_enabled():  # an evaluation call says nothing of the training dtype
            flow.watched.autocast.note(flow.log.step)
        sampler = flow.sampler_on(flow.log.step)
        if sampler is not None:
            sampler.on_inputs(flow.watched.names.get(module, ""), args, kwargs)
        forensics = flow.capturing()
        if forensics is not None:
            forensics.capture.inputs(module, args, kwargs)
        flow.sampled.enter_root(module)  # last: ours is done

    def root_post(self, module: torch.nn.Module, args: tuple, output: Any,
                  kwargs: Optional[dict] = None) -> None:
        flow = self.flow
        if id(module) not in flow.watched.root_ids:
            return
        if flow.watched.discovery.ends_call(module) and flow.forensics is not None and kwargs:
            flow.forensics.capture.kwargs(module, kwargs)
        forensics = flow.capturing()
        if forensics is not None:
            forensics.capture.output(module, output)
