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
    test_verdict_table.py checks every part). ``doc`` and ``doc_fixes``: its row of the
    README's verdict table, which ``python docs/doctables.py`` writes from this table (with
    docs/verdicts.md's)."""

    id: str
    means: str
    priority: Optional[int]
    family: str
    report: str
    fixtures: tuple[str, ...]
    doc: str  # what it means, as the README's verdict table says it (docs/doctables.py)
    doc_fixes: str  # its main fix ids, as the README's table lists them


_DIAG = "tests/diagnosis/test_diagnosis.py::"
_OVERFLOW = "tests/diagnosis/rules/test_overflow.py::"
_FP8 = "tests/record/test_fp8layers.py::"
TABLE = (
    Verdict("healthy", "no failure; GradScaler calibration and probing skips are normal",
            None, "engine", "neither", ("healthy_fp16", "healthy_bf16"),
            doc="the run trained: no failure found, and the loss fell beyond its noise (a run "
                "under 50 steps: no failure found, whether it learns not judged); GradScaler "
                "calibration and probing skips are normal",
            doc_fixes="—"),
    Verdict("grad_underflow", "fp16 gradients flush to zero: no GradScaler, or a scale stuck low",
            62, "trends", "range", ("grad_underflow",),
            doc="fp16 gradients flush to zero: no GradScaler, or a scale stuck low (≤ 8)",
            doc_fixes="`add_grad_scaler` or `raise_init_scale` (init scale from the recorded "
                      "gradients' sizes), `use_bf16`"),
    Verdict("masked_underflow",
            "the scale looks healthy but some layers' gradients flush anyway",
            60, "trends", "range", ("masked_underflow", "aux_flushed"),
            doc="the scale looks healthy (≥ 2^10) but some layers' gradients flush anyway, or "
                "(kind `flushed`) a layer's gradient is exactly 0 on every sampled step while a "
                "gradient arrives at it in fp16: it does not learn at all",
            doc_fixes="`use_bf16`, `rebalance_losses` (weight from the layers' gradient rms "
                      "ratio)"),
    Verdict("lr_overflow", "weights and activations grow with the LR until fp16 overflows",
            80, "overflow", "range", ("lr_overflow", "nanogpt_lr"),
            doc="weights and activations grow with the LR until fp16 overflows",
            doc_fixes="`lower_lr` (LR from an LR range test on the run's first state, else a "
                      "bound from the update ratios and the LR history; `max_norm` the script's "
                      "own clip, else from the healthy steps' grad norms), `use_bf16`; first "
                      "`scheduler_per_step` when a scheduler stepped per micro-batch, "
                      "`floor_lr` when the LR went below 0"),
    Verdict("unstable_op",
            "one op overflows fp16 (or its backward goes NaN) while weights are steady",
            80, "overflow", "range", ("unstable_op", "hidden_overflow"),
            doc="one op overflows fp16 (or its backward goes NaN) while the weights are steady; "
                "or (kind `hidden_overflow`) an op inside a module overflows on sampled steps "
                "while the module's output stays finite (a hand-written fp16 norm's `x * x`: inf, "
                "then exact zeros), with no NaN anywhere and a loss that does not fall",
            doc_fixes="`fp32_island` (the module the replay named, and its siblings), "
                      "`scale_attention`, `use_bf16`; for a norm: `norm_in_fp32`"),
    Verdict("mask_overflow",
            "an attention mask constant becomes -inf in fp16; masked rows go NaN",
            81, "overflow", "range", ("mask_overflow",),
            doc="an attention mask constant (-1e9) becomes -inf in fp16; masked rows go NaN",
            doc_fixes="`safe_mask`, `fp32_island`"),
    Verdict("adam_eps", "fp16 weights/optimizer state with an eps that rounds to 0 in fp16",
            87, "located", "bug", ("adam_eps",),
            doc="fp16 weights or optimizer state with an eps that rounds to 0 in fp16",
            doc_fixes="`adam_eps` (eps from the state's dtype and the gradients' sizes), "
                      "`fp32_master_weights`"),
    Verdict("bad_input", "the batch itself holds NaN/inf or values beyond fp16's range, or "
            "targets that make the loss NaN in fp32 too (kind targets)",
            84, "located", "bug", ("bad_input", "ignore_index"),
            doc="the batch itself holds NaN/inf or values beyond fp16's range, or (kind "
                "`targets`) the loss is NaN in fp32 too on a finite output because of its targets "
                "(every one `ignore_index`, out of range, NaN)",
            doc_fixes="`check_data`"),
    Verdict("accum_overflow",
            "finite micro-batch gradients whose sum in an fp16 .grad passes 65504",
            86, "located", "neither", ("accum_half_grad",),
            doc="every micro-batch's gradient is finite, but fp16 parameters accumulate them in "
                "an fp16 `.grad` that passes 65504 (the replay sums them in fp16 and names the "
                "parameter and micro-batch)",
            doc_fixes="`fp32_master_weights`, `divide_loss_by_accum`"),
    Verdict("fp16_loss", "the loss overflows while the model is finite: an fp16 loss, or a "
            "loss whose backward is infinite on fp16-rounded outputs (sigmoid + BCELoss)",
            82, "located", "range", ("fp16_loss", "bce_saturation"),
            doc="the loss overflows while the model is finite: computed in fp16 past 65504; or "
                "made non-finite by the training code's own ops between the model's finite "
                "outputs and the loss under fp16 or bf16 autocast (an entropy's `p * log p` on "
                "an fp16 softmax: 0 x -inf; `log(1 - p)` on a bf16 sigmoid rounded to exactly "
                "1.0), said at 0.6 where the loss is written by hand and neither "
                "the op nor fp32 could be measured; or (kind `loss_backward`) finite but with a "
                "backward that is infinite at what fp16 rounded the model's output to (a Sigmoid "
                "output of exactly 1.0 under `BCELoss`, a sqrt or log at 0), so GradScaler skips "
                "at every scale; a single skip at the initial scale (an fp16 loss cannot take "
                "65536) is calibration, healthy",
            doc_fixes="`loss_in_fp32` (in a bf16 run, from the logits: "
                      "`binary_cross_entropy_with_logits`); for `loss_backward`: "
                      "`loss_on_logits`, `loss_in_fp32`, and "
                      "first `clamp_loss_input` (eps from the values the step reached) where the "
                      "loss's derivative is infinite there in fp32 too (a power below 1 at 0)"),
    Verdict("clip_order", "GradScaler API misuse: clip before unscale_, optimizer.step() "
            "bypassing the scaler, scaler re-created, grads not zeroed, calls out of order",
            None, "misuse", "bug", ("clip_order",),  # ranks by misuse's (by kind)
            doc="GradScaler API misuse: clip before `unscale_` (any clip function), "
                "`optimizer.step()` bypassing the scaler, a loss backwarded without "
                "`scaler.scale` beside a scaled one, `unscale_` before a later backward of the "
                "same step (SAM's second pass), a gradient penalty of `torch.autograd.grad`'s "
                "still-scaled gradients, scaler re-created, gradients not zeroed after a skip, "
                "calls out of order",
            doc_fixes="`unscale_before_clip`, `use_scaler_step`, `scale_every_loss`, "
                      "`unscale_after_last_backward`, `unscale_autograd_grad`, "
                      "`create_scaler_once`, `zero_grad_every_step`, `fix_scaler_calls`"),
    Verdict("lost_updates", "bf16 or fp16 weights updated in place: updates below half an ulp "
            "of a weight round away (was bf16_precision)",
            55, "trends", "neither", ("bf16_precision", "fp16_sgd"),
            doc="bf16 or fp16 weights updated in place: updates below half an ulp of a weight "
                "(bf16 ~0.4 %, fp16 ~0.05 %) round away, most steps change nothing; a layer of "
                "fp32 weights whose gradients underflow is `masked_underflow`'s. Was "
                "`bf16_precision`, an id still understood "
                "(`ampdoctor.diagnosis.verdict.canonical`)",
            doc_fixes="`fp32_master_weights`"),
    Verdict("diverged",
            "no inf/NaN, but the loss blew up and never recovered, or only late (LR, not "
            "precision)",
            54, "progress", "neither", ("diverged",),
            doc="no inf/NaN, but the loss jumped ≥ 10x and stayed up, or came back only after "
                "half the run or more ≥ 3x above its level before, or the jump killed the units "
                "(then `dead_units` is its consequence), or it climbed ≥ 10x above its start; the "
                "learning rate, not the precision",
            doc_fixes="`lower_lr` (LR from the update ratios, below the LR of the jump), "
                      "`revive_units`; first `floor_lr` when the schedule went below 0"),
    Verdict("dead_units",
            "no inf/NaN, but the gradients are exactly 0: units died, the weights stopped",
            53, "progress", "neither", ("dead_units",),
            doc="no inf/NaN, but ≥ 90 % of the gradient is exactly 0 to the end (ReLU units off "
                "for every input), or the update ratios fell ≥ 1000x at an unchanged LR, and the "
                "loss no longer falls",
            doc_fixes="`lower_lr` or `revive_units`"),
    Verdict("fp8_grad_underflow", "a layer trained in fp8 loses its output gradient's values "
            "in the format it casts it to (e4m3 row-wise: e5m2 per tensor keeps them)",
            57, "fp8", "neither", (_FP8 + "test_a_gradient_that_underflows_e4m3_rowwise_is_"
                                   "diagnosed_with_its_layer",),
            doc="a layer already trained in fp8 (torchao's `Float8Linear`) loses its output "
                "gradient's values in the format it casts it to (> 1 % of the non-zero values "
                "flushed, or > 10 % subnormal, and a tenth of them flushed or subnormal together, "
                "on a sampled step, with no NaN); kind `e4m3` where the same gradient per tensor "
                "in e5m2 keeps them, `e5m2` where no fp8 format does",
            doc_fixes="`fp8_tensorwise` (kind `e4m3`), `fp8_keep_layer`"),
    Verdict("fp8_flushed", "a layer trained in fp8 had an operand flushed whole on some "
            "sampled steps: a zero amax (torchao clamps it, silently), a clamped one, or "
            "every value cast to 0; or mostly (kind mostly: one outlier took the per-tensor "
            "scale)", 52, "fp8", "neither",
            (_FP8 + "test_a_layer_fed_zeros_on_some_steps_is_flushed_whole",),
            doc="a layer already trained in fp8 had its input or output gradient flushed whole on "
                "some sampled steps, silently: all zero (kind `zero`: torchao clamps the amax at "
                "1e-12 and casts on), an amax under that floor (`clamped`), or every non-zero "
                "value cast to 0 (`flushed`); or mostly (kind `mostly`: more than half of an "
                "operand's non-zero values cast to 0, one outlier having taken the per-tensor "
                "scale), the fixes tried on the saved step by the fp8 trial",
            doc_fixes="`fp8_rowwise` (kind `mostly`, where row-wise keeps the values), "
                      "`fp8_keep_layer`"),
    Verdict("fp8_saturated", "a layer trained in fp8 clamps an operand at the format's max on "
            "some sampled steps: a delayed scale that an amax jump outgrew",
            56, "fp8", "neither", ("tests/diagnosis/rules/test_fp8self.py::"
                                   "test_a_delayed_scale_behind_an_amax_jump_saturates",),
            doc="a layer already trained in fp8 clamps more than 1e-3 of an operand's values at "
                "the format's max: a delayed scale that an amax jump outgrew (kind `amax_jump`); "
                "read from the record of a delayed-scaled layer (torchao before 0.10; torchao "
                "0.18 scales by the current amax and never clamps)",
            doc_fixes="`fp8_current_scaling`, `fp8_keep_layer`"),
    Verdict("fp8_drift", "a run in fp8 whose loss drifts from its bf16 baseline's (diagnose "
            "--baseline) with no NaN: the layer whose casts lose the most named; without a "
            "baseline (kind self), the saved step re-run in high precision",
            51, "fp8", "neither", (_FP8 + "test_an_fp8_run_that_drifts_from_its_baseline_"
                                   "names_the_layer",),
            doc="a run already trained in fp8 whose loss drifts from its bf16 (or fp32) "
                "baseline's beyond `compare`'s 2 % (trailing means), with no NaN; only with "
                "`diagnose fp8.h5 --baseline bf16.h5`. Kind `diverged` past 10 % without coming "
                "back, else `drift`. The layer named is the fp8 layer whose own casts lose the "
                "most (lowest SQNR): a ranking, not a proof. Without a baseline, kind `self` "
                "(confidence 0.5): the fp8 trial re-ran the saved step with the fp8 layers in "
                "high precision and the step as recorded is > 50 % of the gradient or > 10 % of "
                "the loss off it",
            doc_fixes="`fp8_keep_layer`"),
    Verdict("fp8_amax_mismatch", "an fp8 operand that several ranks hold whole (a DDP "
            "weight, a replicated DTensor) has a different amax and scale on some of them: "
            "replicas that drifted apart, or a scale from a rank-local amax",
            79, "fp8ranks", "bug", ("tests/integration/test_fp8_ranks.py::"
                                    "test_ddp_replicas_that_drift_apart_are_named",),
            doc="an fp8 layer's operand that several ranks hold whole, by the recorded layout (a "
                "weight under DDP, a DTensor replicated over a tensor-parallel group), has a "
                "different amax and so a different fp8 scale on some of them on a sampled step: "
                "the replicas drifted apart (kind `ddp`: gradients not all-reduced, weights "
                "changed on one rank after `DDP(model)`), or a replicated tensor differs across "
                "its group or took its scale from a rank-local amax (kind `dtensor`); from the "
                "job's rank files side by side, with the layer, the step and each rank's amax and"
                " scale. Activations under plain data parallel are never compared",
            doc_fixes="`fp8_sync_replicas`, `fp8_reduce_amax` (kind `dtensor`)"),
    Verdict("not_learning", "no failure found, but the loss did not fall (low confidence; "
            "says what was checked)", 15, "learning", "neither", ("not_learning",),
            doc="no failure found, but over 50 steps or more the loss did not fall (less than 10 "
                "%, or within its own noise): low confidence, the evidence says what was checked; "
                "a found cause takes the verdict instead",
            doc_fixes="`overfit_one_batch`"),
    Verdict("state_poisoning", "BatchNorm/buffers non-finite while the weights are finite",
            88, "located", "bug", ("state_poisoning",),
            doc="BatchNorm running statistics (buffers) non-finite while the weights are finite",
            doc_fixes="`guard_buffers`, `fp32_buffers`, `check_data`"),
    Verdict("not_reproducible", "a non-finite step whose replay on the same batch and weights "
            "is finite: the machine (a faulty device, nondeterminism), not the numbers",
            83, "reproduced", "neither", ("faulty_device", "faulty_rank"),
            doc="a non-finite step whose replay on the same batch, weights and RNG is finite: a "
                "faulty device or silent data corruption (the rank named), a nondeterministic "
                "kernel, or code the replay does not run; one such skip in an otherwise healthy "
                "run is only a note",
            doc_fixes="`test_device`, `rerun_elsewhere`, `deterministic_algorithms`"),
    Verdict("compiler", "a non-finite step of a compiled model whose replay is finite eagerly "
            "and non-finite compiled again: torch.compile makes the NaN (the region and op "
            "named)", 85, "reproduced", "neither", ("compile_nan",),
            doc="a compiled model's non-finite step whose replay is finite eagerly and non-finite "
                "compiled again (aot_eager, inductor's decompositions, inductor): torch.compile "
                "makes the NaN; the region and the first non-finite op named, the fixes tried on "
                "the step",
            doc_fixes="`compiler_disable`, `compile_backend`, `report_compiler_bug`"),
    Verdict("scale_collapse", "the scale fell persistently and no root cause could be told",
            None, "fallbacks", "range",  # a consequence (root=False): ranks by nothing
            (_DIAG + "test_scale_collapse_when_nothing_else_can_be_told",),
            doc="the scale fell persistently and no root cause could be told (says what is "
                "missing)",
            doc_fixes="`use_bf16`"),
    Verdict("nonfinite", "weights non-finite before the first update (loaded so), or non-finite "
            "values that no class explains (low confidence; see notes)", 5, "fallbacks",
            "neither", (_OVERFLOW + "test_nonfinite_in_fp32_too_without_growth_is_not_claimed",
                        "tests/diagnosis/rules/test_fallbacks.py::"
                        "test_weights_nonfinite_before_the_first_update_are_the_checkpoints"),
            doc="weights non-finite before the run's first update (loaded so: a resume from a NaN "
                "checkpoint), or non-finite values that no class explains (low confidence, says "
                "what is missing; never where the failure's replay was finite)",
            doc_fixes="`reload_finite_checkpoint`, `check_data`"),
    Verdict("no_training", "no optimizer step was recorded",
            70, "fallbacks", "neither", (_DIAG + "test_no_steps_is_no_training",),
            doc="no optimizer step was recorded (the script never trained)",
            doc_fixes="—"),
    Verdict("recording_stopped", "ampdoctor stopped recording (an internal error) before any "
            "step was kept; the script itself may have trained",
            70, "fallbacks", "neither",
            ("tests/integration/test_stacks.py::"
             "test_recording_stopped_before_any_step_is_not_never_trained",),
            doc="ampdoctor stopped recording (an internal error, its text shown) before any step "
                "was kept; the script itself may have trained",
            doc_fixes="—"),
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
