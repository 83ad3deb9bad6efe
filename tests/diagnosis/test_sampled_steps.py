"""The per-step arrays of the sampled tier held over the sampled steps only
(``diagnosis/sampled.py``), read over every step as the rules index them."""

import numpy as np

from ampdoctor.diagnosis.sampled import SampledSteps


def test_values_land_on_their_steps_in_any_order_of_arrival():
    per = SampledSteps(12, {"bad": (np.int64, 0), "top": (np.float64, np.nan)})
    dense_bad, dense_top = np.zeros(12, np.int64), np.full(12, np.nan)
    for pos, value in ((np.array([4, 4, 8]), 1.0), (np.array([0, 8, 11]), 3.0),
                       (np.array([4]), 2.0)):
        k = per.index(pos)
        np.add.at(per.parts["bad"], k, 1)
        np.fmax.at(per.parts["top"], k, np.full(len(k), value))
        np.add.at(dense_bad, pos, 1)
        np.fmax.at(dense_top, pos, np.full(len(pos), value))
    np.testing.assert_array_equal(per.positions, [0, 4, 8, 11])
    np.testing.assert_array_equal(per.dense("bad"), dense_bad)
    np.testing.assert_array_equal(per.dense("top"), dense_top)
    np.testing.assert_array_equal(per.seen(), np.isin(np.arange(12), [0, 4, 8, 11]))


def test_nothing_seen_reads_as_the_fill():
    per = SampledSteps(3, {"n": (np.float64, 0.0)})
    np.testing.assert_array_equal(per.dense("n"), np.zeros(3))
    assert not per.seen().any()
