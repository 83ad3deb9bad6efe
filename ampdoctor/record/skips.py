"""The skip decision: is this step failing, seen while its parameters are still in place? Then
the forensic tier gets it (``trigger``).

The syncs of a steady step, all of them (tests/record/test_host_reads.py counts them):

- GradScaler, any optimizer: none of ampdoctor's own. found_inf and the loss are copied into
  host mirrors (``readback.HostMirror``) with non-blocking copies (``stage_found``). A
  non-fused optimizer makes GradScaler.step sync on found_inf (``.item()``) after the copy
  was queued, so the mirror has landed by ``update()``: decided there (``at_update``). A fused
  one makes GradScaler sync on nothing: decided at the next step's start (``settle``), if need
  be after a wait for that copy alone, queued a step earlier (the device still has the step's
  optimizer kernels queued behind it, so it never runs dry).
- No scaler, forensics armed: one read before optimizer.step (``check_before_step``).
- GradScaler applying a step: its landed mirror read before optimizer.step instead of at
  ``update`` (``check_applied_loss``): a non-finite loss that skips nothing is still caught
  with the weights in place. The same one read of host memory, not a second.
- Every flush (about once a second): one read per device of all pending steps' values
  (``steplog.StepLog.drain``). Where the flat-loss watch runs (``flatloss.py``), up to five
  more flushes in a run's first 330 steps.

On the event itself (a failing step, rare) more is read: the replay, and one read of the
module buffers' finiteness (``_audit_buffers``). With ``forensics=False``, or once
``max_replays`` are used up, nothing here copies or reads anything.

Example (what the hooks do under a GradScaler)::

    skips.stage_found(scaler, optimizer)   # after unscale_: queued, no wait
    skips.at_update(scaler, step)          # decided now, or at the next step's start
    skips.settle()                         # the next step's first hook
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..runfile.schema import Event, Kind
from . import readback, sharding, stats
from .forensic.forensics import Forensics
from .journal import Journal
from .steplog import StepLog
from .steps import Step
from .torchcompat import found_inf
from .watched import Watched


class Skips:
    """The skip decision of each step, with its host mirrors (``pools``, one per device)."""

    def __init__(self, journal: Journal, watched: Watched, log: StepLog,
                 forensics: Optional[Forensics]):
        self.journal = journal
        self.watched = watched
        self.log = log
        self.forensics = forensics
        self.pools: dict[torch.device, readback.MirrorPool] = {}
        self.undecided: Optional[Step] = None  # a scaled step whose skip is not known yet

    @property
    def armed(self) -> bool:
        return self.forensics is not None and self.forensics.armed

    def _pool(self, device: torch.device) -> readback.MirrorPool:
        pool = self.pools.get(device)
        if pool is None:
            pool = self.pools[device] = readback.MirrorPool(device)
        return pool

    def stage_found(self, scaler: Any, optimizer: Any = None) -> None:
        """Queue found_inf of ``optimizer`` (default: every optimizer GradScaler has checked
        this step and no hook has staged), with the step's loss, into a host mirror. Two
        small kernels (a stack, a non-blocking copy) and no wait."""
        st = self.log.step
        states = scaler._per_optimizer_states
        keys = [id(optimizer)] if optimizer is not None else list(states)
        for key in keys:
            if key in st.staged or key not in states:  # a defaultdict: never index a new key
                continue
            total = found_inf(scaler, key)
            if total is None:
                continue
            dev = total.device
            loss = st.loss_sum.to(dev) if st.loss_sum is not None else \
                self.log.constants.nan(dev)
            mirror = self._pool(dev).take()
            mirror.stage(torch.stack([total.reshape(()).float(), loss.reshape(())]))
            st.staged[key] = mirror

    def at_update(self, scaler: Any, st: Step) -> None:
        """``scaler.update()`` is about to run: optimizers no hook has staged are staged, and
        the step is decided if its mirrors have landed (else at the next step's start)."""
        self.stage_found(scaler)
        skipped = self._decide(st, wait=False)
        if skipped is None:
            st.undecided = True  # a fused optimizer on a device still running the step
        elif skipped:
            self.trigger(Event.SKIPPED)

    def _decide(self, st: Step, wait: bool) -> Optional[bool]:
        """Was the scaled step ``st`` skipped? From its mirrors: True or False (and
        ``st.loss_nonfinite``), or None while a copy is in flight and ``wait`` is False."""
        mirrors = list(st.staged.values())
        if not all(m.ready() for m in mirrors):
            if not wait:
                return None
            for m in mirrors:
                m.wait()
        values = [m.read() for m in mirrors]
        self.give_back(st)
        if not values:
            return False  # GradScaler checked no optimizer of ours: nothing to decide
        st.loss_nonfinite = st.loss_sum is not None and not math.isfinite(values[0][1])
        return any(v[0] > 0 for v in values)

    def give_back(self, st: Step) -> None:
        for mirror in st.staged.values():
            self._pool(mirror.device).give(mirror)
        st.staged.clear()

    def ended(self, st: Step) -> None:
        """The step has ended: undecided, it waits for the next step's start (its captures
        stay with the forensic tier until then); staged and never decided (no update(), or
        disarmed since), its mirrors go back."""
        if st.undecided:
            self.undecided = st
        elif st.staged:
            self.give_back(st)

    def settle(self, wait: bool = True) -> None:
        """The previous step's skip, decided now (its mirrors landed, or ``wait``): at the
        first hook of the next step, before its forward allocates anything or any weight
        changes. Until then the forensic tier holds that step's captures (see
        ``forensics.Forensics.end_step``); they are released here, replayed or not."""
        st = self.undecided
        if st is None:
            return
        skipped = self._decide(st, wait)
        if skipped is None:
            return
        self.undecided = None
        try:
            if skipped and self.armed:
                self.trigger(Event.SKIPPED, st)
        finally:
            if self.forensics is not None:
                self.forensics.capture.release_held()

    def check_applied_loss(self) -> None:
        """GradScaler is applying this step (found_inf was 0), yet its loss may be non-finite:
        a loss with zero gradients (targets all ``ignore_index``: 0/0) skips nothing. Seen here,
        just before ``optimizer.step``, the parameters are still those that failed. Read from
        the step's mirror only once its copy has landed (GradScaler's own sync on found_inf
        lands it for a non-fused optimizer; a fused one syncs on nothing and is not checked):
        no wait of ours, and ``_decide`` reuses the values read."""
        st = self.log.step
        if st.loss_checked or not self.armed or st.loss_sum is None:
            return
        mirrors = list(st.staged.values())
        if not mirrors or not all(m.ready() for m in mirrors):
            return
        st.loss_checked = True
        values = [m.read() for m in mirrors]
        if all(v[0] == 0 for v in values) and not math.isfinite(values[0][1]):
            self.trigger(Event.NONFINITE_LOSS)

    def check_before_step(self) -> None:
        """Without a scaler: is this step about to apply non-finite values?

        The one sync of such a step, made only while the forensic tier is armed: one read of
        the loss and the grad norm stacked together, just before ``optimizer.step``. It waits
        for backward (and clipping) to finish on the device, so the host launches the
        optimizer step only then. A faithful replay needs it: without a scaler a non-finite
        step writes NaN into the weights, so a decision one step later would replay against
        the poisoned weights. ``forensics=False``, or ``max_replays`` used up, removes it.
        """
        if not self.armed:
            return
        st = self.log.step
        values = [v for v in (st.loss_sum, st.grad_norm) if v is not None]
        if not values:
            return
        dev = values[0].device
        read = torch.stack([v.to(dev).reshape(()) for v in values]).tolist()  # the sync
        loss_ok = st.loss_sum is None or math.isfinite(read[0])
        if not loss_ok or (st.grad_norm is not None and not math.isfinite(read[-1])):
            self.trigger(Event.NONFINITE_GRAD if loss_ok else Event.NONFINITE_LOSS)
        elif st.loss_sum is not None:
            self._rising(st, read[0])

    def _rising(self, st: Step, loss_sum: float) -> None:
        """A finite loss already read, handed to the LR range test's divergence watch
        (``lrrange.RangeTest.on_loss``): the step's mean over its micro-batches."""
        if self.forensics is not None and self.forensics.captures:
            self.forensics.lrrange.on_loss(st.index, loss_sum / max(1, st.loss_n),
                                           self.forensics.captures)

    def trigger(self, why: Event, st: Optional[Step] = None) -> None:
        """Parameters are still those that failed: hand the step to the forensic tier.
        ``st``: a step already ended, whose skip was decided at the next step's start."""
        st = st if st is not None else self.log.step
        forensics = self.forensics
        if forensics is None or st.triggered:
            return
        st.triggered = True
        self.log.drain()  # the steps up to the event reach the file before anything else
        snapshot = forensics.on_event(st, why, held=st is not self.log.step)
        if snapshot is not None:
            self.journal.event(Event.FORENSICS, st, value=float(snapshot))
            self.journal.file.flush()  # the snapshot survives a crash that may follow the event
            self.log.flush_now = True  # and the event's own step row is written at its end
        self._audit_buffers(st)

    def _audit_buffers(self, st: Step) -> None:
        """On a failing step: module buffers the forward made non-finite (BatchNorm statistics
        are updated before GradScaler skips the step, and stay poisoned). One host sync."""
        names = self.watched.names
        buffers = [(f"{names[m]}.{n}", b, type(m).__name__) for m in list(names)
                   for n, b in m.named_buffers(recurse=False) if stats.measurable(b)]
        if not buffers:
            return
        dev = buffers[0][1].device
        finite = torch.stack([torch.isfinite(sharding.local(b)).all().to(dev)
                              for _, b, _ in buffers]).tolist()
        for (name, b, owner), ok in zip(buffers, finite):
            if not ok:
                tid = self.journal.tensor_id(Kind.BUFFER, name, 0, b, owner)
                self.journal.event(Event.NONFINITE_BUFFER, st, tensor=tid)
