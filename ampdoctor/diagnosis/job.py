"""The rank files of one job, known from their summaries: which ranks to read in full.

A job of 1024 ranks is diagnosed from what each rank's ``/summary`` says (``runfile.summary``:
steps, skips, the first bad step, where the value was born, status, loss scale change points)
and from the few ranks read in full: the rank where a value went non-finite first (its
diagnosis is the job's), and a few ranks whose loss scale or skip count disagrees with the
others (their notes). Every other rank is opened for a few milliseconds and closed, so a diagnosis
of 1024 files takes seconds and its memory does not grow with the rank count
(``benchmarks/scale_diagnose.py``).

``RankFacts`` is what the job-level diagnosis knows of one rank, the same whether it came from
a summary or from the loaded run (a file of format 1 has no summary; a summary that disagrees
with its tables is not used): ``tests/diagnosis/test_ranks.py`` checks that both agree.

numpy only, like the rest of the analysis side.

Example::

    facts = [job.from_summary(s) for s in summaries]
    job.chosen(facts, job.base_rank(facts))     # the ranks to read in full (17, then 3)
    job.compare_scales(facts, read_history)     # where the loss scales part, or None
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..runfile import summary as summaries
from ..runfile.schema import Phase
from . import ranks
from .streamed import _PHASE_ORDER

# Ranks read in full beside the base rank: representatives of the loss scale or skip count
# groups that disagree with the others (their own notes join the diagnosis).
EXTRA_FULL = 3
# ... and ranks whose replays may have found a failure of their own that did not reproduce (a
# non-finite loss of theirs, and a replay that stayed finite): how many of their non-finite
# steps did not reproduce is in their snapshots' detail, which only a full read sees. A rank
# that only received a NaN through the all-reduce has finite losses and is not one of them.
UNREPRODUCED_FULL = 8
# ... and ranks tied with the base rank at its first bad step where no rank's value was born
# (GradScaler's first skips at its initial scale, alike on every rank), with replays of their
# own: a later one may have found that rank's own batch or forward failing (``ranks.first_rank``
# reads ``born`` from the full read)
TIED_FULL = 4


@dataclass
class RankFacts:
    """One rank as the job-level diagnosis knows it (``from_summary`` or ``from_run``)."""

    outline: dict  # ranks.outline's keys
    loss_bad_steps: int  # steps whose loss was non-finite: the value was born on this rank
    first_step: Optional[int]
    last_step: Optional[int]
    contiguous: bool  # every step from first_step to last_step, once, in order
    local_norm_steps: int  # steps whose grad_norm is this rank's share (a sharded model)
    replays: int
    replays_finite: int
    scaled: bool  # some step has a loss scale
    scale_key: tuple  # equal keys: equal loss scale histories
    scale_points: Optional[list]  # every change point (step, scale), or None: read /steps
    summary: bool  # known from the file's summary (not read in full)

    @property
    def rank(self) -> int:
        return int(self.outline["rank"])

    @property
    def path(self) -> str:
        return str(self.outline["path"])

    @property
    def world_size(self) -> int:
        return int(self.outline["world_size"])


def from_summary(s: summaries.RankSummary) -> RankFacts:
    """What a rank's summary says, in ``ranks.outline``'s terms."""
    outline = {"path": s.path, "rank": s.rank, "world_size": s.world_size, "status": s.status,
               "steps": s.steps, "skipped": s.skipped, "first_bad": s.first_bad,
               "first_loss_bad": s.first_loss_bad, "module": None, "phase": None,
               "local": False, "own_bad": None, "born": s.first_loss_bad,
               "stopped": s.stopped,
               "nonfinite_steps": s.bad_steps,
               # none: a rank whose replays may hold one is read in full (``chosen``)
               "unreproduced": []}
    if s.first_bad is not None:
        _place(outline, s)
    return RankFacts(outline, s.loss_bad_steps, s.first_step, s.last_step, s.contiguous,
                     s.local_norm_steps, s.replays, s.replays_finite, s.scaled,
                     (s.scale_digest, s.scale_n, s.first_step, s.last_step, s.contiguous),
                     s.scale_points, True)


def _place(outline: dict, s: summaries.RankSummary) -> None:
    """Where the first non-finite value was found, as ``ranks.outline`` says it."""
    if s.located is not None:
        phase = Phase(s.located["phase"])
        outline["module"] = s.located["module"] or None
        outline["phase"] = phase.name.lower()
        outline["local"] = phase in ranks.LOCAL_PHASES and s.located["step"] == s.first_bad
    elif s.sampled is not None and _recorded(s, s.sampled["step"]):
        outline["module"] = s.sampled["module"]
        outline["phase"] = _PHASE_ORDER.get(s.sampled["kind"], (9, "unknown"))[1]
        outline["local"] = outline["phase"] in ranks.SAMPLED_LOCAL and \
            s.sampled["step"] == s.first_bad
    if s.first_loss_bad == s.first_bad:
        outline["local"] = True


def _recorded(s: summaries.RankSummary, step: int) -> bool:
    """Is ``step`` one of the rank's recorded steps (statistics of a step whose /steps row a
    kill cut off do not count, as in the full read)?"""
    return s.contiguous and s.first_step is not None and s.last_step is not None and \
        s.first_step <= step <= s.last_step


def from_run(run: Any, outline: Optional[dict] = None) -> RankFacts:
    """The same facts from a loaded run (a file of format 1, or a rank read in full)."""
    tally = summaries.Tally()
    tally.add("steps", run.steps, 0)
    tally.add("snapshots", np.asarray(run.snapshots[["phase", "step"]]), 0)
    s = tally.row({"steps": 0, "events": 0, "snapshots": 0})[0]
    n = int(s["scale_n"])
    points = tally.scale_points if n <= len(tally.scale_points) else None
    first = tally.first_step if tally.first_step >= 0 else None
    last = tally.last_step if tally.last_step >= 0 else None
    return RankFacts(outline if outline is not None else ranks.outline(run),
                     tally.loss_bad_steps, first, last, tally.contiguous,
                     tally.local_norm_steps, tally.replays, tally.replays_finite,
                     tally.scaled, (bytes(s["scale_digest"]).hex(), n, first, last,
                                    tally.contiguous), points, False)


# ---------------------------------------------------------------------------------------------
# Which ranks to read in full


def base_rank(facts: list[RankFacts]) -> int:
    """The rank whose diagnosis is the job's: where a value went non-finite first
    (``ranks.first_rank``), else the lowest rank."""
    origin = ranks.first_rank([f.outline for f in facts])
    return origin if origin is not None else min(f.rank for f in facts)


def chosen(facts: list[RankFacts], base: int) -> list[RankFacts]:
    """The ranks to read in full: ``base``, then up to ``EXTRA_FULL`` ranks that stand for a
    loss scale history or a skip count the base rank does not share (earliest bad step
    first)."""
    mine = next(f for f in facts if f.rank == base)
    seen = {(mine.scale_key, mine.outline["skipped"])}
    out = [mine]
    order = sorted(facts, key=lambda f: (f.outline["first_bad"] is None,
                                         f.outline["first_bad"] or 0, f.rank))
    for f in order:
        key = (f.scale_key, f.outline["skipped"])
        if len(out) > EXTRA_FULL or key in seen or not _comparable(f, mine):
            continue
        seen.add(key)
        out.append(f)
    suspects = [f for f in order if f.replays_finite and f.loss_bad_steps and
                all(f is not o for o in out)]
    # tied with the base rank at its first bad step with nothing born there (GradScaler's first
    # skips, alike on every rank): a replay read in full may place a later failure in one
    tied = [f for f in order if not mine.outline["local"] and f.replays and
            f.outline["first_bad"] == mine.outline["first_bad"] and
            all(f is not o for o in out + suspects)]
    return out + suspects[:UNREPRODUCED_FULL] + tied[:TIED_FULL]


def unreproduced_unread(facts: list[RankFacts], read: list[int]) -> int:
    """Ranks that may hold non-finite steps that did not reproduce but were not read in full
    (more than ``UNREPRODUCED_FULL`` of them): their counts are not in the rank view."""
    return sum(1 for f in facts if f.replays_finite and f.loss_bad_steps and
               f.rank not in read)


def _comparable(f: RankFacts, base: RankFacts) -> bool:
    """Ranks recorded over the same steps can disagree; one cut short by a kill differs
    only in length."""
    return (f.first_step, f.last_step) == (base.first_step, base.last_step)


# ---------------------------------------------------------------------------------------------
# Loss scales across ranks, one history per group of identical ones


History = tuple[np.ndarray, np.ndarray]  # steps, loss scale at each (NaN: none)


def history(f: RankFacts) -> Optional[History]:
    """The rank's loss scale at each step from its change points, or None when they are not
    all in the summary (then /steps must be read)."""
    if f.scale_points is None or not f.contiguous or f.first_step is None or \
            f.last_step is None:
        return None
    steps = np.arange(f.first_step, f.last_step + 1, dtype=np.int64)
    values = np.full(len(steps), np.nan)
    for i, (step, value) in enumerate(f.scale_points):
        end = f.scale_points[i + 1][0] if i + 1 < len(f.scale_points) else f.last_step + 1
        values[step - f.first_step:end - f.first_step] = value
    return steps, values


def history_of(run: Any) -> History:
    """A loaded run's loss scale at each step, as ``ranks.scales`` reads it (a later row of
    the same step wins)."""
    sc = ranks.scales(run)
    steps = np.array(sorted(sc), dtype=np.int64)
    return steps, np.array([sc[s] for s in steps.tolist()], dtype=np.float64)


def compare_scales(facts: list[RankFacts], read: Callable[[str], History]) -> Optional[dict]:
    """Where the ranks' loss scales part: ``ranks.scale_divergence``'s answer over every rank
    (``step``, ``scales``, ``text``), and, for each group of ranks whose history is not the
    most common one, the first step where it differs from it (``differ``). None when every
    rank has the same scale at every step they share.

    Computed once per group of equal histories (``scale_key``); ``read(path)`` gives the
    history of a group whose change points are not all in its summary.
    """
    groups: dict[tuple, list[RankFacts]] = {}
    for f in sorted((f for f in facts if f.scaled), key=lambda f: f.rank):
        groups.setdefault(f.scale_key, []).append(f)
    if len(groups) < 2:
        return None
    members = list(groups.values())
    hist = [history(g[0]) or read(g[0].path) for g in members]
    steps = np.unique(np.concatenate([h[0] for h in hist]))
    at = np.full((len(hist), len(steps)), np.nan)
    for g, (s, v) in enumerate(hist):
        at[g, np.searchsorted(steps, s)] = v
    out: dict[str, Any] = {"step": None, "scales": {}, "text": "", "differ": []}
    hi, lo = np.fmax.reduce(at, axis=0), np.fmin.reduce(at, axis=0)
    parted = np.flatnonzero(~np.isnan(hi) & (hi != lo))
    if len(parted):
        i = int(parted[0])
        out["step"] = int(steps[i])
        out["scales"] = {f.rank: float(at[g, i]) for g, group in enumerate(members)
                         for f in group if not np.isnan(at[g, i])}
        out["text"] = (f"loss scale diverged across ranks at step {out['step']} "
                       f"({ranks.scales_text(out['scales'])})")
    out["differ"] = _differ(members, steps, at)
    return out if out["step"] is not None or out["differ"] else None


def _differ(members: list[list[RankFacts]], steps: np.ndarray, at: np.ndarray) -> list[dict]:
    """Each group against the most common history: the first shared step they differ at."""
    usual = max(range(len(members)), key=lambda g: (len(members[g]), -g))
    out = []
    for g, group in enumerate(members):
        both = ~np.isnan(at[g]) & ~np.isnan(at[usual])
        j = np.flatnonzero(both & (at[g] != at[usual]))
        if g != usual and len(j):
            k = int(j[0])
            out.append({"ranks": [f.rank for f in group], "step": int(steps[k]),
                        "scale": float(at[g, k]), "usual": float(at[usual, k])})
    return sorted(out, key=lambda x: (x["step"], x["ranks"][0]))


# ---------------------------------------------------------------------------------------------
# What the job's diagnosis says of the ranks it did not read in full


def summary_notes(facts: list[RankFacts], full: list[int]) -> list[str]:
    """Notes from the summaries: how the ranks ended (those not read in full: a rank read in
    full says it itself)."""
    read = set(full)
    ended = Counter(f.outline["status"] for f in facts if f.rank not in read)
    out = []
    for status, n in sorted(ended.items()):
        if status == "finished":
            continue
        which = [f.rank for f in facts if f.rank not in read and f.outline["status"] == status]
        how = {"interrupted": "were killed or are still being written by a writer on another "
                              "host (their files hold every step up to their last flush)",
               "running": "are still being recorded"}.get(status, f"ended with {status}")
        out.append(f"{ranks.ranks_text(which).capitalize()} {how}.")
    return out
