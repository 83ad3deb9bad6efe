"""The schema's contract on values, checked where rows are read (not in each rule that uses them).

``guard`` keeps a file's structure inside itself; this keeps its values within what a writer
writes: step numbers from 0 that never go back, ``/meta`` values of the type each key holds,
tensor ids that name a row of ``/tensors``, text references inside ``/blob``. A value outside
the contract is one sentence naming the file, the table and the row (``RunFileError``, exit 2),
so that no rule, view or exporter downstream meets it.

Example::

    values.check_steps("run.h5", rows)          # RunFileError: run.h5 is damaged: /steps row 2
                                                # holds step -5 (steps count up from 0)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import RunFileError

# /meta key -> the JSON type its value has (schema.py's list of /meta keys); null is taken
# for any key.
META_TYPES: dict[str, type] = {
    "status": str, "recorder": dict, "torch": dict, "roots": list, "model": dict,
    "device": dict, "compiled": dict, "sharding": dict, "scaler": dict, "optimizer": list,
    "autocast": dict, "clip": dict, "handles": dict, "applied": list,
    "losses": list, "skipped_modules": list, "fp8_layers": dict, "buffers": dict,
    "lr_range": dict}
_TYPE_WORDS: dict[type, str] = {str: "a text", dict: "an object", list: "a list"}


# Root attribute -> (its type, the least value a number may hold); a missing one is fine (each
# reader has its default). argv is JSON text, decoded by attributes.root_attrs.
ATTR_TYPES: dict[str, tuple[Any, Any]] = {
    "rank": (int, 0), "world_size": (int, 1), "pid": (int, 0), "created": ((int, float), None),
    "host": (str, None), "argv": (list, None), "ampdoctor_version": (str, None)}
_ATTR_WORDS = {int: "a whole number", str: "a text", list: "a list"}


def check_attrs(path: str, attrs: dict[str, Any]) -> None:
    """The root attributes a writer writes hold values of their type: ``rank`` a whole
    number from 0, ``world_size`` from 1 and above the rank, ``host`` a text..."""
    for key, (want, least) in ATTR_TYPES.items():
        if key not in attrs or attrs[key] is None:
            continue
        value = attrs[key]
        if isinstance(value, bool) or not isinstance(value, want):
            word = _ATTR_WORDS.get(want, "a number") if isinstance(want, type) else "a number"
            raise RunFileError(f"{path} is damaged: its root attribute {key} holds "
                               f"{_shown(value)} where {word} is expected")
        if least is not None and value < least:
            raise RunFileError(f"{path} is damaged: its root attribute {key} holds {value} "
                               f"(at least {least:g})")
        if key == "argv" and not all(isinstance(a, str) for a in value):
            raise RunFileError(f"{path} is damaged: its root attribute argv holds a list of "
                               "something else than texts")
    rank, world = attrs.get("rank"), attrs.get("world_size")
    if isinstance(rank, int) and isinstance(world, int) and rank >= world:
        raise RunFileError(f"{path} is damaged: its root attributes say rank {rank} of a "
                           f"world of {world}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def damaged(path: str, table: str, row: int, what: str) -> RunFileError:
    return RunFileError(f"{path} is damaged: /{table} row {row} {what}")


def check_steps(path: str, steps: np.ndarray, start: int = 0, before: int | None = None) -> None:
    """Step numbers are >= 0 and never go back, wall times neither infinite nor negative.
    (A learning rate may be anything a scheduler set: torch refuses a negative one only when
    the optimizer is made, and a schedule that passes 0 is a failure to diagnose, not damage.)
    ``start``: the row number of ``steps[0]``; ``before``: the step of the row before it (a
    follower's previous read)."""
    numbers = steps["step"]
    if not len(numbers):
        return
    negative = np.flatnonzero(numbers < 0)
    if len(negative):
        row = int(negative[0])
        raise damaged(path, "steps", start + row,
                      f"holds step {int(numbers[row])} (steps count up from 0)")
    if "time" in (steps.dtype.names or ()):
        # (NaN is the schema's "not measured", as in schema.empty; an infinite or negative
        # time is no time at all)
        clock = np.flatnonzero(np.isinf(steps["time"]) | (steps["time"] < 0))
        if len(clock):
            row = int(clock[0])
            raise damaged(path, "steps", start + row,
                          f"holds the wall time {float(steps['time'][row])!r} (a time "
                          "is in seconds since 1970)")
    previous = np.concatenate(([before if before is not None else numbers[0]], numbers[:-1]))
    back = np.flatnonzero(numbers < previous)
    if len(back):
        row = int(back[0])
        raise damaged(path, "steps", start + row,
                      f"holds step {int(numbers[row])} after step {int(previous[row])} "
                      "(steps never go back)")


# The counts inside /meta values the analysis takes as whole numbers (``int(...)``): each,
# where present and not null, a finite number from 0 (JSON lets a file say NaN or Infinity).
# A path: keys, '*' for every key of an object, '[]' for every item of a list.
META_COUNTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "recorder": (("every",), ("sample",), ("max_replays",)),
    "scaler": (("growth_interval",),),
    "model": (("trainable",), ("modules",), ("param_dtypes", "*")),
    "optimizer": (("[]", "groups"), ("[]", "param_dtypes", "*")),
}


def check_meta(path: str, key: str, value: Any, row: int) -> None:
    """A known ``/meta`` key holds a value of its type (or null), its counts whole numbers."""
    want = META_TYPES.get(key)
    if want is None or value is None:
        return
    if not isinstance(value, want):
        raise damaged(path, "meta", row, f"({key}) holds {_json_type(value)} where "
                                         f"{_TYPE_WORDS[want]} is expected")
    for where in META_COUNTS.get(key, ()):
        for name, count in _found(value, where, key):
            if count is not None and not _is_count(count):
                raise damaged(path, "meta", row, f"({key}) holds {name} = {_shown(count)} "
                                                 "where a count (a whole number from 0) is "
                                                 "expected")


def _found(value: Any, where: tuple[str, ...], name: str) -> list[tuple[str, Any]]:
    """(its name, the value) of each value at ``where`` inside ``value``."""
    if not where:
        return [(name, value)]
    step, rest = where[0], where[1:]
    if step == "[]":
        items = enumerate(value) if isinstance(value, list) else ()
        return [x for i, item in items for x in _found(item, rest, f"{name}[{i}]")]
    if not isinstance(value, dict):
        return []
    keys = list(value) if step == "*" else [step] if step in value else []
    return [x for k in keys for x in _found(value[k], rest, f"{name}.{k}")]


def _is_count(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return _TYPE_WORDS.get(type(value), "a value")


def check_ids(path: str, table: str, ids: np.ndarray, count: int, start: int = 0,
              none: int | None = None) -> None:
    """Every tensor id in ``ids`` (rows ``start``...) names one of ``count`` tensors, or is
    ``none`` (/events' -1: an event about no tensor)."""
    bad = np.flatnonzero(((ids < 0) | (ids >= count)) & (ids != none if none is not None
                                                         else True))
    if len(bad):
        row = int(bad[0])
        raise damaged(path, table, start + row,
                      f"names tensor {int(ids[row])}, which /tensors does not hold "
                      f"({count} tensors)")


def check_refs(path: str, table: str, rows: np.ndarray, texts: list[str], size: int,
               start: int = 0) -> None:
    """Every (``<text>_off``, ``<text>_len``) reference of ``rows`` lies inside a ``/blob`` of
    ``size`` bytes."""
    for text in texts:
        off = rows[f"{text}_off"].astype(np.int64)
        length = rows[f"{text}_len"].astype(np.int64)
        bad = np.flatnonzero((off < 0) | (length < 0) | (off > size - length))
        if len(bad):
            row = int(bad[0])
            raise damaged(path, table, start + row,
                          f"points at {text} past the end of /blob (offset {int(off[row])}, "
                          f"{int(length[row])} bytes, in {size})")
