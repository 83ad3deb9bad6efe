"""The JSON payloads of the run file, declared: a snapshot's ``detail`` and the JSON text of
the ``/events`` kinds that carry one. The recorder builds each payload as one of these types
and the analysis side reads it back through the same type, so a key has one spelling.

Most are records (records.py: frozen dataclasses, or filled in as a replay goes where
their writer builds them step by step), which mypy checks on both sides: the
``HIDDEN_NONFINITE``, ``LOSS_SINGULAR``, ``FLAT_LOSS_PROBE`` and ``FP8_TRIAL`` texts
(``to_text`` / ``from_text``), and the detail's ``compiled`` and ``lr_range``. What follows
is of the one left a checked dict, ``SnapshotDetail``, whose keys are its own.

A payload is a ``dict`` whose keys are checked against its declaration (``KEYS``: name ->
``Key``, its type, its default, the payload version that added it): setting, reading or
testing a key the declaration does not have raises ``UndeclaredKey`` (a bug on either side,
caught by the tests that run it; tests/runfile/test_payloads.py also reads every writer and
reader in the source for the keys they name). Reading a key a file does not hold gives its
declared default (``get(key)``; ``get(key, other)`` gives ``other``). A key from a newer
writer that this reader does not declare is kept as read (``from_json``) and never looked at.

The JSON written is what ``json.dumps(payload, default=str)`` makes of a plain dict: the
declarations add no field to the file, so the format version does not change with them. A new
key is one line in ``KEYS`` with ``since`` raised to the payload's new ``VERSION``
(docs/development.md, "Adding a key or a column"). This module imports the standard library
only, as the rest of ``runfile/`` imports no torch.

Example::

    detail = SnapshotDetail(micro_batches=2)
    detail["reproduced"] = True
    SnapshotDetail.from_json(detail.to_json()).get("stale_grads")     # None: its default
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar

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

R = TypeVar("R", bound=records.Record)
P = TypeVar("P", bound="Payload")
_DECLARED: Any = object()  # get()'s "no default given": the declared one


class UndeclaredKey(KeyError):
    """A key a payload's declaration does not have: a typo, or a key not declared yet."""


@dataclass(frozen=True)
class Key:
    """One declared key: its JSON type(s), the value a reader gets when a file lacks it, the
    payload version that added it, and what it holds."""

    type: Any
    doc: str
    default: Any = None
    since: int = 1


class Payload(dict):
    """A JSON object with declared keys (see the module docstring)."""

    NAME: ClassVar[str] = "payload"
    VERSION: ClassVar[int] = 1
    KEYS: ClassVar[Mapping[str, Key]] = {}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        self.update(*args, **kwargs)

    @classmethod
    def check(cls, key: Any) -> str:
        if key not in cls.KEYS:
            raise UndeclaredKey(f"{key!r} is not a key of {cls.NAME} (runfile/payloads.py "
                                f"declares {', '.join(sorted(cls.KEYS))})")
        return key

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(self.check(key), value)

    def __missing__(self, key: str) -> Any:
        return self.KEYS[self.check(key)].default

    def __getitem__(self, key: str) -> Any:
        self.check(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.check(key)
        return super().__contains__(key)

    def get(self, key: str, default: Any = _DECLARED) -> Any:
        self.check(key)
        if super().__contains__(key):
            return super().__getitem__(key)
        return self.KEYS[key].default if default is _DECLARED else default

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.check(key)
        return super().setdefault(key, default)

    def pop(self, key: str, *default: Any) -> Any:
        self.check(key)
        return super().pop(key, *default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def to_json(self) -> str:
        """The text written to the file: as ``json.dumps`` writes the same plain dict."""
        return json.dumps(dict(self), default=_written)

    @classmethod
    def from_json(cls: type[P], text: Any) -> P:
        """The payload in ``text``; empty where the text is empty, not JSON or not an object
        (a damaged or foreign file). Keys this reader does not declare are kept, unread."""
        try:
            value = json.loads(text) if text else {}
        except (ValueError, TypeError):
            value = {}
        return cls.of(value)

    @classmethod
    def of(cls: type[P], value: Any) -> P:
        """``value`` (parsed JSON) as this payload; empty unless it is an object; ``value``
        itself if it is one already."""
        if isinstance(value, cls):
            return value
        out = cls()
        if isinstance(value, dict):
            dict.update(out, value)  # (undeclared keys of a newer writer kept as they are)
            for key, declared in cls.KEYS.items():
                if key in value and _is_record(declared.type):
                    dict.__setitem__(out, key, records.read(declared.type, value[key]))
        return out


def _is_record(kind: Any) -> bool:
    """A key whose value is a record (``records.Record``) or a list or map of them: read
    into its type when the payload is, written back as its JSON object."""
    if typing.get_origin(kind) in (list, dict):
        kind = typing.get_args(kind)[-1]
    return isinstance(kind, type) and issubclass(kind, records.Record)


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


class SnapshotDetail(Payload):
    """``/snapshots`` ``detail``: what a forensic replay learnt beyond the row's columns
    (written by ``record/forensic/``: findings.py, culprit.py, culprit_rerun.py,
    reproduced.py, accum.py, proofs.py, forensics.py, snapshot.py; read by the diagnosis's
    culprit.py, singular.py, proofs.py, ranks.py, facts.py and rules/)."""

    NAME = "a snapshot's detail"
    VERSION = 4
    KEYS = {
        # the replay (findings.py, forensics.py)
        "summary": Key(str, "the finding in one sentence"),
        "micro_batches": Key(int, "micro-batches of the step", 1),
        "model_calls": Key(int, "root-module calls captured in the step"),
        "model_calls_dropped": Key(int, "calls past the capture cap, not kept"),
        "replay": Key(str, "'off: why' where the replay could not run"),
        "replay_error": Key(str, "the exception the replay raised"),
        "rerun_error": Key(str, "the exception the re-run as recorded raised"),
        "weights": Key(str, "the weights replayed: as at the event, or after the step"),
        "input_modified": Key(bool, "the step modified its input in place", False),
        "micro_batches_forward_only": Key(list, "micro-batches with no backward"),
        "fed_by": Key(str, "the model replayed first, whose output this model's inputs were "
                      "computed from (its output gradient came through this one)"),
        "stale_grads": Key(list, ".grad non-finite before the step's backward: the parameters"),
        "history": Key(History, "scale, LR and grad norm over the steps before the event"),
        "arrays": Key(dict, "saved arrays: name -> 'saved' | 'truncated' | 'skipped'"),
        "isolation": Key(Isolation, "what the replay kept from the user's code: hooks_set_aside, "
                         "hooks_not_installed (they did not run in it), output_held_back", since=2),
        # the culprit (culprit.py, accum.py)
        "bad_inputs": Key(list[RowSummary], "the batch's non-finite inputs: label, counts"),
        "chain": Key(list, "the modules the non-finite value passed through"),
        "backward_not_replayed": Key(str, "why the backward was not replayed"),
        "how": Key(str, "how the culprit made its non-finite value"),
        "weights_nonfinite": Key(list, "parameters already non-finite: poisoned earlier"),
        "run": Key(Rows, "the culprit's inputs and outputs in the run's precision"),
        "output_grad_nonfinite": Key(bool, "the gradient at the model's output was"),
        "loss_nonfinite": Key(bool, "the loss itself was non-finite"),
        "output_grad": Key(OutputGrad, "the gradient at the model's output: counts, output_values"),
        "loss": Key(LossInfo, "the loss as replayed: value, grad_nonfinite"),
        "accum_overflow": Key(AccumOverflow, "micro-batch gradients that overflowed when summed"),
        "computed": Key(Computed, "a root input made in this step outside any module (not the "
                        "data): op, function, into, label, dtype, device, autocast", since=4),
        # the culprit re-run (culprit_rerun.py)
        "fp32": Key(Fp32Rerun, "the culprit re-run in fp32: inputs, outputs (detail.py)"),
        "fp32_error": Key(str, "the exception the fp32 re-run raised"),
        "op": Key(OpRecord, "the op inside the culprit that made the value (detail.py)"),
        "op_error": Key(str, "the exception the op probe raised"),
        # reproduced (reproduced.py)
        "recorded": Key(Recorded, "what the real step saw: loss_nonfinite, output_nonfinite"),
        "rerun": Key(TrialOutcome, "the step re-run as recorded"),
        "rerun_scale": Key(float, "the loss scale ``rerun`` ran its backward at, where not the "
                           "recorded one (1: at the recorded one a finite forward's gradients "
                           "overflowed)", since=4),
        "loss_recomputed": Key(bool, "the replay recomputed the loss"),
        "loss_not_recomputed": Key(str, "why the loss was not recomputed"),
        "loss_input_nonfinite": Key(list, "the loss's non-finite inputs"),
        "reproduced": Key(bool, "did the replay repeat the failure (False: the machine)"),
        "loss_fp32": Key(TrialOutcome, "the loss recomputed in fp32: loss_finite"),
        "targets": Key(list[TargetsCheck], "each loss call's targets, checked (detail.py)"),
        # the compiled replay (compiled_replay.py)
        "compiled": Key(CompiledReplay, "the finite replay of a compiled model run again "
                        "compiled: reproduced, rungs, region, op", since=3),
        # proofs (proofs.py)
        "trials": Key(dict[str, TriedFix], "the fixes tried on the step: fix id -> what it "
                      "did (detail.py)"),
        "trials_error": Key(str, "the exception the trials raised"),
        "trials_seconds": Key(float, "time the trials took"),
        "loss_singular_fp32": Key(LossDerivative, "a torch loss's backward checked in fp32"),
        # the LR range test (lrrange.py)
        "lr_range": Key(LrRange, "the LR range test from the run's first state", since=3),
    }

    # The keys that hold records (detail.py), read typed: None where the file holds none.
    @property
    def recorded(self) -> Recorded | None:
        return self._record("recorded", Recorded)

    @property
    def loss(self) -> LossInfo | None:
        return self._record("loss", LossInfo)

    @property
    def output_grad(self) -> OutputGrad | None:
        return self._record("output_grad", OutputGrad)

    @property
    def accum_overflow(self) -> AccumOverflow | None:
        return self._record("accum_overflow", AccumOverflow)

    @property
    def op(self) -> OpRecord | None:
        return self._record("op", OpRecord)

    @property
    def bad_inputs(self) -> list[RowSummary]:
        value = self.get("bad_inputs")
        return value if isinstance(value, list) else []

    @property
    def stale_grads(self) -> list[str]:
        value = self.get("stale_grads")
        return [str(p) for p in value] if isinstance(value, (list, dict)) else []

    @property
    def history(self) -> History | None:
        return self._record("history", History)

    @property
    def isolation(self) -> Isolation | None:
        return self._record("isolation", Isolation)

    @property
    def computed(self) -> Computed | None:
        return self._record("computed", Computed)

    @property
    def trials(self) -> dict[str, TriedFix]:
        value = self.get("trials")
        return value if isinstance(value, dict) else {}

    @property
    def run(self) -> Rows | None:
        return self._record("run", Rows)

    @property
    def fp32(self) -> Fp32Rerun | None:
        return self._record("fp32", Fp32Rerun)

    @property
    def rerun(self) -> TrialOutcome | None:
        return self._record("rerun", TrialOutcome)

    @property
    def loss_fp32(self) -> TrialOutcome | None:
        return self._record("loss_fp32", TrialOutcome)

    @property
    def loss_singular_fp32(self) -> LossDerivative | None:
        return self._record("loss_singular_fp32", LossDerivative)

    @property
    def targets(self) -> list[TargetsCheck]:
        value = self.get("targets")
        return value if isinstance(value, list) else []

    @property
    def lr_range(self) -> LrRange | None:
        return self._record("lr_range", LrRange)

    @property
    def compiled(self) -> CompiledReplay | None:
        return self._record("compiled", CompiledReplay)

    def _record(self, key: str, kind: type[R]) -> R | None:
        value = self.get(key)
        return value if isinstance(value, kind) else None


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


@dataclass
class Fp8Recipe(records.Record):
    """One recipe of the fp8 trial (``Fp8Trial.recipes``). An effect is {"loss",
    "loss_change", "grad_error", "grad_cosine", "worst_param", "worst_param_error"} against
    the step re-run as recorded ("inf"/"nan" as strings; {"loss", "note"} where no gradient
    came back). Not frozen: the trial fills it in as it goes."""

    all: dict[str, Any] = field(default_factory=dict)  # every layer cast: its effect
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # NAME -> its effect alone
    # the layers to keep in high precision (None: a file whose recipe holds no list of them)
    keep: list[str] | None = None
    untried: list[str] = field(default_factory=list)  # left untried when the budget ran out
    all_but_keep: dict[str, Any] | None = None  # every layer cast but ``keep``: its effect

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
    # a run already in fp8: its fp8 layers re-run in high precision (the reference then),
    # {"loss", "as_recorded": effect, "layers": {NAME: {"high_precision": effect, "rowwise":
    # effect}}, "thresholds", "untried"}, or {"note"}
    own: dict[str, Any] | None = None
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


# Every declared payload: the contract test reads each writer and reader against these.
PAYLOADS: tuple[type[Payload], ...] = (SnapshotDetail,)
