"""The mechanism behind every door of ``patches``: ``Patch`` (one attribute of torch replaced,
put back on ``remove``), ``PatchSet`` (patches and hook handles that go away together),
``guard`` (a callback's failure goes to a fault handler, never to the training loop) and the
marks that tell a wrapper made here from the function it wraps.

Like ``patches``, its code only passes calls through: ``exits.RECORDING_CODE`` and
``tests/record/test_host_reads.py`` leave it out.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .listener import Fault

MARK = "__ampdoctor_original__"  # on a wrapper made here: the function it wraps
_LISTENER = "__ampdoctor_listener__"
_compiling = torch.compiler.is_compiling


class Patch:
    """One attribute of ``owner`` replaced by ``wrapper``; ``remove`` puts the original back."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable], Callable],
                 listener: Any = None):
        self.owner = owner
        self.name = name
        self.original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        self.wrapper = make(self.original)
        setattr(self.wrapper, MARK, self.original)
        setattr(self.wrapper, _LISTENER, listener)
        setattr(owner, name, self.wrapper)

    def remove(self) -> None:
        if self.owner is None:
            return
        if getattr(self.owner, self.name, None) is self.wrapper:
            setattr(self.owner, self.name, self.original)
        self.owner = None


class Entry:
    """A key of a dict, deleted on ``remove`` (if still there)."""

    def __init__(self, table: dict, key: Any):
        self.table, self.key = table, key

    def remove(self) -> None:
        self.table.pop(self.key, None)


class PatchSet:
    """Patches and hook handles that go away together. A context manager."""

    def __init__(self) -> None:
        self._items: list[Any] = []

    def add(self, item: Any) -> Any:
        self._items.append(item)
        return item

    def remove(self) -> None:
        while self._items:
            self._items.pop().remove()

    def __enter__(self) -> "PatchSet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def guard(fault: Fault, fn: Optional[Callable[..., Any]], *args: Any) -> Any:
    """Call ``fn(*args)`` (nothing when ``fn`` is None); an exception goes to ``fault(exc,
    fn.__name__)``, not the caller.

    Under dynamo's tracing ``is_compiling()`` is a constant True: the call is left out of the
    graph (no graph break, nothing traced of the recorder's state).
    """
    if fn is None or _compiling():
        return None
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a debugger must never break the run it watches
        fault(exc, getattr(fn, "__name__", type(fn).__name__))
        return None


def subclasses(base: type) -> list[type]:
    """``base`` and every subclass of it defined so far, at any depth (the user's included),
    each once: the classes whose own methods a patch on ``base`` must wrap too."""
    classes, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes.append(cls)
            todo.extend(cls.__subclasses__())
    return classes


def wrapped_for(fn: Any, key: Any) -> bool:
    """Is ``key`` (the door or callback a wrapper was made for) already behind ``fn`` (a chain
    of wrappers made here)? A bound method is made anew at each access: compared by ``==``."""
    while hasattr(fn, MARK):
        mark = getattr(fn, _LISTENER, None)
        if mark is not None and mark == key:
            return True
        fn = getattr(fn, MARK)
    return False


def original(fn: Any) -> Any:
    """The unpatched function behind a wrapper made here (or ``fn`` itself)."""
    return getattr(fn, MARK, fn)
