"""Each fix's premise (``diagnosis/fixes/premises.py``), declared once on its ``@fix``: what
rules it out, that ``make`` offers no fix whose premise fails, and that the docs list them."""

import os
import re

from conftest import ROOT

from ampdoctor.diagnosis.fixes import PREMISES, Context, make, unmet
from ampdoctor.diagnosis.fixes.premises import DOMAIN, OVERFLOW, nonfinite_kind, relu_free
from ampdoctor.runfile.detail import OpRecord


def ids(ctx):
    return [fx.id for fx in make(["fp32_island", "scale_attention", "use_bf16", "lower_lr",
                                  "revive_units"], ctx)]


def culprit(fp32_finite, op=None, created=("posinf",), dtype="float16"):
    found = OpRecord(op=op, created=list(created), dtype=dtype) if op else None
    return {"module": "blocks.0.attn", "phase": "forward", "fp32_finite": fp32_finite,
            "op": found}


def test_a_range_failure_gets_every_precision_fix():
    ctx = Context(low="fp16", lr=1e-3, culprit=culprit(1, "matmul"))
    assert ids(ctx) == ["fp32_island", "scale_attention", "use_bf16", "lower_lr",
                        "revive_units"]


def test_a_nan_fp32_makes_too_gets_no_precision_fix():
    """A softmax over a fully masked row: NaN in fp32 too; bf16 has fp32's range."""
    ctx = Context(low="fp16", culprit=culprit(0, "softmax", ("nan",)))
    assert not {"fp32_island", "scale_attention", "use_bf16"} & set(ids(ctx))
    fx = make(["lower_lr"], ctx)[0]
    ctx.culprit = culprit(0)
    assert "non-finite too" in PREMISES["use_bf16"](ctx, fx)


def test_a_cancellation_gets_no_bf16():
    """A one-pass variance: sqrt of a negative from finite inputs, finite in fp32."""
    ctx = Context(low="fp16", culprit=culprit(1, "sqrt", ("nan",)))
    assert nonfinite_kind(ctx.culprit["op"]) == DOMAIN
    assert "use_bf16" not in ids(ctx) and "fp32_island" in ids(ctx)
    ctx.culprit = culprit(1, "div", ("nan",))  # 0/0 of a value fp16 flushed: range, bf16 helps
    assert "use_bf16" in ids(ctx)


def test_no_bf16_for_a_run_already_in_bf16_and_no_island_for_an_op_already_in_fp32():
    assert "use_bf16" not in ids(Context(low="bf16"))
    op = culprit(-1, "exp", ("posinf",), dtype="float32")
    assert nonfinite_kind(op["op"]) == OVERFLOW
    assert "fp32_island" not in ids(Context(culprit=op))
    assert "fp32_island" in ids(Context(culprit=dict(op, fp32_finite=1)))


def test_no_lower_lr_at_lr_0_and_no_revive_units_without_a_relu():
    assert "lower_lr" not in ids(Context(lr=0.0))
    assert relu_free(["Linear", "SiLU", "GroupNorm"]) and not relu_free(["SiLU", "ReLU"])
    assert not relu_free(["Linear"])  # F.relu called as a function: not measured
    assert "revive_units" not in ids(Context(relu_free=True))


def test_a_clip_is_the_scripts_own():
    ctx = Context(lr=1e-2, clip_max_norm=0.5)
    fx = make(["lower_lr"], ctx)[0]
    assert unmet(fx, ctx) is None
    fx.values["max_norm"] = 1.0
    assert "already clips at 0.5" in unmet(fx, ctx)


def test_the_docs_list_each_fix_with_a_premise():
    with open(os.path.join(ROOT, "docs", "verdicts.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text[text.index("### A fix's premise"):]
    section = section[:section.index("\n\n", section.index("| fix | premise |"))]
    listed = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert listed == set(PREMISES)
