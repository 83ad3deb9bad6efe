"""The records a forensic replay nests in a snapshot's ``detail`` (runfile/payloads.py's
``SnapshotDetail``): the op that made the non-finite value (``op``), the culprit's tensors
as replayed (``run``, ``bad_inputs``) and re-run in fp32 (``fp32``), and a re-run of the step
under a trial (``rerun``, ``loss_fp32``; the outcome ``record/forensic/trial.py`` fills in).
Each is declared once here (records.py) and used by both sides: the recorder builds it, the
diagnosis reads its fields.

Example::

    op = OpRecord.from_json({"op": "mul", "created": ["posinf"], "dtype": "float16"})
    op.created, op.mask_operand       # ['posinf'], True (a file older than mask_operand)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .records import Record


@dataclass(frozen=True)
class OpRecord(Record):
    """``detail["op"]``: the first op inside a forward culprit whose result held NaN/inf its
    inputs did not (record/opprobe.py), read by the diagnosis's culprit.py and the mask and
    operand premises."""

    op: str = ""  # torch's name of the op: "mul", "masked_fill"
    created: list[str] = field(default_factory=list)  # what it made: "nan", "posinf", "neginf"
    dtype: str = ""  # of its result: "float16"
    counts: dict[str, int] = field(default_factory=dict)  # nan, posinf, neginf in its result
    numel: int = 0  # elements of its result
    in_absmax: float | None = None  # the largest finite input magnitude
    big_scalar: float | None = None  # the largest finite scalar argument
    in_nan: bool = False  # an input already held NaN
    in_posinf: bool = False
    in_neginf: bool = False
    index: int = 0  # ops probed before it
    # an input looks like an additive mask (one negative constant); a file older than this
    # key reads True, the reading it was judged by then
    mask_operand: bool = True


@dataclass(frozen=True)
class Recorded(Record):
    """``detail["recorded"]``: what the real step saw, measured at the event; each True
    (non-finite), False, or None (not seen) (record/forensic/reproduced.py)."""

    loss_nonfinite: bool | None = None  # the loss
    output_nonfinite: bool | None = None  # the model's output
    output_grad_nonfinite: bool | None = None  # the gradient at the model's output
    loss_fns: list[str] = field(default_factory=list)  # the torch loss functions it called


@dataclass(frozen=True)
class LossInfo(Record):
    """``detail["loss"]``: the loss as replayed, and the gradient that reached it
    (record/forensic/culprit.py); empty where the step had no loss."""

    dtype: str | None = None  # the loss's dtype
    value: float | None = None  # the loss, summed
    grad_fp32: float | None = None  # the loss scale: the gradient reaching the loss, in fp32
    grad: float | None = None  # that gradient cast to the loss's dtype
    grad_nonfinite: bool | None = None  # the cast overflowed

    OMIT = frozenset({"dtype", "value", "grad_fp32", "grad", "grad_nonfinite"})


@dataclass(frozen=True)
class OutputGrad(Record):
    """``detail["output_grad"]``: the gradient the loss's backward sent into the model's first
    bad output (record/forensic/culprit.py)."""

    index: int = 0  # which output
    nonfinite: int = 0  # elements NaN/inf
    numel: int = 0
    dtype: str = ""  # the gradient's dtype
    finite_absmax: float | None = None  # the largest finite magnitude
    output_values: list[float] | None = None  # the output's values where it is non-finite
    output_values_n: int | None = None  # how many distinct such values

    OMIT = frozenset({"output_values", "output_values_n"})


@dataclass(frozen=True)
class AccumOverflow(Record):
    """``detail["accum_overflow"]``: where the micro-batch gradients summed in a half ``.grad``
    overflowed (record/forensic/accum.py)."""

    param: str = ""  # the parameter
    micro: int = 0  # the micro-batch whose gradient made the sum overflow
    micro_batches: int = 0  # micro-batches of the step
    dtype: str = ""  # the .grad's dtype
    fp32_absmax: float = 0.0  # the sum's magnitude in fp32


@dataclass(frozen=True)
class RowSummary(Record):
    """One tensor of the fp32 re-run: its counts as a /stats row has them."""

    label: str = ""
    dtype: str = ""
    numel: int = 0
    absmax: float = math.nan
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    over16: int = 0
    zeros: int = 0


@dataclass(frozen=True)
class Rows(Record):
    """``detail["run"]``: the culprit's inputs and outputs as the replay measured them in the
    run's precision (record/forensic/culprit.py), at most 16 each."""

    inputs: list[RowSummary] = field(default_factory=list)
    outputs: list[RowSummary] = field(default_factory=list)


@dataclass(frozen=True)
class Fp32Rerun(Rows):
    """``detail["fp32"]``: the culprit module re-run alone in fp32 (record/forensic/
    culprit_rerun.py): what went in and came out, at most 16 each."""

    copied_module: bool = False  # a half module was re-run as an fp32 copy


@dataclass
class TrialOutcome(Record):
    """``detail["rerun"]``, ``detail["loss_fp32"]``: one re-run of the step under a trial
    (record/forensic/trial.py's ``Outcome`` is this class). Not frozen: the re-run fills it
    in as it goes. ``loss`` is written as text where not finite (``AS_TEXT``)."""

    trial: str = ""
    finite: bool = False  # outputs, recomputed loss and every parameter gradient finite
    first: str = ""  # where it first was not: "forward", "loss", "backward" ("": nowhere)
    output_finite: bool | None = None
    loss: float | None = None  # the recomputed loss (summed over the loss calls)
    loss_finite: bool | None = None  # None: no loss was recomputed
    loss_fns: list[str] = field(default_factory=list)  # the torch loss functions recomputed
    loss_dtype: str | None = None
    grads: str = "not run"  # "finite", "non-finite", "zero" (every one exactly 0), "not run"
    backward_from: str = ""  # "loss" (recomputed) or "output" (the recorded output gradient)
    micro: int = -1  # rerun_step: the first micro-batch that was not finite
    note: str = ""  # why something was not run
    unjudged: str = ""  # why the re-run cannot judge the change (a target held NaN/inf)

    AS_TEXT = frozenset({"loss"})

    def as_dict(self) -> dict[str, Any]:
        """The JSON object written (``to_json``), for the trials that add keys to it."""
        return self.to_json()



@dataclass(frozen=True)
class TriedFix(Record):
    """``detail["trials"][fix id]``: a fix tried on the saved step (record/forensic/proofs.py,
    compiled_replay.py; the diagnosis's proofs.py ranks the fixes by them). A trial re-run
    whole (``ran``) writes its outcome's keys and then its own; one not tried, or a compiled
    replay's, writes ``tried``, ``note`` and the few it measured."""

    tried: bool = False
    note: str | None = None  # why it was not tried (or what the trial was)
    finite: bool | None = None  # the step under the fix: outputs, loss, gradients finite
    loss: float | None = None
    first: str | None = None  # where it first was not: "forward", "loss", "backward"
    step: int | None = None  # the step tried
    backend: str | None = None  # compile_backend: the backend that kept it finite
    outcome: TrialOutcome | None = None  # the re-run's whole outcome, where it ran whole
    at_scale: float | None = None  # run at this loss scale (the recorded one overflowed)
    recorded_scale: float | None = None
    seconds: float | None = None
    modules: list[str] | None = None  # fp32_island: the modules the island went around

    OMIT = frozenset({"note", "finite", "loss", "first", "step", "backend", "outcome",
                      "at_scale", "recorded_scale", "seconds", "modules"})
    # keys written after the outcome's own, in this order, by a trial re-run whole
    AFTER = ("at_scale", "recorded_scale", "tried", "step", "seconds", "modules")

    @classmethod
    def ran(cls, outcome: TrialOutcome, step: int | None, seconds: float | None = None,
            modules: list[str] | None = None, at_scale: float | None = None,
            recorded_scale: float | None = None) -> TriedFix:
        """A trial re-run whole: its outcome, with what the proofs add beside it."""
        return cls(tried=True, note=outcome.note, finite=outcome.finite, loss=outcome.loss,
                   first=outcome.first, step=step, outcome=outcome, at_scale=at_scale,
                   recorded_scale=recorded_scale, seconds=seconds, modules=modules)

    def to_json(self) -> dict[str, Any]:
        if self.outcome is None:
            return super().to_json()
        out = self.outcome.to_json()
        for name in self.AFTER:
            value = getattr(self, name)
            if value is not None or name not in self.OMIT:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, value: Any) -> TriedFix:
        read = super().from_json(value)
        if not isinstance(value, dict) or "trial" not in value:  # not a whole outcome
            return read
        return replace(read, outcome=TrialOutcome.from_json(value))


@dataclass
class Isolation(Record):
    """``detail["isolation"]``: what a replay kept from the user's code (record/forensic/
    isolated.py's ``preserved`` counts it, so not frozen): hooks that did not run, hooks its
    forward registered that were not installed, characters of output held back."""

    hooks_set_aside: int = 0
    hooks_not_installed: int = 0
    output_held_back: int = 0


@dataclass(frozen=True)
class History(Record):
    """``detail["history"]``: the steps before the event, as the device had them
    (record/forensic/forensics.py): one value per step in each list."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    found_inf: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Computed(Record):
    """``detail["computed"]``: a root input made in the step outside any module, not the data
    (record/forensic/computed.py): the op or custom autograd.Function that made it."""

    op: str = ""  # the op, or the Function's class name
    function: bool = False  # a custom autograd.Function
    into: str = ""  # the model it was given to
    label: str = ""  # as which input: "args.0"
    dtype: str = ""  # its dtype
    device: str = ""  # the autocast device type
    autocast: str | None = None  # the autocast dtype it ran under; None: autocast off


@dataclass(frozen=True)
class Derivative(Record):
    """An op's derivative at each held value, in one precision: how many were non-finite,
    and the largest finite one (None: none was)."""

    nonfinite: int = 0
    largest: float | None = None


@dataclass(frozen=True)
class LossDerivative(Derivative):
    """``detail["loss_singular_fp32"]``: the torch loss functions recomputed in fp32 on the
    replayed outputs, differentiated with respect to them (record/forensic/singular.py)."""

    numel: int = 0  # derivatives
    loss_fns: list[str] = field(default_factory=list)  # the loss functions recomputed
    loss: float | None = None  # the loss recomputed

    AS_TEXT = frozenset({"loss"})


@dataclass(frozen=True)
class SingularOp(Record):
    """One op of a hand-written loss whose derivative is infinite at a point (log at 0, pow
    below 1 at 0), measured at its held input: an entry of the ``LOSS_SINGULAR`` event's
    ``ops`` (record/forensic/singular.py; diagnosis/singular.py). One whose input was not
    held has a ``note`` instead of the measures; a measurement that failed, ``error`` only."""

    op: str = ""  # "pow", "log", "binary_cross_entropy"
    node: str = ""  # its autograd node: "PowBackward0"
    exponent: float | None = None  # pow's
    points: list[float] = field(default_factory=lambda: [0.0])  # where it is singular
    note: str | None = None  # why its input was not held
    dtype: str | None = None  # of its input
    numel: int | None = None
    at_point: int | None = None  # values exactly at a singular point
    run: Derivative | None = None  # in the run's precision
    fp32: Derivative | None = None  # in fp32
    nearest: float | None = None  # the smallest distance to a point, of those not at one
    eps_nearest: float | None = None  # the smallest where the run's derivative is finite
    eps: float | None = None  # that, rounded up to two digits: the clamp tried
    clamped: Derivative | None = None  # the derivative with the input clamped at eps
    error: str | None = None  # the measurement failed (nothing else is written)
    # a division's denominator (op "div"): True when no gradient reaches it from the model
    # (computed from the batch alone: a count of labelled tokens, a mask's sum)
    constant: bool | None = None

    OMIT = frozenset({"note", "dtype", "numel", "at_point", "run", "fp32", "nearest",
                      "eps_nearest", "eps", "clamped", "error", "constant"})
    MEASURED = frozenset({"nearest", "eps_nearest", "eps"})  # written, null or not, once measured

    def omitted(self) -> frozenset[str]:
        return self.OMIT - self.MEASURED if self.fp32 is not None else self.OMIT

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error} if self.error is not None else super().to_json()


@dataclass(frozen=True)
class TargetsCheck(Record):
    """One ``detail["targets"]`` entry: what a loss call's targets hold (record/forensic/
    losscall.py ``check_targets``; the diagnosis's rules/reproduced.py and fallbacks.py).
    Floating targets write ``nonfinite`` (and ``outside`` for a probability); class
    indices ``ignore_index`` to ``all_ignored``."""

    fn: str = ""  # the loss function: "cross_entropy"
    numel: int = 0
    dtype: str = ""
    problem: str | None = None  # what makes the loss non-finite whatever the precision
    nonfinite: int | None = None
    outside: int | None = None  # outside [0, 1] (below 0 for kl_div)
    ignore_index: int | None = None
    ignored: int | None = None
    reduction: str | None = None
    classes: int | None = None  # from the input's shape
    out_of_range: int | None = None
    all_ignored: bool | None = None
    unalignable: int | None = None  # CTC label sequences longer than their input allows

    OMIT = frozenset({"nonfinite", "outside", "ignore_index", "ignored", "reduction",
                      "classes", "out_of_range", "all_ignored", "unalignable"})
