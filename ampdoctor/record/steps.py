"""The step buffer: what one optimizer step has shown so far (``Step``), its device scalars
stacked without a sync (``device_values``) and many steps' read back in one host read per
device (``fetch``, the sync point of a drain). ``steplog`` turns finished steps into rows.

Example::

    st = Step(index=0, t0=time.perf_counter())
    values = device_values(st, Constants())   # one 0-dim-per-field tensor, no host read
    columns(fetch([values]))["scale"][0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


@dataclass
class Step:
    """What the current optimizer step has shown so far."""

    index: int
    t0: float
    micro: int = 0
    loss_sum: Optional[torch.Tensor] = None
    loss_nonfinite: Optional[bool] = None  # read with found_inf from the step's host mirrors
    loss_n: int = 0
    loss_dtype: int = 0
    scaled: bool = False  # an enabled GradScaler scaled a loss in this step
    unscaled: bool = False  # some optimizer's gradients were unscaled in this step
    unscaled_by: set = field(default_factory=set)  # id() of each optimizer unscale_ saw
    in_scaler_step: bool = False
    grads_ready: bool = False
    grad_norm: Optional[torch.Tensor] = None
    fallback: Optional[list] = None  # parameters clip_grad_norm_ saw, before optimizers are known
    clip_norm: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    scale_after: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None
    # this rank's own found_inf, copied before a scaler combined it across ranks (FSDP's
    # ShardedGradScaler): summed over optimizers and devices
    own_found_inf: Optional[torch.Tensor] = None
    stepped: bool = False
    bypassed: bool = False  # an optimizer stepped outside scaler.step: no update() may follow
    flags: int = 0
    sampled: bool = False
    keep: list = field(default_factory=list)  # scaled losses, so their ids stay unique
    # ... and what each scaled (keep's order; None once backwarded and counted as the loss)
    unscaled_of: list = field(default_factory=list)
    unscaled_backwards: int = 0  # losses backwarded without scaler.scale, a scaler in use
    backward_after_unscale: int = 0  # scaled losses backwarded after this step's unscale_
    # id() of each optimizer unscale_ was called for by the script, not yet stepped
    pending_unscaled: set = field(default_factory=set)
    # torch.autograd.grad(create_graph=True) of a scaled loss, not yet followed by
    # scaler.get_scale() (the docs' unscale of those gradients) before the next scale()
    scaled_grads_pending: bool = False
    scale_read: bool = False  # scaler.get_scale() called after a scaled loss in this step
    staged: dict = field(default_factory=dict)  # id(optimizer) -> HostMirror of found_inf, loss
    undecided: bool = False  # ended before its mirrors landed: decided at the next step's start
    loss_checked: bool = False  # an applied scaled step's loss read before optimizer.step
    triggered: bool = False  # handed to the forensic tier already (one event per step)
    # while the model is discovered (the first step): each backward's ``Micro``, so that the
    # micro-batches of a root dropped at the step's end leave it (Hooks._settle_discovery)
    ledger: list = field(default_factory=list)


@dataclass
class Micro:
    """One backward of the discovery step: the roots called since the one before, and the
    loss it counted (its fp32 value, its dtype code, its objectives slot), if any."""

    roots: frozenset
    value: Optional[torch.Tensor] = None
    dtype: int = 0
    slot: int = -1


def drop_micro(st: Step, dropped: frozenset) -> Optional[list[Micro]]:
    """The discovery step without the micro-batches that ran only roots in ``dropped`` (ids
    of roots no optimizer trains: a model run and dropped before the real one): its micro
    count, loss and loss dtype made again from the rest, summed in their order, as the step
    summed them. The micro-batches kept that counted a loss; None when none was dropped."""
    ledger, st.ledger = st.ledger, []
    if not dropped:
        return None
    kept = [m for m in ledger if not (m.roots and m.roots <= dropped)]
    st.micro -= len(ledger) - len(kept)
    losses = [m for m in kept if m.value is not None]
    st.loss_sum = None
    for m in losses:
        st.loss_sum = m.value if st.loss_sum is None else st.loss_sum + m.value
    st.loss_n = len(losses)
    st.loss_dtype = losses[0].dtype if losses else 0
    return losses


# The step's device scalars, in the order they are stacked and fetched: the mean loss, then
# the ``Step`` fields of these names (a new one is a field above and a name here, nothing else).
VALUES = ("loss_mean", "scale", "scale_after", "found_inf", "grad_norm", "clip_norm",
          "own_found_inf")
_FIELDS = VALUES[1:]


class Constants:
    """NaN placeholders per device, made once (not a kernel per step)."""

    def __init__(self) -> None:
        self._nan: dict[torch.device, torch.Tensor] = {}

    def nan(self, device: torch.device) -> torch.Tensor:
        t = self._nan.get(device)
        if t is None:
            t = self._nan[device] = torch.full((), math.nan, device=device)
        return t


def device_values(st: Step, constants: Constants) -> torch.Tensor:
    """The step's device scalars stacked into one tensor (no sync); order as in VALUES."""
    loss = st.loss_sum / st.loss_n if st.loss_sum is not None and st.loss_n > 1 else st.loss_sum
    values = [loss] + [getattr(st, name) for name in _FIELDS]
    dev = next((v.device for v in values if v is not None), torch.device("cpu"))
    nan = constants.nan(dev)
    return torch.stack([nan if v is None else
                        v if (v.device == dev and v.dtype == torch.float32 and v.dim() == 0)
                        else v.to(dev).float().reshape(()) for v in values])


def fetch(values: list[torch.Tensor]) -> np.ndarray:
    """Device values of many steps in one host read per device (the sync point)."""
    out = np.full((len(values), len(VALUES)), np.nan)
    if values:
        out[:] = fetch_all(values)
    return out


def fetch_all(values: list[torch.Tensor]) -> list[np.ndarray]:
    """1-D device tensors of any lengths, read in one host read per device: each one's
    values, in order."""
    out: list[np.ndarray] = [np.zeros(0)] * len(values)
    by_dev: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        by_dev.setdefault(v.device, []).append(i)
    for idx in by_dev.values():
        flat = np.array(torch.cat([values[i].reshape(-1) for i in idx]).double().tolist())
        at = 0
        for i in idx:
            n = values[i].numel()
            out[i] = flat[at:at + n]
            at += n
    return out


def columns(values: np.ndarray) -> dict[str, np.ndarray]:
    """``fetch``'s result by name: ``columns(fetch(v))["grad_norm"]``, one value per step."""
    return {name: values[:, i] for i, name in enumerate(VALUES)}
