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


def scale_resets(f: Facts) -> list[int]:
    """Step numbers where the scale restarted after the first step: it jumped back up
    outside update(), or a GradScaler was created again."""
    s = f.steps
    before, after = s["scale"][1:].astype(float), s["scale_after"][:-1].astype(float)
    with np.errstate(invalid="ignore"):
        jumps = np.flatnonzero(np.isfinite(before) & np.isfinite(after) & (before > after * 1.5))
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
