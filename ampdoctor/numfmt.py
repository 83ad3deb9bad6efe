"""How a measured value is shown: the one number formatter of every text ampdoctor prints.

``diagnose``'s evidence and history, ``top``'s screen, ``parity``'s table and the release
report all show values through ``fmt``, so a loss scale or an abs max reads the same in each.
(Fix snippets write Python literals instead: see ``diagnosis/fixes/registry.py``.)

The rules:

* ``None`` is ``-`` (nothing measured); NaN and the infinities are ``nan``, ``inf``, ``-inf``;
  an ``int`` is a count and prints exactly.
* From ``SMALL`` up to ``LARGE``: an integral value prints exactly (a loss scale of 65536,
  fp16's 65504), any other with ``digits`` significant digits (252.2, 1.42, 0.00109).
* Below ``SMALL`` or from ``LARGE`` on: scientific notation with one digit fewer, the exponent
  saying the size, trailing zeros dropped (6.1e-05, 1.09e-04, 1e+09).

Example::

    fmt(65536.0), fmt(252.23), fmt(1.0899e-4), fmt(2.0 ** -14), fmt(None)
    # ('65536', '252.2', '1.09e-04', '6.1e-05', '-')
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LARGE", "SMALL", "count", "fmt"]

SMALL = 1e-3
LARGE = 1e5


def fmt(x: Any, digits: int = 4) -> str:
    """``x`` (a float, an int or None; numpy scalars too) as a reader sees it: see the module
    docstring for the rules."""
    if x is None:
        return "-"
    if isinstance(x, int) or getattr(getattr(x, "dtype", None), "kind", "") in ("i", "u"):
        return str(int(x))
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if SMALL <= abs(x) < LARGE:
        return str(int(x)) if x.is_integer() else f"{x:.{digits}g}"
    mantissa, exponent = f"{x:.{max(digits - 2, 0)}e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{exponent}"


def count(n: int, noun: str, plural: str = "") -> str:
    """A count with its noun in the right number: ``count(1, "step")`` is "1 step",
    ``count(3, "step")`` "3 steps", ``count(2, "replay", "replays")`` the same spelled out."""
    n = int(n)
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
