"""Snapshots of the environment a run trains in, for /meta: the device, the GradScaler's
settings, the model's parameter dtypes, each optimizer's class, hyperparameters and state
dtypes (the records of runfile/meta.py), and the process's peak memory.

Example::

    device_info(torch.device("cpu"))      # {"type": "cpu", "name": "x86_64"}
    optimizer_info([torch.optim.AdamW(model.parameters())])[0].eps   # 1e-08
"""

from __future__ import annotations

import resource
from typing import Any, Iterable, Optional

import torch

from ..runfile.meta import OptimizerInfo, ScalerInfo
from . import sharding
from .torchcompat import scaler_enabled


def peak_memory(device: Optional[torch.device]) -> int:
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def device_info(device: torch.device) -> dict:
    info: dict[str, Any] = {"type": device.type, "name": device.type}
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        info["name"] = torch.cuda.get_device_name(idx)
        info["capability"] = list(torch.cuda.get_device_capability(idx))
        info["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    else:
        import platform

        info["name"] = platform.processor() or platform.machine()
    return info


def scaler_info(scaler: Any) -> ScalerInfo:
    return ScalerInfo(name=type(scaler).__name__, enabled=scaler_enabled(scaler),
                      init_scale=getattr(scaler, "_init_scale", None),
                      growth_factor=getattr(scaler, "_growth_factor", None),
                      backoff_factor=getattr(scaler, "_backoff_factor", None),
                      growth_interval=getattr(scaler, "_growth_interval", None),
                      device=str(getattr(scaler, "_device", "")),
                      own_found_inf=sharding.combines_found_inf(scaler))


def model_summary(roots: list[torch.nn.Module]) -> dict:
    dtypes: dict[str, int] = {}
    trainable = 0
    modules = 0
    for root in roots:
        modules += sum(1 for _ in root.modules())
        for p in root.parameters():
            key = str(p.dtype).replace("torch.", "")
            dtypes[key] = dtypes.get(key, 0) + p.numel()
            trainable += p.numel() if p.requires_grad else 0
    return {"param_dtypes": dtypes, "trainable": trainable, "modules": modules}


HYPER = ("lr", "eps", "betas", "weight_decay", "momentum", "amsgrad", "fused", "foreach",
          "capturable", "nesterov")


def optimizer_info(optimizers: Iterable[Any]) -> list[OptimizerInfo]:
    out = []
    for opt in optimizers:
        hyper = {k: plain(opt.defaults[k]) for k in HYPER if k in opt.defaults}
        state_dtypes: dict[str, str] = {}
        param_dtypes: dict[str, int] = {}
        for g in opt.param_groups:
            for p in g["params"]:
                key = str(p.dtype).replace("torch.", "")
                param_dtypes[key] = param_dtypes.get(key, 0) + p.numel()
                for name, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        state_dtypes[name] = str(value.dtype).replace("torch.", "")
        out.append(OptimizerInfo(name=type(opt).__name__, hyper=hyper,
                                 groups=len(opt.param_groups), param_dtypes=param_dtypes,
                                 state_dtypes=state_dtypes))
    return out


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 and value.device.type == "cpu" else None
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
