"""Forensic tier (tier 3): catch the failing step cheaply, replay it, keep the evidence.

**Every step (capture, references only).** The recorder's root-module hooks hand over each
root call: references to its arguments, the RNG state (host copies of the generators'
states, no device sync), the autocast state, and a tensor hook on each root output that keeps
a reference to the gradient arriving there in backward, and a reference to the loss.
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
micro-batches of the step are replayed in order by ``replay.explain`` until one explains the
event (forward culprit, backward culprit, bad batch or loss); if none does and ``.grad`` is
non-finite anyway, it was left over from an earlier step (``zero_grad`` skipped).

**Rate limit.** Events close together (at most ``EPISODE_GAP`` steps apart) form an episode.
In an episode the 1st, 2nd, 4th, 8th... events are replayed (and the next one whenever a
replay found nothing), and a run replays at most ``max_replays`` times. After that the tier
disarms: no capture, no sync. A run that skips every step thus costs a handful of replays.

**No observer effect.** A replay forks the RNG of the CPU and of every initialised CUDA
device, restores every module buffer it changed bit for bit (BatchNorm running statistics),
reads gradients with ``torch.autograd.grad`` only (``.grad`` and the optimizer state are never
written) and never runs the DDP/compile wrapper, only the module inside.

**What is kept.** Each replay writes a /snapshots row (culprit, phase, fp32 verdict, scale, LR,
and in its detail JSON the culprit's statistics in both precisions and the scale/LR/grad-norm
history up to the event), /stats rows of every tensor of the replay (``Source.REPLAY``) and of
the fp32 re-run (``Source.REPLAY_FP32``), and /arrays: the batch, the culprit's inputs, the
output gradient and the RNG state, within ``BATCH_BYTES``. For a backward culprit the
snapshot's ``in_absmax``/``out_absmax`` describe its grad_output/grad_input and ``fp32_absmax``
its fp32 gradients.

In a notebook::

    with ampdoctor.watch(model, optimizer, scaler) as rec:
        ...train...
    rec.events          # [ForensicEvent(step=12, trigger='skipped', phase='forward',
                        #                module='blocks.0.attn', fp32='finite'), ...]
    r = rec.replay(12)  # re-run step 12's micro-batches, instrumented
    print(r); r.trace   # what went non-finite, in execution order

``rec.replay`` runs against the model's *current* weights, with the batch, RNG state and
output gradient kept from the event (CPU copies, up to ``KEEP_BYTES`` per event);
``r.faithful`` says whether the weights are still those of the event (nothing has stepped
the optimizer since, e.g. the event's step was skipped and was the last one).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import numpy as np
import torch

from ..errors import AmpDoctorError
from ..runfile import schema
from ..runfile.schema import Event, Phase, Source
from . import compiled, replay, sharding, stats
from .journal import Journal
from .replay import Capture, Culprit
from .sampler import tensors_in
from .steplog import StepLog
from .steps import columns, device_values, fetch
from .watched import Watched

BATCH_BYTES = 16 << 20  # arrays saved with one snapshot
KEEP_BYTES = 64 << 20  # CPU copies kept per replayed event for rec.replay
GRAD_BYTES = 256 << 20  # output gradients held for earlier micro-batches of one step
MAX_CAPTURES = 64  # root calls held per step (oldest dropped beyond)
HISTORY = 64  # steps of scale/LR/grad-norm history in a snapshot's detail
EPISODE_GAP = 16  # events at most this many steps apart belong to one episode
# A skipped step whose loss is finite is GradScaler calibrating or probing (gradients overflow
# at too high a scale) far more often than a failure: the first such step is replayed, then
# only an overflow that has lasted this many steps in a row (deeper than a calibration from
# 2**16 usually goes), so that the budget is left for the failures that follow.
GRAD_REPLAY_RUN = 8
MAX_EVENTS = 1024  # entries kept in rec.events

TRIGGERS = {Event.SKIPPED: "skipped", Event.NONFINITE_LOSS: "nonfinite_loss",
            Event.NONFINITE_GRAD: "nonfinite_grad"}
FP32 = {True: "finite", False: "non-finite", None: "not run"}


@dataclass
class TraceRow:
    """One tensor measured in a replay, in the order it was seen."""

    order: int
    kind: str  # "input", "output", "grad_output", "grad_input", "param_grad"
    module: str
    label: str
    dtype: str
    absmax: float
    rms: float
    zeros: int
    nonfinite: bool


@dataclass
class ReplayResult:
    """What a forensic replay found. ``str(result)`` is one paragraph for a person.

    ``phase``: "forward", "backward", "input" (the batch held NaN/inf), "loss" (the loss,
    outside the model), "none" (the replay stayed finite) or "unknown" (it failed).
    ``fp32_finite``: True when the culprit re-run alone in fp32 is finite (an fp32 island
    fixes the step), False when it is non-finite in fp32 too (the values are too large: LR or
    data), None when no fp32 re-run applies.
    """

    step: int
    micro: int
    trigger: str
    phase: str
    module: Optional[str] = None
    module_type: Optional[str] = None
    fp32_finite: Optional[bool] = None
    fp32_absmax: float = math.nan
    in_absmax: float = math.nan
    out_absmax: float = math.nan
    summary: str = ""
    detail: dict = field(default_factory=dict, repr=False)
    faithful: bool = True
    snapshot: Optional[int] = None
    trace: list = field(default_factory=list, repr=False)

    @property
    def fp32(self) -> str:
        return FP32[self.fp32_finite]

    def __str__(self) -> str:
        return self.summary


@dataclass
class ForensicEvent:
    """An event the forensic tier caught: a skipped step, or a non-finite loss or grad norm."""

    step: int
    trigger: str
    replayed: bool = False
    result: Optional[ReplayResult] = None
    note: str = ""

    @property
    def phase(self) -> Optional[str]:
        return self.result.phase if self.result else None

    @property
    def module(self) -> Optional[str]:
        return self.result.module if self.result else None

    @property
    def fp32(self) -> Optional[str]:
        return self.result.fp32 if self.result else None

    def __repr__(self) -> str:
        if not self.replayed:
            return f"ForensicEvent(step={self.step}, trigger={self.trigger!r}, {self.note})"
        return (f"ForensicEvent(step={self.step}, trigger={self.trigger!r}, "
                f"phase={self.phase!r}, module={self.module!r}, fp32={self.fp32!r})")


@dataclass
class _Kept:
    """What rec.replay needs after the step is gone: CPU copies and the weights' versions."""

    captures: list
    versions: tuple
    scale: Optional[float]


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
        self._overflows = (-2, 0, None)
        self._kept: dict[int, _Kept] = {}
        self._too_big: set[int] = set()
        self._devices: list = _cuda_devices()
        self._hooks: list = []  # handles of this step's output-gradient hooks
        self.held: Optional[tuple] = None  # (captures, dropped) of a step not decided yet

    @property
    def armed(self) -> bool:
        """Replays remain: capture every step, and sync once per step to see the event."""
        return self.replays < self.max_replays

    # -- every step: references only --------------------------------------------------------

    def begin_step(self) -> None:
        self._unhook()
        self.captures = []
        self.dropped = 0
        self._devices = _cuda_devices()

    def end_step(self, step: Any, hold: bool = False) -> None:
        """The step is over: its output-gradient hooks go, and its captures with them, unless
        ``hold`` (its skip is decided at the next step's start; ``release_held`` then)."""
        row = self.log.latest
        if row is not None and row.step == step.index:
            self._history.append(row)  # host fields and device values: no copy, no sync
        self._unhook()
        self.held = (self.captures, self.dropped) if hold and self.captures else None
        self.begin_step()

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
        seen = self.watched.autocast_seen  # (enabled, dtype), just read by the recorder
        enabled, dtype = seen if seen is not None else (False, None)
        st = self.log.step
        self.captures.append(Capture(root, args, dict(kwargs), replay.rng_state(self._devices),
                                     (device, enabled, dtype, torch.is_autocast_cache_enabled()),
                                     micro=st.micro if st else 0,
                                     versions=_versions((args, kwargs))))

    def capture_kwargs(self, root: torch.nn.Module, kwargs: dict) -> None:
        """Keyword arguments of the latest root call, known only after it (discovery mode:
        a global forward pre-hook gets no kwargs)."""
        cap = self.captures[-1] if self.captures else None
        if cap is not None and cap.root is root:
            cap.kwargs = dict(kwargs)
            cap.versions = _versions((cap.args, cap.kwargs))

    def capture_output(self, root: torch.nn.Module, output: Any) -> None:
        if self.replaying or not self.captures or self.captures[-1].root is not root:
            return
        if self.watched.sharding is not None:
            return  # never replayed: its output gradients would be held for nothing
        grads = self.captures[-1].grads
        for i, t in enumerate(tensors_in(output)):
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
        self.captures[-1].losses.append((loss.detach(), {"scaled": scaled}))

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
        trace, finding, micro = self._run(captures, scale)
        if dropped:
            finding.detail["model_calls_dropped"] = dropped
        result = self._result(step.index, ev.trigger, trace, finding, micro, captures)
        self._note_history(result, step)
        ev.replayed, ev.result = True, result
        explained = finding.phase not in (Phase.NONE, Phase.UNKNOWN) or \
            bool(finding.detail.get("stale_grads"))
        self._episode = self._episode[:3] + (explained,)
        result.snapshot = self._write(step, why, result, trace, finding, captures)
        stale = finding.detail.get("stale_grads")
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
            root_name = names.get(cap.root) or type(replay.unwrap(cap.root)).__name__
            trace, finding = replay.check_batch(cap, names, root_name)
            if finding is None:
                continue
            finding.detail["replay"] = f"off: {unsafe} runs collectives in its forward"
            result = self._result(step.index, ev.trigger, trace, finding, micro, captures)
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
            labels = [b.get("label", "?") for b in finding.detail.get("bad_inputs", [])
                      if isinstance(b, dict)]
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
        captures = [_reload(c) for c in kept.captures]
        trace, finding, micro = self._run(captures, kept.scale, stale_check=False)
        trigger = next((e.trigger for e in self.events if e.step == step), "on_demand")
        result = self._result(step, trigger, trace, finding, micro, captures)
        result.faithful = result.faithful and \
            kept.versions == _param_versions(self._roots(captures))
        result.detail["weights"] = "as at the event" if result.faithful else \
            "current: the optimizer has stepped since the event"
        if not result.faithful:
            result.summary += (" (Replayed against the current weights: the optimizer has "
                               "stepped since the event.)")
        return result

    def _run(self, captures: list, scale: Optional[float], stale_check: bool = True):
        """Replay the micro-batches until one explains the event; (trace, finding, micro)."""
        if not captures:
            return None, Culprit(Phase.UNKNOWN, summary="no root-module call of this step was "
                                 "captured (the model ran without grad, or is not the "
                                 "watched one)"), -1
        self.replaying = True
        try:
            # Compiled code runs eagerly here: instrumented, and never recompiled.
            with _preserved(self._roots(captures), _cuda_devices()), compiled.eager():
                return self._search(captures, scale, stale_check)
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

    def _search(self, captures: list, scale: Optional[float], stale_check: bool):
        names = self.watched.names
        last = None
        forward_only = []  # micro-batches whose output gradient was not kept (GRAD_BYTES)
        for micro, cap in enumerate(captures):
            for _, holder in cap.losses:
                holder["scale"] = scale if holder.get("scaled") else None
            root_name = names.get(cap.root) or type(replay.unwrap(cap.root)).__name__
            trace, finding = replay.explain(cap, names, root_name, self._devices,
                                            self.watched.param_names, self.strict)
            if _versions((cap.args, cap.kwargs)) != cap.versions:
                finding.detail["input_modified"] = True
            if forward_only:
                finding.detail["micro_batches_forward_only"] = list(forward_only)
            if finding.phase not in (Phase.NONE, Phase.UNKNOWN):
                return trace, finding, micro
            if cap.grads_dropped:
                forward_only.append(micro)
            last = (trace, finding, micro)
        trace, finding, micro = last
        stale = self._stale_grads() if stale_check else []
        accum = self._accum_overflow(captures, stale) if stale and len(captures) > 1 else None
        if accum:
            self._accum_finding(finding, accum, len(captures))
            return trace, finding, accum["micro"]
        if stale:
            finding.detail["stale_grads"] = stale
            finding.summary = (f"every micro-batch replays finite, yet .grad already holds "
                               f"NaN/inf ({', '.join(stale[:3])}): left over from an earlier "
                               "step whose gradients were not zeroed (zero_grad skipped)")
        elif finding.phase == Phase.NONE:
            finding.summary = ("the replay of every micro-batch stayed finite: the event did "
                               "not reproduce (inputs changed in place, or nondeterminism)")
        return trace, finding, micro

    def _accum_overflow(self, captures: list, stale: list[str]) -> Optional[dict]:
        """Finite micro-batch gradients whose sum overflows in a low-precision ``.grad``
        (``backward()`` adds each micro-batch into an fp16 parameter's ``.grad`` in fp16):
        each micro-batch's parameter gradients are recomputed from its kept output gradient
        and summed in that dtype, in order. Returns the first parameter and micro-batch
        whose running sum turns non-finite while every term is finite, else None (the
        ``.grad`` was stale). Event only: one backward and one param-sized sum per
        micro-batch, host reads to compare."""
        by_name = {self.watched.param_names.get(id(p)): p for p in self.watched.trained_params()}
        params = [(n, p) for n, p in by_name.items() if n in stale and p.dtype == torch.float16]
        if not params or any(not c.grads for c in captures):
            return None
        sums = [torch.zeros_like(p) for _, p in params]
        for k, cap in enumerate(captures):
            grads = _micro_param_grads(cap, [p for _, p in params])
            for j, g in enumerate(grads):
                if g is None:
                    continue
                if not bool(torch.isfinite(g).all()):
                    return None  # a micro-batch's own gradient: not the accumulation
                wide = (sums[j].float() + g.float()).abs().max()
                sums[j] += g
                if not bool(torch.isfinite(sums[j]).all()):
                    return {"param": params[j][0], "micro": k, "micro_batches": len(captures),
                            "dtype": str(g.dtype).replace("torch.", ""),
                            "fp32_absmax": float(wide)}
        return None

    def _accum_finding(self, finding: Culprit, accum: dict, n: int) -> None:
        """The replay's finding when the accumulation in ``.grad`` overflowed."""
        owner = accum["param"].rsplit(".", 1)[0] if "." in accum["param"] else accum["param"]
        module = next((m for m, name in self.watched.names.items() if name == owner), None)
        finding.phase, finding.module = Phase.BACKWARD, owner
        finding.module_type = type(module).__name__ if module is not None else ""
        finding.fp32_absmax = accum["fp32_absmax"]  # the sum's (no module to re-run in fp32)
        finding.detail["accum_overflow"] = accum
        finding.summary = (f"each of the {n} micro-batches' gradients is finite, but their sum "
                           f"in {accum['dtype']} .grad passes 65504 at micro-batch "
                           f"{accum['micro']} ({accum['param']}, "
                           f"{accum['fp32_absmax']:.3g} in fp32)")
        finding.detail["how"] = finding.summary

    def _stale_grads(self) -> list[str]:
        named = [(self.watched.param_names.get(id(p), "param"), p.grad)
                 for p in self.watched.trained_params() if p.grad is not None
                 and stats.measurable(p.grad)]
        if not named:
            return []
        by_device: dict = {}
        for i, (_, g) in enumerate(named):
            by_device.setdefault(g.device, []).append(i)
        ok = [True] * len(named)
        for idx in by_device.values():  # event only: one sync per device
            flags = torch.stack([torch.isfinite(named[i][1]).all() for i in idx]).cpu()
            for i, flag in zip(idx, flags.tolist()):
                ok[i] = flag
        return [n for (n, _), good in zip(named, ok) if not good]

    def _roots(self, captures: Optional[list] = None) -> list:
        roots = [c.root for c in captures] if captures else list(self.watched.roots)
        out: list = []
        for r in roots:
            inner = replay.unwrap(r)
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
        self._kept[step] = _Kept([_offload(c, keep_grads) for c in captures],
                                 _param_versions(self._roots(captures)), scale)

    # -- the result and the snapshot --------------------------------------------------------

    def _result(self, step: int, trigger: str, trace: Optional[replay.Trace], f: Culprit,
                micro: int, captures: list) -> ReplayResult:
        # A micro-batch is a backward call; a step may call the model more than once per one.
        micro = captures[micro].micro if 0 <= micro < len(captures) else 0
        f.detail["micro_batches"] = max((c.micro for c in captures), default=0) + 1
        f.detail["model_calls"] = len(captures)
        r = ReplayResult(step=step, micro=micro, trigger=trigger,
                         phase=f.phase.name.lower(), module=f.module or None,
                         module_type=f.module_type or None, fp32_finite=f.fp32_finite,
                         fp32_absmax=f.fp32_absmax, in_absmax=f.in_absmax,
                         out_absmax=f.out_absmax, detail=f.detail,
                         faithful=not f.detail.get("input_modified", False))
        r.summary = _summary(r, f)
        f.detail["summary"] = r.summary
        if trace is not None:
            r.trace = [TraceRow(i, s.kind.name.lower(), s.name, s.label,
                                schema.DType(int(row["dtype"])).name.lower(),
                                float(row["absmax"]), float(row["rms"]), int(row["zeros"]),
                                bool(row["nonfinite"]))
                       for i, (s, row) in enumerate(zip(trace.slots, trace.rows))]
        return r

    def _note_history(self, result: ReplayResult, step: Any) -> None:
        """Scale, LR, grad norm and loss of the steps up to the event (one sync, event only)."""
        rows = [(row.step, row.lr, row.values) for row in self._history]
        if not rows or rows[-1][0] != step.index:  # a step decided later is there already
            rows.append((step.index, _max_lr(self.watched.optimizers),
                         device_values(step, self.log.constants)))
        values = columns(fetch([v for _, _, v in rows]))
        result.detail["history"] = {
            "step": [int(s) for s, _, _ in rows], "loss": values["loss_mean"].tolist(),
            "scale": values["scale"].tolist(), "found_inf": values["found_inf"].tolist(),
            "grad_norm": values["grad_norm"].tolist(), "lr": [float(x) for _, x, _ in rows]}

    def _write(self, step: Any, why: Event, r: ReplayResult, trace: Optional[replay.Trace],
               f: Culprit, captures: list) -> Optional[int]:
        w = self.journal.writer
        if w is None or w.closed:
            return None
        sid = w.rows("snapshots")
        row = schema.empty("snapshots", 1)
        row["id"], row["step"], row["micro"] = sid, step.index, r.micro
        row["trigger"], row["phase"] = int(why), int(f.phase)
        row["module_off"], row["module_len"] = w.text(f.module)
        row["module_type_off"], row["module_type_len"] = w.text(f.module_type)
        cap = next((c for c in captures if c.micro == r.micro), None)
        row["autocast"] = _autocast_code(cap.autocast) if cap else 0
        row["fp32_finite"] = -1 if f.fp32_finite is None else int(f.fp32_finite)
        row["fp32_absmax"], row["in_absmax"], row["out_absmax"] = (
            f.fp32_absmax, f.in_absmax, f.out_absmax)
        row["scale"] = _scalar(getattr(step, "scale", None))
        lrs = r.detail.get("history", {}).get("lr")  # at the event (a later decision: LR moved)
        row["lr"] = lrs[-1] if lrs else _max_lr(self.watched.optimizers)
        if trace is not None:
            ids = self._stats_rows(w, sid, step.index, trace, f)
            if f.culprit_slot is not None:
                row["culprit"] = ids[f.culprit_slot]
        items = _array_items(cap, f) if cap is not None else []
        f.detail["arrays"] = _write_arrays(w, sid, items)
        row["detail_off"], row["detail_len"] = w.text(json.dumps(f.detail, default=str))
        w.append("snapshots", row)
        return sid

    def _stats_rows(self, w: Any, sid: int, step: int, trace: replay.Trace,
                    f: Culprit) -> list[int]:
        rows = trace.rows.copy()
        ids = [self._tensor_id(s, row) for s, row in zip(trace.slots, rows)]
        if len(rows):
            rows["tensor"] = ids
            rows["call"] = [s.nth for s in trace.slots]
            rows["seq"] = np.arange(len(rows))
            rows["source"] = int(Source.REPLAY)
            rows["step"], rows["snapshot"] = step, sid
            w.append("stats", rows)
        if f.fp32_rows:
            fp32 = np.array([row for _, row in f.fp32_rows], dtype=schema.STATS)
            fp32["tensor"] = [self._tensor_id(s, row) for s, row in f.fp32_rows]
            fp32["call"] = [s.nth for s, _ in f.fp32_rows]
            fp32["seq"] = np.arange(len(fp32))
            fp32["source"] = int(Source.REPLAY_FP32)
            fp32["step"], fp32["snapshot"] = step, sid
            w.append("stats", fp32)
        return ids

    def _tensor_id(self, slot: replay.Slot, row: np.ndarray) -> int:
        # A meta tensor carries the dtype and size to /tensors without any memory.
        dtype = _TORCH_DTYPES.get(int(row["dtype"]), torch.float32)
        meta = torch.empty(int(row["numel"]), dtype=dtype, device="meta")
        return self.journal.tensor_id(slot.kind, slot.name, slot.index, meta, slot.owner)


# ---------------------------------------------------------------------------------------------
# helpers

_TORCH_DTYPES = {int(schema.DType.FLOAT32): torch.float32,
                 int(schema.DType.FLOAT16): torch.float16,
                 int(schema.DType.BFLOAT16): torch.bfloat16,
                 int(schema.DType.FLOAT64): torch.float64}


def _summary(r: ReplayResult, f: Culprit) -> str:
    where = f"step {r.step}" + (f", micro-batch {r.micro}" if f.detail.get("micro_batches", 1) > 1
                                else "")
    if f.phase in (Phase.FORWARD, Phase.BACKWARD):
        text = (f"{where}: {f.module} ({f.module_type}) went non-finite in {r.phase}: "
                f"{f.detail.get('how', '')}.")
        if f.detail.get("weights_nonfinite"):
            text += (" Its weights already hold NaN/inf "
                     f"({', '.join(f.detail['weights_nonfinite'][:3])}): poisoned earlier.")
        if f.fp32_finite is True:
            what = "output" if f.phase == Phase.FORWARD else "backward"
            text += (f" Re-run alone in fp32 its {what} is finite (abs max "
                     f"{f.fp32_absmax:.4g}): an fp32 island around {f.module} fixes this step.")
        elif f.fp32_finite is False:
            text += (" It is non-finite in fp32 too: the values themselves are too large "
                     "(weights grown by the learning rate, or the data).")
        elif "fp32_error" in f.detail:
            text += f" The fp32 re-run could not be done ({f.detail['fp32_error']})."
        return text
    return f"{where}: {f.summary}."


def _keep_grad(grads: dict, index: int, grad: torch.Tensor) -> None:
    """Tensor hook on a root output: keep a reference to the gradient arriving there."""
    if grad is None:  # an output of a compiled (AOT autograd) region that no loss reached
        return
    if grad.requires_grad:  # create_graph=True: keep the value, not its graph
        grad = grad.detach()
    prev = grads.get(index)
    grads[index] = grad if prev is None else prev + grad


def _micro_param_grads(cap: Capture, params: list) -> list:
    """One micro-batch's gradients for ``params``: its forward again (same RNG, autocast),
    backward from the output gradient the real step saw; .grad is not touched."""
    replay.set_rng(cap.rng)
    with torch.enable_grad(), replay.autocast(cap.autocast):
        output = replay.unwrap(cap.root)(*cap.args, **cap.kwargs)
    outs = list(tensors_in(output))
    pairs = [(t, cap.grads[i]) for i, t in enumerate(outs)
             if i in cap.grads and isinstance(t, torch.Tensor) and t.requires_grad]
    if not pairs:
        return [None] * len(params)
    return list(torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs],
                                    allow_unused=True))


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _versions(value: Any) -> tuple:
    out = []
    for t in tensors_in(value):
        try:
            out.append(t._version)
        except RuntimeError:  # inference tensors have no version counter
            out.append(-1)
    return tuple(out)


def _param_versions(roots: list) -> tuple:
    return tuple((p._version, p.data_ptr()) for r in roots for p in r.parameters())


def _cuda_devices() -> list:
    """CUDA devices whose RNG a replay may draw from: all of them, once CUDA is initialised
    (never initialise it here: a CPU run must not get a CUDA context)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def _autocast_code(state: tuple) -> int:
    if not state[1]:
        return int(schema.DType.UNKNOWN)
    return int(schema.DTYPE_NAMES.get(state[2], schema.DType.OTHER))


def _scalar(t: Any) -> Optional[float]:
    if isinstance(t, torch.Tensor):
        return float(t.detach().float().cpu())
    return None if t is None else float(t)


def _max_lr(optimizers: list) -> float:
    lrs = [g.get("lr") for o in optimizers for g in o.param_groups]
    return max((float(x) for x in lrs if isinstance(x, (int, float))), default=math.nan)


@contextlib.contextmanager
def _preserved(roots: list, devices: list):
    """Fork the RNG of the CPU and the listed CUDA devices; restore module buffers."""
    saved = []
    for root in roots:
        for m in root.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    saved.append((m, name, b, b.detach().clone()))
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for m, name, b, value in saved:
                    if m._buffers.get(name) is not b:
                        m._buffers[name] = b  # the forward replaced the attribute: put it back
                    if not _same_bits(b, value):
                        b.copy_(value)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:
        return False


# -- kept copies for rec.replay ---------------------------------------------------------------


@dataclass
class _Offloaded:
    tensor: torch.Tensor
    device: torch.device
    requires_grad: bool


def _offload_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return _Offloaded(value.detach().to("cpu", copy=True), value.device,
                          value.requires_grad and value.is_leaf)
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_offload_value(v, depth + 1) for v in value)
    if depth < 4 and type(value) is dict:
        return {k: _offload_value(v, depth + 1) for k, v in value.items()}
    return value


def _reload_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, _Offloaded):
        t = value.tensor.to(value.device, copy=True)
        return t.requires_grad_(True) if value.requires_grad else t
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_reload_value(v, depth + 1) for v in value)
    if depth < 4 and type(value) is dict:
        return {k: _reload_value(v, depth + 1) for k, v in value.items()}
    return value


def _offload(cap: Capture, grads: bool = True) -> Capture:
    return Capture(cap.root, _offload_value(cap.args), _offload_value(cap.kwargs),
                   {k: v.clone() for k, v in cap.rng.items()}, cap.autocast, cap.micro,
                   (), {i: _offload_value(g) for i, g in cap.grads.items()} if grads else {},
                   [(_offload_value(loss), {k: _offload_value(v) for k, v in h.items()})
                    for loss, h in cap.losses], cap.grads_dropped or not grads)


def _reload(cap: Capture) -> Capture:
    args, kwargs = _reload_value(cap.args), _reload_value(cap.kwargs)
    return Capture(cap.root, args, kwargs, cap.rng, cap.autocast, cap.micro,
                   _versions((args, kwargs)), {i: _reload_value(g) for i, g in cap.grads.items()},
                   [(_reload_value(loss), {k: _reload_value(v) for k, v in h.items()})
                    for loss, h in cap.losses], cap.grads_dropped)


# -- arrays -----------------------------------------------------------------------------------


def _array_items(cap: Capture, f: Culprit) -> list[tuple[str, torch.Tensor]]:
    """What a user needs to reproduce the event, most important first."""
    items = [(f"rng.{k}", v) for k, v in cap.rng.items()]
    items += list(replay.labeled(cap.args, cap.kwargs))
    items += [(f"culprit.{label}", t) for label, t in f.culprit_inputs]
    items += [(f"grad_output.{i}", g) for i, g in sorted(cap.grads.items())]
    return items


def _write_arrays(writer: Any, sid: int, items: list) -> dict:
    """Arrays (never pickles) within BATCH_BYTES; a tensor over the budget keeps its leading
    rows. Returns {name: "saved" | "truncated" | "skipped"} for the snapshot's detail."""
    budget = BATCH_BYTES
    rows, report = [], {}
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_complex() \
                or t.device.type == "meta":
            continue
        t = sharding.local(t).detach()  # a DTensor batch (tensor parallel): this rank's part
        per_row = t[0].numel() * t.element_size() if t.ndim and len(t) else t.element_size()
        keep = t.numel() if not t.ndim else min(len(t), budget // max(per_row, 1))
        if keep <= 0 or (not t.ndim and t.element_size() > budget):
            report[name] = "skipped"
            continue
        part = t[:keep] if t.ndim else t
        if part.dtype == torch.bfloat16:
            part = part.float()  # numpy has no bfloat16; fp32 holds every bf16 value exactly
        arr = np.ascontiguousarray(part.cpu().numpy())
        budget -= arr.nbytes
        row = schema.empty("arrays", 1)
        row["snapshot"] = sid
        row["name_off"], row["name_len"] = writer.text(name)
        row["dtype"] = arr.dtype.str.encode()
        row["ndim"] = min(t.ndim, 8)
        row["shape"][0, :min(t.ndim, 8)] = tuple(t.shape)[:8]
        row["numel"] = t.numel()
        row["saved"] = arr.size
        row["data_off"], row["data_len"] = writer.bytes(arr.tobytes())
        rows.append(row)
        report[name] = "saved" if arr.size == t.numel() else "truncated"
    if rows:
        writer.append("arrays", np.concatenate(rows))
    return report
