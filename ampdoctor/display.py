"""How data objects print without importing their renderers.

A data object (``Diagnosis``, ``Comparison``, ``ReleaseReport``...) inherits ``Displayable``:
``str(x)`` and Jupyter's ``_repr_markdown_``/``_repr_html_`` look up a renderer registered for
its class and format. The renderers live in ``ampdoctor.render`` and register themselves with
``@renders(cls, fmt)``, so rendering depends on data and never the reverse. The package
façade (``ampdoctor/__init__.py``) calls ``set_loader`` with a function that imports
``ampdoctor.render``; it runs the first time a lookup misses, so printing works whichever
module made the object.

Example::

    from ampdoctor import display

    @display.renders(Diagnosis, "text")
    def render_text(d: Diagnosis) -> str: ...

    str(diagnosis)  # -> render_text(diagnosis)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

Renderer = Callable[[Any], str]

_RENDERERS: dict[tuple[type, str], Renderer] = {}
_loader: Optional[Callable[[], object]] = None
_loaded = False


def renders(cls: type, fmt: str) -> Callable[[Renderer], Renderer]:
    """Register the decorated function as the ``fmt`` renderer of ``cls`` (and its subclasses)."""

    def register(fn: Renderer) -> Renderer:
        _RENDERERS[(cls, fmt)] = fn
        return fn

    return register


def set_loader(fn: Callable[[], object]) -> None:
    """Set what imports the renderers (called once, by the package façade)."""
    global _loader, _loaded
    _loader, _loaded = fn, False


def lookup(obj: Any, fmt: str) -> Optional[Renderer]:
    """The renderer of ``obj`` in ``fmt``, or None; loads the renderers on the first miss."""
    global _loaded
    for klass in type(obj).__mro__:
        fn = _RENDERERS.get((klass, fmt))
        if fn is not None:
            return fn
    if not _loaded and _loader is not None:
        _loaded = True
        _loader()
        return lookup(obj, fmt)
    return None


def render(obj: Any, fmt: str) -> str:
    """``obj`` rendered in ``fmt``; LookupError when nothing renders it so."""
    fn = lookup(obj, fmt)
    if fn is None:
        raise LookupError(f"no {fmt} renderer for {type(obj).__name__}")
    return fn(obj)


class Displayable:
    """Mixin: ``str()`` and Jupyter display through the registry (formats not registered fall
    back to ``repr`` for text and to nothing for Jupyter, which then tries the next one)."""

    def __str__(self) -> str:
        fn = lookup(self, "text")
        return fn(self) if fn is not None else repr(self)

    def _repr_markdown_(self) -> Optional[str]:
        fn = lookup(self, "markdown")
        return fn(self) if fn is not None else None

    def _repr_html_(self) -> Optional[str]:
        fn = lookup(self, "html")
        return fn(self) if fn is not None else None
