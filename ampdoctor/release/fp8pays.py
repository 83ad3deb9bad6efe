"""When fp8 pays: the dtype decision's fp8 line (which cards, which layers).

numpy only. fp8 speeds training only where the GPU multiplies fp8 matrices in hardware:
NVIDIA compute capability 8.9 (Ada Lovelace) and 9.0 (Hopper: H100, H200) for per-tensor
and row-wise scales, 10.0 and up (Blackwell) for MX blocks too (``torch._scaled_mm`` and
torchao's float8 training need sm89; torchao's MX training, sm100). Elsewhere a cast to fp8
is emulated (torchao's ``emulate=True``): it shows what fp8 would do to the numbers, at a
cost, never a speed-up. Which layers is the fp8 readiness' answer (``release/fp8.py``): the
recipe the trial found to suit and the Linears it keeps in high precision, or the statistics'
ranking where no trial ran; the early warning (``diagnosis/fp8watch.py``) adds the layers an
outlier is pushing out of the format's range.

Example::

    matmuls, text = fp8_pays(decision, ampdoctor.fp8_readiness("run.h5"), watch)
    matmuls      # True on an H100, False on an A100, None on a CPU
"""

from __future__ import annotations

from typing import Any, Optional

FP8_CAPABILITY = (8, 9)  # Ada Lovelace: the first NVIDIA generation with fp8 tensor cores
MX_CAPABILITY = (10, 0)  # Blackwell: MX block scales in hardware
CARDS = ("fp8 pays only on a GPU with fp8 matmuls: NVIDIA Ada Lovelace (sm89), Hopper (sm90: "
         "H100, H200) or Blackwell (sm100; mxfp8 needs Blackwell)")


def fp8_matmuls(decision: Any, recipe: str = "tensorwise") -> Optional[bool]:
    """Whether the run's GPU multiplies ``recipe``'s fp8 in hardware; None where the run
    says nothing of it (a CPU, an unknown device, AMD)."""
    cap = decision.capability
    if decision.device_type != "cuda" or not cap or decision.generation is None:
        return None
    major, minor = (int(x) for x in str(cap).split(".")[:2])
    need = MX_CAPABILITY if recipe == "mxfp8" else FP8_CAPABILITY
    return (major, minor) >= need


def fp8_pays(decision: Any, fp8: Any, watch: Any = None) -> tuple[Optional[bool], str]:
    """(whether this GPU has fp8 matmuls, the decision's fp8 sentence); "" where the run has
    no fp8 figures (no Linear, the fp8 counts off, a file before format 4)."""
    if fp8 is None or not any(r.layers or r.trial for r in fp8.recipes.values()):
        return None, ""
    recipe = fp8.suits or "tensorwise"
    chosen = fp8.recipes[recipe]
    has = fp8_matmuls(decision, recipe)
    unknown = "recorded on a CPU, the GPU it will train on is not known from this run" \
        if decision.device_type == "cpu" else "whether the run's device has them is not known"
    here = {True: f"{decision.device} has them", None: unknown,
            False: f"{decision.device} has none: fp8 there is emulated, slower than bf16, "
                   "useful only to check the numbers"}[has]
    layers = len(chosen.layers) or len(chosen.trial.get("layers", {}))
    keep = chosen.keep_high_precision
    how = "measured by the fp8 trial" if chosen.decided_by == "trial" else \
        "ranked from the sampled statistics, not measured"
    which = (f"under {recipe}, {layers - len(keep)} of {layers} Linears in fp8"
             + (f", {', '.join(keep[:5])}{' ...' if len(keep) > 5 else ''} kept in bf16"
                if keep else "") + f" ({how})")
    risky = [x.name for x in (watch.at_risk if watch is not None else [])]
    warned = (f"; the early warning has {', '.join(risky[:5])} leaving fp8's range as the run "
              "goes on") if risky else ""
    return has, (f"{CARDS}; {here}. For this model: {which}{warned}. Confirm on the whole run: "
                 f"record --apply fp8, then compare against this run.")
