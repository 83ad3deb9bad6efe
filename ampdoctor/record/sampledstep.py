"""The sampled step's hooks: the sampled tier (``sampler``) and the op probe (``opprobe``) turned
on before a step's first forward, their module hooks, and the one drain at the step's end.

A step is sampled at the interval (``every``), or once more when the loss stops falling
(``flatloss.py``). On a sampled step the global module hooks feed ``Sampler.on_forward``
(``sample_post``) and the op probe opens and closes a call per module (``probe_pre``,
``probe_post``); ``drain`` reads the step's statistics and the probe's measurements in one
copy per device (``readback.HostRead``) and writes them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..runfile.payloads import FlatLossProbe, HiddenNonfinite
from ..runfile.schema import Event, Kind
from . import flatloss, patches
from .buffers import module_buffers
from .journal import Journal
from .listener import Fault
from .opprobe import StepProbe
from .readback import HostRead
from .sampler import Sampler
from .steplog import StepLog
from .steps import Step
from .watched import Watched


class SampledStep:
    """The sampled tier's hooks of one recorder (``sampler`` None: no sampled tier)."""

    def __init__(self, journal: Journal, watched: Watched, log: StepLog,
                 sampler: Optional[Sampler], *, every: int, fault: Fault,
                 replaying: Callable[[], bool], op_probe: bool = True):
        self.journal = journal
        self.watched = watched
        self.log = log
        self.sampler = sampler
        self.every = every  # the interval (0: never)
        self.fault = fault
        self.replaying = replaying  # a forensic replay re-runs the model: not the step's calls
        self.hooks = patches.PatchSet()  # this step's module hooks
        # the op probe: overflows hidden inside a module (opprobe.StepProbe)
        self.probe = StepProbe() if sampler is not None and op_probe else None
        self.probing = False  # its hooks are in place this step
        self.fp8_trial: Any = None  # forensic/fp8trial.TrialAtClose: keeps each sampled step
        # ... and once more when the loss stops falling (flatloss.py): where the interval is
        # longer than the watch's first mark, so that a flat stretch may hold no sampled step
        if self.probe is not None and every > flatloss.FIRST:
            log.flat = flatloss.FlatLoss()

    def detach(self) -> None:
        self.hooks.remove()
        self.probing = False
        if self.probe is not None:
            self.probe.abort()  # (a fault inside a probed forward: the mode goes too)
        if self.sampler is not None:
            self.sampler.active = False

    def maybe_sample(self) -> None:
        """Turn the sampled tier on for this step if it is due (before its first forward): at
        the interval, or because the loss has not fallen for a while (``_flat_due``)."""
        st = self.log.step
        sampler = self.sampler
        if sampler is None or st.sampled or self.every <= 0 or st.micro:
            return
        flat = self._flat_due()
        if st.index % self.every and flat is None:
            return
        st.sampled = True
        if flat is not None:  # (a step due at the interval anyway is probed for both reasons)
            self.journal.event(Event.FLAT_LOSS_PROBE, st, value=flat.recent / flat.start,
                               text=flat.to_text())
        sampler.active = True
        eager = self.watched.eager
        if eager is None:
            patches.hook_modules(self.hooks, self.fault, None, self.sample_post)
            if self.probe is not None and self.watched.sharding is None:
                # (not inside compiled regions, nor on a DTensor's shards)
                patches.hook_module_calls(self.hooks, self.fault, self.probe_pre,
                                          self.probe_post)
                self.probing = True
            return
        for m in eager:  # a compiled model: only modules that run outside its regions
            self.hooks.add(m.register_forward_hook(
                lambda m, a, o: patches.guard(self.fault, self.sample_post, m, a, o)))

    def _flat_due(self) -> Optional[FlatLossProbe]:
        """The flat-loss watch's probe, if one is armed and the op probe can run this step
        (not on a compiled model's regions nor on a DTensor's shards: there it is dropped)."""
        watch = self.log.flat
        if watch is None or watch.due is None:
            return None
        due = watch.take()
        if self.probe is None or self.watched.eager is not None or \
                self.watched.sharding is not None:
            return None
        return due

    def sample_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.replaying() or self.sampler is None:
            return
        probe = self.probe
        if probe is not None:
            probe.busy += 1  # our own work inside a probed forward is not the model's
        try:
            if id(module) not in self.watched.root_ids and module in self.watched.names:
                self.watched.autocast.note_inner(self.log.step, bool(self.watched.roots))
            self.sampler.on_forward(module, output, args)
        finally:
            if probe is not None:
                probe.busy -= 1

    def probe_pre(self, module: torch.nn.Module, args: tuple) -> None:
        name = self.watched.names.get(module)
        if self.probe is not None and name is not None and not self.replaying():
            self.probe.open_call(module, name)

    def probe_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.probe is not None and module in self.watched.names and not self.replaying():
            self.probe.close_call(module, output)
            self.probe.leave(module)

    def enter_root(self, module: torch.nn.Module) -> None:
        """A root's training forward begins: the op probe enters it (last of the root's
        pre-hook work: ours is done)."""
        probe = self.probe
        if probe is not None and self.probing and id(module) in self.watched.root_ids and \
                torch.is_grad_enabled():
            probe.enter(module, self.watched.names.get(module, ""))

    def unsample(self, st: Step) -> None:
        """The step is not sampled after all: its statistics so far are dropped."""
        self.hooks.remove()
        if self.sampler is not None:
            self.sampler.active = False
            self.sampler.reset()
        st.sampled = False
        if self.probe is not None and self.probing:
            self.probe.abort()
        self.probing = False

    def end(self, st: Step) -> None:
        """The sampled step ends: its hooks go, and its drain runs."""
        if self.sampler is None:
            return
        self.hooks.remove()
        self.sampler.active = False
        self.drain(self.sampler, st)

    def drain(self, sampler: Sampler, st: Any) -> None:
        """The sampled step's drain: its statistics, its parameter probe and the op probe's
        measurements read in one copy per device (``readback.HostRead``), then written: the
        /stats rows, and one /events row per module whose output stayed finite although an op
        inside it made inf/NaN."""
        names = self.watched.names
        sampler.on_buffers(module_buffers(names, list(names)) + self.watched.side.buffers())
        read = HostRead()
        fp8 = self._stage_fp8(sampler, st.index, read)
        rows = sampler.stage(st.index, read)
        probe, self.probing = self.probe, False
        hidden = None
        if probe is not None:
            probe.abort()
            if probe.error is None:
                hidden = probe.stage(read)
        read.run()
        self.journal.file.append("stats", rows())
        if fp8 is not None:
            self._write_fp8(sampler, st.index, fp8())
        if probe is not None and probe.error is not None:
            self._probe_failed(probe.error)
        for h in hidden() if hidden is not None else []:
            tid = self.journal.tensor_id(Kind.OUTPUT, h.name, 0, None, type(h.module).__name__)
            self.journal.event(Event.HIDDEN_NONFINITE, st, tensor=tid, value=float(h.created),
                               text=HiddenNonfinite(op=h.op, dtype=h.dtype, inner=h.inner,
                                                    index=h.index, ops=h.ops).to_text())

    def _write_fp8(self, sampler: Sampler, step: int, fp8_rows: Any) -> None:
        self.journal.file.append("fp8", fp8_rows)
        if self.fp8_trial is not None:
            self.fp8_trial.rank(fp8_rows)
        if sampler.fp8 is not None and sampler.fp8.layers_changed:
            sampler.fp8.layers_changed = False
            self.journal.meta("fp8_layers", dict(sampler.fp8.layers), step)

    def _probe_failed(self, error: BaseException) -> None:
        """The probe stepped aside; the recorder goes on (strict mode raises)."""
        self.probe = None
        if self.journal.strict:
            raise error
        why = f"{type(error).__name__}: {error}"
        self.journal.warn_once("op_probe", f"the op probe stopped ({why}); sampled steps go "
                               "on without it")

    def _stage_fp8(self, sampler: Sampler, step: int, read: HostRead) -> Any:
        """The /fp8 rows of the step staged in ``read``; None where the fp8 counts are off or
        stepped aside (an internal failure: warned once, the sampled tier goes on)."""
        if sampler.fp8 is None:
            return None
        try:
            return sampler.fp8.stage(step, read)
        except Exception as exc:  # noqa: BLE001 - the fp8 counts must never stop the recording
            sampler.fp8 = None
            if self.journal.strict:
                raise
            self.journal.warn_once("fp8", f"the fp8 counts stopped ({type(exc).__name__}: "
                                   f"{exc}); sampled steps go on without them")
            return None
