"""The files of one recording: ``run.h5``, or one ``run.rank{R}.h5`` per rank, diagnosed together.

Under torchrun every rank records its own file beside the output the user named::

    ampdoctor record -o run.h5 -- torchrun --nproc_per_node=2 train.py
    # -> run.rank0.h5, run.rank1.h5
    ampdoctor diagnose run.h5     # finds both and diagnoses them together

A merged diagnosis is the diagnosis of the rank where things went wrong first, plus what only
the ranks side by side can show: which rank went non-finite first (a NaN born in one rank's
forward reaches every rank through the gradient all-reduce in the same step, so only the
origin has a non-finite loss or a forward culprit of its own), and whether the loss scale
diverged across ranks (their GradScalers disagreed about skipping, so their weights drift).
Where no rank's loss or forward tells, a scaler that combines found_inf across ranks (FSDP's
ShardedGradScaler) still leaves each rank's own flag (``Event.OWN_NONFINITE_GRAD``): the rank
whose own shard of the gradients went non-finite is named before those that only skipped.

numpy only, like the rest of the analysis side.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..numfmt import fmt
from ..runfile.meta import ShardingInfo
from ..runfile.paths import run_name
from ..runfile.payloads import SnapshotDetail
from ..runfile.schema import Event, Phase, flag
from .verdict import Diagnosis, Evidence

BAD = flag(Event.SKIPPED) | flag(Event.NONFINITE_LOSS) | flag(Event.NONFINITE_GRAD)
OWN = flag(Event.OWN_NONFINITE_GRAD)
# Replay phases that put the first non-finite value inside this rank (not in what it received).
LOCAL_PHASES = (Phase.INPUT, Phase.FORWARD, Phase.LOSS)
# The same for the sampled tier's first non-finite tensor (a module output, the batch).
SAMPLED_LOCAL = ("input", "forward")


# ---------------------------------------------------------------------------------------------
# One run in a few numbers (the end-of-record summary, and the merge below)


def outline(run: Any) -> dict:
    """Steps, skipped steps, and where the first non-finite value appeared, for one ``Run``.

    Example::

        with ampdoctor.load("run.h5") as run:
            ranks.outline(run)   # {'steps': 30, 'skipped': 30, 'first_bad': 0, ...}
    """
    from .events import recording_stopped

    steps = run.steps
    flags = steps["flags"] if len(steps) else np.zeros(0, np.int32)
    bad = np.flatnonzero((flags & BAD) != 0)
    local = np.flatnonzero((flags & flag(Event.NONFINITE_LOSS)) != 0)
    out = {
        "path": run.path,
        "rank": run.rank,
        "world_size": int(run.attrs.get("world_size", 1)),
        "status": run.status,
        "steps": int(len(steps)),
        "skipped": int(np.sum(steps["skipped"] == 1)) if len(steps) else 0,
        "first_bad": int(steps["step"][bad[0]]) if len(bad) else None,
        "first_loss_bad": int(steps["step"][local[0]]) if len(local) else None,
        "module": None,
        "phase": None,
        "local": False,  # the first non-finite value was born in this rank
        # the first step where a replay placed a failure inside this rank (its batch, its
        # forward, its loss) or its loss went non-finite, whatever came before (GradScaler's
        # first skips): None where neither happened (``first_rank``'s tie-break)
        "born": None,
        # this rank's own found_inf at first_bad (before ShardedGradScaler combined it): read
        # only where it tells the ranks apart (``read_own_flags``), else None
        "own_bad": None,
        "stopped": recording_stopped(run),  # {"step", "why"}: the recorder faulted there
        "nonfinite_steps": int(len(bad)),
        "unreproduced": unreproduced_steps(run),  # began here, did not reproduce here
    }
    if out["first_bad"] is None:
        return out
    _place(run, out)
    return out


def _place(run: Any, out: dict) -> None:
    """Fill ``out`` (``outline``'s, with a first bad step) with where the first non-finite
    value appeared: its module and phase, whether it was born in this rank, and when."""
    from .facts import Facts

    snaps = run.snapshots
    located = [s for s in snaps if int(s["phase"]) not in (Phase.NONE, Phase.UNKNOWN)]
    if located:
        s = located[0]
        out["module"] = s["module"] or None
        out["phase"] = Phase(int(s["phase"])).name.lower()
        out["local"] = Phase(int(s["phase"])) in LOCAL_PHASES and int(s["step"]) == \
            out["first_bad"]
    else:
        sampled = Facts(run).first_nonfinite_sampled()
        if sampled:
            out["module"], out["phase"] = sampled["module"], sampled["phase"]
            # a module's output (or the batch) is this rank's own, never all-reduced
            out["local"] = sampled["phase"] in SAMPLED_LOCAL and sampled["step"] == \
                out["first_bad"]
    if out["first_loss_bad"] == out["first_bad"]:
        out["local"] = True
    born = [int(s["step"]) for s in snaps if int(s["phase"]) in LOCAL_PHASES]
    if out["first_loss_bad"] is not None:
        born.append(out["first_loss_bad"])
    out["born"] = min(born) if born else None


def own_flag(steps: Any, step: int) -> bool:
    """Was this rank's own found_inf set at ``step`` (``Event.OWN_NONFINITE_GRAD``)? False
    for a rank whose scaler does not record it as for one whose gradients were finite: the
    ranks of one job run the same scaler, so ``first_rank`` reads it only where some rank
    has it at that step."""
    if not len(steps):
        return False
    at = steps["step"] == step
    return bool(((steps["flags"][at] & OWN) != 0).any())


def own_flag_in_file(outline: dict, step: int) -> bool:
    """``own_flag`` of a rank file at ``step``: its /steps row of that step alone where the
    rows run one per step from the first (two rows read, as a summary is), else its /steps."""
    from ..runfile.store import load_steps, summary

    path = outline["path"]
    first = summary.step_flags(path, 0)
    if first is not None and step >= first[0]:
        got = summary.step_flags(path, step - first[0])
        if got is not None and got[0] == step:
            return bool(got[1] & OWN)
    return own_flag(load_steps(path), step)


def read_own_flags(outlines: list[dict], read: Callable[[dict, int], bool]) -> int:
    """Where the ranks that went bad first are tied with none born there (no non-finite loss,
    no located value), each one's own found_inf at that step, ``read(outline, step)``, into
    its ``own_bad``: ``first_rank`` then names the rank whose own gradients went non-finite
    (ShardedGradScaler). Read there only, the same on a summary's outline as on a loaded
    run's (a summary does not hold it). Returns how many ranks were read."""
    bad = [o for o in outlines if o["first_bad"] is not None]
    if not bad:
        return 0
    step = min(o["first_bad"] for o in bad)
    tied = [o for o in bad if o["first_bad"] == step]
    if len(tied) < 2 or any(o["local"] for o in tied):
        return 0
    todo = [o for o in tied if o.get("own_bad") is None]
    for o in todo:
        o["own_bad"] = read(o, step)
    return len(todo)


# ---------------------------------------------------------------------------------------------
# Diagnosing the ranks together


LOCAL_NORM = flag(Event.GRAD_NORM_LOCAL)


def combine_grad_norms(runs: list) -> int:
    """Sharded runs (FSDP): steps whose ``grad_norm`` is each rank's share of the norm
    (flagged ``GRAD_NORM_LOCAL``) get the global norm, sqrt(sum of squared shares), in every
    rank's ``run.steps`` (in memory; the files are not changed). Only steps that every rank
    recorded and flagged are combined: the shares of a missing rank cannot be guessed.
    Returns how many steps were combined.

    Example::

        shares = {0: 3.0, 1: 4.0}   # two ranks' shares of one step -> global norm 5.0
    """
    world = max((int(r.attrs.get("world_size", 1)) for r in runs), default=1)
    shares = NormShares(world)
    for r in runs:
        shares.add(r.steps)
    for r in runs:
        shares.apply(r.steps)
    return shares.combined


class NormShares:
    """The global gradient norm of a sharded run's steps, from each rank's /steps given one
    at a time (``add``): memory for the steps every rank flagged so far, not for the ranks.

    Example::

        shares = NormShares(world=2)
        shares.add(run0.steps); shares.add(run1.steps)
        shares.apply(run0.steps)      # run0.steps["grad_norm"] now the global norm
    """

    def __init__(self, world: int):
        self.world = world
        self.files = 0
        self.flagged = False  # some rank flagged a step
        self._sums: Optional[dict[int, float]] = None  # step -> sum of squared shares

    def add(self, steps: Any) -> None:
        self.files += 1
        local = (steps["flags"] & LOCAL_NORM) != 0 if len(steps) else np.zeros(0, bool)
        self.flagged = self.flagged or bool(local.any())
        share = dict(zip(steps["step"][local].tolist(),
                         (steps["grad_norm"][local].astype(np.float64) ** 2).tolist()))
        if self._sums is None:
            self._sums = share
        else:
            self._sums = {k: v + share[k] for k, v in self._sums.items() if k in share}

    def norms(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps combined (sorted) and their global norms; none while a rank is missing."""
        if not self.flagged or self.files < self.world or not self._sums:
            return np.zeros(0, np.int64), np.zeros(0)
        keys = np.array(sorted(self._sums), dtype=np.int64)
        return keys, np.sqrt(np.array([self._sums[k] for k in keys.tolist()]))

    @property
    def combined(self) -> int:
        return len(self.norms()[0])

    def apply(self, steps: Any) -> None:
        """Put the global norms into one rank's ``steps`` (in memory)."""
        keys, norm = self.norms()
        if not len(keys):
            return
        pos = np.searchsorted(steps["step"], keys)
        steps["grad_norm"][pos] = norm
        steps["flags"][pos] &= ~LOCAL_NORM


# Evidence measured on parameters or their gradients: per shard in a sharded run.
SHARD_EVIDENCE = ("update_ratio", "weight_norm_growth", "unchanged_fraction", "layer_underflow",
                  "layers_underflowing", "grad_underflow_fraction", "grad_rms_ratio",
                  "worst_layer_underflow")


def per_shard(d: Any, info: Optional[ShardingInfo]) -> Any:
    """Say "per shard" beside evidence taken on parameters of a sharded run (each rank
    measured its own shard of every parameter; ``info``: /meta ``sharding``); returns ``d``."""
    if info is not None and info.local_shards:
        for e in d.evidence:
            if e.key in SHARD_EVIDENCE and not e.text.endswith("(per shard)"):
                e.text += " (per shard)"
    return d


def combine_into(run: Any, others: list[str]) -> int:
    """``combine_grad_norms`` for one loaded rank file (the report's curves), reading the
    other ranks' files ``others`` only for their shares."""
    from ..runfile.store import load

    with contextlib.ExitStack() as stack:
        return combine_grad_norms([run] + [stack.enter_context(load(p)) for p in others])


def sharding_notes(info: Optional[ShardingInfo], steps: Any) -> list[str]:
    """What a diagnosis of a sharded run (FSDP; ``info``: /meta ``sharding``) must say:
    per-layer numbers are per shard, forensic replay is off and why, and grad norms still per
    rank in this file."""
    if info is None:
        return []
    kind = {"fsdp2": "FSDP2", "fsdp1": "FSDP"}.get(info.kind, info.kind)
    out = []
    if info.local_shards:
        out.append(f"Sharded training ({kind}, {info.world_size} ranks): "
                   "per-parameter statistics (gradients, weight norms, update ratios) were "
                   "measured on each rank's own shard of every parameter, module outputs on "
                   "its own batch.")
    if info.replay == "off" and info.replay_reason:
        reason = info.replay_reason
        out.append(reason[0].upper() + reason[1:] + ".")
    local = int(np.sum((steps["flags"] & LOCAL_NORM) != 0)) if len(steps) else 0
    if local:
        out.append(f"On {local} steps no clip_grad_norm_ combined the shards: the gradient "
                   "norm shown is this rank's share; `ampdoctor diagnose` on the run (all "
                   "rank files) combines them into the global norm.")
    return out


def unreproduced_steps(run: Any) -> list[int]:
    """Steps whose non-finite value began on this rank (its own loss or model output was
    non-finite) and whose replay on this rank was finite: a device fault's fingerprint when
    they pile up on one rank (``rules/reproduced.py``)."""
    from .reproduced import began_here, unreproduced

    out = []
    for s in run.snapshots:
        try:
            detail = json.loads(s["detail"]) if s["detail"] else {}
        except ValueError:
            continue
        if not isinstance(detail, dict):
            continue
        snap = {"phase": _PHASE_NAMES.get(int(s["phase"]), "unknown"),
                "detail": SnapshotDetail.from_json(detail)}
        if unreproduced(snap) and began_here(snap):
            out.append(int(s["step"]))
    return out


_PHASE_NAMES = {int(p): p.name.lower() for p in Phase}


def unreproduced_evidence(outlines: list[dict]) -> Optional[Evidence]:
    """Per rank, how many of the run's non-finite steps began there and did not reproduce
    when replayed there; None when none did."""
    counts = {o["rank"]: o.get("unreproduced") or [] for o in outlines}
    if not any(counts.values()):
        return None
    total = max(int(o.get("nonfinite_steps") or 0) for o in outlines)
    worst = max(counts, key=lambda r: (len(counts[r]), -r))
    steps = counts[worst]
    listed = ", ".join(str(x) for x in steps[:8]) + (", ..." if len(steps) > 8 else "")
    text = (f"rank {worst}: {len(steps)} of the run's {total} non-finite steps began there and "
            f"did not reproduce when replayed (steps {listed})")
    others = [f"rank {r}: {len(v)}" for r, v in sorted(counts.items()) if r != worst]
    if others:
        text += "; " + ", ".join(others)
    return Evidence(text, "unreproduced_by_rank", float(len(steps)), steps[0])


def scales(run: Any) -> dict[int, float]:
    s = run.steps
    return {int(k): float(v) for k, v in zip(s["step"], s["scale"]) if not np.isnan(v)}


_UNSET: Any = object()


def merge(per_rank: Sequence[tuple[dict, Optional[Diagnosis], Any]], *,
          divergence: Any = _UNSET, scaled: Optional[bool] = None) -> Diagnosis:
    """One diagnosis from each rank's (outline, Diagnosis, {step: loss scale}).

    A rank known only from its summary (the job-level fast path, ``engine.diagnose_files``)
    comes with no Diagnosis and no scales: then ``divergence`` (``job.compare_scales``) and
    ``scaled`` (some rank has a loss scale) are given, and the rank where a value went
    non-finite first (or the lowest) must have its Diagnosis.
    """
    outlines = [o for o, _, _ in per_rank]
    origin = first_rank(outlines)
    base_index = next((i for i, o in enumerate(outlines) if o["rank"] == origin), 0)
    d = per_rank[base_index][1]
    if d is None:
        raise ValueError(f"rank {outlines[base_index]['rank']} must be diagnosed in full")
    evidence: list[Any] = []
    if origin is not None:
        evidence.append(Evidence(_origin_text(outlines, origin), "first_rank", float(origin),
                                 outlines[base_index]["first_bad"],
                                 outlines[base_index]["module"]))
        if d.first_bad is not None:
            d.first_bad = dict(d.first_bad, rank=origin)
    unreproduced = unreproduced_evidence(outlines)
    if unreproduced is not None:
        evidence.append(unreproduced)
    if divergence is _UNSET:
        divergence = scale_divergence({o["rank"]: sc for o, _, sc in per_rank})
        scaled = any(sc for _, _, sc in per_rank)
    if divergence is not None and divergence.get("step") is not None:
        evidence.append(Evidence(divergence["text"], "scale_divergence",
                                 float(divergence["step"]), divergence["step"]))
        d.notes.append("The ranks' loss scales diverged, so their GradScalers skipped "
                       "different steps and their weights no longer match: make every rank "
                       "see the same found_inf (gradients all-reduced before "
                       "scaler.step, or ShardedGradScaler with FSDP).")
    elif scaled:
        evidence.append(Evidence(f"loss scale identical on every rank ({len(per_rank)} ranks)",
                                 "scale_divergence"))
    d.evidence = evidence + list(d.evidence)
    for i, (o, other, _) in enumerate(per_rank):
        if i != base_index and other is not None:  # what every rank says is said once
            d.notes += [f"rank {o['rank']}: {note}" for note in other.notes
                        if note not in d.notes]
    world = max(o["world_size"] for o in outlines)
    if len(outlines) < world:
        have = ranks_text([o["rank"] for o in outlines])
        d.notes.append(f"Only {len(outlines)} of {world} rank files were found "
                       f"({have}); the other ranks never trained or their files are missing.")
    shown = outlines[base_index]["rank"]
    d.notes.insert(0, f"{len(outlines)} rank files diagnosed together ("
                   + files_text([o["path"] or "" for o in outlines])
                   + f"); the steps and history shown are rank {shown}'s"
                   + (", where it went non-finite first." if origin is not None else "."))
    d.run = dict(d.run, path=run_name(outlines[0]["path"] or ""), world_size=world,
                 ranks=outlines, origin_rank=origin)
    return d


def files_text(paths: list[str], limit: int = 8) -> str:
    """The files' names, or for many rank files one pattern: ``run.rank{0-1023}.h5``."""
    names = [os.path.basename(p) for p in paths]
    if len(names) <= limit:
        return ", ".join(names)
    found = [re.fullmatch(r"(.*)\.rank(\d+)(\.[^.]*)", n) for n in names]
    if all(found) and len({(m.group(1), m.group(3)) for m in found if m}) == 1:
        m = found[0]
        assert m is not None
        ids = spans(sorted(int(x.group(2)) for x in found if x))
        return f"{m.group(1)}.rank{{{ids}}}{m.group(3)}"
    return ", ".join(names[:limit]) + f" and {len(names) - limit} more"


def first_rank(outlines: list[dict]) -> Optional[int]:
    """The rank that went non-finite first: earliest bad step; at the same step, a rank where
    the value was born (non-finite loss, forward culprit) before one that only received it;
    where none was, one where a later step's was (``born``: the ranks' first bad step was
    GradScaler's first skips, which every rank makes alike, and one rank's own batch
    overflowed later), and then a rank whose own gradients were non-finite (``own_flag``)
    before one that only skipped with the others."""
    bad = [o for o in outlines if o["first_bad"] is not None]
    if not bad:
        return None
    best = min(bad, key=lambda o: (o["first_bad"], not o["local"], o.get("born") is None,
                                   o.get("born") or 0, o["local"] or not o.get("own_bad"),
                                   o["rank"]))
    return int(best["rank"])


def by_own_flag(outlines: list[dict], origin: Optional[int]) -> bool:
    """Was ``origin`` told from the others by its own found_inf alone (no rank's loss or
    forward went non-finite at its first bad step)?"""
    o = next((x for x in outlines if x["rank"] == origin), None)
    return o is not None and not o["local"] and bool(o.get("own_bad"))


def where(outline: dict) -> str:
    """Where the first non-finite value was found, in words: "in blocks.0.attn (forward)"."""
    module, phase = outline.get("module"), outline.get("phase")
    if phase == "input":
        return f"in the batch given to {module}" if module else "in the input batch"
    if phase in ("loss", "optimizer"):
        return f"in the {'loss' if phase == 'loss' else 'optimizer step'}"
    if module:
        return f"in {module} ({phase})" if phase else f"in {module}"
    return ""


def _origin_text(outlines: list[dict], origin: int) -> str:
    o = next(x for x in outlines if x["rank"] == origin)
    own = by_own_flag(outlines, origin)
    what = "a non-finite loss" if o["first_loss_bad"] == o["first_bad"] else \
        OWN_TEXT if own else "non-finite gradients"
    place = where(o)
    text = f"rank {origin} went non-finite first, at step {o['first_bad']}: {what}" + \
        (f", first seen {place}" if place else "")
    if not o["local"] and o.get("born") is not None and o["born"] > o["first_bad"] and \
            any(x["rank"] != origin and x["first_bad"] == o["first_bad"] for x in outlines):
        text = (f"rank {origin}'s own step failed first, at step {o['born']} (its replay placed "
                f"the failure in its own batch, forward or loss); every rank skipped from step "
                f"{o['first_bad']} alike")
    others = [x for x in outlines if x["rank"] != origin]
    same = [x["rank"] for x in others if x["first_bad"] == o["first_bad"] and not x["local"]]
    if own:
        text += _own_others([x for x in others if x["rank"] in same])
        same = []
    later: dict[int, list[int]] = {}
    for x in others:
        if x["first_bad"] is not None and x["first_bad"] > o["first_bad"]:
            later.setdefault(x["first_bad"], []).append(x["rank"])
    clean = [x["rank"] for x in others if x["first_bad"] is None]
    if same:
        text += f"; {ranks_text(same, LISTED)} only received it (through the gradient all-reduce)"
    steps = sorted(later)
    for step in steps[:LISTED]:
        text += f"; {ranks_text(later[step], LISTED)} followed at step {step}"
    if steps[LISTED:]:
        rest = steps[LISTED:]
        text += f"; {sum(len(later[k]) for k in rest)} more ranks from step {rest[0]} on"
    if clean:
        text += f"; {ranks_text(clean, LISTED)} stayed finite"
    return text


# (ShardedGradScaler's unscale_, DeepSpeed's overflow check, Megatron-core's found_inf: each
# combines the ranks' flags in an all-reduce; record/engines.py reads the engines' own)
OWN_TEXT = ("non-finite gradients in its own shard, before the scaler combined the ranks' "
            "found_inf")


def _own_others(same: list[dict]) -> str:
    """The ranks that went bad at the origin's step, by their own found_inf."""
    text = ""
    flagged = [x["rank"] for x in same if x.get("own_bad")]
    clean = [x["rank"] for x in same if not x.get("own_bad")]
    if flagged:
        text += f"; {ranks_text(flagged, LISTED)}: non-finite in their own shards too"
    if clean:
        text += (f"; {ranks_text(clean, LISTED)}: own gradients finite, skipped only because "
                 "the ranks' found_inf is combined")
    return text


LISTED = 10  # ranks (or steps) named one by one in a sentence; the rest are counted


def ranks_text(ranks: list[int], limit: Optional[int] = None) -> str:
    """``rank 3``, ``ranks 0, 2``, ``ranks 0-511, 513-1023`` (runs of three or more as a
    span); with ``limit``, at most that many spans, then how many ranks more."""
    word = "rank " if len(ranks) == 1 else "ranks "
    return word + spans(sorted(ranks), limit)


def spans(ranks: list[int], limit: Optional[int] = None) -> str:
    """Sorted ranks with runs of three or more as spans: ``0, 1, 4-9``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][-1] + 1:
            spans[-1].append(r)
        else:
            spans.append([r])
    parts: list[tuple[str, int]] = []  # (text, ranks it names)
    for span in spans:
        parts += [(f"{span[0]}-{span[-1]}", len(span))] if len(span) >= 3 else \
            [(str(r), 1) for r in span]
    if limit is not None and len(parts) > limit:
        rest = sum(n for _, n in parts[limit:])
        return ", ".join(t for t, _ in parts[:limit]) + f" and {rest} more"
    return ", ".join(t for t, _ in parts)


def scales_text(values: dict[int, float]) -> str:
    """Each rank's loss scale: ``rank 0: 4, rank 1: 8``; for many ranks, by value:
    ``ranks 0-511, 513-1023: 6.554e+04; rank 512: 3.277e+04``."""
    if len(values) <= 8:
        return ", ".join(f"rank {r}: {fmt(v)}" for r, v in sorted(values.items()))
    by_value: dict[float, list[int]] = {}
    for r, v in sorted(values.items()):
        by_value.setdefault(v, []).append(r)
    order = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return "; ".join(f"{ranks_text(rs, LISTED)}: {fmt(v)}" for v, rs in order)


def scale_divergence(scales: dict[int, dict[int, float]]) -> Optional[dict]:
    """The first step at which two ranks that both have a loss scale there differ, with each
    rank's value then, or None. (A rank whose recording ends early is compared on the steps
    it has.)

    Example::

        scale_divergence({0: {0: 65536.0, 1: 32768.0}, 1: {0: 65536.0, 1: 65536.0}})
        # {'step': 1, 'scales': {0: 32768.0, 1: 65536.0}, 'text': ...}
    """
    with_scale = {r: sc for r, sc in scales.items() if sc}
    if len(with_scale) < 2:
        return None
    for step in sorted(set().union(*(set(sc) for sc in with_scale.values()))):
        values = {r: sc[step] for r, sc in with_scale.items() if step in sc}
        if len(values) > 1 and max(values.values()) != min(values.values()):
            return {"step": step, "scales": values,
                    "text": f"loss scale diverged across ranks at step {step} "
                            f"({scales_text(values)})"}
    return None
