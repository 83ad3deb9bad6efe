"""The scaler hooks: what GradScaler's methods tell the recorder, in a scaled step's order::

    on_scale             the loss as given to scale(); the file created (lazy recorder)
    before_unscale       gradients complete: sampled gradient statistics
    after_unscale_grads  this rank's own found_inf copied (ShardedGradScaler, before its
                         all-reduce)
    after_unscale        found_inf staged for the skip decision (non-fused optimizers)
    enter_scaler_step / exit_scaler_step    (the optimizer's own hooks between)
    before_update        scale, found_inf, grad norm; the skip decided (or deferred)
    after_update         the scale after; the step ends

``on_get_scale``: the docs' ``g * (1. / scaler.get_scale())`` (a gradient penalty unscaled).
"""

from __future__ import annotations

from typing import Any

import torch

from ..runfile.schema import Event, flag
from . import callorder, sharding
from .listener import ScalerDoor
from .optimizerhooks import OptimizerHooks
from .stepflow import StepFlow
from .steps import Step
from .torchcompat import found_inf, scaler_enabled, unscaled_already


class ScalerHooks:
    """GradScaler's callbacks of one recorder (``door``: them, handed to ``patch_scaler``)."""

    def __init__(self, flow: StepFlow, optimizer: OptimizerHooks):
        self.flow = flow
        self.optimizer = optimizer
        self.door = ScalerDoor(
            fault=flow.fault, on_scale=self.on_scale, before_unscale=self.before_unscale,
            after_unscale=self.after_unscale, enter_scaler_step=self.enter_scaler_step,
            exit_scaler_step=self.exit_scaler_step, before_update=self.before_update,
            after_update=self.after_update, on_scaler_init=self.on_scaler_init)

    def on_scaler_init(self, scaler: Any) -> None:
        self.flow.watched.scaler_created(scaler, self.flow.log.step)

    def on_scale(self, scaler: Any, outputs: Any, out: Any) -> None:
        flow = self.flow
        if not flow.watched.uses_scaler(scaler) or not scaler_enabled(scaler):
            return
        self.optimizer.catch_up()
        flow.training()
        self._penalty_unscaled(flow.log.step)
        flow.log.step.scaled = True
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            # counted as the step's loss when it is backwarded (before_backward): a scaled
            # output taken only through torch.autograd.grad (a gradient penalty's) is not one
            flow.log.step.keep.append(out)
            flow.log.step.unscaled_of.append(outputs)

    def on_get_scale(self, scaler: Any) -> None:
        """The docs' ``g * (1. / scaler.get_scale())``, read after the step's first scaled
        loss: before or after ``autograd.grad``, the gradients can be unscaled with it."""
        if self.flow.watched.uses_scaler(scaler):
            st = self.flow.log.step
            st.scaled_grads_pending = False
            st.scale_read = st.scale_read or st.scaled

    def _penalty_unscaled(self, st: Step) -> None:
        """The step scales a loss after a penalty's gradients were taken of the scaled loss and
        never unscaled (no ``get_scale()`` since ``autograd.grad``): that penalty is the scale
        (squared, for a squared norm) times too large."""
        if st.scaled_grads_pending and not st.flags & flag(Event.SCALED_GRADS_IN_LOSS):
            self.flow.journal.event(Event.SCALED_GRADS_IN_LOSS, st)
        st.scaled_grads_pending = False

    def before_unscale(self, scaler: Any, optimizer: Any) -> None:
        flow = self.flow
        if flow.watched.uses_scaler(scaler):
            flow.skips.settle()
            flow.watched.owns(optimizer, through_scaler=True)
            st = flow.log.step
            if unscaled_already(scaler, optimizer) and not st.flags & flag(Event.UNSCALE_TWICE):
                flow.journal.event(Event.UNSCALE_TWICE, st)  # GradScaler raises next; this says why
            flow.grads.ready()
            flow.objectives.norm(optimizer, st, scaler)

    def after_unscale(self, scaler: Any, optimizer: Any) -> None:
        flow = self.flow
        if flow.watched.uses_scaler(scaler):
            flow.log.step.unscaled = True
            callorder.unscaled(flow.log.step, optimizer)
            if flow.skips.armed and scaler_enabled(scaler):
                # Queued before GradScaler.step reads found_inf (non-fused optimizers):
                # its own sync lands this copy too.
                flow.skips.stage_found(scaler, optimizer)

    def after_unscale_grads(self, scaler: Any, optimizer: Any, found: Any) -> None:
        """``_unscale_grads_`` returned this rank's found_inf per device. A scaler that
        combines it across ranks (``sharding.combines_found_inf``: ShardedGradScaler's
        ``unscale_`` all-reduces it in place next) has it copied now, on the device; the
        drain reads it with the step's other values (``Event.OWN_NONFINITE_GRAD``)."""
        if not isinstance(found, dict) or not found or not self.flow.watched.uses_scaler(
                scaler) or not sharding.combines_found_inf(scaler):
            return
        flags = list(found.values())
        dev = flags[0].device
        own = torch.stack([f.to(dev).reshape(()).float() for f in flags]).sum()  # a copy
        st = self.flow.log.step
        st.own_found_inf = own if st.own_found_inf is None else st.own_found_inf + own.to(
            st.own_found_inf.device)

    def enter_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        flow = self.flow
        if flow.watched.uses_scaler(scaler):
            flow.skips.settle()
            flow.watched.owns(optimizer, through_scaler=True)
            callorder.stepping(flow.log.step, optimizer)
            flow.grads.ready()
            flow.objectives.stepping(optimizer)

    def exit_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        if scaler is self.flow.watched.scaler:
            self.flow.log.step.in_scaler_step = False

    def before_update(self, scaler: Any) -> None:
        flow = self.flow
        if not flow.watched.uses_scaler(scaler) or not scaler_enabled(scaler):
            return
        flow.settle_discovery()  # (every optimizer of the step has been through the scaler)
        flow.skips.settle()
        st = flow.log.step
        flow.grads.ensure_norm()
        if scaler._scale is not None:
            st.scale = scaler._scale.detach().reshape(()).clone()  # update() changes it in place
        found = found_inf(scaler)
        if found is not None:
            st.found_inf = found
        flow.objectives.found(scaler)
        if flow.skips.armed:
            flow.skips.at_update(scaler, st)

    def after_update(self, scaler: Any) -> None:
        st = self.flow.log.step
        if scaler is not self.flow.watched.scaler or not scaler_enabled(scaler) or not st.scaled:
            return
        if scaler._scale is not None:  # stacked by _end_step right away: a view is enough
            st.scale_after = scaler._scale.detach().reshape(())
        self.flow.end_step()
