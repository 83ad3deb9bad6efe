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

from ..runfile.schema import Event
from .journal import Journal
from .steps import Step


def late_backward(st: Step, scaled: bool) -> None:
    """A loss is backwarded: one after an ``unscale_`` of this step is counted when it went
    through ``scaler.scale`` (its gradients are still scaled at ``scaler.step``)."""
    if scaled and st.unscaled:
        st.backward_after_unscale += 1


def step_events(journal: Journal, st: Step) -> None:
    """The step's call-order rows, at its end."""
    if st.scaled and st.unscaled_backwards:  # beside a scaled loss: its gradients / S
        journal.event(Event.BACKWARD_UNSCALED, st, value=float(st.unscaled_backwards))
    if st.backward_after_unscale:
        journal.event(Event.BACKWARD_AFTER_UNSCALE, st, value=float(st.backward_after_unscale))
