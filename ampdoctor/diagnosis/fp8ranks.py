"""fp8 operands that must agree across ranks, compared across a job's rank files.

Each rank file's /meta ``fp8_layers`` names, per fp8 layer, the operands several ranks hold
whole and which ranks (``replicas``, written by ``record/replicas.py`` from the layout: a
weight under DDP, a replicated DTensor). Such an operand's amax (exact, over the whole tensor)
and the scale its layer's cast takes from it must be bit-equal on every rank of the group at
every sampled step: the ranks sample the same steps. ``compare`` reads, rank file by rank file,
the casts of those operands only (``fp8.casts``: the layer's own recipe's rows) and keeps, per
operand and sampled step, each rank's amax and scale; ``Operand.differ`` lists the steps where
they are not all the same. Operands no file declares (activations under plain data parallel,
each rank its own batch; shards) are never compared.

numpy only. One file open at a time; what is kept is a few numbers per declared operand, rank
and sampled step.

Example::

    found = compare(paths.rank_files("run.h5"))
    op = found.mismatched[0]
    op.layer, op.role, op.by, op.differ[0], op.at(op.differ[0])
    # ('0', 'weight', 'ddp', 5, {0: (0.2252, 1989.2), 1: (0.2228, 2010.8)})
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from .fp8 import casts, fp8_layers


@dataclass
class Operand:
    """One operand of one fp8 layer that a group of ranks holds whole, and what each rank's
    cast of it recorded: ``values[step][rank] = (amax, scale)``."""

    layer: str
    role: str  # "input", "weight", "grad_output"
    by: str  # "ddp", "dtensor": what in the layout makes the ranks hold it whole
    group: tuple[int, ...]  # the ranks declared to hold it
    placements: tuple[str, ...] = ()  # a DTensor's
    values: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)

    @property
    def compared(self) -> list[int]:
        """Sampled steps that two ranks of the group or more recorded."""
        return sorted(s for s, by_rank in self.values.items() if len(by_rank) > 1)

    @property
    def differ(self) -> list[int]:
        """The compared steps whose amaxes or scales are not bit-equal across the ranks."""
        return [s for s in self.compared if len(_distinct(self.values[s].values())) > 1]

    def at(self, step: int) -> dict[int, tuple[float, float]]:
        """Each rank's (amax, scale) at ``step``, by rank."""
        return dict(sorted(self.values.get(step, {}).items()))


@dataclass
class Agreement:
    """Every declared operand of a job's fp8 layers, compared (``compare``)."""

    operands: list[Operand]
    files: int  # rank files read

    @property
    def mismatched(self) -> list[Operand]:
        """The operands whose ranks disagree, the earliest disagreement first (a weight
        before an input before an output gradient at the same step)."""
        order = {"weight": 0, "input": 1, "grad_output": 2}
        bad = [op for op in self.operands if op.differ]
        return sorted(bad, key=lambda op: (op.differ[0], order.get(op.role, 3), op.layer))

    @property
    def steps(self) -> int:
        """Sampled steps compared (on any operand)."""
        return len({s for op in self.operands for s in op.compared})


def compare(paths: Iterable[str], loaded: Any = None) -> Optional[Agreement]:
    """The fp8 operands the rank files ``paths`` declare held whole by several ranks, with
    each rank's amax and scale per sampled step; None where the first file declares none (a
    job's ranks share one model and layout). ``loaded``: one of them, already loaded (the
    rank a job's diagnosis reads in full), read in place of its path."""
    from ..runfile.store import load

    mine = os.path.abspath(str(loaded.path)) if loaded is not None else None

    def runs() -> Iterable[Any]:
        for path in paths:
            if os.path.abspath(path) == mine:
                yield loaded
                continue
            with load(path) as run:
                yield run
    return compare_runs(runs())


def declares(run: Any) -> bool:
    """Does ``run`` declare an fp8 operand that several ranks hold whole? (A job's ranks
    share one layout: where the rank read in full declares none, no file is compared.)"""
    return bool(_declared(run))


def compare_runs(runs: Iterable[Any]) -> Optional[Agreement]:
    """``compare`` of rank files already loaded (or loaded one at a time by ``runs``)."""
    found: dict[tuple, Operand] = {}
    files = 0
    for run in runs:
        files += 1
        declared = _declared(run)
        if not declared and files == 1:
            return None
        if declared:
            _read(run, declared, found)
    return Agreement(list(found.values()), files) if found else None


def _declared(run: Any) -> dict[tuple[str, str], tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """(layer, role) -> (by, group, placements) from the run's /meta fp8_layers."""
    out = {}
    for name, layer in fp8_layers(run).items():
        replicas = layer.get("replicas")
        for role, rep in (replicas.items() if isinstance(replicas, dict) else ()):
            if not isinstance(rep, dict) or not isinstance(rep.get("ranks"), list):
                continue
            group = tuple(sorted(int(r) for r in rep["ranks"] if isinstance(r, int)))
            if len(group) > 1:
                out[(name, str(role))] = (str(rep.get("by") or "?"), group,
                                          tuple(str(p) for p in rep.get("placements") or ()))
    return out


def _read(run: Any, declared: dict, found: dict[tuple, Operand]) -> None:
    """The declared operands' casts of one rank file into ``found``."""
    rank = int(run.rank)
    made, _ = casts(run)
    for c in made:
        key = (c.layer, c.role)
        if key not in declared:
            continue
        by, group, placements = declared[key]
        if rank not in group:
            continue
        op = found.get((c.layer, c.role, group))
        if op is None:
            op = found[(c.layer, c.role, group)] = Operand(c.layer, c.role, by, group,
                                                            placements)
        op.values.setdefault(c.step, {})[rank] = (c.amax, c.scale)


def _distinct(values: Iterable[tuple[float, float]]) -> set:
    """The distinct (amax, scale) pairs, NaN equal to NaN (a non-finite amax on every rank
    is no disagreement)."""
    return {tuple("nan" if math.isnan(v) else v for v in pair) for pair in values}
