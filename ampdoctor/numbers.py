"""How a measured value is shown in the diagnosis' evidence.

Example::

    fmt(252.23), fmt(2.0 ** -14)   # ('252.2', '6.1e-05')
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fmt"]


def fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"
