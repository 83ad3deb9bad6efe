"""The autocast state a watched model really runs in: read at the root's pre-hook each training
call, and inside the forward on the steps that have module hooks anyway
(``amp_state.Tracker``); /meta ``autocast`` on a change, and ``Event.FP16_WITHOUT_SCALER``
once for a model run under fp16 autocast with no GradScaler.

Example::

    notes = AutocastNotes(journal)
    notes.track("cuda").declare(root)   # when the roots are adopted
    notes.note(step)                    # at the root's pre-hook
    notes.seen                          # (enabled, dtype): what the forensic tier captures
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..runfile.schema import Event
from . import amp_state
from .journal import Journal
from .steps import Step
from .torchcompat import scaler_enabled


class AutocastNotes:
    """Where autocast really runs for the roots of one ``Watched``, written down on a change."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self.seen: Optional[tuple] = None  # at the root's pre-hook (forensics)
        self._amp: Optional[amp_state.Tracker] = None  # where autocast really runs
        self._meta: Optional[dict] = None
        self._fp16_noted = False  # FP16_WITHOUT_SCALER written (once per run)

    def track(self, device_type: str) -> amp_state.Tracker:
        """The tracker for the roots' device type (a new one when it changed)."""
        if self._amp is None or self._amp.device_type != device_type:
            self._amp = amp_state.Tracker(device_type)
        return self._amp

    def note(self, step: Step) -> None:
        """At the root's pre-hook, every training call: one read, a /meta row on a change."""
        amp = self._amp
        if amp is None:
            return
        state = amp.outer()
        if state != self.seen:
            self.seen = state
            self._write(amp, step)

    def note_inner(self, step: Step, has_roots: bool) -> None:
        """Inside the root's forward (steps with module hooks only): autocast entered there,
        by accelerate's wrapped forward or a decorator, is what the model's ops ran in."""
        amp = self._amp
        if amp is not None and amp.entered != amp_state.INSIDE and has_roots and \
                torch.is_grad_enabled():
            amp.inner()
            if amp.entered == amp_state.INSIDE:
                self._write(amp, step)

    def _write(self, amp: amp_state.Tracker, step: Step) -> None:
        state = amp.effective()
        if state != self._meta:
            self._meta = state
            self.journal.meta("autocast", state, step=step.index)

    def fp16_without_scaler(self, st: Step, scaler: Any) -> None:
        """FP16_WITHOUT_SCALER, once, at the end of the first step whose model ran under fp16
        autocast with no enabled GradScaler scaling the loss (host state only)."""
        ac = self._meta
        if self._fp16_noted or not ac or ac.get("dtype") != "float16" or st.scaled or \
                scaler_enabled(scaler):
            return
        self._fp16_noted = True
        self.journal.event(Event.FP16_WITHOUT_SCALER, st, text="fp16 autocast, no GradScaler")
