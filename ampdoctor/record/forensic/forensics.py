"""Forensic tier (tier 3): catch the failing step cheaply, replay it, keep the evidence.

**Every step (capture, references only).** The recorder's root-module hooks hand over each
root call: references to its arguments, the RNG state (host copies of the generators'
states, no device sync), the autocast state, a tensor hook on each root output that keeps
a reference to the gradient arriving there in backward, weak references to the outputs, a
reference to the loss, and each torch loss function called after the model (``losscall``).
Nothing is copied. While micro-batches accumulate, earlier micro-batches' output gradients
are held only up to ``GRAD_BYTES`` (the latest always is).

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
``proofs.MAX_PROVED`` per run) and their outcomes go into the snapshot (``detail["trials"]``).
Where the loss's backward failed, whether it is singular in fp32 too is checked
(``singular``): a torch loss function at once, a loss written by hand on the next event
within ``singular.WATCH_STEPS`` steps, its singular op's input held from the loss's graph
before that step's backward (an ``Event.LOSS_SINGULAR`` row says what it measured).

**Rate limit.** Events close together (at most ``EPISODE_GAP`` steps apart) form an episode.
In an episode the 1st, 2nd, 4th, 8th... events are replayed (and the next one whenever a
replay found nothing), and a run replays at most ``max_replays`` times. After that the tier
disarms: no capture, no sync. A run that skips every step thus costs a handful of replays.

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

Capture, the trigger policy and the rate limit live here, with the facade the recorder and its
hooks enter the room through (``.importlinter`` holds them to that); the micro-batch search
is ``replay.search``. What stands alone lives beside it: ``accum``, ``isolated``, ``kept``,
``losscall``, ``reproduced``, ``trial``, ``proofs``, ``singular``, ``lrrange`` (the LR range
test at the first failure, from the state kept at the first step).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import deque
from dataclasses import replace
from functools import partial
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
from . import compiled_replay, findings, losscall, proofs, replay, snapshot
from .culprit import Culprit
from .findings import TRIGGERS, ForensicEvent, ReplayResult
from .isolated import preserved, rng_devices, rng_state
from .kept import Kept, offload, reload, versions
from .lrrange import RangeTest
from .trace import Capture, Gone, Trace, outputs_of, root_name, unwrap
from .trial import AS_RECORDED, Outcome, Trial, rerun_step

KEEP_BYTES = 64 << 20  # CPU copies kept per replayed event for rec.replay
GRAD_BYTES = 256 << 20  # output gradients held for earlier micro-batches of one step
MAX_CAPTURES = 64  # root calls held per step (oldest dropped beyond)
MAX_LOSS_CALLS = 8  # torch loss function calls held per root call
HISTORY = 64  # steps of scale/LR/grad-norm history in a snapshot's detail
EPISODE_GAP = 16  # events at most this many steps apart belong to one episode
# A skipped step whose loss is finite is GradScaler calibrating or probing (gradients overflow
# at too high a scale) far more often than a failure: the first such step is replayed, then
# only an overflow that has lasted this many steps in a row (deeper than a calibration from
# 2**16 usually goes), so that the budget is left for the failures that follow.
GRAD_REPLAY_RUN = 8
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
        self.captures: list[Capture] = []
        self.events: list[ForensicEvent] = []
        self.replaying = False
        self.dropped = 0  # root calls dropped this step (MAX_CAPTURES)
        self._history: deque = deque(maxlen=HISTORY)
        self._episode = (-1, -EPISODE_GAP - 1, 0, True)  # start, last event, events, found
        # finite-loss skips: last step, run length, and None / "calibrated" (the initial
        # calibration was seen) / "replayed" (the first later one was replayed)
        self._overflows: tuple[int, int, Optional[str]] = (-2, 0, None)
        self._kept: dict[int, Kept] = {}
        self._too_big: set[int] = set()
        self._devices: list = rng_devices()
        self._hooks: list = []  # handles of this step's output-gradient hooks
        self.held: Optional[tuple] = None  # (captures, dropped) of a step not decided yet
        self._loss_budget = [losscall.HELD_BYTES]  # loss arguments held by reference
        self.prover = proofs.Prover(self)  # the fixes tried on a located failure's step
        self.recompiled = 0  # compiled replays run (compiled_replay.MAX_REPLAYS)
        self.lrrange = RangeTest(self)  # the LR range test from the first state, at the failure

    def context(self) -> replay.ReplayContext:
        """What a replay of this step needs of the recorder (``replay.ReplayContext``)."""
        return replay.ReplayContext(self.watched, self._devices, self.strict)

    @property
    def armed(self) -> bool:
        """Replays remain: capture every step, and sync once per step to see the event."""
        return self.replays < self.max_replays

    # -- every step: references only --------------------------------------------------------

    def begin_step(self) -> None:
        self._unhook()
        self.captures = []
        self.dropped = 0
        self._devices = rng_devices()
        self._loss_budget = [losscall.HELD_BYTES]

    def end_step(self, step: Any, hold: bool = False) -> None:
        """The step is over: its output-gradient hooks go, and its captures with them, unless
        ``hold`` (its skip is decided at the next step's start; ``release_held`` then)."""
        row = self.log.latest
        if row is not None and row.step == step.index:
            self._history.append(row)  # host fields and device values: no copy, no sync
        self._unhook()
        self.held = (self.captures, self.dropped) if hold and self.captures else None
        self.begin_step()

    def keep_roots(self, root_ids: set[int]) -> None:
        """The first step's discovery dropped a root (no optimizer trains it): its calls are
        not the step's, nor replayed with it."""
        self.captures = [c for c in self.captures if id(c.root) in root_ids]

    def release_held(self) -> None:
        self.held = None

    def _unhook(self) -> None:
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()

    def capture_inputs(self, root: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.replaying or not torch.is_grad_enabled():
            return
        if len(self.captures) >= MAX_CAPTURES:
            self.captures.pop(0)
            self.dropped += 1
        if self.captures:  # a new micro-batch: the previous ones' backward is done
            self._bound_held_grads()
        device = self.watched.device.type if self.watched.device is not None else "cpu"
        seen = self.watched.autocast.seen  # (enabled, dtype), just read by the recorder
        enabled, dtype = seen if seen is not None else (False, None)
        st = self.log.step
        self.captures.append(Capture(root, args, dict(kwargs), rng_state(self._devices),
                                     (device, enabled, dtype, torch.is_autocast_cache_enabled()),
                                     micro=st.micro if st else 0,
                                     versions=versions((args, kwargs)), open=True))

    def capture_kwargs(self, root: torch.nn.Module, kwargs: dict) -> None:
        """Keyword arguments of the latest root call, known only after it (discovery mode:
        a global forward pre-hook gets no kwargs)."""
        cap = self.captures[-1] if self.captures else None
        if cap is not None and cap.root is root:
            cap.kwargs = dict(kwargs)
            cap.versions = versions((cap.args, cap.kwargs))

    def capture_output(self, root: torch.nn.Module, output: Any) -> None:
        if self.replaying or not self.captures or self.captures[-1].root is not root or \
                not self.captures[-1].open:
            return  # (a call under no_grad after it was not captured: it is not this one)
        cap = self.captures[-1]
        cap.open = False
        outs = list(tensors_in(output))
        cap.outputs = [weakref.ref(t) for t in outs]  # measured on the event only
        if self.watched.sharding is not None:
            return  # never replayed: its output gradients would be held for nothing
        # Each output's node (the loss's graph's end, what a later model's input may be made
        # from: trace.feeds), dropped with the capture at the end of the step.
        cap.output_meta = [Gone(t.grad_fn, t.output_nr, t.shape) if t.grad_fn is not None
                           else None for t in outs]
        grads = cap.grads
        for i, t in enumerate(outs):
            # A leaf (a parameter handed back) would keep the hook after the step: skip it.
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                # The hook holds the dict and nothing else: a hook that reached the output
                # tensor (through the capture, or this recorder and the step's loss) would
                # make a cycle through autograd's C++ hook table that Python's collector
                # cannot see, and leak each step's graph.
                self._hooks.append(t.register_hook(partial(_keep_grad, grads, i)))

    def capture_loss(self, loss: torch.Tensor, scaled: bool) -> None:
        """The loss of the latest root call (a reference), and whether GradScaler scaled it:
        the gradient reaching it is then the scale, in the loss's dtype."""
        if self.replaying or not self.captures or loss.grad_fn is None:
            return
        cap = self.captures[-1]
        cap.losses.append((loss.detach(), {"scaled": scaled}))
        if self.prover.watching(self.log.step):
            self.prover.read(cap, loss)

    def capture_loss_call(self, name: str, fn: Any, args: tuple, kwargs: dict,
                          out: Any) -> None:
        """A torch loss function's call after the latest root call, held for a replay to
        compute it again (``losscall.capture``: references only). One made while the root
        call is still running is the model's own, replayed with it."""
        if self.replaying or not self.captures or not torch.is_grad_enabled() or \
                self.watched.sharding is not None:  # (never replayed)
            return
        cap = self.captures[-1]
        if cap.open or len(cap.loss_calls) >= MAX_LOSS_CALLS:
            return
        calls = [outputs_of(c) for c in self.captures[::-1][:losscall.EARLIER_CALLS + 1]]
        call = losscall.capture(name, fn, args, kwargs, out, calls, self._loss_budget,
                                self._hooks)
        if call is not None:
            cap.loss_calls.append(call)

    def _bound_held_grads(self) -> None:
        """Earlier micro-batches' output gradients are what accumulation would have freed:
        keep them within GRAD_BYTES, oldest dropped first (the step's last is always kept)."""
        held = sum(_nbytes(c.grads.values()) for c in self.captures)
        for old in self.captures:
            if held <= GRAD_BYTES:
                break
            if old.grads:
                held -= _nbytes(old.grads.values())
                old.grads.clear()
                old.grads_dropped = True

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
        captures, dropped = (self.held or ([], 0)) if held else (self.captures, self.dropped)
        self.prover.at_event(step, captures)
        if not captures:
            ev.note = ("not replayed: no call of the model with grad enabled was captured in "
                       "this step (in discovery mode the model is known after its first step)")
            return None
        unsafe = self.unsafe(captures)
        if self._calibrating(step, why):
            ev.note = ("not replayed: gradients overflowed with a finite loss, as while "
                       "GradScaler calibrates (the first such step is replayed, then one that "
                       f"has lasted {GRAD_REPLAY_RUN} steps in a row)")
            return None
        start, due = self._due(step.index)
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
            finding.detail["model_calls_dropped"] = dropped
        result = findings.result(step.index, ev.trigger, trace, finding, micro, captures)
        self._note_history(result, step)
        ev.replayed, ev.result = True, result
        explained = finding.phase not in (Phase.NONE, Phase.UNKNOWN) or \
            bool(finding.detail.stale_grads)
        self._episode = self._episode[:3] + (explained,)
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
            finding.detail["replay"] = f"off: {unsafe} runs collectives in its forward"
            result = findings.result(step.index, ev.trigger, trace, finding, micro, captures)
            self._note_history(result, step)
            ev.replayed, ev.result = True, result
            self._episode = self._episode[:3] + (True,)
            result.snapshot = self._write(step, why, result, trace, finding, captures)
            self._note_input(finding, step)
            return result.snapshot
        self._episode = self._episode[:3] + (False,)
        ev.note = (f"not replayed: {unsafe} runs collectives in its forward, and a replay on "
                   "one rank would wait for the others; the batch on this rank was finite")
        return None

    def _note_input(self, finding: Culprit, step: Any) -> None:
        """NONFINITE_INPUT when the replay (or the batch check) found the batch itself bad."""
        if finding.phase == Phase.INPUT:
            labels = [b.label or "?" for b in finding.detail.bad_inputs]
            self.journal.event(Event.NONFINITE_INPUT, step, text=", ".join(labels[:4]))

    def _calibrating(self, step: Any, why: Event) -> bool:
        """A skip with a finite loss that is not the first one, nor the GRAD_REPLAY_RUN-th of a
        run of them: GradScaler adjusting its scale, not worth a replay.

        The skips from step 0 on (GradScaler's first calibration at its initial scale) do not
        use up "the first one": their first is replayed, and so is the first later
        finite-loss skip that comes after the scale held for GRAD_REPLAY_RUN applied steps,
        where a failure begins (an overflow in the loss's backward skips at every scale and
        would otherwise only be replayed after 8 in a row). Skips closer to the calibration
        are the scale still settling."""
        if why != Event.SKIPPED or getattr(step, "loss_nonfinite", None) is not False:
            return False
        last, run, seen = self._overflows
        applied = step.index - last - 1  # steps since the last finite-loss skip
        run = run + 1 if step.index == last + 1 else 1
        if step.index == run - 1:  # every step so far was skipped: the initial calibration
            self._overflows = (step.index, run, "calibrated")
            return run != 1 and run != GRAD_REPLAY_RUN
        first = seen is None or (seen == "calibrated" and applied >= GRAD_REPLAY_RUN)
        self._overflows = (step.index, run, "replayed" if first else seen)
        return not first and run != GRAD_REPLAY_RUN

    def _due(self, index: int) -> tuple[int, bool]:
        start, last, n, found = self._episode
        if index - last > EPISODE_GAP:
            start, n, found = index, 0, True
        n += 1
        self._episode = (start, index, n, found)
        return start, (n & (n - 1)) == 0 or not found

    def replay(self, step: int) -> ReplayResult:
        """Re-run a replayed event's micro-batches now (see the module docstring)."""
        kept = self._kept_event(step)
        captures = [reload(c) for c in kept.captures]
        trace, finding, micro = self._run(captures, kept.scale, stale_check=False)
        trigger = next((e.trigger for e in self.events if e.step == step), "on_demand")
        result = findings.result(step, trigger, trace, finding, micro, captures)
        result.faithful = result.faithful and \
            kept.versions == _param_versions(self._roots(captures))
        result.detail["weights"] = "as at the event" if result.faithful else \
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
                finding.detail["isolation"] = replace(isolation)
            return trace, finding, micro
        except Exception as exc:  # noqa: BLE001 - a replay must never stop the training run
            if self.strict:
                raise
            self.journal.warn_once("replay", f"forensic replay failed ({type(exc).__name__}: "
                                          f"{exc}); recording goes on")
            f = Culprit(Phase.UNKNOWN, summary=f"the replay failed: {type(exc).__name__}: {exc}")
            f.detail["replay_error"] = f"{type(exc).__name__}: {exc}"
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
        inputs = sum(_nbytes(tensors_in((c.args, c.kwargs))) for c in captures)
        grads = sum(_nbytes(c.grads.values()) for c in captures)
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
        result.detail["history"] = History(
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


def _keep_grad(grads: dict, index: int, grad: torch.Tensor) -> None:
    """Tensor hook on a root output: keep a reference to the gradient arriving there."""
    if grad is None:  # an output of a compiled (AOT autograd) region that no loss reached
        return
    if grad.requires_grad:  # create_graph=True: keep the value, not its graph
        grad = grad.detach()
    prev = grads.get(index)
    grads[index] = grad if prev is None else prev + grad


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _param_versions(roots: list) -> tuple:
    return tuple((p._version, p.data_ptr()) for r in roots for p in r.parameters())


def _scalar(t: Any) -> Optional[float]:
    if isinstance(t, torch.Tensor):
        return float(t.detach().float().cpu())
    return None if t is None else float(t)


def _max_lr(optimizers: list) -> float:
    lrs = [g.get("lr") for o in optimizers for g in o.param_groups]
    return max((float(x) for x in lrs if isinstance(x, (int, float))), default=math.nan)
