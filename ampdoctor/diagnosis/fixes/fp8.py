"""Fixes for a run that already trains in fp8 (torchao's ``Float8Linear``): keep one layer in
high precision, cast per tensor (the output gradient in e5m2), cast row-wise (one scale per
row), or scale by the current amax (not a delayed scale). Each is tried on the whole run by
``record --apply fp8=RECIPE[:keep=...]`` (``record/treatment.py``); the forensic replay of a
failing step does not convert layers, but the fp8 trial at close re-runs the saved step with
each fp8 layer kept in high precision or cast row-wise (``rules/fp8own.py`` reads it as the
outcome of ``fp8_keep_layer`` and ``fp8_rowwise``).
"""

from __future__ import annotations

from typing import Optional

from .registry import Advice, Context, fix, one_line

# torchao's recipe names that `record --apply fp8=` takes (record/prescription.FP8_RECIPES;
# the analysis side does not import record/, tests/record/test_treatment.py holds them together)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_REPLAY = "the replay of the saved step does not convert layers to fp8"


def _recipe(c: Context) -> Optional[str]:
    recipe = (c.fp8 or {}).get("recipe")
    return recipe if recipe in RECIPES else None


def _kept(c: Context) -> list[str]:
    """The layers already kept in high precision, then the culprit."""
    kept = [str(k) for k in (c.fp8 or {}).get("keep") or [] if k]
    return list(dict.fromkeys(kept + ([c.module] if c.module else [])))


def _keep_apply(c: Context) -> Optional[str]:
    recipe, kept = _recipe(c), _kept(c)
    if recipe is None or not kept or any(not _plain(k) for k in kept):
        return None
    return f"fp8={recipe}:keep={','.join(kept)}"


def _plain(name: str) -> bool:
    """A module name ``--apply`` can carry (no separator of the form's own)."""
    return bool(name) and not any(ch in name for ch in ",:= \n\t")


def _converted(recipe: str, note: str) -> str:
    """The lines that convert ``model`` with torchao's ``recipe`` (``note``: why it)."""
    return ("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
            f"config = Float8LinearConfig.from_recipe_name({recipe!r})  # {note}\n"
            "convert_to_float8_training(model, config=config)")


def _filter(kept: list[str]) -> str:
    return "{" + ", ".join(repr(k) for k in kept) + "}"


@fix("fp8_keep_layer", "leave the named layer out of the fp8 conversion: it trains in bf16",
     apply=_keep_apply, manual="the run's fp8 recipe or the layer's name cannot be given to "
     "record --apply fp8", replay=_REPLAY)
def fp8_keep_layer(c: Context) -> Advice:
    layer = one_line(c.module or "the layer")
    kept = _kept(c) or [layer]
    recipe = _recipe(c) or "tensorwise"
    snippet = ("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
               f"config = Float8LinearConfig.from_recipe_name({recipe!r})\n"
               f"keep = {_filter(kept)}  # trained in bf16\n"
               "convert_to_float8_training(model, config=config,\n"
               "                           module_filter_fn=lambda mod, fqn: fqn not in keep)")
    return (f"Keep {layer} in bf16: leave it out of the fp8 conversion (torchao's "
            "module_filter_fn), so that its matmul reads its operands unscaled; the other "
            "layers stay in fp8.", snippet)


@fix("fp8_tensorwise", "cast per tensor (torchao's tensorwise recipe): the output gradient in "
     "e5m2, whose range reaches 2^14 times further below its top than e4m3's",
     apply="fp8=tensorwise", replay=_REPLAY)
def fp8_tensorwise(c: Context) -> Advice:
    was = _recipe(c) or "the run's"
    snippet = _converted("tensorwise", "grad_output: e5m2")
    return (f"Train with torchao's tensorwise recipe instead of {was}: it casts the output "
            "gradient to e5m2 with one scale per tensor, and e5m2 keeps values down to 2^-16, "
            "2^32 below its top of 57344 (e4m3: 2^-9, 2^18 below 448), so a gradient whose "
            "values span many binades is no longer flushed.", snippet)


@fix("fp8_rowwise", "cast row-wise (torchao's rowwise recipe): one scale per row, so one "
     "outlier sets only its own row's scale", apply="fp8=rowwise", replay=_REPLAY)
def fp8_rowwise(c: Context) -> Advice:
    was = _recipe(c) or "the run's"
    snippet = _converted("rowwise", "one scale per row")
    return (f"Train with torchao's rowwise recipe instead of {was}: each row (token) gets its "
            "own power-of-two scale, so a massive activation in one token no longer pushes "
            "the other tokens' values below e4m3's smallest subnormal.", snippet)


@fix("fp8_current_scaling", "scale each cast by the tensor's current amax (torchao's dynamic "
     "tensorwise recipe) instead of a delayed or static scale: the scale follows an amax jump "
     "on the step it happens", apply="fp8=tensorwise", replay=_REPLAY)
def fp8_current_scaling(c: Context) -> Advice:
    snippet = _converted("tensorwise", "dynamic scaling")
    return ("Scale by the current amax: torchao's dynamic scaling (every recipe of torchao "
            "0.10 and later) computes each cast's scale from the tensor it casts, so the "
            "largest value maps to the format's max and none is clamped. Where a delayed scale "
            "must stay (TransformerEngine's DelayedScaling), give it a margin (margin=1 halves "
            "the scale) or a shorter amax history.", snippet)
