"""The order of a step's backward calls against GradScaler's: the /events rows written at a
step's end for a loss that went past the scaler's bookkeeping.

``unscale_`` is once per optimizer per ``update()``: GradScaler remembers it, and
``scaler.step`` then steps on the gradients as they are. A scaled loss backwarded after it
(SAM's second pass, a second loss after the first's ``unscale_``) leaves gradients still
multiplied by the loss scale when the optimizer applies them; a loss backwarded without
``scaler.scale`` beside a scaled one arrives divided by it. The hooks count both on the
``Step`` (no tensor read); ``step_events`` writes them.

Example::

    st.scaled, st.backward_after_unscale = True, 1
    step_events(journal, st)   # one BACKWARD_AFTER_UNSCALE row, value 1
"""

from __future__ import annotations

from typing import Any

from ..runfile.schema import Event
from .journal import Journal
from .steps import Step


def unscaled(st: Step, optimizer: Any) -> None:
    """``unscale_(optimizer)`` returned; one the script called (not ``scaler.step``'s own)
    waits for its ``scaler.step``."""
    st.unscaled_by.add(id(optimizer))
    if not st.in_scaler_step:
        st.pending_unscaled.add(id(optimizer))


def stepping(st: Step, optimizer: Any) -> None:
    """``scaler.step(optimizer)`` begins: that optimizer's ``unscale_`` is consumed."""
    st.in_scaler_step = True
    st.pending_unscaled.discard(id(optimizer))


def late_backward(st: Step, scaled: bool) -> None:
    """A loss is backwarded: one through ``scaler.scale`` while an optimizer's ``unscale_``
    waits for its ``scaler.step`` is counted (those gradients stay scaled at that step; a
    GAN's generator backwarded after the discriminator's ``scaler.step`` is not)."""
    if scaled and st.pending_unscaled:
        st.backward_after_unscale += 1


def step_events(journal: Journal, st: Step) -> None:
    """The step's call-order rows, at its end."""
    if st.scaled and st.unscaled_backwards:  # beside a scaled loss: its gradients / S
        journal.event(Event.BACKWARD_UNSCALED, st, value=float(st.unscaled_backwards))
    if st.backward_after_unscale:
        journal.event(Event.BACKWARD_AFTER_UNSCALE, st, value=float(st.backward_after_unscale))
