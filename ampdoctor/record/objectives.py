"""Several losses and optimizers: each loss's own curve, and each optimizer's.

The AMP docs train several models, losses and optimizers with one scaler: a GAN backwards the
discriminator's loss and steps its optimizer, then the generator's; a multi-task model
backwards two losses and steps two optimizers. /steps holds one loss per step (the mean of
every loss backwarded) and one gradient norm; here each loss and each optimizer keeps its own.

A loss is known by where the training code backwarded it (its *site*): the innermost frame of
the script's own code on the stack of ``backward`` or ``scaler.scale`` (frames of torch, of
ampdoctor and of installed libraries are passed over, unless only those are there, as for a
trainer installed as a package), with the frames that called it: micro-batches backwarded
from one line are one loss, and a helper that backwards, called from two lines (the
discriminator's loss, then the generator's), makes two. /meta ``losses`` holds each one's
``frames``: the reader takes two losses of one line whose steps follow one another and whose
stacks differ only in the outermost frame (the same loop called from a warm-up, then from the
main loop) as one (``diagnosis/objectives.py``). Each
loss is kept with the optimizers it *feeds*: those that step after its backward and whose
parameters its graph reaches (walked once, the first time the loss is seen in a run with
several optimizers), less the parameters whose gradients were zeroed in between
(``optimizer.zero_grad``, ``module.zero_grad``): a GAN's generator loss reaches the
discriminator too, whose gradients are zeroed before its own step.

A run with one loss and one optimizer writes nothing here and pays one frame walk per
backward. The others write a /losses row per step and loss, an /optimizers row per step and
optimizer (their device values read at the drain with /steps', ``steplog``), and /meta
``losses`` (each loss's site, the optimizers it feeds and those its graph reaches).

Example (what the recorder's hooks do)::

    objectives.loss(value, loss, step)         # a backward: its value kept under its site
    objectives.norm(optimizer, step, scaler)   # before an optimizer's gradients change
    parts = objectives.end_step(step)          # None for one loss and one optimizer
"""

from __future__ import annotations

import collections
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..runfile.meta import LossSlot
from . import stats
from .apply import lrfactors
from .journal import Journal
from .steps import Constants, Step
from .torchcompat import found_inf, scaler_enabled
from .watched import Watched

# Frames of the training code that name a loss: the innermost few (a helper that backwards,
# called from two lines, makes two losses).
SITE_FRAMES = 3
STACK_LIMIT = 64  # frames looked at, at most
# Autograd nodes a loss's graph is walked over to find the parameters it reaches; a larger
# graph is taken to reach every optimizer's (its loss feeds each one that steps after it).
WALK_LIMIT = 200_000
# Steps a new loss waits for an optimizer to step after its backward; then it is settled with
# what was seen (a loss backwarded for no step feeds none).
SETTLE_STEPS = 3

_OURS = (os.path.dirname(torch.__file__) + os.sep,
         os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_LIBRARY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# (frozen "<...>" files: importlib's, runpy's)
_FROZEN = "<"


@dataclass
class Slot:
    """One loss of the run: where it is backwarded, and what it feeds."""

    index: int
    site: str  # "train.py:41", or "train.py:12 (from train.py:41)" where a helper backwards
    key: tuple
    reaches: Optional[frozenset] = None  # ids of the parameters its graph reaches (walked)
    feeds: set = field(default_factory=set)  # optimizer indices
    settled: bool = False
    waited: int = 0  # step ends since it was first seen, unsettled
    node: Any = None  # its first grad_fn, until walked (the end of its first step at latest)


@dataclass
class Parts:
    """A finished step's losses and optimizers, until the drain: host fields, and the device
    values in one tensor (``values``: each loss's mean, each optimizer's gradient norm, each
    optimizer's found_inf), not read yet."""

    slots: list  # slot indices
    micro: list  # backwards per slot
    optimizers: list  # optimizer indices
    lr: list  # largest LR of each optimizer's groups
    stepped: list  # 1: the optimizer's step() ran in this step
    values: torch.Tensor
    step_loss: bool = False  # its one loss is the step's (/steps loss): no value of its own


class Objectives:
    """The run's losses (``slots``) and this step's values of each loss and optimizer."""

    def __init__(self, journal: Journal, watched: Watched, constants: Constants):
        self.journal = journal
        self.watched = watched
        self.constants = constants
        self.slots: list[Slot] = []  # the run's losses, by index
        self._keys: dict[tuple, Slot] = {}  # call stack -> its loss
        self._kinds: dict[str, int] = {}  # co_filename -> 0 ours, 1 a library, 2 the script
        self._events: list[tuple] = []  # while a slot is unsettled: the step's order
        self._params: dict[int, tuple[int, frozenset]] = {}  # id(opt) -> (size, param ids)
        # this step
        self._losses: dict[int, list] = {}  # slot index -> [sum, backwards]
        self._norms: dict[int, torch.Tensor] = {}  # id(optimizer) -> its unscaled grad norm
        self._found: dict[int, torch.Tensor] = {}  # id(optimizer) -> its found_inf
        self._stepped: set[int] = set()  # id(optimizer)
        self._written: Optional[list] = None  # /meta losses as last written

    # -- a loss -----------------------------------------------------------------------------

    def loss(self, value: torch.Tensor, loss: torch.Tensor) -> int:
        """A loss about to be backwarded (``value``: its detached fp32 scalar); its slot."""
        key = self._site_key(sys._getframe(1))
        slot = self._keys.get(key)
        if slot is None:
            slot = self._slot_for(key, loss)
        kept = self._losses.get(slot.index)
        if kept is None:
            self._losses[slot.index] = [value, 1]
        else:
            kept[0] = kept[0] + value
            kept[1] += 1
        if self._events or not slot.settled:
            self._events.append(("loss", slot.index))
        return slot.index

    def rewind(self, kept: list[tuple[int, torch.Tensor]]) -> None:
        """The first step's losses again from its backwards ``kept`` ((slot, value), in their
        order): those of a root that discovery dropped (a model run and dropped before the real
        one) are left out, and a loss left with none is forgotten (the slots renumbered)."""
        live = sorted({slot for slot, _ in kept})
        index = {old: new for new, old in enumerate(live)}
        self.slots = [self.slots[old] for old in live]
        for slot in self.slots:
            slot.index = index[slot.index]
        self._keys = {slot.key: slot for slot in self.slots}
        self._losses = {}
        for old, value in kept:
            sums = self._losses.get(index[old])
            if sums is None:
                self._losses[index[old]] = [value, 1]
            else:
                sums[0] = sums[0] + value
                sums[1] += 1
        self._events = [e if e[0] != "loss" else ("loss", index[e[1]]) for e in self._events
                        if e[0] != "loss" or e[1] in index]

    def _slot_for(self, key: tuple, loss: torch.Tensor) -> Slot:
        """A new loss: a call stack not seen before."""
        slot = Slot(index=len(self.slots), site=_label(key[0]), key=key)
        self.slots.append(slot)
        self._keys[key] = slot
        if loss.grad_fn is not None:
            if len(self.watched.optimizers) >= 2:
                slot.reaches = _reached(loss.grad_fn)
            else:  # the optimizers may not be known yet (step 0): walked at the step's end
                slot.node = loss.grad_fn
        return slot

    def _site_key(self, frame: Any) -> tuple:
        """The innermost ``SITE_FRAMES`` frames of the script's own code, as (file, line); of
        a library's where there is none (a trainer installed as a package)."""
        mine: list[tuple] = []
        library: list[tuple] = []
        depth = 0
        while frame is not None and depth < STACK_LIMIT and len(mine) < SITE_FRAMES:
            name = frame.f_code.co_filename
            kind = self._kinds.get(name)
            if kind is None:
                kind = self._kinds[name] = _kind(name)
            if kind == 2:
                mine.append((name, frame.f_lineno))
            elif kind == 1 and len(library) < SITE_FRAMES:
                library.append((name, frame.f_lineno))
            frame = frame.f_back
            depth += 1
        return tuple(mine or library) or (("<unknown>", 0),)

    # -- gradients zeroed, optimizers stepped -----------------------------------------------

    def zeroed_optimizer(self, optimizer: Any) -> None:
        if self._events:
            self._events.append(("zero", self._param_ids(optimizer)))

    def zeroed_module(self, module: torch.nn.Module) -> None:
        if self._events:
            self._events.append(("zero", frozenset(id(p) for p in module.parameters())))

    def stepping(self, optimizer: Any) -> None:
        """``optimizer`` is about to step (``scaler.step``, or its own ``step()``): what
        was backwarded before feeds it, whether or not the scaler then skips the step."""
        if self._events:
            index = self._index(optimizer)
            if index is not None:
                self._events.append(("step", index))

    def stepped(self, optimizer: Any) -> None:
        """``optimizer.step()`` ran."""
        self._stepped.add(id(optimizer))

    # -- each optimizer's gradient norm -----------------------------------------------------

    def norm(self, optimizer: Any, st: Step, scaler: Any) -> None:
        """``optimizer``'s own gradient norm, unscaled, if the run has several optimizers and
        it was not taken yet this step: called before its gradients change (``unscale_``,
        a clip, its step). No host read."""
        if len(self.watched.optimizers) < 2 or id(optimizer) in self._norms or \
                self.watched.sharding is not None:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None and stats.measurable(p.grad)]
        if not grads:
            return
        norm = stats.global_norm(grads)
        if st.scaled and id(optimizer) not in st.unscaled_by and scaler_enabled(scaler):
            scale = getattr(scaler, "_scale", None)
            if scale is not None:
                norm = norm / scale.to(norm.device).reshape(())
        self._norms[id(optimizer)] = norm

    def norms_before_clip(self, params: Any, st: Step, scaler: Any) -> None:
        """A clip is about to change these parameters' gradients: the norm of each optimizer
        that holds one of them is taken first (before its clip, as /steps' grad_norm)."""
        if len(self.watched.optimizers) < 2 or not isinstance(params, (list, tuple)):
            return
        ids = {id(p) for p in params}
        for opt in self.watched.optimizers:
            if id(opt) not in self._norms and ids & self._param_ids(opt):
                self.norm(opt, st, scaler)

    def found(self, scaler: Any) -> None:
        """Each optimizer's own found_inf, as ``GradScaler.update`` is about to read them."""
        if len(self.watched.optimizers) < 2:
            return
        for opt in self.watched.optimizers:
            flag = found_inf(scaler, id(opt))
            if flag is not None:
                self._found[id(opt)] = flag

    # -- the step's end -----------------------------------------------------------------------

    def end_step(self, st: Step) -> Optional[Parts]:
        """The step's losses and optimizers (None for a run of one of each), the losses seen
        first settled where they can be, and what this step kept released."""
        try:
            self._settle()
            return self._parts(st)
        finally:
            self._losses = {}
            self._norms = {}
            self._found = {}
            self._stepped = set()

    def _parts(self, st: Step) -> Optional[Parts]:
        opts = self.watched.optimizers
        many = len(self.slots) >= 2
        if not many and len(opts) < 2:
            return None
        slots = sorted(self._losses) if many else []
        if len(slots) == 1 and len(opts) < 2 and self._losses[slots[0]][1] == st.loss_n:
            # one loss this step, all of it: its row is the step's loss (no tensor of its own)
            return Parts(slots=slots, micro=[st.loss_n], optimizers=[], lr=[], stepped=[],
                         values=self.constants.nan(torch.device("cpu")).reshape(1)[:0],
                         step_loss=True)
        several = len(opts) >= 2
        values = [self._losses[s][0] / self._losses[s][1] for s in slots]
        if several:
            values += [self._norms.get(id(o)) for o in opts]
            values += [self._found.get(id(o)) for o in opts]
        dev = next((v.device for v in values if v is not None), torch.device("cpu"))
        nan = self.constants.nan(dev)
        stacked = torch.stack([nan if v is None else v.to(dev).float().reshape(())
                               for v in values]) if values else nan.reshape(1)[:0]
        return Parts(slots=slots, micro=[self._losses[s][1] for s in slots],
                     optimizers=list(range(len(opts))) if several else [],
                     lr=[_largest_lr(o) for o in opts] if several else [],
                     stepped=[int(id(o) in self._stepped) for o in opts] if several else [],
                     values=stacked)

    def _settle(self) -> None:
        """Each unsettled loss: the optimizers that stepped after its backward, whose
        parameters its graph reaches and were not zeroed in between."""
        pending = [s for s in self.slots if not s.settled]
        if not pending:
            self._events = []
            return
        several = len(self.watched.optimizers) >= 2
        params = [self._param_ids(o) for o in self.watched.optimizers]
        changed = False
        for slot in pending:
            if slot.node is not None:
                slot.reaches = _reached(slot.node) if several else None
                slot.node = None
            live: Optional[set] = None
            after = stepped_after = False
            for event in self._events:
                if event[0] == "loss":
                    if event[1] == slot.index:  # each backward of it: all it reaches again
                        after = True
                        live = set(slot.reaches) if slot.reaches is not None else None
                elif not after:
                    continue
                elif event[0] == "zero":
                    if live is not None:
                        live -= event[1]
                elif event[1] < len(params):  # "step"
                    stepped_after = True
                    if live is None or live & params[event[1]]:
                        slot.feeds.add(event[1])
            slot.waited += 1
            if stepped_after or slot.waited >= SETTLE_STEPS:
                slot.settled = changed = True
        if all(s.settled for s in self.slots):
            self._events = []
        else:  # the next step's events follow on from the last backward seen
            first = min((i for i, e in enumerate(self._events) if e[0] == "loss"
                         and not self.slots[e[1]].settled), default=len(self._events))
            self._events = self._events[first:]
        if changed or (len(self.slots) >= 2 and self._written is None):
            self._write_meta()

    def _write_meta(self) -> None:
        if len(self.slots) < 2:
            return
        params = [self._param_ids(o) for o in self.watched.optimizers]
        value = []
        for slot in self.slots:
            reaches = None if slot.reaches is None else \
                [i for i, p in enumerate(params) if slot.reaches & p]
            site = slot.site
            if len(slot.key) > 1 and any(s.key[0] == slot.key[0] for s in self.slots
                                         if s is not slot):
                site = f"{site} (from {_label(slot.key[1])})"  # a helper's: who called it
            value.append(LossSlot(site=site, frames=[_label(k) for k in slot.key],
                                  optimizers=sorted(slot.feeds), reaches=reaches,
                                  settled=slot.settled))
        if value != self._written:
            self._written = value
            self.journal.meta("losses", value)

    def _index(self, optimizer: Any) -> Optional[int]:
        return next((i for i, o in enumerate(self.watched.optimizers) if o is optimizer), None)

    def _param_ids(self, optimizer: Any) -> frozenset:
        size = sum(len(g["params"]) for g in optimizer.param_groups)
        kept = self._params.get(id(optimizer))
        if kept is None or kept[0] != size:
            kept = self._params[id(optimizer)] = (size, frozenset(
                id(p) for g in optimizer.param_groups for p in g["params"]))
        return kept[1]


def _kind(filename: str) -> int:
    """0: torch's or ampdoctor's own code (or frozen), 1: an installed library, 2: the script's."""
    if filename.startswith(_FROZEN) or filename.startswith(_OURS):
        return 0
    return 1 if any(part in filename for part in _LIBRARY) else 2


def _label(where: tuple) -> str:
    return f"{os.path.basename(where[0])}:{where[1]}"


def _reached(node: Any) -> Optional[frozenset]:
    """ids of the parameters (leaves that accumulate a gradient) the graph at ``node``
    reaches; None for a graph larger than ``WALK_LIMIT`` nodes."""
    seen = {id(node)}
    todo = collections.deque([node])
    found = set()
    while todo:
        if len(seen) > WALK_LIMIT:
            return None
        n = todo.popleft()
        variable = getattr(n, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        for nxt, _ in getattr(n, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                todo.append(nxt)
    return frozenset(found)


def _largest_lr(optimizer: Any) -> float:
    lrs = lrfactors.ran_with(optimizer)
    return max(lrs) if lrs else math.nan
