"""fp8 amaxes that differ across ranks that should agree (``fp8_amax_mismatch``), read from the
comparison of a job's rank files (``diagnosis/fp8ranks.py``, which the engine gives the facts
of the rank it diagnoses in full: ``Facts.fp8_ranks``).

Which ranks must agree is the recorded layout's (``record/replicas.py``), never the values'. A
weight under DDP is held whole on every rank of its process group; a DTensor replicated over
some mesh dimensions is the same local tensor on the ranks along them. Their amax is exact
(over the whole tensor) and the scale is a function of it, so on one sampled step they are
bit-equal on every rank of the group, or something is wrong: the replicas no longer hold the
same tensor (a DDP step whose gradients were not all-reduced, weights changed on one rank
after DDP was built; a batch or dropout mask that differs across a tensor-parallel group),
or the scale came from a rank-local amax (Megatron-LM PR 442: TransformerEngine's amax
reduced over the data-parallel group only, at tensor parallel 8; torchtitan#3109: torchao's
amax of a DTensor's local shard). No NaN is needed: each rank trains on, with its own scale.

Kind: ``ddp`` (a DDP weight's replicas differ: ``fp8_sync_replicas``) or ``dtensor`` (a
replicated DTensor operand: ``fp8_sync_replicas``, ``fp8_reduce_amax``).
"""

from __future__ import annotations

from typing import Any, Optional

from ...numfmt import fmt
from .. import fixes
from ..facts import Facts
from ..verdict import HELD, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS: dict[str, tuple[str, ...]] = {"steps": (), "stats": ()}

_BY = {"ddp": "under DDP", "dtensor": "as a replicated DTensor"}
_ROLE = {"grad_output": "output gradient"}


def rule_fp8_amax_mismatch(f: Facts) -> Optional[Finding]:
    """An fp8 operand that several ranks hold whole has a different amax (or scale) on some
    of them on a sampled step."""
    found = f.fp8_ranks
    if found is None or not found.mismatched:
        return None
    op = found.mismatched[0]
    step = op.differ[0]
    role = _ROLE.get(op.role, op.role)
    held = f"{op.layer}'s {role}, which ranks {_ranks(op.group)} hold whole {_BY.get(op.by, '')}"
    values = op.at(step)
    agreed = [s for s in op.compared if s not in op.differ]
    ev = [Evidence(f"on sampled step {step}, {held}: {_values(values)}", "fp8_amax_mismatch",
                   _spread(values), step, op.layer),
          Evidence(f"its ranks disagree on {len(op.differ)} of {len(op.compared)} sampled steps "
                   f"compared (from step {step})" + (f"; bit-equal on step "
                                                     f"{', '.join(map(str, agreed[:6]))}"
                                                     if agreed else ""),
                   "fp8_amax_steps", float(len(op.differ)), step, op.layer)]
    others = [o for o in found.mismatched[1:]]
    if others:
        ev.append(Evidence("the same in " + ", ".join(f"{o.layer} ({_ROLE.get(o.role, o.role)})"
                                                      for o in others[:4])
                           + (" ..." if len(others) > 4 else ""), "fp8_amax_elsewhere",
                           float(len(others))))
    ids = ["fp8_sync_replicas"] if op.by == "ddp" else ["fp8_sync_replicas", "fp8_reduce_amax"]
    ctx = f.fix_context(op.layer, step=step)
    ctx.fp8 = {"by": op.by, "role": op.role, "group": list(op.group)}
    finding = Finding("fp8_amax_mismatch", 0.9 if len(op.differ) >= 2 else 0.8,
                      _summary(op, held, step, values), ev, fixes.make(ids, ctx),
                      first_bad(step, op.layer, "backward" if op.role == "grad_output"
                                else "forward"),
                      priority=PRIORITY["fp8_amax_mismatch"], kind=op.by)
    finding.premises = [
        Premise("layout_declares_replicas", HELD,
                f"{op.layer}'s {role} is held whole by ranks {_ranks(op.group)} "
                f"{_BY.get(op.by, '')}" + (f" ({', '.join(op.placements)})" if op.placements
                                           else "") + ": /meta fp8_layers replicas, recorded "
                "from the layout"),
        Premise("same_sampled_step", HELD,
                f"ranks {_ranks(list(values))} each recorded sampled step {step}")]
    return finding


def _summary(op: Any, held: str, step: int, values: dict) -> str:
    what = ("the replicas no longer hold the same weights. DDP broadcasts them once, when it "
            "is built, then only all-reduces gradients: a step whose gradients were not "
            "all-reduced (no_sync() on every micro-batch), weights changed on one rank after "
            "DDP(model), or a rank-local update leaves each rank its own model"
            if op.by == "ddp" else
            "the ranks of the group no longer see one tensor (a batch or dropout mask that "
            "differs across the group), or each took its scale from a rank-local amax")
    return (f"{held}, has a different amax on each rank from sampled step {step} "
            f"({_values(values)}), so each casts it to fp8 with its own scale: {what}. No NaN, "
            "no error: only the ranks side by side show it.")


def _values(values: dict) -> str:
    """``rank 0: amax 0.2252, scale 1989; rank 1: ...``, ranks with the same values together."""
    by_value: dict[tuple, list[int]] = {}
    for rank, pair in values.items():
        by_value.setdefault(pair, []).append(rank)
    parts = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: amax {fmt(a, 6)}, "
                     f"scale {fmt(s, 6)}" for (a, s), rs in parts[:6]) + \
        ("; ..." if len(parts) > 6 else "")


def _spread(values: dict) -> float:
    """max / min of the ranks' amaxes (1 where only the scales differ)."""
    amaxes = [a for a, _ in values.values() if a == a]
    low = min(amaxes, default=0.0)
    return max(amaxes) / low if low > 0 else float("inf")


def _ranks(ranks: Any, shown: int = 8) -> str:
    """``0, 1, 5`` (at most ``shown``, then how many more). (``diagnosis/ranks.py`` has the
    spans; the rules do not import the rank merge.)"""
    ranks = sorted(int(r) for r in ranks)
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return ", ".join(str(r) for r in ranks[:shown]) + more
