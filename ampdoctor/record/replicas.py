"""Which ranks hold the same copy of an fp8 layer's operand: /meta ``fp8_layers``' ``replicas``.

In a multi-rank run some operands of a Linear are one tensor held whole on several ranks:

* a weight under DDP: ``DistributedDataParallel`` broadcasts the module's state when it is
  built and all-reduces every gradient, so every rank of its process group holds the weight
  bit for bit (the parameters it is told to ignore left out);
* a DTensor replicated over some mesh dimensions: the input of a tensor-parallel
  ``ColwiseParallel`` Linear (``Replicate()`` over the TP group), a weight sharded over TP and
  replicated over a data-parallel dimension. Its local tensor is the same on every rank that
  shares its coordinates on the other dimensions (a ``Partial`` one is a partial sum: never).

The amax of such an operand, and the fp8 scale taken from it, must be bit-equal on every rank
of that group; ``diagnosis/fp8ranks.py`` compares them across the rank files. Which ranks is
read from the layout, never from the values: the DDP wrappers the model was called through and
their process groups, a DTensor's mesh and placements. An operand none of these describes (an
activation under plain data parallel, each rank its own batch; a shard) is not declared and
never compared. No collective: ``get_process_group_ranks`` and the mesh are local lookups.

Example::

    replicas = Replicas()
    replicas.saw(ddp_model)                     # the wrapper the model is called through
    replicas.describe(linear, x)                # {'weight': {'ranks': [0, 1], 'by': 'ddp'}}
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .sharding import is_dtensor


class Replicas:
    """The data-parallel groups of the parameters seen so far (``saw``), and per operand the
    ranks that hold it whole (``of``)."""

    def __init__(self) -> None:
        self._ddp: dict[int, list[int]] = {}  # id(param) -> the ranks of its DDP group
        self._seen: set[int] = set()

    def saw(self, module: Any) -> None:
        """A module the model was called through (DDP's wrapper is looked through by the
        discovery, ``watched.enter``) or given as a root: a DDP wrapper's parameters are held
        whole by every rank of its process group."""
        if id(module) in self._seen or type(module).__name__ != "DistributedDataParallel":
            return
        self._seen.add(id(module))
        ranks = _group_ranks(getattr(module, "process_group", None))
        inner = getattr(module, "module", None)
        if len(ranks) < 2 or not isinstance(inner, torch.nn.Module):
            return
        ignored = set(getattr(module, "parameters_to_ignore", None) or ())
        for name, p in inner.named_parameters():
            if name not in ignored and not is_dtensor(p):
                self._ddp[id(p)] = ranks

    def of(self, role: str, t: Any, param: Any = None) -> Optional[dict]:
        """The ranks that hold ``t`` (an operand of ``role``; ``param``: the parameter a weight
        is) whole, and by what: ``{"ranks": [0, 1], "by": "ddp"}``; None for an operand held by
        one rank only, or one the layout does not describe."""
        if is_dtensor(t):
            return _dtensor(t)
        if role == "weight" and param is not None and id(param) in self._ddp:
            return {"ranks": self._ddp[id(param)], "by": "ddp"}
        return None

    def describe(self, module: torch.nn.Module, x: Any) -> dict:
        """The operands of a Linear's call held whole by several ranks, by role: its input
        ``x`` and its weight (the output gradient is declared where it arrives)."""
        out = {}
        weight = getattr(module, "weight", None)
        for role, t, param in (("input", x, None), ("weight", weight, weight)):
            found = self.of(role, t, param) if t is not None else None
            if found is not None:
                out[role] = found
        return out


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of a process group (the default group for None), or [] outside a
    distributed run."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        if group is None:
            return list(range(dist.get_world_size()))
        return sorted(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group this rank is not in, an odd backend: undeclared
        return []


def _dtensor(t: Any) -> Optional[dict]:
    """The ranks whose local tensor of DTensor ``t`` is the same: those sharing this rank's
    coordinates on its sharded mesh dimensions, every rank along the replicated ones."""
    placements = tuple(getattr(t, "placements", ()))
    mesh = getattr(t, "device_mesh", None)
    if mesh is None or not placements or any(pl.is_partial() for pl in placements):
        return None
    coord = mesh.get_coordinate()
    if coord is None or not any(pl.is_replicate() for pl in placements):
        return None
    index = tuple(slice(None) if pl.is_replicate() else coord[i]
                  for i, pl in enumerate(placements))
    ranks = sorted(int(r) for r in mesh.mesh[index].flatten().tolist())
    if len(ranks) < 2:
        return None
    return {"ranks": ranks, "by": "dtensor", "placements": [str(pl) for pl in placements]}
