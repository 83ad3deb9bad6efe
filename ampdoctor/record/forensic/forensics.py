"""Forensic tier (tier 3): catch the failing step cheaply, replay it, keep the evidence.

**Every step (capture, references only).** The recorder's root-module hooks hand over each
root call: references to its arguments, the RNG state (host copies of the generators'
states, no device sync), the autocast state, a tensor hook on each root output that keeps
a reference to the gradient arriving there in backward, weak references to the outputs, a
reference to the loss, and each torch loss function called after the model (``losscall``).
Nothing is copied. While micro-batches accumulate, earlier micro-batches' output gradients
are held only up to ``capture.GRAD_BYTES`` (the latest always is).

**Nothing kept past the step.** When the step ends the tensor hooks are removed from the
outputs (a user's ``logits`` variable, still bound until the next forward returns, no longer
reaches the gradient) and the references are dropped. One exception, the deferred decision:
with a fused optimizer under GradScaler on CUDA, nothing syncs on found_inf, so whether the
step was skipped is known only once a non-blocking copy lands, at the latest at the next
step's first hook (before its forward). Until then ``held`` keeps that step's captures: its
batch (which the loop usually holds too) and the gradient at its outputs, for an LLM
B x T x vocab values in the logits' dtype, e.g. 134 MB for 16 x 256 x 8192 fp32. It is held
between the two steps, never during the next forward or backward, so the peak is unchanged;
memory between steps grows by it only while the device is still running the step when the
host has finished it. A replay from there is still faithful: a skipped step left the weights
as they were.

**On the event.** The recorder calls ``on_event`` while the parameters are still the ones that
failed: with a GradScaler from ``update`` once found_inf says the step is being skipped (or
at the next step's first hook, when found_inf had not reached the host yet: ``held``), or
without one just before ``optimizer.step`` when the loss or the grad norm is non-finite. The
micro-batches of the step are replayed in order by ``replay.search`` until one explains the
event (forward culprit, backward culprit, bad batch or loss); if none does and ``.grad`` is
non-finite anyway, it was left over from an earlier step (``zero_grad`` skipped). A loss-phase
finding is checked against what the real step saw (``reproduced``): the loss recomputed, in
fp32 too, its targets read; a step whose loss or output was non-finite and whose replay is
finite did not reproduce (the machine, not the numbers). ``trial`` and ``rerun`` re-run a
step under a ``trial.Trial`` (an fp32 island, another autocast dtype, the loss in
fp32) and say whether it comes out finite.

**The fixes, tried on the step.** Once a replay located the failure, the fixes one step can
test are tried on it (``proofs.Prover``: a few re-runs, once per culprit, at most
``proofs.MAX_PROVED`` per run) and their outcomes go into the snapshot (``detail.trials``).
Where the loss's backward failed, whether it is singular in fp32 too is checked
(``singular``): a torch loss function at once, a loss written by hand on the next event
within ``singular.WATCH_STEPS`` steps, its singular op's input held from the loss's graph
before that step's backward (an ``Event.LOSS_SINGULAR`` row says what it measured).

**Rate limit** (``policy``). Events close together (at most ``EPISODE_GAP`` steps apart) form
an episode. In an episode the 1st, 2nd, 4th, 8th... events are replayed (and the next one
whenever a replay found nothing), and a run replays at most ``max_replays`` times. After that
the tier disarms: no capture, no sync. A run that skips every step thus costs a handful of
replays.

**No observer effect.** A replay forks the RNG of the CPU and of every initialised CUDA
device, restores every module buffer it changed bit for bit (BatchNorm running statistics),
reads gradients with ``torch.autograd.grad`` only (``.grad`` and the optimizer state are never
written) and never runs the DDP/compile wrapper, only the module inside. The user's code does
not see it: the user's hooks are set aside, the modules' Python state is put back and their
output held back (``isolated.py``).

**What is kept** (``snapshot.py``). Each replay writes a /snapshots row (culprit, phase,
fp32 verdict, scale, LR, and in its detail JSON the culprit's statistics in both precisions and
the scale/LR/grad-norm history up to the event), /stats rows of every tensor of the replay
(``Source.REPLAY``) and of the fp32 re-run (``Source.REPLAY_FP32``), and /arrays: the batch,
the culprit's inputs, the output gradient and the RNG state, within ``snapshot.BATCH_BYTES``.
For a backward culprit the snapshot's ``in_absmax``/``out_absmax`` describe its
grad_output/grad_input and ``fp32_absmax`` its fp32 gradients.

In a notebook::

    with ampdoctor.watch(model, optimizer, scaler) as rec:
        ...train...
    rec.events          # [ForensicEvent(step=12, trigger='skipped', phase='forward',
                        #                module='blocks.0.attn', fp32='finite'), ...]
    r = rec.replay(12)  # re-run step 12's micro-batches, instrumented
    print(r); r.trace   # what went non-finite, in execution order

``rec.replay`` runs against the model's *current* weights, with the batch, RNG state and
output gradient kept from the event (CPU copies, up to ``KEEP_BYTES`` per event: ``kept.py``);
``r.faithful`` says whether the weights are still those of the event (nothing has stepped
the optimizer since, e.g. the event's step was skipped and was the last one). What the tier
reports, ``ForensicEvent``, ``ReplayResult`` and its ``TraceRow``s, is in ``findings.py``.

The trigger policy lives here, with the facade the recorder and its hooks enter the room
through (``.importlinter`` holds them to that); the capture each step is ``capture``'s
(``StepCapture``, ``forensics.capture``), the rate limit ``policy``'s (``EventPolicy``), the
micro-batch search ``replay.search``. What stands alone lives beside it: ``accum``,
``isolated``, ``kept``, ``losscall``, ``reproduced``, ``trial``, ``proofs``, ``singular``,
``lrrange`` (the LR range test at the first failure, from the state kept at the first step).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import replace
from typing import Any, Iterator, Optional

import torch

from ...errors import AmpDoctorError
from ...runfile.detail import History
from ...runfile.schema import Event, Phase
from .. import compiled, sharding
from ..journal import Journal
from ..sampler import tensors_in
from ..steplog import StepLog
from ..steps import columns, device_values, fetch
from ..watched import Watched
from . import compiled_replay, findings, proofs, replay, snapshot
from .capture import StepCapture, nbytes
from .culprit import Culprit
from .findings import TRIGGERS, ForensicEvent, ReplayResult
from .isolated import preserved, rng_devices
from .kept import Kept, offload, reload
from .lrrange import RangeTest
from .policy import GRAD_REPLAY_RUN, EventPolicy
from .trace import Capture, Trace, root_name, unwrap
from .trial import AS_RECORDED, Outcome, Trial, rerun_step

KEEP_BYTES = 64 << 20  # CPU copies kept per replayed event for rec.replay
HISTORY = 64  # steps of scale/LR/grad-norm history in a snapshot's detail
MAX_EVENTS = 1024  # entries kept in rec.events


class Forensics:
    """The forensic tier of one recorder: capture, trigger policy, replay, snapshot."""

    def __init__(self, watched: Watched, journal: Journal, log: StepLog, *, max_replays: int,
                 strict: bool = False):
        self.watched = watched  # the model, names, optimizers, device, autocast state
        self.journal = journal  # /events, /tensors, the writer; warnings
        self.log = log  # the current step, the history of those ended
        self.max_replays = max_replays
        self.strict = strict
        self.replays = 0  # replays that wrote a snapshot
        self.events: list[ForensicEvent] = []
        self.replaying = False
        self.capture = StepCapture(self)  # this step's root calls, references only
        self.policy = EventPolicy()  # which events are replayed (the rate limit)
        self._history: deque = deque(maxlen=HISTORY)
        self._kept: dict[int, Kept] = {}
        self._too_big: set[int] = set()
        self.prover = proofs.Prover(self)  # the fixes tried on a located failure's step
        self.recompiled = 0  # compiled replays run (compiled_replay.MAX_REPLAYS)
        self.lrrange = RangeTest(self)  # the LR range test from the first state, at the failure

    def context(self) -> replay.ReplayContext:
        """What a replay of this step needs of the recorder (``replay.ReplayContext``)."""
        return replay.ReplayContext(self.watched, self.capture.devices, self.strict)

    @property
    def armed(self) -> bool:
        """Replays remain: capture every step, and sync once per step to see the event."""
        return self.replays < self.max_replays

    # -- every step: references only --------------------------------------------------------

    @property
    def captures(self) -> list[Capture]:
        """This step's root calls (``capture.StepCapture``)."""
        return self.capture.captures

    def end_step(self, step: Any, hold: bool = False) -> None:
        """The step is over: its row joins the history, its captures go (unless ``hold``:
        ``StepCapture.end_step``)."""
        row = self.log.latest
        if row is not None and row.step == step.index:
            self._history.append(row)  # host fields and device values: no copy, no sync
        self.capture.end_step(hold)

    # -- on the event -----------------------------------------------------------------------

    def on_event(self, step: Any, why: Event, held: bool = False) -> Optional[int]:
        """The recorder saw an event with the failing parameters in place; returns the
        snapshot id when a replay ran (and wrote it), None when the rate limit skipped it.
        ``held``: the event is a step already ended, whose captures are ``self.held``. A
        replay that wrote its snapshot counts against ``max_replays``."""
        snapshot = self._on_event(step, why, held)
        if snapshot is not None:
            self.replays += 1
        return snapshot

    def _on_event(self, step: Any, why: Event, held: bool) -> Optional[int]:
        ev = ForensicEvent(step.index, TRIGGERS.get(why, why.name.lower()))
        if len(self.events) < MAX_EVENTS:
            self.events.append(ev)
        cap = self.capture
        captures, dropped = (cap.held or ([], 0)) if held else (cap.captures, cap.dropped)
        self.prover.at_event(step, captures)
        if not captures:
            ev.note = ("not replayed: no call of the model with grad enabled was captured in "
                       "this step (in discovery mode the model is known after its first step)")
            return None
        unsafe = self.unsafe(captures)
        if self.policy.calibrating(step, why):
            ev.note = ("not replayed: gradients overflowed with a finite loss, as while "
                       "GradScaler calibrates (the first such step is replayed, then one that "
                       f"has lasted {GRAD_REPLAY_RUN} steps in a row)")
            return None
        start, due = self.policy.due(step.index)
        if not due:
            ev.note = f"not replayed: same episode as step {start} (rate limit)"
            return None
        scale = _scalar(getattr(step, "scale", None))
        captures = list(captures)
        if unsafe:
            return self._check_batch(step, why, ev, captures, unsafe)
        # Stale gradients come from an earlier failing step: with none, a non-finite .grad
        # after a finite replay is this step's own (another rank's, through the all-reduce,
        # or a backward that did not reproduce), never left over.
        earlier = any(e.step < step.index for e in self.events)
        trace, finding, micro = self._run(captures, scale, earlier=earlier, step=step.index)
        self.prover.after_replay(step.index, captures, finding, micro, scale)
        self.lrrange.after_replay(step.index, captures, finding, scale, why,
                                  getattr(step, "loss_nonfinite", None))
        if dropped:
            finding.detail.model_calls_dropped = dropped
        result = findings.result(step.index, ev.trigger, trace, finding, micro, captures)
        self._note_history(result, step)
        ev.replayed, ev.result = True, result
        explained = finding.phase not in (Phase.NONE, Phase.UNKNOWN) or \
            bool(finding.detail.stale_grads)
        self.policy.found(explained)
        result.snapshot = self._write(step, why, result, trace, finding, captures)
        stale = finding.detail.stale_grads
        if stale:  # not an accumulation overflow: _search checked that first
            self.journal.event(Event.GRAD_NOT_ZEROED, step, text=", ".join(stale[:4]))
        self._note_input(finding, step)
        self._keep_for_later(step.index, captures, scale)
        return result.snapshot

    def unsafe(self, captures: Optional[list] = None) -> Optional[str]:
        """What makes a replay unsafe (a sharded model, or one whose forward runs
        collectives: a rank replaying alone would hang the job), or None. ``captures``:
        those of the event (default: this step's)."""
        sharded = self.watched.sharding
        if sharded is not None:
            return sharded.name
        captures = self.captures if captures is None else captures
        return sharding.collective_forward([c.root for c in captures] or self.watched.roots)

    def _check_batch(self, step: Any, why: Event, ev: ForensicEvent, captures: list,
                     unsafe: str) -> Optional[int]:
        """No replay (``unsafe`` says why): only the batch this rank was given is measured,
        a local look that runs no model code and no collective. A non-finite batch becomes
        a snapshot (phase input), as a replay would have found it."""
        names = self.watched.names
        for micro, cap in enumerate(captures):
            trace, finding = replay.check_batch(cap, names, root_name(names, cap.root))
            if finding is None:
                continue
            finding.detail.replay = f"off: {unsafe} runs collectives in its forward"
            result = findings.result(step.index, ev.trigger, trace, finding, micro, captures)
            self._note_history(result, step)
            ev.replayed, ev.result = True, result
            self.policy.found(True)
            result.snapshot = self._write(step, why, result, trace, finding, captures)
            self._note_input(finding, step)
            return result.snapshot
        self.policy.found(False)
        ev.note = (f"not replayed: {unsafe} runs collectives in its forward, and a replay on "
                   "one rank would wait for the others; the batch on this rank was finite")
        return None

    def _note_input(self, finding: Culprit, step: Any) -> None:
        """NONFINITE_INPUT when the replay (or the batch check) found the batch itself bad."""
        if finding.phase == Phase.INPUT:
            labels = [b.label or "?" for b in finding.detail.bad_inputs]
            self.journal.event(Event.NONFINITE_INPUT, step, text=", ".join(labels[:4]))

    def replay(self, step: int) -> ReplayResult:
        """Re-run a replayed event's micro-batches now (see the module docstring)."""
        kept = self._kept_event(step)
        captures = [reload(c) for c in kept.captures]
        trace, finding, micro = self._run(captures, kept.scale, stale_check=False)
        trigger = next((e.trigger for e in self.events if e.step == step), "on_demand")
        result = findings.result(step, trigger, trace, finding, micro, captures)
        result.faithful = result.faithful and \
            kept.versions == _param_versions(self._roots(captures))
        result.detail.weights = "as at the event" if result.faithful else \
            "current: the optimizer has stepped since the event"
        if not result.faithful:
            result.summary += (" (Replayed against the current weights: the optimizer has "
                               "stepped since the event.)")
        return result

    def _kept_event(self, step: int) -> Kept:
        """What ``replay`` and ``rerun`` need of a replayed event, or one clear sentence."""
        kept = self._kept.get(step)
        unsafe = self.unsafe() if kept is None else None
        if unsafe:
            raise AmpDoctorError(f"{unsafe} runs collectives in its forward: ampdoctor never "
                                 "replays it (a rank replaying alone would wait for the "
                                 "others); the run file has each rank's batch check")
        if kept is None and step in self._too_big:
            raise AmpDoctorError(f"step {step}'s batch was over {KEEP_BYTES >> 20} MiB and was "
                                 "not kept; its snapshot in the run file has what was found")
        if kept is None:
            have = sorted(self._kept)
            raise AmpDoctorError(
                f"step {step} has no kept batch to replay; replayed events: "
                f"{', '.join(map(str, have)) if have else 'none'} (see rec.events)")
        return kept

    def _run(self, captures: list, scale: Optional[float], stale_check: bool = True,
             earlier: bool = True, step: Optional[int] = None):
        """Replay the micro-batches until one explains the event; (trace, finding, micro).
        ``earlier``: an earlier step failed (stale gradients can only come from one). A
        compiled model's step that replays finite is replayed compiled (``compiled_replay``)."""
        if not captures:
            return None, Culprit(Phase.UNKNOWN, summary="no root-module call of this step was "
                                 "captured (the model ran without grad, or is not the "
                                 "watched one)"), -1
        self.replaying = True
        try:
            # Compiled code runs eagerly here: instrumented, and never recompiled.
            with preserved(self._roots(captures), rng_devices()) as isolation, \
                    compiled.eager():
                trace, finding, micro = replay.search(captures, self.context(), scale,
                                                      stale_check, earlier)
                if self.recompiled < compiled_replay.MAX_REPLAYS and compiled_replay.examine(
                        captures, finding, self.watched.names, step, self.strict):
                    self.recompiled += 1
            if isolation.hooks_set_aside or isolation.hooks_not_installed:
                finding.detail.isolation = replace(isolation)
            return trace, finding, micro
        except Exception as exc:  # noqa: BLE001 - a replay must never stop the training run
            if self.strict:
                raise
            self.journal.warn_once("replay", f"forensic replay failed ({type(exc).__name__}: "
                                          f"{exc}); recording goes on")
            f = Culprit(Phase.UNKNOWN, summary=f"the replay failed: {type(exc).__name__}: {exc}")
            f.detail.replay_error = f"{type(exc).__name__}: {exc}"
            return None, f, -1
        finally:
            self.replaying = False

    # -- trials: the saved step re-run with a change --- ------------------------------------

    def trial(self, captures: list, t: Trial = AS_RECORDED,
              scale: Optional[float] = None) -> Outcome:
        """Re-run ``captures`` (a step's micro-batches, held at the event or reloaded from a
        kept one) under trial ``t`` (``trial.py``), with a replay's guarantees: RNG
        forked, module buffers restored, ``.grad`` untouched, compiled code run eagerly.
        ``scale``: the loss scale at the event (None: as the replay already noted it)."""
        if scale is not None:
            for cap in captures:
                for _, holder in cap.losses:
                    holder["scale"] = scale if holder.get("scaled") else None
        with self.guarded(captures):
            return rerun_step(captures, t, self.watched.names)

    @contextlib.contextmanager
    def guarded(self, captures: list) -> Iterator[None]:
        """A replay's guarantees around a re-run of ``captures``: RNG forked, buffers
        restored, the recorder told it is replaying, compiled code run eagerly."""
        self.replaying = True
        try:
            with preserved(self._roots(captures), rng_devices()), compiled.eager():
                yield
        finally:
            self.replaying = False

    def rerun(self, step: int, t: Trial = AS_RECORDED) -> Outcome:
        """A replayed event's step re-run now under ``t`` (against the current weights, as
        ``replay``)::

            rec.forensics.rerun(12, Trial("island", fp32_modules=("blocks.3.attn",)))
        """
        kept = self._kept_event(step)
        return self.trial([reload(c) for c in kept.captures], t, kept.scale)

    def _roots(self, captures: Optional[list] = None) -> list:
        roots = [c.root for c in captures] if captures else list(self.watched.roots)
        out: list = []
        for r in roots:
            inner = unwrap(r)
            if all(inner is not o for o in out):
                out.append(inner)
        return out

    def _keep_for_later(self, step: int, captures: list, scale: Optional[float]) -> None:
        """CPU copies of the step's micro-batches within KEEP_BYTES; the output gradients
        go first when over it (a later replay is then forward-only)."""
        inputs = sum(nbytes(tensors_in((c.args, c.kwargs))) for c in captures)
        grads = sum(nbytes(c.grads.values()) for c in captures)
        if not captures or inputs > KEEP_BYTES:
            self._too_big.add(step)
            return
        keep_grads = inputs + grads <= KEEP_BYTES
        self._kept[step] = Kept([offload(c, keep_grads) for c in captures],
                                _param_versions(self._roots(captures)), scale)

    # -- the result and the snapshot --------------------------------------------------------

    def _note_history(self, result: ReplayResult, step: Any) -> None:
        """Scale, LR, grad norm and loss of the steps up to the event (one sync, event only)."""
        rows = [(row.step, row.lr, row.values) for row in self._history]
        if not rows or rows[-1][0] != step.index:  # a step decided later is there already
            rows.append((step.index, _max_lr(self.watched.optimizers),
                         device_values(step, self.log.constants)))
        values = columns(fetch([v for _, _, v in rows]))
        result.detail.history = History(
            step=[int(s) for s, _, _ in rows], loss=values["loss_mean"].tolist(),
            scale=values["scale"].tolist(), found_inf=values["found_inf"].tolist(),
            grad_norm=values["grad_norm"].tolist(), lr=[float(x) for _, x, _ in rows])

    def _write(self, step: Any, why: Event, r: ReplayResult, trace: Optional[Trace],
               f: Culprit, captures: list) -> Optional[int]:
        """The replay into the run file (``snapshot.write``); None once the file is closed."""
        w = self.journal.writer
        if w is None or w.closed:
            return None
        lrs = r.detail.history.lr if r.detail.history else None  # at the event (LR moves later)
        return snapshot.write(w, self.journal.tensor_id, step.index, why, r, trace, f, captures,
                              scale=_scalar(getattr(step, "scale", None)),
                              lr=lrs[-1] if lrs else _max_lr(self.watched.optimizers))


# ---------------------------------------------------------------------------------------------
# helpers


def _param_versions(roots: list) -> tuple:
    return tuple((p._version, p.data_ptr()) for r in roots for p in r.parameters())


def _scalar(t: Any) -> Optional[float]:
    if isinstance(t, torch.Tensor):
        return float(t.detach().float().cpu())
    return None if t is None else float(t)


def _max_lr(optimizers: list) -> float:
    lrs = [g.get("lr") for o in optimizers for g in o.param_groups]
    return max((float(x) for x in lrs if isinstance(x, (int, float))), default=math.nan)
