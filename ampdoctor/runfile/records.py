"""Records: the JSON objects the run file nests, declared once as frozen dataclasses that
both sides use. The recorder builds one and writes ``to_json()``; the analysis side reads it
back with ``from_json(value)`` and reads its fields as attributes, so mypy checks the writer's
keyword arguments and the reader's attribute names and types against the one declaration.

A field's type is its JSON type: ``str``, ``int``, ``float``, ``bool``, another ``Record``,
``list[...]``, ``dict[str, ...]``, a union of them (``X | None``), or ``Any`` (taken as
read). ``from_json`` is lenient, as a reader of an older or damaged file must be: a key the
file lacks, or a value not of the field's type, reads as the field's default (the reading an
older format gets); a key the record does not declare is not read. ``to_json`` writes each
field under its name (``NAMES`` where a JSON key is a Python keyword), in declaration order,
leaving out the fields named in ``OMIT`` while they are None (keys a writer adds only where
they apply) and writing the floats named in ``AS_TEXT`` (or a list's floats) as text where not
finite, so that a
record writes the same JSON the plain dict it replaced wrote; a float read as that text is
the number again.

This module imports the standard library only, as the rest of ``runfile/`` imports no torch.

Example::

    @dataclass(frozen=True)
    class Point(Record):
        x: float = 0.0
        label: str | None = None
        OMIT = frozenset({"label"})

    Point(x=2.0).to_json()                      # {'x': 2.0}
    Point.from_json({"x": "two"}).x             # 0.0: not a number, its default
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, ClassVar, Mapping, TypeVar, cast

R = TypeVar("R", bound="Record")
_BAD: Any = object()  # a value not of the field's type
NOT_FINITE = ("nan", "inf", "-inf")  # a float as AS_TEXT writes it where not finite


class Record:
    """The base of a frozen dataclass written to the run file as a JSON object."""

    OMIT: ClassVar[frozenset[str]] = frozenset()  # fields left out of the JSON while None
    # float fields written as text where not finite ("inf", "nan": JSON has no NaN)
    AS_TEXT: ClassVar[frozenset[str]] = frozenset()
    NAMES: ClassVar[Mapping[str, str]] = {}  # field -> its JSON key, where they differ

    def to_json(self) -> dict[str, Any]:
        """The JSON object written: each field under its key (see the module docstring)."""
        out: dict[str, Any] = {}
        omit = self.omitted()
        for f in dataclasses.fields(cast(Any, self)):
            value = getattr(self, f.name)
            if value is None and f.name in omit:
                continue
            if f.name in self.AS_TEXT:
                value = [_text(v) for v in value] if isinstance(value, list) else _text(value)
            out[self.NAMES.get(f.name, f.name)] = plain(value)
        return out

    def to_text(self) -> str:
        """The JSON text of ``to_json()``: an event's ``text`` (what ``json.dumps`` writes of
        the same plain dict, a value JSON cannot hold as its ``str``)."""
        return json.dumps(self.to_json(), default=str)

    @classmethod
    def from_text(cls: type[R], text: Any) -> R:
        """The record in the JSON ``text``; all defaults where it is empty or not JSON."""
        try:
            value = json.loads(text) if text else {}
        except (ValueError, TypeError):
            value = {}
        return cls.from_json(value)

    def omitted(self) -> frozenset[str]:
        """The fields left out while None: ``OMIT`` (a record of two shapes narrows it)."""
        return self.OMIT

    @classmethod
    def from_json(cls: type[R], value: Any) -> R:
        """``value`` (parsed JSON) as this record: each field read from its key, its default
        where the key is missing or holds another type; ``value`` itself if a record already."""
        if isinstance(value, cls):
            return value
        raw = value if isinstance(value, dict) else {}
        hints = _hints(cls)
        found: dict[str, Any] = {}
        for f in dataclasses.fields(cast(Any, cls)):
            key = cls.NAMES.get(f.name, f.name)
            if key in raw:
                got = coerce(hints[f.name], raw[key])
                if got is not _BAD:
                    found[f.name] = got
        return cast(Any, cls)(**found)


def _text(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def plain(value: Any) -> Any:
    """``value`` with every record in it as its JSON object (what ``json.dumps`` takes)."""
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def read(hint: Any, value: Any, default: Any = None) -> Any:
    """``value`` read as the type ``hint`` (a record, ``list[Record]``, ...); ``default``
    where it is not of that type."""
    got = coerce(hint, value)
    return default if got is _BAD else got


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def coerce(hint: Any, value: Any) -> Any:
    """``value`` as ``hint``'s type, records built from their objects; ``_BAD`` if it is not."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(hint), value)
    if origin is list:
        return _list(typing.get_args(hint)[0], value)
    if origin is dict:
        return _dict(typing.get_args(hint)[1], value)
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value) if isinstance(value, (dict, hint)) else _BAD
    if not _scalar(hint, value):
        return _BAD
    return float(value) if isinstance(value, str) and hint is float else value


def _scalar(hint: Any, value: Any) -> bool:
    if hint is bool or isinstance(value, bool):
        return hint is bool and isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) or value in NOT_FINITE
    return isinstance(value, hint) if isinstance(hint, type) else False


def _union(options: tuple, value: Any) -> Any:
    if value is None:
        return None if type(None) in options else _BAD
    for option in options:
        if option is not type(None):
            got = coerce(option, value)
            if got is not _BAD:
                return got
    return _BAD


def _list(item: Any, value: Any) -> Any:
    if not isinstance(value, list):
        return _BAD
    return [got for got in (coerce(item, v) for v in value) if got is not _BAD]


def _dict(item: Any, value: Any) -> Any:
    if not isinstance(value, dict):
        return _BAD
    out = {k: coerce(item, v) for k, v in value.items() if isinstance(k, str)}
    return {k: v for k, v in out.items() if v is not _BAD}
