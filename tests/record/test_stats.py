"""ampdoctor.record.stats against a plain numpy reference, on edge values and random tensors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.record import stats
from ampdoctor.runfile import schema

EDGE = [0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, -70000.0, 32768.0, 32767.0, 6.1035e-5,
        6.0e-5, 5.96e-8, 5.9e-8, 1e-9, 1e-30, 1e-39, 1e-41, 3.3e38, 3.39e38, math.inf,
        -math.inf, math.nan, 1.5e-45]


def reference(values: np.ndarray) -> dict:
    """Straightforward definitions, one boolean mask per statistic."""
    x = values.astype(np.float64).ravel()
    a = np.abs(x)
    finite = np.isfinite(x)
    nz = finite & (a > 0)
    out = {
        "numel": x.size,
        "nan": int(np.isnan(x).sum()),
        "posinf": int((x == np.inf).sum()),
        "neginf": int((x == -np.inf).sum()),
        "zeros": int((x == 0).sum()),
        "over16": int((finite & (a > 65504)).sum()),
        "near16": int((finite & (a >= 2**15)).sum()),
        "sub16": int((nz & (a < 2**-14)).sum()),
        "flush16": int((nz & (a < 2**-24)).sum()),
        "overbf16": int((finite & (a > schema.BF16_MAX)).sum()),
        "subbf16": int((nz & (a < 2**-126)).sum()),
        "flushbf16": int((nz & (a < 2**-133)).sum()),
    }
    not_nan = ~np.isnan(x)
    out["absmax"] = float(a[not_nan].max()) if not_nan.any() else math.nan
    out["absmin"] = float(a[nz].min()) if nz.any() else math.inf
    out["rms"] = float(np.sqrt(np.mean(x[finite] ** 2))) if finite.any() else math.nan
    out["nonfinite"] = (1 if out["nan"] else 0) | (2 if out["posinf"] else 0) | (
        4 if out["neginf"] else 0)
    return out


def check(row, ref, rtol=1e-5):
    for key in ("numel", "nan", "posinf", "neginf", "zeros", "over16", "near16", "sub16",
                "flush16", "overbf16", "subbf16", "flushbf16", "nonfinite"):
        assert int(row[key]) == ref[key], key
    assert row["sample_n"] == ref["numel"]
    for key in ("absmax", "absmin"):  # stored as float32 in the run file
        np.testing.assert_allclose(float(row[key]), float(np.float32(ref[key])), rtol=rtol,
                                   err_msg=key)
    if math.isfinite(ref["rms"]) and ref["rms"] < 1e38:
        np.testing.assert_allclose(float(row["rms"]), float(np.float32(ref["rms"])), rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_edge_values_match_numpy(dtype):
    t = torch.tensor(EDGE, dtype=torch.float64).to(dtype)
    row = stats.exact(t)
    # The reference sees exactly the values the tensor holds (after rounding to dtype).
    check(row, reference(t.double().numpy()))
    assert row["dtype"] == stats.dtype_code(dtype)


def test_fp16_rounding_is_what_gets_counted():
    t = torch.tensor([65504.0, 65519.0, 65520.0, 1e-8, 3e-8], dtype=torch.float32)
    row = stats.exact(t.half())
    # 65520 rounds to inf in fp16; 1e-8 flushes to 0; 3e-8 becomes the smallest subnormal.
    assert row["posinf"] == 1 and row["zeros"] == 1 and row["flush16"] == 0
    assert row["absmax"] == np.inf
    row32 = stats.exact(t)
    # In fp32 both 65519 and 65520 exceed fp16's largest finite value, 65504.
    assert row32["over16"] == 2 and row32["flush16"] == 2 and row32["posinf"] == 0


def test_bf16_threshold_is_not_rounded():
    # 65280 is a bf16 value below 65504; the next bf16 value, 65536, is above it.
    t = torch.tensor([65280.0, 65536.0], dtype=torch.bfloat16)
    row = stats.exact(t)
    assert row["over16"] == 1 and row["near16"] == 2


@pytest.mark.parametrize("t", [torch.empty(0), torch.arange(5), torch.ones(3, dtype=torch.bool),
                               torch.ones(3, dtype=torch.complex64),
                               torch.ones(3, 3).to_sparse(), None, "x"])
def test_unmeasurable_tensors_are_skipped(t):
    assert stats.exact(t) is None if isinstance(t, torch.Tensor) else not stats.measurable(t)
    c = stats.Collector()
    assert c.add(t) is None
    assert len(c.drain()) == 0


def test_sampled_mode_is_exact_on_small_tensors_and_on_absmax():
    torch.manual_seed(0)
    small = torch.tensor(EDGE)
    big = torch.randn(300, 257) * 1e-5
    big[17, 3] = 70000.0
    big[290, 200] = -math.inf
    c = stats.Collector(sample=1024)
    assert c.add(small) == 0 and c.add(big) == 1
    rows = c.drain()
    check(rows[0], reference(small.numpy()))
    assert rows[1]["sample_n"] == 1024 and rows[1]["numel"] == big.numel()
    assert rows[1]["absmax"] == np.inf  # exact: the single -inf is not in the sample
    assert rows[1]["nonfinite"] == 4
    # Counts are an estimate out of sample_n: ~98% of 1e-5-sized values sit in the fp16
    # subnormal band (|x| < 6.1e-5).
    frac = rows[1]["sub16"] / rows[1]["sample_n"]
    assert 0.9 < frac <= 1.0


def test_sampled_absmax_with_nan_falls_back_to_the_sample():
    t = torch.ones(10000)
    t[5] = math.nan
    t[7] = 3.0
    c = stats.Collector(sample=100)
    c.add(t)
    row = c.drain()[0]
    assert row["nonfinite"] & 1
    assert row["absmax"] <= 3.0


def test_sample_positions_spread_over_columns():
    # A plain stride of numel/sample would hit one column of a 64 x 4096 matrix every time.
    idx = stats.sample_index(64 * 4096, 4096, torch.device("cpu"))
    cols = np.unique(idx.numpy() % 4096)
    rows = np.unique(idx.numpy() // 4096)
    assert len(cols) > 2000 and len(rows) == 64
    assert len(np.unique(idx.numpy())) == 4096


def test_collector_keeps_slot_order_across_dtypes():
    c = stats.Collector(sample=8)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    tensors = [torch.full((5,), float(i + 1), dtype=dtypes[i % 3]) for i in range(9)]
    for t in tensors:
        c.add(t)
    rows = c.drain()
    np.testing.assert_array_equal(rows["absmax"], np.arange(1, 10, dtype=np.float32))
    assert len(c) == 0


def test_non_contiguous_and_fp16_inputs():
    t = torch.randn(64, 32).half().t()
    row = stats.exact(t)
    check(row, reference(t.double().numpy()), rtol=1e-3)
    c = stats.Collector(sample=t.numel())
    c.add(t)
    check(c.drain()[0], reference(t.double().numpy()), rtol=1e-3)


def test_exact_chunks_merge(monkeypatch):
    monkeypatch.setattr(stats, "EXACT_CHUNK", 7)
    t = torch.tensor(EDGE + [4.0, -3.0, 1e-6, 2.0])
    check(stats.exact(t), reference(t.numpy()))


def test_no_host_sync_needed_to_add(monkeypatch):
    """add() must not read values on the host: .item() / .cpu() are the sync points."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append("item"))
    c = stats.Collector()
    c.add(torch.randn(1000))
    c.add(torch.randn(10).half())
    assert calls == []


values = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from(EDGE))


@settings(max_examples=150, deadline=None)
@given(st.lists(values, min_size=1, max_size=60),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_property_exact_matches_reference(xs, dtype):
    t = torch.tensor(xs, dtype=torch.float32).to(dtype)
    check(stats.exact(t), reference(t.double().numpy()), rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(values, min_size=1, max_size=300), st.integers(8, 64))
def test_property_sampled_counts_are_bounded_and_absmax_exact(xs, sample):
    t = torch.tensor(xs, dtype=torch.float32)
    c = stats.Collector(sample=sample)
    c.add(t)
    row = c.drain()[0]
    ref = reference(t.numpy())
    assert row["sample_n"] == min(len(xs), sample)
    for key in ("nan", "posinf", "neginf", "zeros", "over16", "sub16", "flush16"):
        assert 0 <= row[key] <= row["sample_n"]
    if ref["nan"] == 0:
        np.testing.assert_allclose(float(row["absmax"]), ref["absmax"], rtol=1e-6)
        assert row["nonfinite"] == ref["nonfinite"]
    else:
        assert row["nonfinite"] & 1
