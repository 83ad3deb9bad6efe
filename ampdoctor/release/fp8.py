"""fp8 readiness: what each fp8 recipe would do to each Linear layer, from any run.

numpy only. On sampled steps the recorder scales and rounds every Linear's input, weight and
output gradient as four recipes would (``record/fp8.py``, the /fp8 table): per-tensor current
scaling (``tensorwise``), per-tensor delayed scaling over the run's own sampled amaxes
(``delayed``), power-of-two row scales (``rowwise``) and 32-element MX blocks with E8M0 scales
(``mxfp8``). This module reads those counts into, per recipe and layer, the share of values
flushed to zero, the share saturated, the SQNR of the dequantised tensor and a status, and
ranks the layers at risk: ``keep_high_precision``, the layers to leave in bf16 first.

Where the recording ran the fp8 trial (``record/forensic/fp8trial.py``: when it closed, the
last sampled step re-run with each Linear in emulated fp8, alone and together), the trial
decides: ``keep_high_precision`` lists the layers whose cast alone moved the step's gradient
or loss past the trial's thresholds, worst first, and each recipe carries what was measured
(``trial``: every layer's effect, all layers', all but those kept) and the lines to paste
(``paste``: torchao's ``module_filter_fn``, TransformerEngine's, ``record --apply``).
``decided_by`` says which: ``"trial"``, or ``"statistics"`` where no trial ran for that recipe
(``delayed`` never is: one step holds no amax history), ranked from the counts alone.

Gradients are as the backward saw them: under GradScaler, multiplied by its scale. The
tensorwise, rowwise and MX recipes are relative to each tensor's own amax, so a power-of-two
loss scale changes nothing in them; the delayed recipe sees a change of scale as a change of
amax. A skipped step's gradients (inf by design under GradScaler) are left out.

Example::

    r = ampdoctor.fp8_readiness("bf16.h5")
    r.to_dict()["recipes"]["tensorwise"]["keep_high_precision"]     # ['blocks.3.mlp.fc2']
    r.recipes["mxfp8"].layers["blocks.3.mlp.fc2"].status             # 'ok'
    r.recipes["tensorwise"].decided_by, r.suits                       # ('trial', 'rowwise')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..diagnosis.thresholds import FP8_FLUSHED, FP8_SATURATED, FP8_SUBNORMAL
from ..runfile.payloads import Fp8Trial
from ..runfile.schema import Recipe, Role, columns
from . import fp8trial
from .readiness import plain

RECIPES = {Recipe.TENSOR: "tensorwise", Recipe.DELAYED: "delayed", Recipe.ROWWISE: "rowwise",
           Recipe.MX: "mxfp8"}
ROLES = {Role.INPUT: "input", Role.WEIGHT: "weight", Role.GRAD_OUTPUT: "grad_output"}
_COLUMNS = columns("fp8", "step", "tensor", "role", "recipe", "sample_n", "zeros", "flushed",
                   "subnormal", "saturated", "sqnr_db", "amax")

# The thresholds, each with its reason (the one place they are written down).
# Flushed and subnormal: shares of the non-zero values (diagnosis/thresholds.py, where the
# casts of a run already in fp8 are judged by the same).
FLUSHED = FP8_FLUSHED
SUBNORMAL = FP8_SUBNORMAL
# Saturated: a value clamped to the format's max has an error that grows with it. One in a
# thousand clamped (the sample's resolution is 1 in 1024) means the scale no longer covers the
# tensor: delayed scaling behind a growing amax. MX is left out: its FLOOR rule clamps only a
# block's largest value, by at most 512/448, and SQNR counts that.
SATURATED = FP8_SATURATED  # (diagnosis/thresholds.py: a run in fp8 that saturates reads it)
SATURATION_RECIPES = (Recipe.TENSOR, Recipe.DELAYED, Recipe.ROWWISE)
# SQNR: rounding to e4m3 alone gives about 30 dB and to e5m2 about 25 dB (4 and 3 significant
# bits); below 20 dB the tensor lost much more than its format's rounding.
LOW_SQNR_DB = 20.0

STATUSES = {  # most severe first
    "nonfinite": "the tensor held NaN or inf on a sampled step: no scale describes it",
    "saturates": f"more than {SATURATED:g} of the values clamped to the format's max",
    "flushes": f"more than {FLUSHED:g} of the non-zero values flushed to zero, or more than "
               f"{SUBNORMAL:g} of them subnormal",
    "low_sqnr": f"SQNR below {LOW_SQNR_DB:g} dB",
    "ok": "within every threshold",
}
_SEVERITY = {s: i for i, s in enumerate(STATUSES)}


@dataclass
class TensorFp8:
    """One operand of one layer under one recipe, over the sampled steps: shares of the
    sampled values (``flushed``, ``subnormal``: of the non-zero ones), the worst step's SQNR."""

    flushed: float
    subnormal: float
    saturated: float
    sqnr_db: float
    nonfinite: bool
    steps: int

    def status(self, saturable: bool = True) -> str:
        """``STATUSES``' most severe that holds; ``saturable`` False: saturation bounded by
        the recipe (MX), judged by its SQNR instead."""
        return "nonfinite" if self.nonfinite else \
            "saturates" if saturable and self.saturated > SATURATED else \
            "flushes" if self.flushed > FLUSHED or self.subnormal > SUBNORMAL else \
            "low_sqnr" if self.sqnr_db < LOW_SQNR_DB else "ok"


@dataclass
class LayerFp8:
    """One layer under one recipe: its operands (``ROLES``' names) and its worst status."""

    name: str
    tensors: dict[str, TensorFp8] = field(default_factory=dict)
    saturable: bool = True  # False for MX: its saturation is bounded (see SATURATED)

    @property
    def status(self) -> str:
        found = [t.status(self.saturable) for t in self.tensors.values()] or ["ok"]
        return min(found, key=_SEVERITY.__getitem__)

    def risk(self) -> tuple:
        """Sort key, most at risk first: status, then the largest share lost, then SQNR."""
        lost = max((t.flushed + t.saturated + t.subnormal / 10 for t in self.tensors.values()),
                   default=0.0)
        sqnr = min((t.sqnr_db for t in self.tensors.values()), default=math.inf)
        return (_SEVERITY[self.status], -lost, sqnr, self.name)


@dataclass
class RecipeFp8:
    layers: dict[str, LayerFp8] = field(default_factory=dict)
    name: str = ""
    # this recipe's part of the fp8 trial ({} where none ran): "all", "layers" (name ->
    # effect), "keep", "all_but_keep", "untried" (payloads.Fp8Trial)
    trial: dict = field(default_factory=dict)

    @property
    def decided_by(self) -> str:
        return "trial" if "keep" in self.trial else "statistics"

    @property
    def keep_high_precision(self) -> list[str]:
        """The layers the trial kept, worst first; without a trial, those whose statistics
        put them at risk, most at risk first."""
        if self.decided_by == "trial":
            return [str(n) for n in self.trial["keep"]]
        risky = [layer for layer in self.layers.values() if layer.status != "ok"]
        return [layer.name for layer in sorted(risky, key=LayerFp8.risk)]

    def paste(self) -> dict:
        """The lines that train this recipe with ``keep_high_precision`` kept: ``torchao``,
        ``transformer_engine``, ``apply`` (record's argument; "" where it cannot)."""
        keep = self.keep_high_precision
        return {"torchao": fp8trial.torchao_lines(self.name, keep),
                "transformer_engine": fp8trial.te_lines(self.name, keep),
                "apply": fp8trial.apply_arg(self.name, keep)}


@dataclass
class Fp8Readiness:
    """Per recipe (``RECIPES``' names) and layer, what fp8 would do (see the module doc)."""

    recipes: dict[str, RecipeFp8]
    sampled_steps: int = 0
    # the fp8 trial's own fields (payloads.Fp8Trial less "recipes"): step, weights_step, loss,
    # suits, thresholds, runs, seconds, budget, stopped, note, error; {} where none ran
    trial: dict = field(default_factory=dict)

    @property
    def suits(self) -> str:
        """The recipe the trial found to suit the model ("" : none, or no trial)."""
        return str(self.trial.get("suits") or "")

    def to_dict(self) -> dict:
        return plain({"trial": self.trial, "suits": self.suits, "recipes": {
            name: {"keep_high_precision": recipe.keep_high_precision,
                   "decided_by": recipe.decided_by,
                   "trial": {k: v for k, v in recipe.trial.items() if k != "layers"},
                   "paste": recipe.paste(),
                   "layers": {layer.name: {
                       "status": layer.status,
                       "tensors": {role: {"flushed": t.flushed, "saturated": t.saturated,
                                          "sqnr_db": t.sqnr_db}
                                   for role, t in layer.tensors.items()},
                       **({"trial": recipe.trial["layers"][layer.name]}
                          if layer.name in recipe.trial.get("layers", {}) else {})}
                       for layer in recipe.layers.values()}}
            for name, recipe in self.recipes.items()}})

    def at_risk(self) -> dict[str, list[str]]:
        """recipe -> keep_high_precision, the recipes with none left out."""
        return {name: r.keep_high_precision for name, r in self.recipes.items()
                if r.keep_high_precision}


def fp8_readiness(run: Any) -> Fp8Readiness:
    """Read a loaded ``Run``'s /fp8 rows (see the module doc); empty recipes for a run without
    them (recorded before format 4, or with no Linear layer on a sampled step)."""
    rows = run.fp8.columns(_COLUMNS) if len(run.fp8) else np.zeros(0, _dtype(run))
    skipped = run.steps["step"][run.steps["skipped"] == 1] if len(run.steps) else []
    rows = rows[~((rows["role"] == int(Role.GRAD_OUTPUT)) & np.isin(rows["step"], skipped))]
    names = {int(i): str(n) for i, n in zip(run.tensors["id"], run.tensors["name"])}
    out = Fp8Readiness(recipes={name: RecipeFp8(name=name) for name in RECIPES.values()},
                       sampled_steps=int(len(np.unique(rows["step"]))))
    _read_trial(run, out)
    key = np.stack([rows["tensor"].astype(np.int64), rows["role"], rows["recipe"]], 1)
    groups, inverse = np.unique(key, axis=0, return_inverse=True)
    known = ({int(r) for r in RECIPES}, {int(r) for r in ROLES})
    for g, (tensor, role, recipe) in enumerate(groups):
        if int(recipe) not in known[0] or int(role) not in known[1]:
            continue  # a recipe or operand a later ampdoctor added
        recipe_name = RECIPES[Recipe(int(recipe))]
        name = names.get(int(tensor), f"tensor {int(tensor)}")
        layer = out.recipes[recipe_name].layers.setdefault(
            name, LayerFp8(name, saturable=Recipe(int(recipe)) in SATURATION_RECIPES))
        layer.tensors[ROLES[Role(int(role))]] = _tensor(rows[inverse.ravel() == g])
    return out


def _read_trial(run: Any, out: Fp8Readiness) -> None:
    """The fp8 trial's result, where the run holds one, into ``out`` (a recipe it did not
    run, or one it ran with no layer, keeps the statistics' ranking). A value of the wrong
    type (a damaged or crafted file) reads as its default."""
    t = fp8trial.trial(run)
    if t is None or t == Fp8Trial():
        return
    num, text = (int, float), str
    out.trial = {"step": _as(t.step, int, -1), "weights_step": _as(t.weights_step, int, -1),
                 "loss": _as(t.loss, num, None), "suits": _as(t.suits, text, ""),
                 "thresholds": _as(t.thresholds, dict, {}), "runs": _as(t.runs, int, 0),
                 "seconds": _as(t.seconds, num, 0.0), "budget": _as(t.budget, num, 0.0),
                 "stopped": _as(t.stopped, text, ""), "note": _as(t.note, text, ""),
                 "error": _as(t.error, text, "")}
    for name, part in (t.recipes or {}).items():
        if name in out.recipes and part.keep is not None:
            out.recipes[name].trial = {
                "all": part.all.to_json(), "keep": list(part.keep),
                "all_but_keep": part.all_but_keep.to_json() if part.all_but_keep else {},
                "untried": list(part.untried),
                "layers": {n: e.to_json() for n, e in part.layers.items()}}


def _as(value: Any, kind: Any, default: Any) -> Any:
    """``value`` where it is of ``kind`` (a bool is no number), else ``default``."""
    return value if isinstance(value, kind) and not isinstance(value, bool) else default


def _dtype(run: Any) -> np.dtype:
    return np.dtype([(n, run.fp8.dtype[n]) for n in _COLUMNS])


def _tensor(rows: np.ndarray) -> TensorFp8:
    counted = float(rows["sample_n"].sum())
    nonzero = max(counted - float(rows["zeros"].sum()), 1.0)
    sqnr = rows["sqnr_db"].astype(np.float64)  # inf: a step cast without error
    finite_amax = np.isfinite(rows["amax"]).all()
    return TensorFp8(flushed=float(rows["flushed"].sum()) / nonzero,
                     subnormal=float(rows["subnormal"].sum()) / nonzero,
                     saturated=float(rows["saturated"].sum()) / max(counted, 1.0),
                     sqnr_db=math.nan if np.isnan(sqnr).all() else float(np.nanmin(sqnr)),
                     nonfinite=not finite_amax, steps=int(len(np.unique(rows["step"]))))
