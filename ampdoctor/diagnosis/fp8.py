"""What the casts of a run's fp8 layers did on the sampled steps, and each layer's headroom.

numpy only. A run that trains layers in fp8 (torchao's ``Float8Linear``) names them in /meta
``fp8_layers`` with the cast of each operand (``record/fp8layers.py``); the /fp8 table holds,
per sampled step and Linear, what each recipe's cast does to its input, weight and output
gradient (``record/fp8.py``), scales and amaxes computed as torchao computes them. ``casts``
picks, for each fp8 layer and operand, the rows of the cast the layer really makes (torchao's
``tensorwise`` is the /fp8 ``TENSOR`` recipe, ``axiswise`` the ``ROWWISE`` one); ``other``
reads what another recipe would have done to the same tensor on the same step (the
discriminator of a gradient that underflows e4m3 row-wise and not e5m2 per tensor).

``headroom`` (per step and layer: ``layer_headroom``, which ``ampdoctor export`` writes) is
the early warning in fp8 terms, for any Linear: per sampled step, how many
binades lie between a tensor's amax and the top of the format under the scale that delayed
scaling would have chosen from its earlier sampled amaxes (``DELAYED`` rows:
log2(fmt max / (amax * scale))). Current scaling maps the amax to the top on every step, so
it never saturates; a delayed scale lags, and an amax that grows eats this headroom until the
cast clamps (at about -0.05: 464/448). A tensor with falling headroom is an outlier growing.

``own_trial`` reads the fp8 trial's re-run of such a run with its fp8 layers in high
precision (``record/forensic/fp8trial.py``): the run measured against itself on the saved
step, which ``rules/fp8own.py`` reads.

Read by the rules of ``rules/fp8.py``; the thresholds are those of the readiness
(``thresholds.FP8_FLUSHED``).

Example::

    made, every = casts(ampdoctor.load("fp8.h5"))
    for c in made:
        c.layer, c.role, c.step, c.recipe, c.amax, c.flushed_share, c.whole
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..runfile.meta import AppliedFix
from ..runfile.payloads import Fp8Own, Fp8Trial
from ..runfile.schema import E4M3_MAX, E5M2_MAX, Event, Fp8Format, Recipe, Role, columns
from . import fixes
from .facts import Facts
from .thresholds import FP8_MOSTLY_FLUSHED
from .verdict import HELD, Premise

# torchao's floor under an amax (float8_utils.EPS): an amax below it gives the scale
# fmt max / 1e-12, finite, and the cast goes on without a word.
EPS = 1e-12
ROLES = {Role.INPUT: "input", Role.WEIGHT: "weight", Role.GRAD_OUTPUT: "grad_output"}
# A cast's granularity in torchao's config -> the /fp8 recipe that computes the same scales.
GRANULARITY = {"tensorwise": Recipe.TENSOR, "axiswise": Recipe.ROWWISE}
FORMATS = {Fp8Format.E4M3: ("e4m3", E4M3_MAX), Fp8Format.E5M2: ("e5m2", E5M2_MAX)}
_ROLE_CODES = [int(r) for r in ROLES]
_RECIPE_CODES = [int(r) for r in Recipe]
_FORMAT_CODES = [int(f) for f in FORMATS]
_COLUMNS = columns("fp8", "step", "tensor", "role", "recipe", "format", "sample_n", "zeros",
                   "flushed", "subnormal", "saturated", "sqnr_db", "amax", "scale")


@dataclass
class Cast:
    """One operand of one layer on one sampled step under one recipe (a module called several
    times in the step: its calls together, the largest amax)."""

    layer: str
    role: str  # ROLES' names
    step: int
    recipe: Recipe
    format: str  # "e4m3" or "e5m2"
    amax: float
    scale: float  # the tensor's scale (tensorwise, delayed), the smallest row scale (rowwise)
    counted: int  # sampled elements
    zeros: int  # exact zeros before the cast
    flushed: int
    subnormal: int
    saturated: int
    sqnr_db: float

    @property
    def nonzero(self) -> int:
        return max(self.counted - self.zeros, 0)

    @property
    def flushed_share(self) -> float:
        """Of the non-zero sampled values, the share the cast made 0."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def whole(self) -> Optional[str]:
        """How the tensor was flushed whole, if it was: ``zero`` (every value 0: the amax is
        0, torchao clamps it and casts zeros), ``clamped`` (0 < amax < 1e-12: the scale is
        clamped at fmt max / 1e-12), ``flushed`` (every non-zero value cast to 0)."""
        if self.amax == 0:
            return "zero"
        if 0 < self.amax < EPS:
            return "clamped"
        if self.nonzero and self.flushed == self.nonzero:
            return "flushed"
        return None

    @property
    def saturated_share(self) -> float:
        """Of the sampled values, the share the cast clamped at the format's max."""
        return self.saturated / self.counted if self.counted else 0.0

    @property
    def mostly(self) -> bool:
        """Most of the non-zero values cast to 0 (``FP8_MOSTLY_FLUSHED``) but not all: a few
        large values (a massive activation) took the scale and squeezed the rest below the
        format's smallest subnormal."""
        return self.whole is None and self.flushed_share > FP8_MOSTLY_FLUSHED


@dataclass
class Baseline:
    """The run an fp8 run is measured against (``diagnose(..., baseline=)``): its path, its
    /steps, its fp8 layers (a baseline should have none) and its precision in a word."""

    path: str
    steps: np.ndarray
    fp8_layers: dict
    precision: str

    @classmethod
    def of(cls, run: Any) -> "Baseline":
        ac = run.autocast or {}
        precision = "fp32" if not ac.get("enabled") else \
            {"bfloat16": "bf16", "float16": "fp16"}.get(str(ac.get("dtype")), "fp32")
        return cls(str(run.path), run.steps, fp8_layers(run), precision)


def fp8_layers(run: Any) -> dict[str, dict]:
    """/meta ``fp8_layers``: the layers the run trains in fp8 (``Run.fp8_layers``)."""
    return run.fp8_layers if hasattr(run, "fp8_layers") else {}


def fp8_trial(run: Any) -> Fp8Trial:
    """The run's fp8 trial (its last ``Event.FP8_TRIAL`` text); empty where none ran."""
    ev = getattr(run, "events", None)
    if ev is None or not len(ev):
        return Fp8Trial()
    rows = ev[ev["kind"] == int(Event.FP8_TRIAL)]
    return Fp8Trial.from_text(rows["text"][-1] if len(rows) else "")


def own_trial(run: Any) -> tuple[Optional[Fp8Own], int]:
    """The fp8 trial's re-run of a run already in fp8 with its fp8 layers in high precision
    (``payloads.Fp8Trial``'s ``own``: the reference then, and each layer alone kept in high
    precision or cast row-wise, measured against it), and the trial's ``step``; (None, -1)
    where none ran."""
    trial = fp8_trial(run)
    own = trial.own
    if own is None or own.as_recorded is None:
        return None, -1
    return own, trial.step if trial.step is not None else -1


def recipe_of(layer: dict, role: str) -> Optional[Recipe]:
    """The /fp8 recipe whose scales are the ones ``layer`` casts ``role`` with; None where it
    keeps the operand in high precision, or casts it in a way no /fp8 recipe computes. A
    ``delayed`` scale (torchao before 0.10, ``ScalingType.DELAYED``: the scale from an amax
    history) is the /fp8 ``delayed`` recipe's, whose history is of the sampled steps."""
    cast = layer.get(role)
    if not isinstance(cast, dict):
        return None
    if cast.get("scaling") == "delayed" and cast.get("granularity") in (None, "tensorwise"):
        return Recipe.DELAYED
    if cast.get("scaling") != "dynamic":
        return None
    return GRANULARITY.get(str(cast.get("granularity")))


class Casts:
    """The /fp8 rows of the layers named (``layers``) as ``Cast``s, by (layer, role, step,
    recipe)."""

    def __init__(self, run: Any, layers: Any):
        self.by_key: dict[tuple, Cast] = {}
        if not len(run.fp8):
            return
        names = {int(i): str(n) for i, n in zip(run.tensors["id"], run.tensors["name"])
                 if str(n) in layers}
        rows = run.fp8.columns(_COLUMNS)
        rows = rows[np.isin(rows["tensor"], list(names)) & np.isin(rows["role"], _ROLE_CODES)
                    & np.isin(rows["recipe"], _RECIPE_CODES)
                    & np.isin(rows["format"], _FORMAT_CODES)]  # (not what a later one added)
        skipped = run.steps["step"][run.steps["skipped"] == 1] if len(run.steps) else []
        # A step GradScaler skipped had inf gradients by design: no cast describes them.
        rows = rows[~((rows["role"] == int(Role.GRAD_OUTPUT)) & np.isin(rows["step"], skipped))]
        for r in rows:
            key = (names[int(r["tensor"])], ROLES[Role(int(r["role"]))], int(r["step"]),
                   Recipe(int(r["recipe"])))
            self._add(key, r, FORMATS[Fp8Format(int(r["format"]))][0])

    def _add(self, key: tuple[str, str, int, Recipe], r: Any, fmt: str) -> None:
        seen = self.by_key.get(key)
        if seen is None:
            layer, role, step, recipe = key
            self.by_key[key] = Cast(layer, role, step, recipe, format=fmt, amax=float(r["amax"]),
                                    scale=float(r["scale"]), counted=int(r["sample_n"]),
                                    zeros=int(r["zeros"]), flushed=int(r["flushed"]),
                                    subnormal=int(r["subnormal"]),
                                    saturated=int(r["saturated"]), sqnr_db=float(r["sqnr_db"]))
            return
        seen.amax = max(seen.amax, float(r["amax"]))
        seen.scale = min(seen.scale, float(r["scale"]))
        seen.sqnr_db = min(seen.sqnr_db, float(r["sqnr_db"]))
        for name in ("counted", "zeros", "flushed", "subnormal", "saturated"):
            column = "sample_n" if name == "counted" else name
            setattr(seen, name, getattr(seen, name) + int(r[column]))

    def other(self, cast: Cast, recipe: Recipe) -> Optional[Cast]:
        """The same tensor on the same step under ``recipe``."""
        return self.by_key.get((cast.layer, cast.role, cast.step, recipe))


def casts(run: Any) -> tuple[list[Cast], Casts]:
    """The casts the fp8 layers of ``run`` made, by step, layer and operand, and every /fp8
    row of those layers (``Casts``, for ``other``); [] for a run without fp8 layers or without
    /fp8 rows (the fp8 counts off, or a file before format 4)."""
    layers = fp8_layers(run)
    every = Casts(run, layers)
    made = [c for (name, role, _, recipe), c in every.by_key.items()
            if recipe_of(layers[name], role) == recipe]
    return sorted(made, key=lambda c: (c.step, c.layer, c.role)), every


def headroom(amax: np.ndarray, scale: np.ndarray, fmt: np.ndarray) -> np.ndarray:
    """Binades between each amax and the top of its format under ``scale`` (a /fp8 DELAYED
    row's): log2(fmt max / (amax * scale)); +inf for a zero amax, NaN for a non-finite one."""
    top = np.where(fmt == int(Fp8Format.E5M2), E5M2_MAX, E4M3_MAX)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.log2(top / (amax.astype(np.float64) * scale.astype(np.float64)))
    out[amax == 0] = math.inf
    out[~np.isfinite(amax)] = math.nan
    return out


HEADROOM_COLUMNS = columns("fp8", "step", "tensor", "role", "recipe", "format", "amax", "scale",
                           "sample_n", "zeros", "flushed")


def layer_headroom(rows: np.ndarray, names: dict[int, str], layers: Any
                   ) -> dict[tuple[int, str], tuple[float, float]]:
    """Per (step, layer) of /fp8 ``rows`` (``HEADROOM_COLUMNS`` at least; ``names``: tensor id
    -> layer name): its headroom, the least over its operands (``headroom`` of its DELAYED
    rows), and for a layer in fp8 (``layers``, /meta fp8_layers) the largest share of an
    operand's non-zero values its own cast flushed (NaN for a layer not in fp8)."""
    out: dict[tuple[int, str], tuple[float, float]] = {}
    delayed = rows[rows["recipe"] == int(Recipe.DELAYED)]
    room = headroom(delayed["amax"], delayed["scale"], delayed["format"])
    for step, tid, h in zip(delayed["step"], delayed["tensor"], room):
        name = names.get(int(tid))
        if name is None:
            continue
        key = (int(step), name)
        least = out.get(key, (math.inf, math.nan))[0]
        # a non-finite operand (NaN) leaves the layer's headroom NaN: no scale covers it
        out[key] = (float(h) if math.isnan(h) or h < least else least, math.nan)
    mine = [t for t, n in names.items() if n in layers]
    for r in rows[np.isin(rows["tensor"], mine)] if mine else ():
        name = names[int(r["tensor"])]
        role = ROLES[Role(int(r["role"]))] if int(r["role"]) in _ROLE_CODES else None
        if role is None or recipe_of(layers[name], role) != int(r["recipe"]):
            continue
        nonzero = int(r["sample_n"]) - int(r["zeros"])
        share = int(r["flushed"]) / nonzero if nonzero > 0 else 0.0
        key = (int(r["step"]), name)
        least, lost = out.get(key, (math.nan, math.nan))
        out[key] = (least, share if math.isnan(lost) else max(lost, share))
    return out


# -- a cast told in a sentence, and the fix context of its layer: both fp8 rule families --------

# What each cast is called in a sentence: torchao's granularity and the element format.
_CAST = {Recipe.TENSOR: "per tensor", Recipe.ROWWISE: "row-wise",
         Recipe.DELAYED: "per tensor, delayed scale"}


def layer_casts(f: Facts) -> tuple[list[Cast], Casts]:
    return f.memo("fp8_casts", lambda: casts(f.run))


def in_fp8(f: Facts, c: Cast) -> Premise:
    return Premise("layer_in_fp8", HELD, f"{c.layer} trains in fp8: {cast_text(f, c)} "
                   "(/meta fp8_layers)")


def cast_text(f: Facts, c: Cast) -> str:
    layer = fp8_layers(f.run).get(c.layer, {})
    return (f"torchao {layer.get('recipe') or 'fp8'}, {role_text(c.role)} {_CAST.get(c.recipe, '')}"
            f" in {c.format}")


def layer_context(f: Facts, c: Cast) -> fixes.Context:
    ctx = f.fix_context(c.layer, step=c.step)
    recipes = {str(v.get("recipe")) for v in fp8_layers(f.run).values()}
    applied: list[AppliedFix] = f.run.applied  # (Facts.run is untyped: the records are not)
    kept = [k for a in applied if a.fix == "fp8" for k in a.keep or []]
    ctx.fp8 = {"recipe": recipes.pop() if len(recipes) == 1 else None, "keep": kept}
    return ctx


def role_text(role: str) -> str:
    return {"grad_output": "output gradient"}.get(role, role)


def phase_of(role: str) -> str:
    return "backward" if role == "grad_output" else "forward"


def steps_text(steps: list[int]) -> str:
    if not steps:
        return "no sampled step"
    shown = ", ".join(str(s) for s in steps[:6]) + (" ..." if len(steps) > 6 else "")
    return f"sampled step {shown}" if len(steps) == 1 else f"sampled steps {shown}"
