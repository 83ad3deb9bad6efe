"""Sharded training (FSDP2's ``fully_shard``, FSDP1, DTensor): what the recorder must know.

Under FSDP every rank holds a shard of each parameter and of its gradient. FSDP2 keeps them
as DTensors, and an op that mixes a DTensor with a plain tensor raises, while an op on
DTensors alone may run a collective that every rank must join. So the recorder measures
only what a rank holds, with plain local ops, and never starts a collective of its own:

* ``local(t)``: the shard of ``t`` this rank holds (a DTensor's local tensor; anything else
  as it is). Every statistic, weight norm and update ratio is taken on it (per shard).
* The global gradient norm is clip_grad_norm_'s, when it ran: it has already combined the
  shards (FSDP2 returns a replicated DTensor, FSDP1's ``model.clip_grad_norm_`` an
  all-reduced tensor). ``clip_result`` turns it into a plain tensor and says whether it is
  global.
* Without a clip there is no global norm on any rank, and an all-reduce per step to make
  one is a cost the training run would pay. ``Sharding.norm_share`` gives this rank's share
  instead: the norm of its shards, each squared norm divided by the number of ranks holding
  the same shard (1 under FULL_SHARD, the replica count under HSDP), so that the global
  norm is the square root of the sum of the ranks' squared shares. The step is flagged
  ``Event.GRAD_NORM_LOCAL``; ``diagnose run.h5`` combines the rank files
  (``ranks.combine_grad_norms``). A NaN or inf in any shard makes that rank's share, and so
  the combined norm, non-finite: the finiteness check needs no collective either.
* FSDP's ShardedGradScaler all-reduces found_inf in ``unscale_``, so ``update()`` sees every
  rank's combined flag. This rank's own (``combines_found_inf``) is copied on the device as
  ``_unscale_grads_`` returns it, before that all-reduce, read at the drain with the step's
  other values, and flags the step ``Event.OWN_NONFINITE_GRAD``. Under FULL_SHARD it is this
  rank's shard of the reduce-scattered gradients: a NaN in one rank's batch reaches every
  shard, while a value non-finite only in one shard flags that rank alone.
* Forensic replay re-runs the model's forward, which under FSDP all-gathers every
  parameter: a rank replaying alone would wait forever for the others, and FSDP's backward
  hooks would write reduced gradients into ``.grad``. So it is off (``REPLAY_OFF``): on a
  failing step each rank checks the batch it was given instead (``replay.check_batch``),
  a local, collective-free look that still tells a NaN batch from the rest.

Example::

    s = sharding.detect([model])          # None for a model that is not sharded
    s.kind, s.meta()                      # 'fsdp2', ShardingInfo(kind='fsdp2', ...)
    share = s.norm_share(params)          # this rank's share of the global grad norm
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

import torch

from ..runfile.meta import ShardingInfo

REPLAY_OFF = ("forensic replay is off under {what}: a replay re-runs the forward, which "
              "all-gathers the sharded parameters from every rank (a rank replaying alone "
              "would wait for the others forever) and whose backward writes reduced "
              "gradients into .grad; on a failing step each rank checks its own batch "
              "instead")
_NAMES = {"fsdp2": "FSDP2 (fully_shard)", "fsdp1": "FSDP (FullyShardedDataParallel)",
          "dtensor": "DTensor parameters", "deepspeed": "DeepSpeed"}
_WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dtensor_class() -> Optional[type]:
    """DTensor, if torch.distributed.tensor is loaded (never imported here: a model that is
    not sharded must not pay for it)."""
    return _loaded("DTensor", "torch.distributed.tensor", "torch.distributed._tensor")


def _fsdp_classes() -> tuple[Optional[type], Optional[type]]:
    """(FSDPModule, FullyShardedDataParallel), where torch.distributed.fsdp is loaded."""
    return (_loaded("FSDPModule", "torch.distributed.fsdp", "torch.distributed._composable.fsdp"),
            _loaded("FullyShardedDataParallel", "torch.distributed.fsdp"))


def _loaded(name: str, *modules: str) -> Optional[type]:
    """``name`` from the first of ``modules`` already imported (before torch 2.4-2.6 these
    lived in private modules)."""
    for module in modules:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            return cls
    return None


def is_dtensor(t: Any) -> bool:
    if type(t) in _PLAIN:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """The part of ``t`` this rank holds: a DTensor's local shard, anything else as is.

    No copy, no collective: ``local(p.grad)`` of an FSDP2 parameter is the slice of the
    gradient that the reduce-scatter left on this rank.
    """
    if type(t) in _PLAIN or not is_dtensor(t):
        return t
    shard = getattr(t, "_local_tensor", None)
    if shard is None:
        with torch.no_grad():
            shard = t.to_local()
    return shard


def fsdp1_class() -> Optional[type]:
    """``FullyShardedDataParallel``, whose own ``clip_grad_norm_`` combines the shards."""
    return _fsdp_classes()[1]


def is_fsdp1(module: Any) -> bool:
    _, fsdp1 = _fsdp_classes()
    return fsdp1 is not None and isinstance(module, fsdp1)


def clean_name(name: str) -> str:
    """A module or parameter name without FSDP1's wrapper levels:
    ``clean_name("0._fsdp_wrapped_module.weight") == "0.weight"``."""
    parts = [p for p in name.split(".") if p not in _WRAPPED]
    return ".".join(parts)


@dataclass
class Sharding:
    """How the watched model is sharded, found once when its root is adopted."""

    kind: str  # "fsdp2", "fsdp1", "dtensor", "deepspeed"
    world_size: int = 1
    replicas: dict = field(default_factory=dict)  # id(param) -> ranks holding the same shard
    layout: ShardingInfo = field(default_factory=ShardingInfo)  # /meta's fields of its kind

    @property
    def name(self) -> str:
        return _NAMES.get(self.kind, self.kind)

    @property
    def replay_off(self) -> str:
        """Why forensic replay is off (always, for a sharded model)."""
        return REPLAY_OFF.format(what=self.name)

    def meta(self, forensics: bool = True) -> ShardingInfo:
        """The /meta ``sharding`` entry: diagnose reads the layout and the replay note."""
        return replace(self.layout, kind=self.kind, local_shards=self.kind != "deepspeed",
                       world_size=self.world_size,
                       grad_norm="clip_grad_norm_'s global norm on steps that clip; otherwise "
                                 "this rank's share (steps flagged GRAD_NORM_LOCAL), combined "
                                 "across the rank files by diagnose",
                       replay="off" if forensics else "disabled",
                       replay_reason=self.replay_off if forensics else None)

    def norm_share(self, params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's share of the global L2 gradient norm (fp32 scalar, on the device; no
        sync, no collective), or None when no parameter has a gradient here."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            g = p.grad
            if g is None:
                continue
            g = local(g)
            if g.layout != torch.strided or not g.is_floating_point() or not g.numel():
                continue
            key = (g.device, g.dtype, self.replicas_of(p))
            groups.setdefault(key, []).append(g.detach())
        if not groups:
            return None
        dev = next(iter(groups))[0]
        parts = []
        for (_, _, reps), grads in groups.items():
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            sq = torch.linalg.vector_norm(torch.stack(norms)).to(dev).square()
            parts.append(sq / reps if reps != 1 else sq)
        return torch.stack(parts).sum().sqrt() if len(parts) > 1 else parts[0].sqrt()

    def replicas_of(self, p: torch.Tensor) -> int:
        """How many ranks hold the same shard of ``p`` (its squared norm is counted once)."""
        reps = self.replicas.get(id(p))
        if reps is None:
            reps = self.replicas[id(p)] = _replicas(p, self.world_size)
        return reps


def clip_result(total: torch.Tensor, sharding: Optional[Sharding],
                from_fsdp1: bool = False) -> tuple[torch.Tensor, bool]:
    """What ``clip_grad_norm_`` returned, as a plain fp32 scalar, and whether it is the
    global norm (True) or only this rank's part of it (False).

    A replicated DTensor (FSDP2) and FSDP1's own ``model.clip_grad_norm_`` hold the global
    norm (they ran the collective); a partial DTensor holds this rank's part; the plain
    ``torch.nn.utils.clip_grad_norm_`` on FSDP1's flat parameters saw only local shards.
    """
    total = total.detach()
    if is_dtensor(total):
        placements = getattr(total, "placements", ())
        glob = all(pl.is_replicate() for pl in placements)
        total = local(total)
    else:
        glob = from_fsdp1 or sharding is None or sharding.kind != "fsdp1"
    return total.float().reshape(()), glob


def combines_found_inf(scaler: Any) -> bool:
    """Does ``scaler``'s class rewrite ``unscale_`` (FSDP's ShardedGradScaler, whose
    ``unscale_`` all-reduces found_inf across ranks)? Then the found_inf that ``update()``
    reads is every rank's, and this rank's own is read before, from ``_unscale_grads_``.
    Python attributes only: no tensor read."""
    base = torch.amp.GradScaler
    for cls in type(scaler).__mro__:
        if cls is base:
            return False
        if "unscale_" in cls.__dict__:
            return True
    return False


def detect(roots: list[torch.nn.Module], world_size: int = 1) -> Optional[Sharding]:
    """How ``roots`` are sharded, or None. Reads module types and parameter placements only
    (no collective)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    fsdp2, fsdp1 = _fsdp_classes()
    modules = [m for r in roots for m in r.modules()]
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in modules):
        return _fsdp1(modules, fsdp1, world_size)
    params = [p for r in roots for p in r.parameters()]
    dparams = [p for p in params if is_dtensor(p)]
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in modules):
        kind = "fsdp2"
    elif dparams:
        kind = "dtensor"
    elif any(type(m).__name__ == "DeepSpeedEngine" for m in modules):
        return Sharding("deepspeed", world_size)
    else:
        return None
    s = Sharding(kind, world_size)
    for p in params:
        s.replicas_of(p)
    if dparams:
        p = dparams[0]
        s.layout = ShardingInfo(mesh=list(p.device_mesh.shape),
                                placements=[str(pl) for pl in p.placements],
                                sharded_params=len(dparams), params=len(params))
    return s


def _replicas(p: torch.Tensor, world_size: int) -> int:
    """Ranks holding the same values of ``p``: for a DTensor, the mesh dimensions it is
    replicated over; a plain parameter beside sharded ones is replicated on every rank."""
    if not is_dtensor(p):
        return max(1, world_size)
    mesh = p.device_mesh
    return math.prod(mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_replicate())


def _fsdp1(modules: list, fsdp1: type, world_size: int) -> Sharding:
    """FSDP1: each wrapper's flat parameter (or its original parameters, with
    use_orig_params) is sharded over the wrapper's process group, replicated across the
    others (HYBRID_SHARD), or not sharded at all (NO_SHARD)."""
    dist = torch.distributed
    s = Sharding("fsdp1", world_size)
    strategies = set()
    for m in modules:
        if not isinstance(m, fsdp1):
            continue
        strategy = getattr(m, "sharding_strategy", None)
        name = getattr(strategy, "name", str(strategy))
        strategies.add(name)
        group = getattr(m, "process_group", None)
        try:
            size = dist.get_world_size(group) if dist.is_initialized() else world_size
        except Exception:  # noqa: BLE001 - an odd group: assume it spans the world
            size = world_size
        reps = world_size if name == "NO_SHARD" else max(1, world_size // max(size, 1))
        handle = getattr(m, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        for p in [flat] + list(getattr(flat, "_params", None) or []):
            if p is not None:
                s.replicas[id(p)] = reps
    s.layout = ShardingInfo(strategy=sorted(strategies))
    return s


_COLLECTIVE = ("FullyShardedDataParallel", "DeepSpeedEngine")


def collective_forward(roots: list) -> Optional[str]:
    """The first module whose forward gathers sharded parameters (FSDP, FSDP2, ZeRO-3,
    tensor parallel), by its class name, or None: what ``detect`` cannot measure but a
    replay must still never run. DDP is fine: the replay runs the module inside it."""
    for root in roots:
        for m in root.modules():
            name = type(m).__name__
            if name in _COLLECTIVE or name.startswith("FSDP"):
                return name
        for p in root.parameters():
            if is_dtensor(p) or type(p).__name__ == "DTensor":
                return "a DTensor parameter"
    return None
