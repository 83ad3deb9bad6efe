"""Where autocast really runs, so that the dtype a run records is the one its ops ran in.

Autocast is entered in one of three places, and the root module's forward pre-hook, where the
recorder looks on every step, sees only the first:

* around the model call (a hand-written loop, Lightning's precision plugin around
  ``training_step``): on at the root's pre-hook;
* inside the model's ``forward``: accelerate (and so HF Trainer) wraps ``model.forward`` in
  ``torch.autocast``, a ``@torch.autocast(...)`` decorator on ``forward`` does the same, or a
  ``with torch.autocast(...)`` in the forward's body: off at the root's pre-hook, on in every
  module the forward calls;
* inside a compiled forward: as above, but no hook runs in there.

``Tracker`` combines what the root's pre-hook sees (every step, one cheap read) with what the
modules inside see (read once on the steps that have module hooks anyway: the first step and
sampled steps), and, where no module hook can run (a compiled model), with the autocast a
forward is declared with (``declared``). Its ``effective`` state is what the run computed in.

Example::

    tracker = Tracker("cpu")
    tracker.outer()                  # at the root's pre-hook: (False, 'float32')
    tracker.inner()                  # in a submodule's hook: (True, 'bfloat16')
    tracker.effective()              # {'device_type': 'cpu', 'enabled': True,
                                     #  'dtype': 'bfloat16', 'entered': 'inside forward'}
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import torchcompat

AROUND = "around the model"
INSIDE = "inside forward"
DECLARED = "declared on forward"
MAX_WRAPPERS = 8  # decorators followed through __wrapped__ / __func__


def read(device_type: str) -> tuple[bool, str]:
    """(enabled, dtype name) of autocast on ``device_type`` right now."""
    return torchcompat.autocast_state(device_type)


def declared(module: torch.nn.Module, device_type: str) -> Optional[tuple[bool, str]]:
    """The autocast a module's forward is wrapped in (accelerate's ``model.forward``, a
    ``@torch.autocast`` decorator), looked for through the wrappers of its forward and, for
    ``torch.compile`` wrappers, of the module inside; None if there is none."""
    seen = 0
    for m in (module, getattr(module, "_orig_mod", None)):
        if not isinstance(m, torch.nn.Module):
            continue
        fn: Any = m.__dict__.get("forward") or type(m).forward
        while fn is not None and seen < MAX_WRAPPERS:
            seen += 1
            fn = getattr(fn, "_torchdynamo_orig_callable", fn)
            fn = getattr(fn, "__func__", fn)
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(value, torch.autocast) and value.device == device_type:
                    return bool(value._enabled), str(value.fast_dtype).replace("torch.", "")
            fn = getattr(fn, "__wrapped__", None)
    return None


class Tracker:
    """What autocast the watched model's ops run in, from the root's call and from inside it."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.around: Optional[tuple[bool, str]] = None  # at the root's pre-hook, latest
        self.within: Optional[tuple[bool, str]] = None  # inside forward, once seen on
        self.entered = AROUND

    def outer(self) -> tuple[bool, str]:
        """Read at the root's forward pre-hook (every training call)."""
        self.around = read(self.device_type)
        return self.around

    def inner(self) -> None:
        """Read in a module called by the root's forward (steps with module hooks)."""
        state = read(self.device_type)
        if state[0] and (self.around is None or not self.around[0]):
            self.within, self.entered = state, INSIDE

    def declare(self, module: torch.nn.Module) -> None:
        """A compiled root: no hook runs inside it, so its forward's declared autocast."""
        state = declared(module, self.device_type)
        if state is not None and state[0] and self.within is None:
            self.within, self.entered = state, DECLARED

    def effective(self) -> dict:
        """The /meta ``autocast`` value: the state the model's ops ran in."""
        around = self.around or (False, "float32")
        if around[0]:
            state, entered = around, AROUND
        elif self.within is not None:
            state, entered = self.within, self.entered
        else:
            state, entered = around, None
        return {"device_type": self.device_type, "enabled": state[0],
                "dtype": state[1] if state[0] else None, "entered": entered}
