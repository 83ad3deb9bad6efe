"""The LR factor an optimizer's steps run with: the one seam between a treatment and the
recorder. ``record --apply lr_factor=F`` (or ``lr=LR``) makes each optimizer step with every
group's LR times F (``treatment.py`` sets it here, once per optimizer); the step log writes the
LR the step ran with, the group's LR times ``of(optimizer)`` (``steplog.py`` reads it here).
Neither imports the other.

Example::

    lrfactors.set(optimizer, 0.1)
    lrfactors.of(optimizer)          # 0.1; 1.0 for an optimizer no treatment touched
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

# Optimizer -> factor, held weakly: the factor goes with its optimizer. One treatment per
# process (``child.py`` installs it once), so one table per process.
_FACTORS: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()


def set(optimizer: Any, factor: float) -> None:  # noqa: A001 - the module is the namespace
    """Steps of ``optimizer`` run with every group's LR times ``factor`` from now on."""
    _FACTORS[optimizer] = factor


def get(optimizer: Any) -> Optional[float]:
    """The factor set for ``optimizer``, or None where none was."""
    try:
        return _FACTORS.get(optimizer)
    except TypeError:  # not weak-referenceable: never one a treatment set
        return None


def of(optimizer: Any) -> float:
    """The factor ``optimizer``'s LR is multiplied by in its steps (1.0: none)."""
    factor = get(optimizer)
    return 1.0 if factor is None else factor


def ran_with(optimizer: Any) -> list[float]:
    """Each param group's LR as ``optimizer``'s step ran with it (the group's LR times
    ``of(optimizer)``); NaN for an LR held in a tensor off the CPU, whose read would be a sync
    (steplog's /groups rows, objectives' /optimizers rows)."""
    factor = of(optimizer)
    out = []
    for g in optimizer.param_groups:
        lr = g.get("lr", math.nan)
        device = getattr(lr, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            out.append(math.nan)
            continue
        try:
            out.append(float(lr) * factor)
        except (TypeError, ValueError):
            out.append(math.nan)
    return out
