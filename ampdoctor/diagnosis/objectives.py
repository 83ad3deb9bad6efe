"""Each loss of a run that backwards several, read on its own (/losses, /meta ``losses``), and
which of them pull against each other.

numpy only. A run that backwards losses from two lines or more (a GAN's discriminator and
generator, a multi-task model's heads) has each loss's curve in /losses; /steps' loss is their
mean, which says little: a GAN keeps it level while both models learn, and a multi-task model's
mean falls while one task's loss stays flat. So learning is judged per loss
(``rules/learning.py``), except for an *adversarial pair*: two groups of losses, each feeding
optimizers of its own, where one group's loss is computed through the models the other's
optimizers step (the generator's loss through the discriminator, an actor's through its
critic). Each of those optimizers steps against the other's loss, and neither loss is meant
to fall: they are not asked to.

Example::

    objs = objectives.read(facts)          # [] for a run of one loss
    [o.site for o in objs if o.rival is not None]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..numfmt import fmt
from ..runfile.meta import LossSlot
from . import curve
from .verdict import Evidence


@dataclass
class Objective:
    """One loss: where it was backwarded, what it feeds, and its curve."""

    slot: int
    site: str  # "train.py:41"
    feeds: tuple  # optimizer indices (/meta optimizer order) its gradients reach and step
    reaches: Optional[tuple]  # optimizers whose parameters its graph reaches (None: unknown)
    steps: np.ndarray  # the steps it was backwarded in
    loss: np.ndarray  # its value at each of them
    curve: curve.Curve
    rival: Optional[str] = None  # the sites of the losses it is paired against, adversarially
    through: bool = False  # ... and it is computed through the models their optimizers step
    rival_feeds: tuple = ()  # those optimizers
    frames: tuple = ()  # its call stack's lines, innermost first (the recorder's /meta)

    @property
    def fell(self) -> bool:
        return self.curve.fell


def read(f: Any) -> list[Objective]:
    """The run's losses (``f``: its ``Facts``, or a ``Run``), each with its curve and its
    rivals; [] where /losses holds fewer than two (one loss, or a file of format 2)."""
    run = getattr(f, "run", f)
    meta: list[LossSlot] = getattr(run, "losses_meta", [])
    rows = getattr(run, "losses", None)
    if len(meta) < 2 or rows is None or not len(rows):
        return []
    rows = _with_first_steps(rows, getattr(run, "steps", None))
    out: list[Objective] = []
    for slot, info in enumerate(meta):
        mine = rows[rows["slot"] == slot]
        if not len(mine):
            continue
        feeds = _indices(info.optimizers)
        reaches = _indices(info.reaches) if info.reaches is not None else None
        frames = tuple(info.frames)
        earlier = _continued(out, frames, int(mine["step"].min()),
                             mine["loss"][np.argsort(mine["step"], kind="stable")])
        if earlier is not None:
            earlier.steps = np.concatenate([earlier.steps, mine["step"]])
            earlier.loss = np.concatenate([earlier.loss, mine["loss"].astype(np.float64)])
            earlier.feeds = tuple(sorted(set(earlier.feeds) | set(feeds)))
            if earlier.reaches is not None and reaches is not None:
                earlier.reaches = tuple(sorted(set(earlier.reaches) | set(reaches)))
            continue
        out.append(Objective(slot=slot, site=info.site or f"loss {slot}", feeds=feeds,
                             reaches=reaches, steps=mine["step"],
                             loss=mine["loss"].astype(np.float64), curve=curve.Curve(n=0),
                             frames=frames))
    if len(out) < 2:
        return []
    for o in out:
        order = np.argsort(o.steps, kind="stable")
        o.steps, o.loss = o.steps[order], o.loss[order]
        o.curve = curve.read(o.loss)
    _pair(out)
    return out


def _with_first_steps(rows: np.ndarray, steps: Any) -> np.ndarray:
    """/losses begins at the step where a second loss was first seen; the steps before it
    had one loss, the first (slot 0), whose value is the step's own loss (/steps)."""
    if steps is None or not len(steps) or not len(rows):
        return rows
    before = steps[(steps["step"] < rows["step"].min()) & np.isfinite(steps["loss"])]
    if not len(before):
        return rows
    first = np.zeros(len(before), rows.dtype)
    first["step"], first["slot"], first["loss"] = before["step"], 0, before["loss"]
    first["micro"] = before["micro"]
    return np.concatenate([first, rows])


def _continued(out: list[Objective], frames: tuple, start: int,
               loss: np.ndarray) -> Optional[Objective]:
    """The loss that ``frames`` continues, if any: one of the same line, backwarded only before
    ``start``, whose call stack differs from it in the outermost frame alone (the same loop,
    called from a warm-up and then from the main loop), the closest such stack; or in one
    frame further in (the training function called again after a resume) where ``loss``
    starts at the level the earlier one ended at (a model trained from scratch by the same
    function starts again from its own start)."""
    best, shared = None, 0
    for o in out:
        if not frames or not o.frames or o.frames[0] != frames[0] or int(o.steps.max()) >= start:
            continue
        common = next((i for i, (a, b) in enumerate(zip(o.frames, frames)) if a != b),
                      min(len(o.frames), len(frames)))
        if common >= max(len(frames), len(o.frames)) - 1 and common > shared:
            best, shared = o, common
        elif best is None and _resumed(o, frames, loss):
            best = o
    return best


# A loss resumed where an earlier one stopped starts within this factor of the level that one
# ended at (its last RESUME_STEPS losses), and well below where that one began.
RESUME_LEVEL = 2.0
RESUME_STEPS = 10


def _resumed(o: Objective, frames: tuple, loss: np.ndarray) -> bool:
    """``frames`` is ``o``'s stack with one frame changed, and its first losses sit at the level
    ``o``'s last ones reached, below half ``o``'s first: training resumed, not begun anew."""
    if len(o.frames) != len(frames) or sum(a != b for a, b in zip(o.frames, frames)) != 1:
        return False
    mine, theirs = loss[np.isfinite(loss)], o.loss[np.isfinite(o.loss)]
    if len(mine) < RESUME_STEPS or len(theirs) < 2 * RESUME_STEPS:
        return False
    began = float(np.median(theirs[:RESUME_STEPS]))
    ended = float(np.median(theirs[-RESUME_STEPS:]))
    again = float(np.median(mine[:RESUME_STEPS]))
    return 0 < again <= RESUME_LEVEL * ended and again < 0.5 * began


def _indices(value: Any) -> tuple:
    return tuple(sorted({int(v) for v in value if isinstance(v, int) and v >= 0})) \
        if isinstance(value, list) else ()


def _pair(objs: list[Objective]) -> None:
    """Mark adversarial pairs: losses grouped by the optimizers they feed; two groups that
    feed none in common, where a loss of one reaches an optimizer the other feeds."""
    groups: dict[tuple, list[Objective]] = {}
    for o in objs:
        if o.feeds:
            groups.setdefault(o.feeds, []).append(o)
    keys = list(groups)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if set(a) & set(b):
                continue
            through = any(o.reaches and set(o.reaches) & set(a) for o in groups[b]) or \
                any(o.reaches and set(o.reaches) & set(b) for o in groups[a])
            if not through:
                continue
            for mine, theirs in ((a, b), (b, a)):
                names = ", ".join(o.site for o in groups[theirs])
                for o in groups[mine]:
                    o.rival = names if o.rival is None else f"{o.rival}, {names}"
                    o.through = o.through or bool(o.reaches and set(o.reaches) & set(theirs))
                    o.rival_feeds = tuple(sorted(set(o.rival_feeds) | set(theirs)))


def optimizer_names(f: Any, indices: tuple) -> str:
    """"Adam #0 and SGD #1": the optimizers by /meta optimizer's class and index."""
    opts = f.optimizers
    names = [f"{opts[i].name or '?' if i < len(opts) else '?'} #{i}" for i in indices]
    return " and ".join(names) if names else "no optimizer"


def describe(f: Any, o: Objective) -> str:
    """One loss's line of evidence: where, what it feeds, and how its curve went."""
    head = f"the loss backwarded at {o.site} (stepping {optimizer_names(f, o.feeds)})"
    c = o.curve
    if o.rival is not None:
        level = f" ({fmt(c.start)} -> {fmt(c.end)})" if c.judged else ""
        how = (f"is computed through the parameters {optimizer_names(f, o.rival_feeds)} "
               f"steps against it, for {o.rival}") if o.through else \
            f"trains the model that {o.rival} is computed through, against it"
        return f"{head} {how}: an adversarial pair, not asked to fall{level}"
    if not c.judged:
        return f"{head} was not judged: {c.why}"
    verb = "fell" if c.fell else "did not fall"
    return (f"{head} {verb}: {fmt(c.start)} -> {fmt(c.end)} ({c.end / c.start:.0%} of its "
            f"start, {c.n} steps)")


def evidence(f: Any, objs: list[Objective]) -> list[Evidence]:
    """A line per loss (``describe``), each with its end-to-start ratio as its value."""
    out = []
    for o in objs:
        c = o.curve
        ratio = c.end / c.start if c.judged and c.start > 0 else None
        last = int(o.steps[-1]) if len(o.steps) else None
        out.append(Evidence(describe(f, o), "loss_per_objective", ratio, last))
    return out
