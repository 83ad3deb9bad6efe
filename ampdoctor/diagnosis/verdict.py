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


@dataclass(frozen=True)
class Verdict:
    """One verdict's declaration: every table about verdicts derives from ``TABLE``.

    ``priority``: what its finding ranks by among root causes (``PRIORITY``; None where the rule
    takes another key's, or no rule decides it). ``family``: the module of ``diagnosis/rules/``
    whose rule decides it (``engine`` for healthy: no rule fired). ``report``: what the release
    report's precision decision reads into it: ``"range"`` (fp16's range failed: another dtype
    or fp32 islands are the remedy), ``"bug"`` (the script or its data: no dtype fixes it), or
    ``"neither"``. ``fixtures``: what shows it decided, keys of fixtures/verdicts/expected.json
    or ``tests/...py::test_name`` for one a recording cannot make (tests/diagnosis/
    test_verdict_table.py checks every part)."""

    id: str
    means: str
    priority: Optional[int]
    family: str
    report: str
    fixtures: tuple[str, ...]


_DIAG = "tests/diagnosis/test_diagnosis.py::"
_OVERFLOW = "tests/diagnosis/rules/test_overflow.py::"
_FP8 = "tests/record/test_fp8layers.py::"
TABLE = (
    Verdict("healthy", "no failure; GradScaler calibration and probing skips are normal",
            None, "engine", "neither", ("healthy_fp16", "healthy_bf16")),
    Verdict("grad_underflow", "fp16 gradients flush to zero: no GradScaler, or a scale stuck low",
            62, "trends", "range", ("grad_underflow",)),
    Verdict("masked_underflow",
            "the scale looks healthy but some layers' gradients flush anyway",
            60, "trends", "range", ("masked_underflow", "aux_flushed")),
    Verdict("lr_overflow", "weights and activations grow with the LR until fp16 overflows",
            80, "overflow", "range", ("lr_overflow", "nanogpt_lr")),
    Verdict("unstable_op",
            "one op overflows fp16 (or its backward goes NaN) while weights are steady",
            80, "overflow", "range", ("unstable_op", "hidden_overflow")),
    Verdict("mask_overflow",
            "an attention mask constant becomes -inf in fp16; masked rows go NaN",
            81, "overflow", "range", ("mask_overflow",)),
    Verdict("adam_eps", "fp16 weights/optimizer state with an eps that rounds to 0 in fp16",
            87, "located", "bug", ("adam_eps",)),
    Verdict("bad_input", "the batch itself holds NaN/inf or values beyond fp16's range, or "
            "targets that make the loss NaN in fp32 too (kind targets)",
            84, "located", "bug", ("bad_input", "ignore_index")),
    Verdict("accum_overflow",
            "finite micro-batch gradients whose sum in an fp16 .grad passes 65504",
            86, "located", "neither", ("accum_half_grad",)),
    Verdict("fp16_loss", "the loss overflows while the model is finite: an fp16 loss, or a "
            "loss whose backward is infinite on fp16-rounded outputs (sigmoid + BCELoss)",
            82, "located", "range", ("fp16_loss", "bce_saturation")),
    Verdict("clip_order", "GradScaler API misuse: clip before unscale_, optimizer.step() "
            "bypassing the scaler, scaler re-created, grads not zeroed, calls out of order",
            None, "misuse", "bug", ("clip_order",)),  # ranks by misuse's (by kind)
    Verdict("lost_updates", "bf16 or fp16 weights updated in place: updates below half an ulp "
            "of a weight round away (was bf16_precision)",
            55, "trends", "neither", ("bf16_precision", "fp16_sgd")),
    Verdict("diverged",
            "no inf/NaN, but the loss blew up and never recovered, or only late (LR, not "
            "precision)",
            54, "progress", "neither", ("diverged",)),
    Verdict("dead_units",
            "no inf/NaN, but the gradients are exactly 0: units died, the weights stopped",
            53, "progress", "neither", ("dead_units",)),
    Verdict("fp8_grad_underflow", "a layer trained in fp8 loses its output gradient's values "
            "in the format it casts it to (e4m3 row-wise: e5m2 per tensor keeps them)",
            57, "fp8", "neither", (_FP8 + "test_a_gradient_that_underflows_e4m3_rowwise_is_"
                                   "diagnosed_with_its_layer",)),
    Verdict("fp8_flushed", "a layer trained in fp8 had an operand flushed whole on some "
            "sampled steps: a zero amax (torchao clamps it, silently), a clamped one, or "
            "every value cast to 0; or mostly (kind mostly: one outlier took the per-tensor "
            "scale)", 52, "fp8", "neither",
            (_FP8 + "test_a_layer_fed_zeros_on_some_steps_is_flushed_whole",)),
    Verdict("fp8_saturated", "a layer trained in fp8 clamps an operand at the format's max on "
            "some sampled steps: a delayed scale that an amax jump outgrew",
            56, "fp8", "neither", ("tests/diagnosis/rules/test_fp8self.py::"
                                   "test_a_delayed_scale_behind_an_amax_jump_saturates",)),
    Verdict("fp8_drift", "a run in fp8 whose loss drifts from its bf16 baseline's (diagnose "
            "--baseline) with no NaN: the layer whose casts lose the most named; without a "
            "baseline (kind self), the saved step re-run in high precision",
            51, "fp8", "neither", (_FP8 + "test_an_fp8_run_that_drifts_from_its_baseline_"
                                   "names_the_layer",)),
    Verdict("fp8_amax_mismatch", "an fp8 operand that several ranks hold whole (a DDP "
            "weight, a replicated DTensor) has a different amax and scale on some of them: "
            "replicas that drifted apart, or a scale from a rank-local amax",
            79, "fp8ranks", "bug", ("tests/integration/test_fp8_ranks.py::"
                                    "test_ddp_replicas_that_drift_apart_are_named",)),
    Verdict("not_learning", "no failure found, but the loss did not fall (low confidence; "
            "says what was checked)", 15, "learning", "neither", ("not_learning",)),
    Verdict("state_poisoning", "BatchNorm/buffers non-finite while the weights are finite",
            88, "located", "bug", ("state_poisoning",)),
    Verdict("not_reproducible", "a non-finite step whose replay on the same batch and weights "
            "is finite: the machine (a faulty device, nondeterminism), not the numbers",
            83, "reproduced", "neither", ("faulty_device", "faulty_rank")),
    Verdict("compiler", "a non-finite step of a compiled model whose replay is finite eagerly "
            "and non-finite compiled again: torch.compile makes the NaN (the region and op "
            "named)", 85, "reproduced", "neither", ("compile_nan",)),
    Verdict("scale_collapse", "the scale fell persistently and no root cause could be told",
            None, "fallbacks", "range",  # a consequence (root=False): ranks by nothing
            (_DIAG + "test_scale_collapse_when_nothing_else_can_be_told",)),
    Verdict("nonfinite", "weights non-finite before the first update (loaded so), or non-finite "
            "values that no class explains (low confidence; see notes)", 5, "fallbacks",
            "neither", (_OVERFLOW + "test_nonfinite_in_fp32_too_without_growth_is_not_claimed",
                        "tests/diagnosis/rules/test_fallbacks.py::"
                        "test_weights_nonfinite_before_the_first_update_are_the_checkpoints")),
    Verdict("no_training", "no optimizer step was recorded",
            70, "fallbacks", "neither", (_DIAG + "test_no_steps_is_no_training",)),
    Verdict("recording_stopped", "ampdoctor stopped recording (an internal error) before any "
            "step was kept; the script itself may have trained",
            70, "fallbacks", "neither",
            ("tests/integration/test_stacks.py::"
             "test_recording_stopped_before_any_step_is_not_never_trained",)),
)
VERDICTS = {v.id: v.means for v in TABLE}
# Old verdict ids, still understood wherever an id is read (``canonical``): the verdict a run
# gets is always the new one.
ALIASES = {"bf16_precision": "lost_updates"}
# Verdicts with no step to diagnose (the CLI exits 2 on them).
EMPTY = ("no_training", "recording_stopped")

# A finding's ``priority`` by what decided it: among root causes the higher wins (exact
# fingerprints of the script's own failure, then located numeric causes, then trends, then the
# fallbacks). The rules (``rules.RULES``) read their priority here: each verdict's from
# ``TABLE``, and the keys that are not one verdict's.
PRIORITY = {
    "exception": 95, "misuse": 90,  # the script's own errors and API misuse events: exact
    "sampled": 70,  # located by sampled statistics only
    "risk": 20,  # a configuration that will fail
    **{v.id: v.priority for v in TABLE if v.priority is not None},
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
