"""Small torch helpers shared across ``record/``: the user's model inside its wrappers, the
autocast state of a device, and what a GradScaler has done (read from its state, no sync).

Example::

    unwrap(torch.compile(DDP(model)))   # model
    autocast_state("cpu")               # (True, "bfloat16") inside torch.autocast("cpu")
    scaler_enabled(torch.amp.GradScaler("cpu", enabled=False))  # False
    placeholder(torch.empty(2, device="meta"))  # True: shapes only, no values
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import torch

from . import sharding


def is_wrapper(module: torch.nn.Module) -> bool:
    """DDP or DataParallel: a module whose forward calls the user's model inside it."""
    return type(module).__name__ in ("DistributedDataParallel", "DataParallel")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DDP/DataParallel/FSDP1/torch.compile wrappers (for names)."""
    for _ in range(4):
        inner = unwrap_once(module)
        if inner is None:
            return module
        module = inner
    return module


def unwrap_once(module: Any) -> Any:
    """The module one wrapper holds (``_orig_mod`` of torch.compile, ``module`` of DDP,
    DataParallel, FSDP1); None for a module that wraps nothing."""
    inner = getattr(module, "_orig_mod", None)
    if inner is None and (is_wrapper(module) or sharding.is_fsdp1(module)):
        inner = getattr(module, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def placeholder(t: Any) -> bool:
    """A tensor with a shape and no values: on the ``meta`` device (``torch.device("meta")``
    initialisation, Lightning's ``measure_flops``) or a ``FakeTensor`` (``FakeTensorMode``,
    which also claims a real device). What runs on them is a copy being measured, never the
    training: it has no values to record, and autocast knows no ``meta`` device."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.is_meta:
        return True
    if type(t) is torch.Tensor:  # every loss of a plain loop ends here (FakeTensor subclasses)
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # (loaded by whoever made one)
    return fake is not None and bool(fake.is_fake(t))


def placeholder_call(module: torch.nn.Module, tensors: Iterable[Any]) -> bool:
    """A module call on placeholders: its first parameter (or buffer) or an input is one."""
    first: Optional[torch.Tensor] = next(module.parameters(), None)
    if first is None:
        first = next(module.buffers(), None)
    return placeholder(first) or any(placeholder(t) for t in tensors)


def scaler_enabled(scaler: Any) -> bool:
    return scaler is not None and bool(getattr(scaler, "_enabled", True))


def unscaled_already(scaler: Any, optimizer: Any) -> bool:
    """Has ``scaler.unscale_(optimizer)`` run since the last update? (GradScaler's own
    per-optimizer stage, read without creating an entry in its defaultdict.)"""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    stage = state.get("stage") if isinstance(state, dict) else None
    return getattr(stage, "name", None) == "UNSCALED"


def found_inf(scaler: Any, key: Optional[int] = None) -> Optional[torch.Tensor]:
    """GradScaler's found_inf for the optimizer ``id()`` ``key`` (None: every optimizer it
    has checked this step), summed over devices into one 0-dim tensor on the first one's
    device; None where it checked none. No host read, and no entry made in its defaultdict."""
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    if key is None:
        picked = list(states.values())
    else:
        picked = [states[key]] if key in states else []
    flags = [f for s in picked for f in s.get("found_inf_per_device", {}).values()]
    if not flags:
        return None
    if len(flags) == 1:  # made fresh by each unscale and never written after: no copy
        return flags[0].reshape(())
    dev = flags[0].device
    return torch.stack([f.to(dev).reshape(()) for f in flags]).sum()


def autocast_state(device_type: str) -> tuple[bool, str]:
    """(enabled, dtype name) of autocast on ``device_type`` right now, on any torch >= 2.3."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: per-device functions
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return bool(enabled), str(dtype).replace("torch.", "")
