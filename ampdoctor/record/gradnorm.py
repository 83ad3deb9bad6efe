"""The step's gradients: the moment they are complete, and the global grad norm, unscaled.

Gradients are complete at the first of ``unscale_``, a clip or the optimizer step
(``ready``): the sampled tier's gradient statistics are taken then, in scaled space under a
scaler. The global norm is computed as late as possible (``ensure_norm``): when a clip ran,
its own pre-clip norm is taken instead of a second pass over the gradients.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runfile.schema import Event, flag
from . import stats
from .sampler import Sampler
from .steplog import StepLog
from .watched import Watched


class GradNorms:
    """The gradient work of one recorder's hooks (``sampler`` None: no sampled tier)."""

    def __init__(self, watched: Watched, log: StepLog, sampler: Optional[Sampler]):
        self.watched = watched
        self.log = log
        self.sampler = sampler

    def ready(self, fallback: Optional[list] = None) -> None:
        """Gradients are complete (first of unscale_, clip, step): sampled grad statistics,
        in scaled space under a scaler."""
        st = self.log.step
        if st.grads_ready:
            return
        st.grads_ready = True
        st.fallback = fallback
        if st.sampled and self.sampler is not None:
            params = self.watched.trained_params(fallback)
            self.sampler.on_grads_ready([(self.watched.param_name(p), p) for p in params])

    def ensure_norm(self) -> None:
        """The global grad norm, unscaled, computed as late as possible: when clip_grad_norm_
        ran, its own pre-clip norm is taken instead of a second pass over the gradients."""
        st = self.log.step
        if st.grad_norm is not None:
            return
        params = self.watched.trained_params(st.fallback)
        if self.watched.sharding is not None:  # no rank holds the whole gradient: its share
            share = self.watched.sharding.norm_share(params)
            if share is not None:
                st.grad_norm = self.unscaled(share)
                st.flags |= flag(Event.GRAD_NORM_LOCAL)
            return
        still = self._still_scaled(params)
        grads = [p.grad for p in params if p.grad is not None and stats.measurable(p.grad)
                 and id(p) not in still]
        left = [p.grad for p in params if id(p) in still and p.grad is not None
                and stats.measurable(p.grad)]
        if grads and left:  # several optimizers, some unscaled: each part in its own space
            scale = self.watched.scaler._scale
            rest = stats.global_norm(left) / scale.to(left[0].device).reshape(())
            st.grad_norm = torch.linalg.vector_norm(torch.stack(
                [stats.global_norm(grads), rest.to(grads[0].device)]))
        elif grads or left:
            st.grad_norm = self.unscaled(stats.global_norm(grads or left), scaled=bool(left))

    def _still_scaled(self, params: list[torch.Tensor]) -> set[int]:
        """ids of the parameters whose gradients are still scaled while another optimizer's
        were unscaled (``unscale_`` is per optimizer: the AMP docs' several-optimizers recipe
        unscales one, then steps each). Empty in the common case (one optimizer, or none or
        every one unscaled): Python sets only, no tensor read."""
        st = self.log.step
        opts = self.watched.optimizers
        if not st.unscaled or len(opts) < 2 or getattr(self.watched.scaler, "_scale", None) is None:
            return set()
        waiting = [o for o in opts if id(o) not in st.unscaled_by]
        if not waiting:
            return set()
        done = {id(p) for o in opts if id(o) in st.unscaled_by
                for g in o.param_groups for p in g["params"]}
        ours = {id(p) for p in params}
        return {id(p) for o in waiting for g in o.param_groups for p in g["params"]
                if id(p) not in done and id(p) in ours}

    def unscaled(self, norm: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """``scaled``: the norm's gradients are known to be still scaled (``_still_scaled``)."""
        st = self.log.step
        scaler = self.watched.scaler
        if st.scaled and (scaled or not st.unscaled) and scaler is not None:
            scale = scaler._scale
            if scale is not None:
                return norm / scale.to(norm.device).reshape(())
        return norm
