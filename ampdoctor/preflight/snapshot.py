"""Save everything a training step can change, and put it back bit for bit.

``check_amp_step`` runs the user's step for real and ``parity`` runs the model's forward
(BatchNorm statistics, dropout's RNG): afterwards the caller's model, optimizer, scaler,
LR schedulers and RNG must be as they were. Tensors are restored *in place* (the same
``Parameter``, ``.grad`` and optimizer-state objects, with their old values), so that
references held elsewhere (an optimizer's param list, a scheduler's optimizer) stay valid.

Example::

    snap = Snapshot(model, optimizer, scaler)
    train_step(model, optimizer, scaler, batch)
    snap.restore()          # model, .grad, optimizer, scaler and RNG as before the step
"""

from __future__ import annotations

import copy
import random
from typing import Any, Optional

import torch

from ..record.forensic.isolated import restore_buffers, rng_state, saved_buffers, set_rng


class Snapshot:
    """The state of ``model`` (parameters, ``.grad``, buffers, train/eval flags),
    ``optimizer`` (state and param groups), ``scaler`` and the RNGs (torch CPU and CUDA,
    Python's ``random``, numpy's global one); LR schedulers are added with ``add_scheduler``
    as they are met. ``params=False`` leaves parameters and ``.grad`` out (a forward-only
    user such as ``parity`` that never writes them). ``restore`` may be called once."""

    def __init__(self, model: Optional[torch.nn.Module], optimizer: Any = None,
                 scaler: Any = None, *, params: bool = True):
        self._rng = _rng_state()
        modules = list(model.modules()) if model is not None else []
        self._training = [(m, m.training) for m in modules]
        kept = _unique(list(model.parameters()) if model is not None and params else [])
        if optimizer is not None:
            kept = _unique(kept + [p for g in optimizer.param_groups for p in g["params"]])
        self._params = [_TensorState(p) for p in kept]
        self._buffers = saved_buffers(modules, empty=True)
        self._optimizer = _OptimizerState(optimizer) if optimizer is not None else None
        self._scaler = _ScalerState(scaler) if scaler is not None else None
        self._schedulers: dict[int, tuple[Any, dict]] = {}

    def add_scheduler(self, scheduler: Any) -> None:
        """Remember an LR scheduler's state (before its first step under watch)."""
        if id(scheduler) not in self._schedulers:
            self._schedulers[id(scheduler)] = (scheduler, copy.deepcopy(scheduler.state_dict()))

    def restore(self) -> None:
        with torch.no_grad():
            for state in self._params:
                state.restore()
        restore_buffers(self._buffers)
        for module, training in self._training:
            module.training = training
        if self._optimizer is not None:
            self._optimizer.restore()
        if self._scaler is not None:
            self._scaler.restore()
        for scheduler, saved in self._schedulers.values():
            scheduler.load_state_dict(saved)
        _set_rng_state(self._rng)


class _TensorState:
    """A parameter's values and its ``.grad`` (the same objects are put back)."""

    def __init__(self, p: torch.Tensor):
        self.p = p
        self.data = p.data
        self.values = p.detach().clone()
        self.requires_grad = p.requires_grad
        self.grad = p.grad
        self.grad_values = p.grad.detach().clone() if p.grad is not None else None

    def restore(self) -> None:
        p = self.p
        if p.data is not self.data:
            p.data = self.data  # the step replaced it (model.half(), p.data = ...)
        p.data.copy_(self.values)
        p.requires_grad_(self.requires_grad)
        if self.grad is None:
            p.grad = None
            return
        if _same_kind(self.grad, self.grad_values):
            self.grad.copy_(self.grad_values)
            p.grad = self.grad
        else:
            p.grad = self.grad_values


class _OptimizerState:
    """``optimizer.state`` (each tensor restored in place) and its param groups' settings."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self.state = {p: dict(st) for p, st in optimizer.state.items()}
        self.values = {(id(p), k): v.detach().clone()
                       for p, st in optimizer.state.items() for k, v in st.items()
                       if isinstance(v, torch.Tensor)}
        self.groups = list(optimizer.param_groups)
        self.settings = [{k: _copy(v) for k, v in g.items() if k != "params"}
                         for g in optimizer.param_groups]
        self.params = [list(g["params"]) for g in optimizer.param_groups]
        self.extra = {k: v for k, v in vars(optimizer).items()
                      if k in ("_opt_called",)}

    def restore(self) -> None:
        opt = self.optimizer
        with torch.no_grad():
            for p, st in self.state.items():
                for k, v in st.items():
                    saved = self.values.get((id(p), k))
                    if saved is not None and _same_kind(v, saved):
                        v.copy_(saved)
                    elif saved is not None:
                        st[k] = saved
        opt.state.clear()
        for p, st in self.state.items():
            opt.state[p] = st
        opt.param_groups[:] = self.groups
        for group, settings, params in zip(self.groups, self.settings, self.params):
            group.clear()
            group.update(settings)
            group["params"] = params
        for k in ("_opt_called",):
            if k in self.extra:
                setattr(opt, k, self.extra[k])
            elif k in vars(opt):
                delattr(opt, k)


class _ScalerState:
    """A GradScaler's attributes; its scale and growth-tracker tensors restored in place."""

    TENSORS = ("_scale", "_growth_tracker")

    def __init__(self, scaler: Any):
        self.scaler = scaler
        self.attrs = {k: (v if k in self.TENSORS else copy.deepcopy(v))
                      for k, v in vars(scaler).items()}
        self.values = {k: v.detach().clone() for k, v in vars(scaler).items()
                       if k in self.TENSORS and isinstance(v, torch.Tensor)}

    def restore(self) -> None:
        for k, saved in self.values.items():
            obj = self.attrs[k]
            if _same_kind(obj, saved):
                obj.copy_(saved)
            else:
                self.attrs[k] = saved
        vars(self.scaler).clear()
        vars(self.scaler).update(self.attrs)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _unique(tensors: list) -> list:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _rng_state() -> dict:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    state = {"torch": rng_state(list(range(torch.cuda.device_count())) if cuda else []),
             "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a core dependency
        pass
    return state


def _set_rng_state(state: dict) -> None:
    set_rng(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
