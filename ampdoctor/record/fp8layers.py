"""The layers a run already trains in fp8, and how each casts its operands: /meta ``fp8_layers``.

A torchao ``Float8Linear`` (``convert_to_float8_training``, or ``record --apply fp8``) is an
``nn.Linear``, so the fp8 counts (``fp8.Fp8Probe``) already measure its input, weight and
output gradient under every recipe on the sampled steps, with the scales and amaxes torchao
computes (``tests/record/test_fp8.py`` checks them bit for bit). What they do not know is which
of those recipes the layer really runs: this module reads it from the layer's
``Float8LinearConfig``, per operand (scaling type, granularity, element dtype), so that the
diagnosis reads the /fp8 rows of the cast the layer made (``diagnosis/fp8.py``) and the rest
as what another recipe would have done.

Read by attribute, never by importing torchao (a run without it never gets here: no module is
a ``Float8Linear``). TransformerEngine's layers are not ``nn.Linear`` and are not read.

Example::

    describe(model.fc1)   # {"library": "torchao", "recipe": "rowwise", "emulate": True,
                          #  "input": {"scaling": "dynamic", "granularity": "axiswise",
                          #            "dtype": "float8_e4m3fn"}, "weight": {...}, ...}
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# The config's cast of each operand, by the name the /fp8 rows give the operand (schema.Role).
_OPERANDS = {"input": "cast_config_input", "weight": "cast_config_weight",
             "grad_output": "cast_config_grad_output"}


def is_float8(module: torch.nn.Module) -> bool:
    """A torchao ``Float8Linear`` (by its class and config, torchao not imported)."""
    return type(module).__name__ == "Float8Linear" and \
        type(module).__module__.startswith("torchao") and hasattr(module, "config")


def describe(module: torch.nn.Module) -> Optional[dict]:
    """What /meta ``fp8_layers`` keeps of one fp8 layer, or None for any other module."""
    if not is_float8(module):
        return None
    config = module.config
    out: dict[str, Any] = {"library": "torchao", "recipe": recipe_name(config),
                           "emulate": bool(getattr(config, "emulate", False))}
    for operand, attr in _OPERANDS.items():
        out[operand] = _cast(getattr(config, attr, None))
    # rowwise_with_gw_hp: the weight gradient's matmul reads the output gradient unscaled
    gw = getattr(config, "cast_config_grad_output_for_grad_weight", None)
    out["grad_weight_in_high_precision"] = _cast(gw)["scaling"] == "disabled"
    return out


def recipe_name(config: Any) -> str:
    """torchao's recipe name the config is (``Float8LinearConfig.from_recipe_name``), told from
    its casts: every operand tensorwise, every one axiswise (rowwise; with the weight
    gradient in high precision, rowwise_with_gw_hp); anything else ``custom``."""
    casts = [_cast(getattr(config, attr, None)) for attr in _OPERANDS.values()]
    grains = {c["granularity"] for c in casts}
    if any(c["scaling"] != "dynamic" for c in casts) or len(grains) != 1:
        return "custom"
    if grains == {"tensorwise"}:
        return "tensorwise"
    gw = _cast(getattr(config, "cast_config_grad_output_for_grad_weight", None))
    return "rowwise_with_gw_hp" if gw["scaling"] == "disabled" else "rowwise"


def _cast(cast: Any) -> dict:
    """One ``CastConfig`` as plain strings: scaling (dynamic, disabled; delayed in torchao
    before 0.10), granularity (tensorwise, axiswise), dtype (float8_e4m3fn, ...; None: the
    config's default)."""
    def word(value: Any) -> Optional[str]:
        value = getattr(value, "value", value)
        return None if value is None else str(value).replace("torch.", "")

    return {"scaling": word(getattr(cast, "scaling_type", None)),
            "granularity": word(getattr(cast, "scaling_granularity", None)),
            "dtype": word(getattr(cast, "target_dtype", None))}
