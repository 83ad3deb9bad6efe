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

    @property
    def fell(self) -> bool:
        return self.curve.fell


def read(f: Any) -> list[Objective]:
    """The run's losses, each with its curve and its rivals; [] where /losses holds fewer
    than two (one loss, or a file recorded before format 3)."""
    meta = getattr(f.run, "losses_meta", [])
    rows = getattr(f.run, "losses", None)
    if len(meta) < 2 or rows is None or not len(rows):
        return []
    out = []
    for slot, info in enumerate(meta):
        mine = rows[rows["slot"] == slot]
        order = np.argsort(mine["step"], kind="stable")
        loss = mine["loss"][order].astype(np.float64)
        out.append(Objective(slot=slot, site=str(info.get("site", f"loss {slot}")),
                             feeds=_indices(info.get("optimizers")),
                             reaches=_indices(info.get("reaches"))
                             if isinstance(info.get("reaches"), list) else None,
                             steps=mine["step"][order], loss=loss, curve=curve.read(loss)))
    _pair(out)
    return out


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
    names = [f"{opts[i].get('class', '?') if i < len(opts) else '?'} #{i}" for i in indices]
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
