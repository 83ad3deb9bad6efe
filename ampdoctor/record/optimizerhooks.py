"""The optimizer and clip hooks: the optimizer step (the step's end without a scaler), the
clips of ``torch.nn.utils`` (the clip config, the pre-clip norm), ``zero_grad`` and the LR
schedulers.

In a step's order::

    before_clip / after_clip          the clip config, the pre-clip norm (every clip of
                                      torch.nn.utils, the split API's included)
    before_optimizer_step             gradients complete; the grad norm; the skip checked
    after_optimizer_step              the step ends (no scaler: the first optimizer seen)
    before_zero_grad                  a step taken inside a compiled region is told here at
                                      the latest (``catch_up``)
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..runfile.schema import Event, flag
from . import sharding
from .stepflow import StepFlow
from .torchcompat import scaler_enabled


class OptimizerHooks:
    """The optimizer, clip, zero_grad and scheduler callbacks of one recorder."""

    def __init__(self, flow: StepFlow):
        self.flow = flow
        self.clip_config: Optional[dict] = None  # the last clip's call, as last written

    # -- the optimizer step -------------------------------------------------------------------

    def before_optimizer_step(self, optimizer: Any) -> None:
        flow = self.flow
        watched, skips = flow.watched, flow.skips
        if flow.engines.stepping or not watched.owns(optimizer):  # (an engine's: its own)
            return
        skips.settle()
        if not flow.journal.created:
            flow.journal.create()
        st = flow.log.step
        scaler = watched.scaler
        if not st.scaled and watched.primary(optimizer):
            flow.settle_discovery()  # (this step ends the step)
        if st.scaled and not st.in_scaler_step:
            st.flags |= flag(Event.STEP_BYPASSES_SCALER)
            flow.journal.event(Event.STEP_BYPASSES_SCALER, st, text=type(optimizer).__name__)
        elif st.in_scaler_step and skips.armed and scaler_enabled(scaler):
            # A fused optimizer: GradScaler checked found_inf and syncs on nothing; the copy
            # is queued ahead of the fused step's kernels.
            skips.stage_found(scaler, optimizer)
        flow.grads.ready()
        flow.grads.ensure_norm()
        flow.objectives.norm(optimizer, st, scaler)
        flow.objectives.stepping(optimizer)
        if not st.scaled and watched.primary(optimizer):
            skips.check_before_step()
        elif st.in_scaler_step and skips.armed and scaler_enabled(scaler):
            skips.check_applied_loss()
        sampler = flow.sampler_on(st)
        if sampler is not None:
            sampler.before_step([(watched.param_name(p), p) for p in watched.trained_params()])
        forensics = flow.capturing()
        if forensics is not None and watched.primary(optimizer):
            forensics.lrrange.before_step(optimizer, st.index, self.clip_config)

    def after_optimizer_step(self, optimizer: Any) -> None:
        flow = self.flow
        if flow.engines.stepping or not flow.watched.owns(optimizer):
            return
        st = flow.log.step
        st.stepped = True
        st.bypassed = st.bypassed or not st.in_scaler_step
        flow.watched.stepped(optimizer)
        flow.objectives.stepped(optimizer)
        sampler = flow.sampler_on(st)
        if not st.scaled and flow.watched.primary(optimizer):
            if sampler is not None:
                sampler.after_step()
            flow.end_step()
        elif sampler is not None:
            sampler.after_step()

    def catch_up(self) -> None:
        """Optimizer steps taken inside a compiled region (``patches.hook_optimizers``), told
        now: the step's gradient norm from the gradients as they still are, and its end. No
        forensic check: the weights have already moved, a replay would not be faithful."""
        flow = self.flow
        while flow.compiled_steps:
            optimizer = flow.compiled_steps.pop(0)
            if not flow.watched.owns(optimizer):
                continue
            if not flow.journal.created:
                flow.journal.create()
            if not flow.log.step.scaled:
                flow.grads.ready()
                flow.grads.ensure_norm()
            self.after_optimizer_step(optimizer)

    def before_zero_grad(self, optimizer: Any) -> None:
        """``optimizer.zero_grad()``: the last eager moment at which a step taken inside a
        compiled region still has its gradients."""
        self.catch_up()
        self.flow.objectives.zeroed_optimizer(optimizer)

    def before_module_zero_grad(self, module: torch.nn.Module) -> None:
        """``module.zero_grad()``: the gradients of a loss backwarded before it do not reach
        an optimizer that steps after it (objectives.py)."""
        self.flow.objectives.zeroed_module(module)

    def before_scheduler_step(self, scheduler: Any) -> None:
        """An LR scheduler steps: counted per optimizer step (``schedules.py``; no host read)."""
        self.flow.schedules.seen(scheduler)

    # -- clips --------------------------------------------------------------------------------

    def before_clip(self, parameters: Any, config: Optional[dict] = None) -> None:
        """``config``: the clip function, max_norm (or clip_value), norm_type, foreach as
        called (``patches.clip_config``), kept in /meta ``clip`` whenever it changes (Python
        values only: no host read)."""
        flow = self.flow
        flow.skips.settle()
        st = flow.log.step
        if config is not None and config != self.clip_config:
            self.clip_config = config
            flow.journal.meta("clip", config, st.index)
        if st.scaled and not st.unscaled and scaler_enabled(flow.watched.scaler):
            if not st.flags & flag(Event.CLIP_BEFORE_UNSCALE):  # one event row per step
                flow.journal.event(Event.CLIP_BEFORE_UNSCALE, st)
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        flow.grads.ready(fallback=params)
        flow.objectives.norms_before_clip(params, st, flow.watched.scaler)
        if config is not None and config.get("how") in ("clip_grad_value_",
                                                         "adaptive_clip_grad"):
            flow.grads.ensure_norm()  # it returns no norm: the pre-clip one is taken now

    def after_clip(self, total_norm: Any, combined: bool = False) -> None:
        """``total_norm``: the pre-clip norm (``clip_grad_norm_``'s result, the ``total_norm``
        given to ``clip_grads_with_norm_``); ``combined``: FSDP1's ``model.clip_grad_norm_``
        returned it (a global norm)."""
        if isinstance(total_norm, torch.Tensor):
            st = self.flow.log.step
            st.clip_norm, whole = sharding.clip_result(total_norm, self.flow.watched.sharding,
                                                       combined)
            share = flag(Event.GRAD_NORM_LOCAL)
            if st.grad_norm is None or (whole and st.flags & share):  # a global norm wins
                st.grad_norm = self.flow.grads.unscaled(st.clip_norm)
                st.flags = (st.flags & ~share) | (0 if whole else share)
