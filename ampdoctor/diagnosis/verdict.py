"""What a diagnosis is made of: the verdict ids, ``Evidence``, ``Finding`` (with its
``first_bad`` and the ``PRIORITY`` table it ranks by) and ``Diagnosis``.

Data only (a leaf module: it imports nothing of ampdoctor but ``display`` and ``fixes``'
``Fix``). ``str(d)`` and Jupyter display go through ``ampdoctor.display``, which finds the
renderers in ``ampdoctor.render.diagnosis``.

Example::

    from ampdoctor.diagnosis.verdict import VERDICTS, Diagnosis
    d = ampdoctor.diagnose("run.h5")
    assert isinstance(d, Diagnosis) and d.verdict in VERDICTS
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ..display import Displayable
from .fixes import Fix

VERDICTS = {
    "healthy": "no failure; GradScaler calibration and probing skips are normal",
    "grad_underflow": "fp16 gradients flush to zero: no GradScaler, or a scale stuck low",
    "masked_underflow": "the scale looks healthy but some layers' gradients flush anyway",
    "lr_overflow": "weights and activations grow with the LR until fp16 overflows",
    "unstable_op": "one op overflows fp16 (or its backward goes NaN) while weights are steady",
    "mask_overflow": "an attention mask constant becomes -inf in fp16; masked rows go NaN",
    "adam_eps": "fp16 weights/optimizer state with an eps that rounds to 0 in fp16",
    "bad_input": "the batch itself holds NaN/inf or values beyond fp16's range, or targets "
                 "that make the loss NaN in fp32 too (kind targets)",
    "accum_overflow": "finite micro-batch gradients whose sum in an fp16 .grad passes 65504",
    "fp16_loss": "the loss overflows while the model is finite: an fp16 loss, or a loss whose "
                 "backward is infinite on fp16-rounded outputs (sigmoid + BCELoss)",
    "clip_order": "GradScaler API misuse: clip before unscale_, optimizer.step() bypassing the "
                  "scaler, scaler re-created, grads not zeroed, calls out of order",
    "lost_updates": "bf16 or fp16 weights updated in place: updates below half an ulp of a "
                    "weight round away (was bf16_precision)",
    "diverged": "no inf/NaN, but the loss blew up and never recovered (LR, not precision)",
    "dead_units": "no inf/NaN, but the gradients are exactly 0: units died, the weights stopped",
    "not_learning": "no failure found, but the loss did not fall (low confidence; says what was "
                    "checked)",
    "state_poisoning": "BatchNorm/buffers non-finite while the weights are finite",
    "not_reproducible": "a non-finite step whose replay on the same batch and weights is "
                        "finite: the machine (a faulty device, nondeterminism), not the numbers",
    "scale_collapse": "the scale fell persistently and no root cause could be told",
    "nonfinite": "non-finite values that no class explains (low confidence; see notes)",
    "no_training": "no optimizer step was recorded",
    "recording_stopped": "ampdoctor stopped recording (an internal error) before any step was "
                         "kept; the script itself may have trained",
}
# Old verdict ids, still understood wherever an id is read (``canonical``): the verdict a run
# gets is always the new one.
ALIASES = {"bf16_precision": "lost_updates"}
# Verdicts with no step to diagnose (the CLI exits 2 on them).
EMPTY = ("no_training", "recording_stopped")

# A finding's ``priority`` by what decided it: among root causes the higher wins (exact
# fingerprints of the script's own failure, then located numeric causes, then trends, then the
# fallbacks). The rules (``rules.RULES``) read their priority here.
PRIORITY = {
    "exception": 95, "misuse": 90,  # the script's own errors and API misuse events: exact
    "state_poisoning": 88, "adam_eps": 87, "accum_overflow": 86, "bad_input": 84,
    "not_reproducible": 83,  # the replay of the failing step: finite where the step was not
    "fp16_loss": 82,
    "mask_overflow": 81, "unstable_op": 80, "lr_overflow": 80,  # located by a replay
    "sampled": 70, "no_training": 70,  # located by sampled statistics only
    "grad_underflow": 62, "masked_underflow": 60, "lost_updates": 55,  # trends, no NaN
    "diverged": 54, "dead_units": 53,  # no NaN, no precision signal (progress.py)
    "not_learning": 15,  # a flat loss that no cause explains (learning.py)
    "risk": 20, "nonfinite": 5,  # a configuration that will fail; the honest fallback
}


@dataclass
class Evidence:
    """One number that decided something, with where and when it was seen."""

    text: str
    key: str = ""
    value: Optional[float] = None
    step: Optional[int] = None
    module: Optional[str] = None


# What a premise's check found: it held, it failed (the verdict is removed), or the file does
# not hold what would tell (the verdict stands, on what was measured).
HELD, FAILED, NOT_MEASURED = "held", "failed", "not measured"


@dataclass
class Premise:
    """What must hold for a verdict, checked against the file: ``name`` says what (e.g.
    ``"buffer_was_finite"``), ``status`` is HELD, FAILED or NOT_MEASURED, ``fact`` the measured
    fact that decided it, as a sentence.

    Example::

        Premise("weights_steady", FAILED, "update ratio |dW|/|W| 10x or more at step 0")
    """

    name: str
    status: str
    fact: str


@dataclass
class Finding:
    """What one rule concluded."""

    verdict: str
    confidence: float
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    first_bad: Optional[dict] = None
    root: bool = True  # False: a consequence of some other cause (scale collapse, underflow)
    priority: int = 50  # among root causes, the higher wins
    kind: str = ""  # a sub-class, e.g. clip_order's "step_bypasses_scaler"
    # Step numbers this finding accounts for (the skips a re-created scaler causes): an "also"
    # whose first bad step and evidence all fall inside them is its symptom, not a second cause.
    explains: frozenset = frozenset()
    # Modules whose output this finding accounts for (a hidden overflow comes out of them as
    # exact zeros): an "also" located at one of them (its dead units, its zeros) is its symptom.
    explains_modules: frozenset = frozenset()
    # What must hold for this verdict (``Premise``): one that failed removes the finding from
    # the verdict and the causes (``engine._conclude`` lists it under ``rejected``).
    premises: list[Premise] = field(default_factory=list)

    @property
    def failed(self) -> list[Premise]:
        """The premises that failed (empty: the finding may stand)."""
        return [p for p in self.premises if p.status == FAILED]


def canonical(verdict_id: str) -> str:
    """The verdict id as diagnose gives it today: ``canonical("bf16_precision")`` is
    ``"lost_updates"``; any other id is returned as it is."""
    return ALIASES.get(verdict_id, verdict_id)


def first_bad(step: Optional[int], module: Optional[str], phase: Optional[str]) -> dict:
    """A finding's ``first_bad``: where the failure begins (any part may be None)."""
    return {"step": step, "module": module, "phase": phase}


@dataclass
class Diagnosis(Displayable):
    """The answer for one run. Rendered by ``render.diagnosis``.

    In a notebook it displays itself; ``str(d)`` is the text ``ampdoctor diagnose`` prints.
    """

    verdict: str
    confidence: float
    summary: str
    first_bad: Optional[dict]
    causes: list[dict]
    evidence: list[Evidence]
    fixes: list[Fix]
    run: dict
    notes: list[str] = field(default_factory=list)
    history: dict = field(default_factory=dict)  # scale/LR/loss around the first bad step
    forecast: Optional[Any] = None  # forecast.Forecast: the early warning (None: not judged)
    rank_view: Optional[dict] = None  # rank files diagnosed together: rankview.build's data
    premises: list[Premise] = field(default_factory=list)  # the verdict's, as checked
    # Verdicts a rule found but whose premise failed: {verdict, confidence, summary, premises}.
    rejected: list[dict] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    def to_dict(self) -> dict:
        """Plain JSON-safe data: NaN becomes null, infinities the strings "inf"/"-inf"."""
        return _finite(json.loads(json.dumps(asdict(self), default=_jsonable)))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
