"""The fp8 counts of the sampled tier (record/fp8.py) against real casts.

Every recipe's rounding is emulated in float32 so that it runs on any device; here each one is
checked against ``Tensor.to(torch.float8_e4m3fn / torch.float8_e5m2)`` of the same scaled
values (clamped first: a saturating cast), element by element, and the counts and SQNR the
recorder writes against the ones the cast gives. Where torchao is installed its scale
functions (``amax_to_scale``, rowwise ``tensor_to_scale``, ``to_mx``) give the scales.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import fresh, train

import ampdoctor
from ampdoctor.errors import RecorderFault
from ampdoctor.record import fp8
from ampdoctor.runfile.schema import Fp8Format, Recipe, Role

CAST = {Fp8Format.E4M3: torch.float8_e4m3fn, Fp8Format.E5M2: torch.float8_e5m2}


def tensors():
    """Tensors that reach every corner: an outlier channel, tiny values that flush, a row
    count and width that are no multiple of 32, exact zeros, bf16 and a huge range."""
    g = torch.Generator().manual_seed(0)
    outlier = torch.randn(48, 96, generator=g)
    outlier[:, 5] *= 3000
    tiny = torch.randn(33, 70, generator=g) * torch.logspace(-12, 2, 70)
    zeros = torch.relu(torch.randn(4, 8, 40, generator=g))
    half = (torch.randn(16, 64, generator=g) * 50).bfloat16()
    wide = torch.randn(7, 100, generator=g) * torch.logspace(-30, 30, 100)
    return {"outlier": outlier, "tiny": tiny, "zeros": zeros, "bf16": half, "wide": wide}


def rows_of(ops, history=None):
    scale, summary = fp8.scales(ops, history)
    counts, formats = fp8.count(ops, scale, summary)
    return fp8.pack(ops, counts.double().numpy(), summary.double().numpy(), formats)


def scaled(ops, history=None):
    """Each recipe's scales for the values of the first of ``ops`` [recipes, S]."""
    return fp8.scales(ops, history)[0][:, 0, :ops[0].length]


def by_cast(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> dict:
    """What the real cast gives for values ``x`` (float32) at per-element ``scale``."""
    dtype = CAST[fmt]
    info = torch.finfo(dtype)
    y = x * scale
    q = y.clamp(-info.max, info.max).to(dtype).float()
    # Saturated: beyond what round-to-nearest keeps at the top (max + half its step).
    over = info.max + info.eps * 2.0 ** math.floor(math.log2(info.max)) / 2
    err = (x.double() - q.double() / scale.double())
    return {"q": q, "flushed": int(((x != 0) & (q == 0)).sum()),
            "subnormal": int(((q != 0) & (q.abs() < info.tiny)).sum()),
            "saturated": int((y.abs() > over).sum()), "zeros": int((x == 0).sum()),
            "sqnr": float(10 * torch.log10(x.double().square().sum() / err.square().sum()))}


@pytest.mark.parametrize("name", list(tensors()))
@pytest.mark.parametrize("role", list(Role))
def test_every_recipe_counts_what_a_real_cast_does(name, role):
    x = tensors()[name]
    ops = [fp8.measure(x, role, sample=None)]
    rows = rows_of(ops)
    values, scales = ops[0].values, scaled(ops)
    for recipe in Recipe:
        fmt = fp8.element_format(recipe, role)
        ref = by_cast(values, scales[recipe], fmt)
        fmax, emin, mbits, _ = fp8.FORMATS[fmt]
        q = fp8.quantise(values * scales[recipe], torch.tensor(fmax), torch.tensor(emin),
                         torch.tensor(mbits))
        assert torch.equal(q, ref["q"]), (name, recipe)  # bit for bit, every element
        row = rows[int(recipe)]
        assert row["format"] == fmt and row["sample_n"] == x.numel()
        for key in ("flushed", "subnormal", "saturated", "zeros"):
            assert row[key] == ref[key], (name, recipe, key, row[key], ref[key])
        assert row["sqnr_db"] == pytest.approx(ref["sqnr"], abs=0.02), (name, recipe)


def test_the_outlier_channel_flushes_under_per_tensor_scaling_not_under_mx():
    x = tensors()["outlier"]
    rows = rows_of([fp8.measure(x, Role.INPUT, sample=None)])
    flushed = {Recipe(r["recipe"]): r["flushed"] / r["sample_n"] for r in rows}
    assert flushed[Recipe.TENSOR] > 0.01 and flushed[Recipe.MX] < flushed[Recipe.TENSOR] / 4


def test_scales_follow_each_recipes_rule():
    x = tensors()["tiny"]
    op = fp8.measure(x, Role.GRAD_OUTPUT, sample=None)
    amax = float(x.abs().max())
    s = scaled([op])
    assert float(s[Recipe.TENSOR][0]) == pytest.approx(57344.0 / amax, rel=1e-6)  # e5m2
    rows = x.abs().amax(1).double()
    row_scale = 2.0 ** torch.floor(torch.log2(448.0 / rows))
    assert torch.equal(s[Recipe.ROWWISE].view(x.shape).double()[:, 0], row_scale)
    block0 = x[:, :32].abs().amax(1).double()
    mx = 2.0 ** -(torch.floor(torch.log2(block0)) - 8)
    assert torch.equal(s[Recipe.MX].view(x.shape).double()[:, 0], mx)


def test_delayed_scaling_takes_the_previous_amaxes_and_saturates_when_they_grow():
    g = torch.Generator().manual_seed(1)
    history = fp8.History(torch.device("cpu"), length=4)
    first = torch.randn(64, 64, generator=g)
    s = scaled([fp8.measure(first, Role.INPUT, sample=None)], history)
    assert float(s[Recipe.DELAYED][0]) == float(s[Recipe.TENSOR][0])  # no history yet
    grown = first * 4  # a jump the previous amax does not cover
    ops = [fp8.measure(grown, Role.INPUT, sample=None)]
    prev = 448.0 / float(first.abs().max())
    rows = rows_of(ops, history)
    assert float(rows[Recipe.DELAYED]["scale"]) == pytest.approx(prev, rel=1e-6)
    assert rows[Recipe.DELAYED]["saturated"] == int((grown * prev).abs().gt(464).sum()) > 0
    assert rows[Recipe.TENSOR]["saturated"] == 0
    # the same tensor twice in one drain: the second sees the first's amax
    twice = [fp8.measure(first, Role.INPUT, sample=None), fp8.measure(grown, Role.INPUT,
                                                                       sample=None)]
    history = fp8.History(torch.device("cpu"), length=4)
    rows = rows_of(twice, history)
    assert float(rows[4 + Recipe.DELAYED]["scale"]) == pytest.approx(prev, rel=1e-6)
    # ... and after four more, the first has left a history of four
    for _ in range(4):
        rows_of([fp8.measure(first * 0.5, Role.INPUT, sample=None)], history)
    rows = rows_of([fp8.measure(first, Role.INPUT, sample=None)], history)
    assert float(rows[Recipe.DELAYED]["scale"]) == pytest.approx(prev * 2, rel=1e-6)


def test_sampled_counts_estimate_the_exact_ones():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 256, generator=g)
    x[:, 7] *= 3000
    exact = rows_of([fp8.measure(x, Role.INPUT, sample=None)])
    sampled = rows_of([fp8.measure(x, Role.INPUT, sample=1024)])
    assert (sampled["sample_n"] == 1024).all()
    for e, s in zip(exact, sampled):
        assert abs(s["subnormal"] / 1024 - e["subnormal"] / e["sample_n"]) < 0.05
    # SQNR from a sample is noisy where a few elements hold the energy (the outlier column:
    # 1 in 256); on a tensor without one it is close.
    plain = torch.randn(512, 256, generator=g)
    exact = rows_of([fp8.measure(plain, Role.INPUT, sample=None)])
    sampled = rows_of([fp8.measure(plain, Role.INPUT, sample=1024)])
    assert np.allclose(sampled["sqnr_db"], exact["sqnr_db"], atol=1.0)
    small = torch.randn(8, 40, generator=g)  # no larger than the sample: counted exactly
    assert np.array_equal(rows_of([fp8.measure(small, Role.WEIGHT, sample=1024)]),
                          rows_of([fp8.measure(small, Role.WEIGHT, sample=None)]))


@pytest.mark.parametrize("cols", [96, 100, 31])
def test_a_sampled_values_block_and_row_amax_are_those_of_the_whole_tensor(cols):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, cols, generator=g) * torch.logspace(-3, 3, cols)
    sampled = fp8.measure(x, Role.INPUT, sample=1024)
    idx = fp8.stats.sample_index(x.numel(), 1024, x.device)
    # the reference: each sampled value's block, sliced from its row
    reference = torch.stack([x[i // cols, (i % cols) // 32 * 32:(i % cols) // 32 * 32 + 32]
                             .abs().max() for i in idx.tolist()])
    assert torch.equal(sampled.block_amax, reference)
    assert torch.equal(sampled.row_amax, x.abs().amax(1)[idx // cols])
    assert float(sampled.amax) == float(x.abs().max())
    small = torch.randn(3, cols, generator=g)  # fewer elements than the sample: padded
    op = fp8.measure(small, Role.INPUT, sample=1024)
    assert op.length == small.numel() and len(op.values) == len(op.block_amax) == 1024
    exact = fp8.measure(small, Role.INPUT, sample=None)
    assert torch.equal(op.block_amax[:op.length], exact.block_amax)


@pytest.mark.parametrize("name", ["outlier", "tiny", "bf16"])
def test_scales_and_casts_agree_with_torchao(name):
    pytest.importorskip("torchao")
    from torchao.float8.float8_utils import ScalingGranularity, amax_to_scale, tensor_to_scale
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = tensors()[name].float()
    op = fp8.measure(x, Role.INPUT, sample=None)
    ours = scaled([op]).view(len(fp8.RECIPES), *x.shape)
    e4m3 = torch.float8_e4m3fn
    assert torch.equal(ours[Recipe.TENSOR][0, 0], amax_to_scale(x.abs().max(), e4m3))
    rowwise = tensor_to_scale(x, e4m3, scaling_granularity=ScalingGranularity.AXISWISE,
                              axiswise_dim=-1, round_scales_to_power_of_2=True)
    assert torch.equal(ours[Recipe.ROWWISE][:, :1], rowwise)
    if x.shape[-1] % 32 == 0:  # to_mx takes whole blocks only
        scale_e8m0, data = to_mx(x, e4m3, 32)
        q = fp8.quantise(x * ours[Recipe.MX], torch.tensor(448.0), torch.tensor(-6),
                         torch.tensor(3))
        assert torch.equal(q, data.float())
        exponent = scale_e8m0.view(torch.uint8).int() - 127
        expected = torch.ldexp(torch.ones(exponent.shape), -exponent).view(x.shape[0], -1)
        assert torch.equal(ours[Recipe.MX][:, ::32], expected)


# -- in the recorder --------------------------------------------------------------------------


def _recorded(path, **options):
    model, opt = fresh()
    losses = train(model, opt, steps=4, dtype=torch.bfloat16,
                   recorder_ctx=ampdoctor.watch(model, opt, path=path, every=2, strict=True,
                                                **options))
    return losses, [p.detach().clone() for p in model.parameters()]


def test_the_fp8_counts_change_nothing_and_can_be_turned_off(tmp_path):
    on = _recorded(str(tmp_path / "on.h5"))
    off = _recorded(str(tmp_path / "off.h5"), fp8=False)
    assert on[0] == off[0]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(on[1], off[1]))
    with ampdoctor.load(str(tmp_path / "on.h5")) as run:
        rows = run.fp8.rows()
        assert run.recorder_settings["fp8"] is True
        assert sorted(set(rows["step"])) == [0, 2]  # the sampled steps only
        layers = {run.tensor_name(int(t)) for t in rows["tensor"]}
        assert layers == {"fc1", "block.0", "head"}  # TinyNet's Linear layers
        assert set(rows["role"]) == {int(r) for r in Role}
    with ampdoctor.load(str(tmp_path / "off.h5")) as run:
        assert run.recorder_settings["fp8"] is False and len(run.fp8) == 0


def test_a_failure_inside_the_fp8_counts_never_reaches_the_loop(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("fp8 bug")

    monkeypatch.setattr(fp8, "count", broken)
    path = str(tmp_path / "run.h5")
    with pytest.warns(RuntimeWarning, match="the fp8 counts stopped .RuntimeError: fp8 bug"):
        model, opt = fresh()
        losses = train(model, opt, steps=4, dtype=torch.bfloat16,
                       recorder_ctx=ampdoctor.watch(model, opt, path=path, every=2))
    assert len(losses) == 4
    with ampdoctor.load(path) as run:
        assert len(run.fp8) == 0 and len(run.stats) > 0  # the sampled tier went on
    with pytest.raises(RecorderFault, match="fp8 bug"):
        _recorded(path)


@pytest.mark.parametrize("name", list(tensors()))
def test_the_kurtosis_is_the_sampled_values_own(name):
    """The /fp8 ``kurtosis`` (the early warning's outlier figure) against numpy's, over every
    element (exact mode) and over the 1024 sampled positions; the same on a recipe's 4 rows."""
    x = tensors()[name]
    for sample in (None, 1024):
        op = fp8.measure(x, Role.INPUT, sample=sample)
        rows = rows_of([op])
        v = op.values[:op.length].double().numpy()
        d = v - v.mean()
        expected = (d ** 4).mean() / (d ** 2).mean() ** 2
        assert len(set(rows["kurtosis"].tolist())) == 1
        assert rows["kurtosis"][0] == pytest.approx(expected, rel=1e-3)
    # one Gaussian channel in 96 holding the energy: about 3 x 96; a Gaussian alone: about 3
    assert rows_of([fp8.measure(tensors()["outlier"], Role.INPUT, sample=None)])["kurtosis"][0] \
        == pytest.approx(3 * 96, rel=0.25)
    gauss = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    assert rows_of([fp8.measure(gauss, Role.INPUT)])["kurtosis"][0] == pytest.approx(3, abs=0.3)
