"""ampdoctor.numfmt.fmt: the one formatter of shown values (diagnose, top, parity, report)."""

import math

import numpy as np
import pytest

from ampdoctor.numfmt import fmt


@pytest.mark.parametrize("value,shown", [
    (None, "-"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (0.0, "0"),
    (123456789, "123456789"),  # a count, exactly
    (np.int64(123456), "123456"),
    (65536.0, "65536"), (65504.0, "65504"), (40000.0, "40000"),  # integral: exactly
    (252.23, "252.2"), (1.42, "1.42"), (0.4, "0.4"), (0.00109, "0.00109"),  # 4 digits
    (np.float32(1.42), "1.42"),
    (1.0899e-4, "1.09e-04"), (2.0 ** -14, "6.1e-05"), (1e-5, "1e-05"),  # small: 3 digits
    (123456.0, "1.23e+05"), (1e5, "1e+05"), (-1e9, "-1e+09"),  # large: 3 digits
])
def test_fmt(value, shown):
    assert fmt(value) == shown


def test_fmt_digits():
    assert fmt(2.345678, digits=6) == "2.34568" and fmt(1.0899e-4, digits=6) == "1.0899e-04"
