"""The fp8 trial read from a run, and the lines a user pastes from it.

numpy only. When a recording closes, the recorder re-runs its last sampled step with the
model's Linear layers in emulated fp8, one at a time and together, under the tensorwise,
rowwise and mxfp8 recipes (``record/forensic/fp8trial.py``), and writes what each re-run did
to the loss and the gradients as one ``Event.FP8_TRIAL`` row (``payloads.Fp8Trial``). This
module reads that row (``trial``) and writes, for a recipe and the layers it keeps, what a
user pastes: a ``module_filter_fn`` for torchao's ``convert_to_float8_training``
(``torchao_lines``), the TransformerEngine equivalent (``te_lines``) and the ``ampdoctor
record --apply`` argument that trains it (``apply_arg``).

Example::

    t = trial(run)                    # payloads.Fp8Trial, or None where no trial ran
    t["recipes"]["tensorwise"]["keep"]                  # ['fc1']
    print(torchao_lines("tensorwise", ["fc1"]))
"""

from __future__ import annotations

from typing import Any, Optional

from ..runfile.payloads import Fp8Trial
from ..runfile.schema import Event

# torchao's Float8LinearConfig recipe for each trial recipe (``from_recipe_name``); mxfp8 is
# torchao's MX prototype, another API (``torchao.prototype.mx_formats``).
TORCHAO = {"tensorwise": "tensorwise", "rowwise": "rowwise", "delayed": ""}
# TransformerEngine's recipe (``transformer_engine.common.recipe``) for each: per-tensor
# current scaling, MX blocks, delayed scaling. TE has no power-of-two rowwise recipe (its
# Float8BlockScaling scales 1x128 and 128x128 blocks): the nearest is named as such.
TE = {"tensorwise": "Float8CurrentScaling()", "mxfp8": "MXFP8BlockScaling()",
      "delayed": "DelayedScaling()", "rowwise": "Float8BlockScaling()"}
APPLY = ("tensorwise", "rowwise")  # the trial's recipes record --apply fp8 can train


def trial(run: Any) -> Optional[Fp8Trial]:
    """The run's last ``Event.FP8_TRIAL`` text, parsed; None where it holds none."""
    ev = run.events
    rows = ev[ev["kind"] == int(Event.FP8_TRIAL)] if len(ev) else ev
    return Fp8Trial.from_text(rows["text"][-1]) if len(rows) else None


def torchao_lines(recipe: str, keep: list[str]) -> str:
    """What converts the model to ``recipe`` with torchao, the ``keep`` layers left alone."""
    if recipe == "mxfp8":
        head = ("from torchao.prototype.mx_formats import MXLinearConfig\n"
                "from torchao.quantization import quantize_\n")
        call = "quantize_(model, MXLinearConfig(), filter_fn=lambda m, fqn: " \
               "isinstance(m, torch.nn.Linear) and fqn not in KEEP)"
        return f"{head}KEEP = {_set(keep)}\n{call}"
    name = TORCHAO.get(recipe) or "tensorwise"
    return ("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
            f"KEEP = {_set(keep)}\n"
            "def module_filter_fn(module, fqn):\n"
            "    return fqn not in KEEP\n"
            "convert_to_float8_training(model, module_filter_fn=module_filter_fn,\n"
            f"    config=Float8LinearConfig.from_recipe_name({name!r}))")


def te_lines(recipe: str, keep: list[str]) -> str:
    """TransformerEngine: which Linears become ``te.Linear`` and the recipe to run them in."""
    nearest = "  # nearest: TE has no power-of-two rowwise recipe" if recipe == "rowwise" else ""
    return (f"KEEP = {_set(keep)}  # stay torch.nn.Linear; every other Linear becomes "
            "te.Linear\n"
            "import transformer_engine.pytorch as te\n"
            "from transformer_engine.common.recipe import " + TE[recipe].rstrip("()") + "\n"
            f"with te.fp8_autocast(enabled=True, fp8_recipe={TE[recipe]}):{nearest}\n"
            "    loss = loss_fn(model(x), y)")


def apply_arg(recipe: str, keep: list[str]) -> str:
    """``--apply fp8=RECIPE[:keep=...]`` for ``record``; "" for a recipe it cannot train."""
    if recipe not in APPLY:
        return ""
    return f"--apply fp8={recipe}" + (f":keep={','.join(keep)}" if keep else "")


def _set(names: list[str]) -> str:
    return "{" + ", ".join(repr(n) for n in names) + "}" if names else "set()"
