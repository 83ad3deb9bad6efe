"""Where the loss scale restarted mid-run: it jumped back up outside ``update()``, or a
GradScaler was created again (``scale_resets``); the skips that recalibrated each new scale
(``recalibration_skips``); and the note a run carries for one restart (a resume that
re-created the scaler without ``load_state_dict``: ``resumed_note``). Read by
``rules/misuse.py`` (``scaler_recreated``) and ``notes.py``.
"""

from __future__ import annotations

import numpy as np

from ..numfmt import count, fmt
from ..runfile.schema import Event
from .facts import Facts

BLOCK = 1 << 20  # steps compared at a time (``scale_jumps``)


def scale_jumps(f: Facts) -> np.ndarray:
    """Positions ``i`` where the scale before step ``i + 1``'s update is over 1.5x the scale
    after step ``i``'s, both finite: the scale jumped back up outside update(). Compared in
    float64 a million steps at a time (two float64 copies of a month-long run's scales were
    160 MB), once per run."""
    def find() -> np.ndarray:
        before, after = f.steps["scale"], f.steps["scale_after"]
        found = [np.zeros(0, np.int64)]
        for a in range(0, len(before) - 1, BLOCK):
            b = min(a + BLOCK, len(before) - 1)
            nxt, prev = before[a + 1:b + 1].astype(float), after[a:b].astype(float)
            with np.errstate(invalid="ignore"):
                found.append(a + np.flatnonzero(np.isfinite(nxt) & np.isfinite(prev)
                                                & (nxt > prev * 1.5)))
        return np.concatenate(found)
    return f.memo("scale_jumps", find)


def scale_resets(f: Facts) -> list[int]:
    """Step numbers where the scale restarted after the first step: it jumped back up
    outside update(), or a GradScaler was created again."""
    jumps = scale_jumps(f)
    created = f.events(Event.SCALER_CREATED)
    return sorted({f.step_at(int(i) + 1) for i in jumps}
                  | {int(x) for x in created["step"] if int(x) > f.step_at(0)})


def resumed_note(f: Facts) -> list[str]:
    """A GradScaler that restarted once mid-run (a resume that re-created it without
    ``load_state_dict``): not a misuse, but its recalibration cost steps."""
    if not f.n or not f.has_scaler:
        return []
    resets = scale_resets(f)
    if len(resets) != 1:
        return []
    at = f.index_of(resets[0])
    skips = len(recalibration_skips(f, [at]))
    init = float(f.steps["scale"][at])
    return [f"The loss scale restarted at {fmt(init)} at step {resets[0]} (a GradScaler "
            "created again, as a resume does, without its state restored): it skipped "
            f"{count(skips, 'step')} to recalibrate. Save scaler.state_dict() with the "
            "checkpoint and load it at the resume to keep its scale."]


def recalibration_skips(f: Facts, resets: list[int]) -> frozenset:
    """Step numbers of the skips that follow each reset of the scale (a new scaler's
    calibration from init_scale): the run of skipped steps starting at each reset index."""
    skipped, out = f.skipped, set()
    for i in set(resets):
        while 0 <= i < f.n and skipped[i]:
            out.add(f.step_at(i))
            i += 1
    return frozenset(out)
