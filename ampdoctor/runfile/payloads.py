"""The JSON payloads of the run file, declared: a snapshot's ``detail`` and the JSON text of
the ``/events`` kinds that carry one. Each is a record (records.py: a dataclass, frozen, or
filled in as a replay goes where its writer builds it step by step) that the recorder builds
by keyword or attribute and the analysis side reads back by attribute through the same type,
so a key has one spelling and mypy checks both sides: the ``HIDDEN_NONFINITE``,
``LOSS_SINGULAR``, ``FLAT_LOSS_PROBE`` and ``FP8_TRIAL`` texts (``to_text`` /
``from_text``), and ``SnapshotDetail`` with the records it nests (detail.py, and the
``compiled`` and ``lr_range`` here).

The JSON written is what ``json.dumps`` made of the plain dicts these replaced: the
declarations add no field to the file, so the format version does not change with them. A new
key is one field, its default what a reader of an older file gets (docs/development.md,
"Adding a key or a column"). This module imports the standard library only, as the rest of
``runfile/`` imports no torch.

Example::

    detail = SnapshotDetail(micro_batches=2)
    detail.reproduced = True
    detail.to_text()          # '{"micro_batches": 2, "reproduced": true}'
    SnapshotDetail.from_text(detail.to_text()).stale_grads    # []: its default
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from . import records
from .detail import (
    AccumOverflow,
    Computed,
    Fp32Rerun,
    History,
    Isolation,
    LossDerivative,
    LossInfo,
    OpRecord,
    OutputGrad,
    Recorded,
    Rows,
    RowSummary,
    SingularOp,
    TargetsCheck,
    TrialOutcome,
    TriedFix,
)


def _written(value: Any) -> Any:
    return value.to_json() if isinstance(value, records.Record) else str(value)


@dataclass(frozen=True)
class CompiledOp(records.Record):
    """A compiled replay's ``op``: the first graph node non-finite from finite inputs
    (record/forensic/compiled_replay.py's probe), the keys that apply."""

    graph: str = "forward"  # "forward" or "backward"
    node: str = ""  # the FX node's name
    op: str = ""  # its op
    decomposed_from: str | None = None  # the op it was decomposed from, where another
    source: str | None = None  # "file:line: code" of the user's source
    module: str | None = None  # its module, by the recorder's name

    OMIT = frozenset({"decomposed_from", "source", "module"})


@dataclass(frozen=True)
class CompiledRung(records.Record):
    """One rung of a compiled replay: the step with every region compiled by one backend."""

    backend: str = ""  # aot_eager, decomposed, inductor
    finite: bool | None = None  # None: not run
    outcome: TrialOutcome | None = None  # the re-run (detail.py); None: not run
    op: CompiledOp | None = None  # the first non-finite node, where probed
    error: str | None = None  # why it did not run

    OMIT = frozenset({"op", "error"})


@dataclass
class CompiledReplay(records.Record):
    """``detail["compiled"]``: a compiled model's finite replay run again compiled, each
    rung of backends (record/forensic/compiled_replay.py; diagnosis/rules/reproduced.py).
    Not frozen: the replay fills it in as it goes. The keys that apply are written, in the
    order they were found."""

    regions: list[str] = field(default_factory=list)  # the compiled regions, by module name
    reproduced: bool | None = None  # the step compiled again is non-finite
    rungs: list[CompiledRung] | None = None  # per backend, lowest first (None: none ran)
    backend: str | None = None  # the lowest backend whose step is non-finite
    op: CompiledOp | None = None  # the first non-finite node of the lowest rung that found one
    alone: list[str] | None = None  # the regions that reproduce compiled alone (of several)
    region: str | None = None  # the region that reproduces (compiled alone, where several)
    error: str | None = None  # the exception the compiled replay raised
    seconds: float | None = None  # time the compiled replay took

    OMIT = frozenset({"rungs", "backend", "op", "alone", "region", "error", "seconds"})


@dataclass(frozen=True)
class LrRung(records.Record):
    """One rung of the LR range test: ``LrRange.STEPS`` steps from the kept state at the
    failing LR times ``factor``."""

    factor: float = 0.0
    lr: float | None = None  # the largest group LR it ran
    finite: bool = False  # every loss finite
    losses: list[float] = field(default_factory=list)  # the first at the kept state
    skipped: int = 0  # steps a GradScaler skipped
    seconds: float = 0.0

    AS_TEXT = frozenset({"losses"})


@dataclass
class LrRange(records.Record):
    """``detail["lr_range"]``: the LR range test run from the run's first state at the first
    failure, or /meta ``lr_range`` where the loss rose with no non-finite value
    (record/forensic/lrrange.py; diagnosis/lrrange.py). ``trains`` is the one test of
    a rung both sides use: the recorder stops one rung below the first that trains. Not
    frozen: the ladder fills it in as it goes. A test that ran writes ``state`` to
    ``max_norm`` (null where no clip); one that did not, its ``note``."""

    STEPS: ClassVar[int] = 12  # optimizer steps per rung
    # A rung trains when every loss is finite and its last is this fraction below its first.
    FALL: ClassVar[float] = 0.05

    state: str | None = None  # the state trained from: "start" (before the first update)
    state_step: int | None = None  # the step whose weights and optimizer state were kept
    event_step: int | None = None  # the failing step
    lr: float | None = None  # the largest group LR the failing step ran with
    batch: str | None = None  # which batches the rungs train on
    steps: int | None = None  # optimizer steps per rung
    rungs: list[LrRung] | None = None  # in the order they ran
    optimizer: str | None = None  # the optimizer's class
    max_norm: float | None = None  # the user's own clip, applied in the trial
    stopped: str | None = None  # why the ladder stopped before a rung trained
    note: str | None = None  # why no trial ran
    # a divergence with no non-finite value: what rose (then the test is /meta lr_range)
    trigger: str | None = None
    seconds: float | None = None  # time the whole test took
    # how the trial's loss combines the step's loss calls, as verified to give the loss the
    # run recorded at the failing step (record/forensic/losssum.py; None: the model's loss)
    loss: str | None = None

    OMIT = frozenset({"state", "state_step", "event_step", "lr", "batch", "steps", "rungs",
                      "optimizer", "max_norm", "stopped", "note", "trigger", "seconds",
                      "loss"})

    def omitted(self) -> frozenset[str]:
        return self.OMIT - {"max_norm"} if self.state is not None else self.OMIT

    @classmethod
    def trains(cls, rung: LrRung) -> bool:
        """Every loss finite over the rung's steps, the last ``FALL`` below the first."""
        losses = rung.losses
        if len(losses) < 2 or not rung.finite or not all(math.isfinite(x) for x in losses):
            return False
        first, last = float(losses[0]), float(losses[-1])
        return last <= first - cls.FALL * abs(first)


@dataclass
class SnapshotDetail(records.Record):
    """``/snapshots`` ``detail``: what a forensic replay learnt beyond the row's columns
    (written by ``record/forensic/``: findings.py, culprit.py, culprit_rerun.py,
    reproduced.py, accum.py, proofs.py, forensics.py, snapshot.py; read by the diagnosis's
    culprit.py, singular.py, proofs.py, ranks.py, facts.py and rules/).

    Not frozen: the replay fills it in as it goes, and the JSON keeps the keys it set in the
    order it first set them (``to_json``), as the dict it replaced wrote them; a field left at
    its default is not written. Read back (``from_json``), the keys keep the file's order."""

    # the replay (findings.py, forensics.py)
    summary: str | None = None  # the finding in one sentence
    micro_batches: int = 1  # micro-batches of the step
    model_calls: int | None = None  # root-module calls captured in the step
    model_calls_dropped: int | None = None  # calls past the capture cap, not kept
    replay: str | None = None  # "off: why" where the replay could not run
    replay_error: str | None = None  # the exception the replay raised
    rerun_error: str | None = None  # the exception the re-run as recorded raised
    weights: str | None = None  # the weights replayed: as at the event, or after the step
    input_modified: bool = False  # the step modified its input in place
    micro_batches_forward_only: list[int] | None = None  # micro-batches with no backward
    # the model replayed first, whose output this model's inputs were computed from (its
    # output gradient came through this one)
    fed_by: str | None = None
    # .grad non-finite before the step's backward: the parameters
    stale_grads: list[str] = field(default_factory=list)
    history: History | None = None  # scale, LR and grad norm over the steps before the event
    arrays: dict[str, str] | None = None  # saved arrays: name -> saved, truncated, skipped
    # what the replay kept from the user's code (since detail version 2)
    isolation: Isolation | None = None
    # the culprit (culprit.py, accum.py)
    bad_inputs: list[RowSummary] = field(default_factory=list)  # the batch's non-finite inputs
    chain: list[str] | None = None  # the modules the non-finite value passed through
    backward_not_replayed: str | None = None  # why the backward was not replayed
    how: str | None = None  # how the culprit made its non-finite value
    weights_nonfinite: list[str] | None = None  # parameters already non-finite: poisoned earlier
    run: Rows | None = None  # the culprit's inputs and outputs in the run's precision
    output_grad_nonfinite: bool | None = None  # the gradient at the model's output was
    loss_nonfinite: bool | None = None  # the loss itself was non-finite
    output_grad: OutputGrad | None = None  # the gradient at the model's output
    loss: LossInfo | None = None  # the loss as replayed: value, grad_nonfinite
    accum_overflow: AccumOverflow | None = None  # micro-batch gradients that overflowed summed
    # a root input made in this step outside any module, not the data (since version 4)
    computed: Computed | None = None
    # the culprit re-run (culprit_rerun.py)
    fp32: Fp32Rerun | None = None  # the culprit re-run in fp32: inputs, outputs
    fp32_error: str | None = None  # the exception the fp32 re-run raised
    op: OpRecord | None = None  # the op inside the culprit that made the value
    op_error: str | None = None  # the exception the op probe raised
    # reproduced (reproduced.py)
    recorded: Recorded | None = None  # what the real step saw
    rerun: TrialOutcome | None = None  # the step re-run as recorded
    # the loss scale ``rerun`` ran its backward at, where not the recorded one (1: at the
    # recorded one a finite forward's gradients overflowed; since version 4)
    rerun_scale: float | None = None
    loss_recomputed: bool | None = None  # the replay recomputed the loss
    loss_not_recomputed: str | None = None  # why the loss was not recomputed
    loss_input_nonfinite: list[str] | None = None  # the loss's non-finite inputs
    reproduced: bool | None = None  # did the replay repeat the failure (False: the machine)
    loss_fp32: TrialOutcome | None = None  # the loss recomputed in fp32: loss_finite
    targets: list[TargetsCheck] = field(default_factory=list)  # each loss call's targets
    # the finite replay of a compiled model run again compiled (compiled_replay.py; since 3)
    compiled: CompiledReplay | None = None
    # proofs (proofs.py): the fixes tried on the step, fix id -> what it did
    trials: dict[str, TriedFix] = field(default_factory=dict)
    trials_error: str | None = None  # the exception the trials raised
    trials_seconds: float | None = None  # time the trials took
    loss_singular_fp32: LossDerivative | None = None  # a torch loss's backward checked in fp32
    # the LR range test from the run's first state (lrrange.py; since version 3)
    lr_range: LrRange | None = None

    VERSION: ClassVar[int] = 4  # raised with each key added (the since of the comments)

    def __post_init__(self) -> None:
        # the keys set, in the order first set: those given at construction, then each set
        object.__setattr__(self, "_order", [f.name for f in fields(self)
                                            if getattr(self, f.name) != _default(f)])

    if not TYPE_CHECKING:  # (hidden from mypy, which lets any name be set on a class with it)
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, value)
            order = self.__dict__.get("_order")
            if order is not None and name not in order and name in _DETAIL_KEYS:
                order.append(name)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written: the keys set, in the order they were first set."""
        return {name: records.plain(getattr(self, name)) for name in self.__dict__["_order"]}

    def to_text(self) -> str:
        """The text written: what ``json.dumps`` writes of the plain dict it replaced."""
        return json.dumps({name: getattr(self, name) for name in self.__dict__["_order"]},
                          default=_written)

    @classmethod
    def from_json(cls, value: Any) -> SnapshotDetail:
        """``value`` (parsed JSON) as a detail, its keys in the file's order; ``value``
        itself if a detail already."""
        got = super().from_json(value)
        if got is not value and isinstance(value, dict):
            object.__setattr__(got, "_order", [k for k in value if k in _DETAIL_KEYS])
        return got


def _default(f: Any) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


_DETAIL_KEYS = frozenset(f.name for f in fields(SnapshotDetail))


@dataclass(frozen=True)
class HiddenNonfinite(records.Record):
    """``Event.HIDDEN_NONFINITE`` text (record/sampledstep.py; diagnosis/events.py): an op
    inside a module whose output stayed finite made inf/NaN."""

    op: str = "?"  # the op that made inf/NaN
    dtype: str = ""  # the dtype of the op's result
    inner: str | None = None  # the module running the op: this one or one inside it
    index: int = 0  # ops probed before it in the step
    ops: int = 1  # ops of the step that made one in this module


@dataclass(frozen=True)
class LossSingular(records.Record):
    """``Event.LOSS_SINGULAR`` text (record/forensic/proofs.py; diagnosis/singular.py): a
    ``SingularOp`` (detail.py) per op, the most singular first."""

    ops: list[SingularOp] = field(default_factory=list)


@dataclass(frozen=True)
class FlatLossProbe(records.Record):
    """``Event.FLAT_LOSS_PROBE`` text (record/flatloss.py via record/sampledstep.py;
    diagnosis/events.py): why a step was probed although not due."""

    start: float = math.nan  # median of the run's first losses
    recent: float = math.nan  # median of the last ten losses
    flat_steps: int = 0  # steps in a row the loss had not fallen, when armed
    probe: int = 0  # which probe of the run, from 1


@dataclass(frozen=True)
class Fp8Effect(records.Record):
    """One re-run of the fp8 trial measured against its reference (record/forensic/
    fp8trial.py's ``measured``): the loss, its relative change, the gradient's relative error
    and cosine over every parameter, the parameter that moved most. Where no gradient came
    back, the loss and the ``note`` alone. A non-finite error or cosine is written as text."""

    loss: float | None = None  # the re-run's loss (None: no loss was recomputed)
    note: str | None = None  # why no gradient came back (then no measure)
    loss_change: float | None = None  # relative to the reference's loss (None: no loss)
    grad_error: float | None = None  # |g - ref| / |ref| over every parameter
    grad_cosine: float | None = None
    worst_param: str | None = None  # the parameter whose own gradient moved most
    worst_param_error: float | None = None  # its relative error
    # no loss recomputed: sum <g, y> of this re-run less the reference's, the loss change
    # to first order
    output_term: float | None = None

    OMIT = frozenset({"note", "loss_change", "grad_error", "grad_cosine", "worst_param",
                      "worst_param_error", "output_term"})
    AS_TEXT = frozenset({"grad_error", "grad_cosine", "worst_param_error"})

    def omitted(self) -> frozenset[str]:
        """A measure writes its loss change (null where no loss) and leaves out the note."""
        return self.OMIT if self.note is not None else self.OMIT - {"loss_change"}


@dataclass(frozen=True)
class Fp8OwnLayer(records.Record):
    """One fp8 layer of a run already in fp8 (``Fp8Own.layers``), re-run against the
    high-precision reference: alone kept in high precision, and alone cast row-wise where it
    is cast per tensor."""

    high_precision: Fp8Effect | None = None
    rowwise: Fp8Effect | None = None

    OMIT = frozenset({"rowwise"})


@dataclass
class Fp8Own(records.Record):
    """``Fp8Trial.own``: a run already in fp8, its fp8 layers re-run in high precision (the
    reference then); against it the step as recorded and each layer's re-runs; or the
    ``note`` alone where the high-precision re-run failed (record/forensic/fp8trial.py;
    diagnosis/rules/fp8own.py). Not frozen: the trial fills in ``untried`` as it goes."""

    note: str | None = None  # why no reference: then nothing else is written
    loss: float | None = None  # the high-precision re-run's loss
    as_recorded: Fp8Effect | None = None  # the step as recorded against it
    layers: dict[str, Fp8OwnLayer] | None = None  # NAME -> its re-runs, in the order tried
    thresholds: dict[str, float] | None = None  # grad_error, loss_change
    untried: list[str] | None = None  # layers left untried when the budget ran out

    OMIT = frozenset({"note", "loss", "as_recorded", "layers", "thresholds", "untried"})

    def omitted(self) -> frozenset[str]:
        return self.OMIT if self.note is not None else frozenset({"note", "untried"})


@dataclass
class Fp8Recipe(records.Record):
    """One recipe of the fp8 trial (``Fp8Trial.recipes``): each effect (``Fp8Effect``)
    against the step re-run as recorded. Not frozen: the trial fills it in as it goes."""

    all: Fp8Effect = field(default_factory=Fp8Effect)  # every layer cast: its effect
    layers: dict[str, Fp8Effect] = field(default_factory=dict)  # NAME -> its effect alone
    # the layers to keep in high precision (None: a file whose recipe holds no list of them)
    keep: list[str] | None = None
    untried: list[str] = field(default_factory=list)  # left untried when the budget ran out
    all_but_keep: Fp8Effect | None = None  # every layer cast but ``keep``: its effect

    OMIT = frozenset({"all_but_keep"})


@dataclass
class Fp8Trial(records.Record):
    """``Event.FP8_TRIAL`` text (record/forensic/fp8trial.py; release/fp8.py,
    diagnosis/fp8.py, record/apply/prescription.py). A trial that ran writes its ``step``
    to ``thresholds`` then what it measured; one that could not, its ``note``. Not frozen:
    the trial fills it in as it goes."""

    step: int | None = None  # the sampled step whose batch was re-run
    weights_step: int | None = None  # the last step: the weights re-run are those after it
    budget: float | None = None  # the seconds it was given
    # grad_error, loss_change: above either a layer is kept
    thresholds: dict[str, float] | None = None
    note: str | None = None  # why the trial did not run, or what it could not do
    loss: float | None = None  # the loss of the step re-run as recorded (the reference)
    own: Fp8Own | None = None  # a run already in fp8: its layers re-run in high precision
    recipes: dict[str, Fp8Recipe] | None = None  # recipe name -> what each re-run did
    # the recipe whose all-but-kept re-run stays within the thresholds with the fewest layers
    # kept ("": none)
    suits: str | None = None
    runs: int | None = None  # re-runs of the step
    stopped: str | None = None  # why layers were left untried
    error: str | None = None  # the exception that stopped it
    seconds: float | None = None  # time the trial took

    OMIT = frozenset({"step", "weights_step", "budget", "thresholds", "note", "loss", "own",
                      "recipes", "suits", "runs", "stopped", "error", "seconds"})

    def omitted(self) -> frozenset[str]:
        """The reference's ``loss`` is written (null where no loss was recomputed) once the
        recipes ran; before, only where it is known."""
        return self.OMIT - {"loss"} if self.recipes is not None else self.OMIT

