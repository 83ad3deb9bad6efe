"""The loss hooks: each backward (a micro-batch, and the loss, unscaled), the torch loss
functions' calls (the forensic capture), and ``torch.autograd.grad`` of a scaled loss (a
gradient penalty's).

In a step's order::

    after_loss           a torch loss function's call after the model (forensic capture)
    before_backward      a micro-batch (and the loss, without a scaler)
    after_autograd_grad  a penalty's gradients taken of the scaled loss
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..runfile.schema import Event, flag
from . import callorder, scaledloss, sharding, stats
from .optimizerhooks import OptimizerHooks
from .stepflow import StepFlow
from .steps import Micro
from .torchcompat import placeholder, scaler_enabled


class LossHooks:
    """The backward, loss-function and ``autograd.grad`` callbacks of one recorder."""

    def __init__(self, flow: StepFlow, optimizer: OptimizerHooks):
        self.flow = flow
        self.optimizer = optimizer

    def after_loss(self, name: str, fn: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A torch loss function returned (``patches.patch_losses``): the forensic tier holds
        the call for a replay to compute it again (references only, dropped at the step's
        end)."""
        forensics = self.flow.capturing()
        if forensics is not None:
            forensics.capture.loss_call(name, fn, args, kwargs, out)

    def before_backward(self, tensors: Any) -> None:
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if any(placeholder(t) for t in items):
            return  # a copy on meta or fake tensors (a FLOP count): no micro-batch, no values
        flow = self.flow
        self.optimizer.catch_up()
        flow.training()
        st = flow.log.step
        st.micro += 1
        micro = Micro(flow.watched.discovery.take_called()) if flow.watched.discovery.open \
            else None
        for t in items:
            if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
                origin = scaledloss.origin(t, st.keep)  # (scaler.scale(loss), or that / n)
                if origin is not None:
                    loss = st.unscaled_of[origin]
                    if loss is not None:  # (backwarded twice, retain_graph: counted once)
                        st.unscaled_of[origin] = None
                        self._add_loss(loss, micro, scaled=True)
                    break
                self._add_loss(t, micro)
                if scaler_enabled(flow.watched.scaler) and \
                        torch._C._current_graph_task_id() == -1:  # (not from a backward)
                    st.unscaled_backwards += 1
                break
        if micro is not None:
            st.ledger.append(micro)

    def _add_loss(self, loss: torch.Tensor, micro: Optional[Micro],
                  scaled: bool = False) -> None:
        st = self.flow.log.step
        # A DTensor loss (loss_parallel): its local value; reading the DTensor would be a
        # collective that a rank whose replay budget ran out earlier would not join.
        value = sharding.local(loss.detach()).reshape(()).float()
        st.loss_sum = value if st.loss_sum is None else st.loss_sum + value
        st.loss_n += 1
        slot = self.flow.objectives.loss(value, loss)
        callorder.late_backward(st, scaled)
        if not st.loss_dtype:
            st.loss_dtype = stats.dtype_code(loss.dtype)
        if micro is not None:
            micro.value, micro.dtype, micro.slot = value, stats.dtype_code(loss.dtype), slot
        forensics = self.flow.capturing()
        if forensics is not None:
            forensics.capture.loss(loss, scaled)

    def after_autograd_grad(self, outputs: Any, create_graph: bool) -> None:
        """``torch.autograd.grad`` returned: of a scaled loss, with a graph to build a loss
        on (a gradient penalty), its gradients must be unscaled before that loss."""
        st = self.flow.log.step
        if create_graph and any(scaledloss.from_any_scaled(t, st.keep)
                                for t in scaledloss.tensors(outputs)):
            st.flags |= flag(Event.PENALTY_AT_SCALE)
            if not st.scale_read:
                st.scaled_grads_pending = True
