"""Per-step arrays of the sampled tier, held over the sampled steps only (``SampledSteps``).

The streamed reduction of /stats (``streamed.Reduced``) keeps about twenty values per step:
the largest output abs max, the underflowing gradient elements, the weight norms... Only the
sampled steps have any (every 100th by default), yet held over every step of a run of ten
million steps they took 80 MB each, 1.6 GB in all. Here they are held over the sampled steps,
in step order, and a rule that reads one gets it over every step (``dense``: NaN or 0 where
nothing was sampled), built when read, as the rules have always indexed them.

Example::

    per = SampledSteps(10, {"out_bad": (np.int64, 0)})
    k = per.index(np.array([3, 3, 7]))      # [0, 0, 1]
    np.add.at(per.parts["out_bad"], k, 1)
    per.dense("out_bad")                    # [0 0 0 2 0 0 0 1 0 0]
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SampledSteps:
    """Arrays over the step positions seen (``positions``, sorted), one per field of
    ``fields`` (name -> (dtype, the value of a step nothing was seen on))."""

    def __init__(self, n: int, fields: dict[str, tuple[Any, Any]]):
        self.n = n
        self.fields = fields
        self.positions = np.zeros(0, np.int64)
        self.parts = {name: np.zeros(0, dtype) for name, (dtype, _fill) in fields.items()}

    def index(self, pos: np.ndarray) -> np.ndarray:
        """Where each step position of ``pos`` is held, those not held yet added (every part
        is then a new array: fetch ``parts`` after this)."""
        held = self.positions
        at = np.minimum(np.searchsorted(held, pos), max(len(held) - 1, 0))
        fresh = pos[held[at] != pos] if len(held) else pos
        if len(fresh):
            # (rows arrive in step order: new steps come sorted, after those held)
            ordered = bool(np.all(fresh[1:] >= fresh[:-1]))
            new = _distinct(fresh) if ordered else np.unique(fresh)
            merged = np.concatenate([held, new])
            if len(held) and new[0] < held[-1]:
                merged.sort()
            where = np.searchsorted(merged, self.positions)
            for name, (dtype, fill) in self.fields.items():
                grown = np.full(len(merged), fill, dtype)
                grown[where] = self.parts[name]
                self.parts[name] = grown
            self.positions = merged
        return np.searchsorted(self.positions, pos)

    def spread(self, values: np.ndarray, fill: Any) -> np.ndarray:
        """``values`` (one per position held) over every step, ``fill`` elsewhere."""
        out = np.full(self.n, fill, values.dtype)
        out[self.positions] = values
        return out

    def dense(self, name: str) -> np.ndarray:
        return self.spread(self.parts[name], self.fields[name][1])

    def seen(self) -> np.ndarray:
        """Per step: was anything held for it?"""
        out = np.zeros(self.n, bool)
        out[self.positions] = True
        return out


class PerStep:
    """A per-step array of an object with ``per_step`` (a ``SampledSteps``), read over every
    step: ``reduced.out_absmax``."""

    def __set_name__(self, owner: Any, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> np.ndarray:
        return obj.per_step.dense(self.name)


def _distinct(ordered: np.ndarray) -> np.ndarray:
    """The distinct values of a sorted array (``np.unique`` without its sort)."""
    keep = np.ones(len(ordered), bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep]
