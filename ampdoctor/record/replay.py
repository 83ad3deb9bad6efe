"""One instrumented re-run of a captured root call: who went non-finite first, would fp32 help.

``forensics`` captures each step's root-module calls; on an event it hands each one to
``explain(capture, names, ...)``, which

1. re-runs the root's forward from the captured RNG state, in the captured autocast state,
   with a forward pre/post hook on every named module, measuring every module input and
   output (``stats.Collector``: NaN/inf presence and abs max exact, counts sampled);
2. runs backward from the gradient that arrived at the root output in the real step, with
   ``torch.autograd.grad`` (``.grad`` is never written), measuring every module's
   grad_output, grad_input and the gradient of each parameter;
3. names the culprit (``_decide``): the first module, in execution order, whose output is
   non-finite while its inputs are finite, preferring the innermost one that explains it;
   else the first module in backward order whose grad_input (or own parameter gradient) is
   non-finite while its grad_output is finite; else the batch or the loss;
4. re-runs the culprit alone (``_culprit_check``), once as it ran (exact statistics in the
   run's precision) and once in fp32: autocast off, inputs ``.float()``, an fp32 copy of
   the module if its parameters are half; for a backward culprit, its backward from the
   same grad_output.

The culprit's inputs (and its grad_output) are not held during the instrumented pass, which
keeps the replay's memory close to the training step's: a second, lean pass re-runs the
step from the same RNG state and keeps only the culprit's.

How a module's own backward is isolated: a hook on a module's input tensor would see that
tensor's *total* gradient (a residual branch adds to it). So the pre-hook hands the module
an alias (``x.view_as(x)``) of each input that requires grad; the alias has one consumer,
the module, and its gradient is exactly the module's grad_input. An alias is made once per
tensor object, so ``query is key`` stays true for self-attention, and values never change.

-inf is not always an accident: an additive attention mask holds 0 and -inf by design. A
tensor whose only non-finite values are -inf and whose other values are all 0 counts as
finite. A tensor holding -inf among other values ("soft") is followed: when a module turns
it into NaN/+inf, the module that produced the -inf from finite inputs is the culprit.

The caller owns the observer-effect guarantee (``forensics``: RNG forked, buffers restored).
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..runfile import schema
from ..runfile.schema import Kind, Phase
from . import patches, stats, torchcompat
from .sampler import tensors_in

CLEAN, SOFT, HARD = 0, 1, 2
ROOT_INPUT, UNKNOWN = -1, -2  # sources of a module input that no module call produced
CHAIN = 12  # modules listed in the propagation chain of a finding


# ---------------------------------------------------------------------------------------------
# what forensics captures and hands over


@dataclass(eq=False)
class Capture:
    """One call of a root module in the real step (one micro-batch), held by reference."""

    root: torch.nn.Module  # the module as called (may be a DDP/compile wrapper)
    args: tuple
    kwargs: dict
    rng: dict  # "cpu" / cuda index -> generator state before the call
    autocast: tuple  # (device_type, enabled, dtype name, cache_enabled)
    micro: int  # backward calls seen in the step before this call
    versions: tuple = ()  # _version of each input tensor: in-place edits since are visible
    grads: dict = field(default_factory=dict)  # output index -> gradient seen in backward
    losses: list = field(default_factory=list)  # (loss, {"scaled": bool, "scale": S}) pairs
    grads_dropped: bool = False


@dataclass
class Slot:
    """What one measured tensor was (the collector's row of the same index has its stats)."""

    kind: Kind
    name: str  # module name (parameter name for PARAM_GRAD)
    index: int  # position among the module's inputs/outputs
    owner: str  # module class
    nth: int  # k-th call of that module in this replay
    label: str  # "args.0", "kwargs.mask", "out.1", "weight"
    call: int  # index into Trace.calls


@dataclass(eq=False)
class Call:
    """One module call seen by the instrumented replay."""

    index: int
    module: torch.nn.Module
    name: str
    nth: int
    end: int = -1  # calls[index+1:end] are its descendants
    inputs: list = field(default_factory=list)  # (label, slot, source call or ROOT/UNKNOWN)
    outputs: list = field(default_factory=list)  # (output index, slot)
    grad_out: list = field(default_factory=list)  # (slot, fired)
    grad_in: list = field(default_factory=list)  # (slot, fired): inputs and own parameters
    parent: int = -1  # index of the call it ran inside (-1: none)


@dataclass
class Culprit:
    """What a replay concluded; forensics turns it into a snapshot and a ReplayResult."""

    phase: Phase
    call: Optional[Call] = None
    module: str = ""
    module_type: str = ""
    culprit_slot: Optional[int] = None  # the slot named in the snapshot's culprit column
    summary: str = ""
    detail: dict = field(default_factory=dict)
    fp32_finite: Optional[bool] = None
    fp32_absmax: float = math.nan
    in_absmax: float = math.nan
    out_absmax: float = math.nan
    fp32_rows: list = field(default_factory=list)  # (Slot, stats row) of the fp32 re-run
    culprit_inputs: list = field(default_factory=list)  # (label, tensor) it was given


# ---------------------------------------------------------------------------------------------
# entry point


def explain(cap: Capture, names: dict, root_name: str, devices: list,
            param_names: Optional[dict] = None, strict: bool = False) -> tuple["Trace", Culprit]:
    """Replay one captured root call and decide what went non-finite first.

    ``names`` maps modules to their qualified names and ``param_names`` parameter ids to
    theirs (the recorder's); ``devices`` lists the CUDA devices whose RNG the replay may
    draw from. The caller forks the RNG and restores module buffers around this call. An
    exception in the re-run (the user's code may refuse to run twice) becomes part of the
    finding, unless ``strict``.
    """
    trace = Trace(cap, names, root_name, devices, param_names or {})
    trace.strict = strict
    bad_inputs = trace.measure_batch()
    if any(level == HARD for _, _, level in bad_inputs):
        return trace, _bad_batch(trace, bad_inputs)
    trace.run()
    finding = _decide(trace, bad_inputs)
    if finding.call is not None and finding.phase in (Phase.FORWARD, Phase.BACKWARD):
        _culprit_check(trace, finding)
        _describe(trace, finding)
    return trace, finding


def check_batch(cap: Capture, names: dict, root_name: str) -> tuple["Trace", Optional[Culprit]]:
    """Measure the captured batch only (no model code runs, no collective): a finding of
    phase input when it holds NaN/inf, else None. What a sharded model gets instead of a
    replay."""
    trace = Trace(cap, names, root_name, [], {})
    bad = [b for b in trace.measure_batch() if b[2] == HARD]
    return trace, (_bad_batch(trace, bad) if bad else None)


# ---------------------------------------------------------------------------------------------
# the instrumented pass


class Trace:
    """The instrumented forward and backward of one captured root call."""

    def __init__(self, cap: Capture, names: dict, root_name: str, devices: list,
                 param_names: dict):
        self.cap = cap
        self.param_names = param_names
        self.root = unwrap(cap.root)
        self.names = dict(names)
        self.names.setdefault(self.root, root_name)
        self.root_name = root_name
        self.devices = devices
        # Presence of NaN/inf and abs max are exact in sampled mode (one aminmax pass); counts
        # come from a fixed sample. The culprit's own tensors are then measured exactly.
        self.collector = stats.Collector()
        self.slots: list[Slot] = []
        self.calls: list[Call] = []
        self.rows = schema.empty("stats")
        self.outputs: list = []  # the root's output tensors (replayed)
        self.error: Optional[str] = None
        self.strict = False
        self.backward_note: Optional[str] = None
        self.fired = 0
        self._stack: list[Call] = []
        self._nth: dict[int, int] = {}
        self._origin: dict[int, tuple] = {}  # id(tensor) -> (weakref, source call)
        self._aliasing = _Aliases()
        self._forward_done = False
        self._batch_slots: dict[int, int] = {}  # id(batch tensor) -> slot

    # -- the batch --------------------------------------------------------------------------

    def measure_batch(self) -> list:
        """Stats of every batch tensor; returns (label, slot, level) of the non-finite ones."""
        owner = type(self.root).__name__
        slots = []
        for label, t in labeled(self.cap.args, self.cap.kwargs):
            slot = self._measure(t, Kind.INPUT, self.root_name, len(slots), owner, 0, label, 0)
            if slot is not None:
                slots.append((label, slot))
                self._origin[id(t)] = (weakref.ref(t), ROOT_INPUT)
                self._batch_slots[id(t)] = slot
        rows = self.collector.drain()
        self.rows = rows
        return [(label, slot, tensor_level(rows[slot])) for label, slot in slots
                if tensor_level(rows[slot]) != CLEAN]

    # -- forward and backward ---------------------------------------------------------------

    def run(self) -> None:
        set_rng(self.cap.rng)
        handles = patches.PatchSet()
        try:
            self._install(handles)
            # Anomaly mode would raise at the first NaN: the replay wants to see them all.
            with torch.enable_grad(), torch.autograd.set_detect_anomaly(False), \
                    autocast(self.cap.autocast):
                output = self.root(*self.cap.args, **self.cap.kwargs)
            self._forward_done = True
            self.outputs = list(tensors_in(output))
            with torch.autograd.set_detect_anomaly(False):
                self._backward(handles)
        except Exception as exc:  # noqa: BLE001 - the replay reports what it could not do
            if self.strict:
                raise
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            handles.remove()
        for call in self._stack:  # calls an exception left open contain everything after
            call.end = len(self.calls)
        rows = self.collector.drain()
        self.rows = np.concatenate([self.rows, rows])

    def _install(self, handles: patches.PatchSet) -> None:
        seen: set[int] = set()
        for m in self.root.modules():
            name = self.names.get(m)
            if name is None or id(m) in seen:
                continue
            seen.add(id(m))
            handles.add(m.register_forward_pre_hook(partial(self._pre, name), with_kwargs=True))
            handles.add(m.register_forward_hook(partial(self._post, name), with_kwargs=True))
        self._handles = handles

    def _pre(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict):
        if self._forward_done:  # activation checkpointing recomputes: same graph, no records
            return self._aliasing.apply(args, kwargs, None)
        nth = self._nth.get(id(module), 0)
        self._nth[id(module)] = nth + 1
        call = Call(len(self.calls), module, name, nth,
                    parent=self._stack[-1].index if self._stack else -1)
        owner = type(module).__name__
        for label, t in labeled(args, kwargs):
            slot = self._batch_slots.get(id(t)) if call.index == 0 else None
            if slot is None or self._source(t) != ROOT_INPUT:  # not the batch as captured
                slot = self._measure(t, Kind.INPUT, name, len(call.inputs), owner, nth, label,
                                     call.index)
            if slot is not None:
                call.inputs.append((label, slot, self._source(t)))
        self.calls.append(call)
        self._stack.append(call)
        return self._aliasing.apply(args, kwargs, partial(self._aliased, call))

    def _aliased(self, call: Call, original: torch.Tensor, alias: torch.Tensor,
                 label: str) -> None:
        self._origin[id(alias)] = (weakref.ref(alias), self._source(original))
        self._handles.add(alias.register_hook(partial(self._on_grad_in, call, label)))

    def _post(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
              output: Any) -> None:
        if self._forward_done or not self._stack:
            return
        call = self._stack.pop()
        call.end = len(self.calls)
        owner = type(module).__name__
        for i, t in enumerate(tensors_in(output)):
            slot = self._measure(t, Kind.OUTPUT, name, i, owner, call.nth, f"out.{i}",
                                 call.index)
            if slot is None:
                continue
            call.outputs.append((i, slot))
            prev = self._origin.get(id(t))
            handed_on = prev is not None and prev[0]() is t and call.index < prev[1] < call.end
            if not handed_on:  # a container returning its child's tensor keeps the child's
                self._origin[id(t)] = (weakref.ref(t), call.index)
            if t.requires_grad:
                self._handles.add(t.register_hook(partial(self._on_grad_out, call, i)))

    def _source(self, t: torch.Tensor) -> int:
        entry = self._origin.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else UNKNOWN

    def _on_grad_out(self, call: Call, index: int, grad: torch.Tensor) -> None:
        slot = self._measure(grad, Kind.GRAD_OUTPUT, call.name, index,
                             type(call.module).__name__, call.nth, f"out.{index}", call.index)
        if slot is not None:
            call.grad_out.append((slot, self._tick()))

    def _on_grad_in(self, call: Call, label: str, grad: torch.Tensor) -> None:
        index = next((i for i, (lab, _, _) in enumerate(call.inputs) if lab == label), 0)
        slot = self._measure(grad, Kind.GRAD_INPUT, call.name, index,
                             type(call.module).__name__, call.nth, label, call.index)
        if slot is not None:
            call.grad_in.append((slot, self._tick()))

    def _on_param_grad(self, owners: list, pname: str, grad: torch.Tensor) -> None:
        slot = self._measure(grad, Kind.PARAM_GRAD, pname, 0, "param", 0, pname,
                             owners[-1].index if owners else -1)
        if slot is None:
            return
        fired = self._tick()
        for call in owners:
            call.grad_in.append((slot, fired))

    def _tick(self) -> int:
        self.fired += 1
        return self.fired

    def _backward(self, handles: patches.PatchSet) -> None:
        grads = self.cap.grads
        pairs = [(t, grads[i]) for i, t in enumerate(self.outputs)
                 if i in grads and isinstance(t, torch.Tensor) and t.requires_grad]
        if not pairs:
            self.backward_note = ("the output gradient was not kept (accumulation memory cap)"
                                  if self.cap.grads_dropped else
                                  "no gradient reached the root output in the real step")
            return
        params = [p for p in self.root.parameters() if p.requires_grad]
        leaves = [t for t in tensors_in((self.cap.args, self.cap.kwargs))
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
        if not params and not leaves:
            self.backward_note = "the model has no parameter that requires grad"
            return
        self._hook_params(handles, params)
        torch.autograd.grad([t for t, _ in pairs], params + leaves, [g for _, g in pairs],
                            allow_unused=True)

    def _hook_params(self, handles: patches.PatchSet, params: list) -> None:
        owners: dict[int, list] = {}
        pnames: dict[int, str] = {}
        for call in self.calls:
            for local, p in call.module.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append(call)
                pnames.setdefault(id(p), local if call.module is self.root
                                  else f"{call.name}.{local}")
        for p in params:
            name = self.param_names.get(id(p)) or pnames.get(id(p), "param")
            handles.add(p.register_hook(partial(self._on_param_grad, owners.get(id(p), []),
                                                name)))

    def _measure(self, t: Any, kind: Kind, name: str, index: int, owner: str, nth: int,
                 label: str, call: int) -> Optional[int]:
        if not stats.measurable(t):
            return None
        if self.collector.add(t) is None:
            return None
        self.slots.append(Slot(kind, name, index, owner, nth, label, call))
        return len(self.slots) - 1

    # -- reading the rows -------------------------------------------------------------------

    def level(self, slot: int) -> int:
        return tensor_level(self.rows[slot])

    def bad(self, slot: int) -> bool:
        return int(self.rows[slot]["nonfinite"]) != 0

    def in_level(self, call: Call) -> int:
        return max((self.level(s) for _, s, _ in call.inputs), default=CLEAN)

    def out_level(self, call: Call) -> int:
        return max((self.level(s) for _, s in call.outputs), default=CLEAN)

    def chain(self) -> list[str]:
        """Modules whose output was non-finite, in execution order (the propagation path)."""
        out: list[str] = []
        for call in self.calls:
            if self.out_level(call) != CLEAN and call.name not in out:
                out.append(call.name)
            if len(out) >= CHAIN:
                break
        return out

    def summary(self, slot: int) -> dict:
        """A JSON-able summary of one measured tensor."""
        row, meta = self.rows[slot], self.slots[slot]
        return _row_summary(row, meta.label)


def _row_summary(row: np.ndarray, label: str) -> dict:
    dtype = schema.DType(int(row["dtype"])).name.lower()
    return {"label": label, "dtype": dtype, "numel": int(row["numel"]),
            "absmax": float(row["absmax"]), "nan": int(row["nan"]),
            "posinf": int(row["posinf"]), "neginf": int(row["neginf"]),
            "over16": int(row["over16"]), "zeros": int(row["zeros"])}


def tensor_level(row: np.ndarray) -> int:
    """CLEAN, SOFT (-inf among other values) or HARD (NaN or +inf) for one stats row."""
    bits = int(row["nonfinite"])
    if bits & 3:
        return HARD
    if bits & 4:
        # An additive mask (0 where kept, -inf where masked) is -inf by design.
        zeros = int(row["zeros"])  # counts are over sample_n elements (all, when exact)
        if zeros and zeros + int(row["neginf"]) == int(row["sample_n"]):
            return CLEAN
        return SOFT
    return CLEAN


class _Aliases:
    """Replaces each input tensor that requires grad by a view of itself (one per object)."""

    def apply(self, args: tuple, kwargs: dict, on_alias: Any):
        memo: dict[int, torch.Tensor] = {}
        new_args = self._map(args, memo, on_alias, "args")
        new_kwargs = self._map(kwargs, memo, on_alias, "kwargs")
        return (new_args, new_kwargs) if memo else None

    def _map(self, value: Any, memo: dict, on_alias: Any, label: str, depth: int = 0) -> Any:
        if isinstance(value, torch.Tensor):
            if not (value.requires_grad and not value.is_leaf and value.is_floating_point()):
                return value
            alias = memo.get(id(value))
            if alias is None:
                alias = memo[id(value)] = value.view_as(value)
                if on_alias is not None:
                    on_alias(value, alias, label)
            return alias
        if depth >= 4:
            return value
        if type(value) in (tuple, list):
            return type(value)(self._map(v, memo, on_alias, f"{label}.{i}", depth + 1)
                               for i, v in enumerate(value))
        if type(value) is dict:
            return {k: self._map(v, memo, on_alias, f"{label}.{k}", depth + 1)
                    for k, v in value.items()}
        return value


def labeled(args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for every tensor in a call's arguments: "args.0", "kwargs.mask.1"."""
    yield from _walk(args, "args", 0)
    yield from _walk(kwargs, "kwargs", 0)


def _walk(value: Any, label: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield label, value
    elif depth < 4 and isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{label}.{i}", depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{label}.{k}", depth + 1)


# ---------------------------------------------------------------------------------------------
# the verdict


def _bad_batch(trace: Trace, bad: list) -> Culprit:
    labels = [label for label, _, _ in bad]
    first = bad[0][1]
    f = Culprit(Phase.INPUT, module=trace.root_name, module_type=type(trace.root).__name__,
                culprit_slot=first)
    f.in_absmax = float(np.nanmax(trace.rows["absmax"][[s for _, s, _ in bad]]))
    f.detail["bad_inputs"] = [trace.summary(s) for _, s, _ in bad]
    f.summary = (f"the batch given to {trace.root_name} already held NaN/inf "
                 f"({', '.join(labels[:4])}): the data, not the model")
    return f


def _decide(trace: Trace, soft_inputs: list) -> Culprit:
    if trace.error is not None and not trace.calls:
        f = Culprit(Phase.UNKNOWN, summary=f"the replay failed: {trace.error}")
        f.detail["replay_error"] = trace.error
        return f
    f = _forward_culprit(trace) or _backward_culprit(trace)
    if f is None and soft_inputs and trace.out_level(trace.calls[0]) != CLEAN:
        f = _bad_batch(trace, soft_inputs)
    if f is None and trace.error is not None:
        f = Culprit(Phase.UNKNOWN, summary=f"the replay failed: {trace.error}")
    if f is None:
        f = _loss_or_nothing(trace)
    f.detail["chain"] = trace.chain()
    if trace.error is not None:
        f.detail["replay_error"] = trace.error
    if trace.backward_note:
        f.detail["backward_not_replayed"] = trace.backward_note
    return f


def _innermost_first(trace: Trace, producers: set[int]) -> Optional[Call]:
    """First producer in execution order that no descendant producer explains."""
    for call in trace.calls:
        if call.index not in producers:
            continue
        if any(i in producers for i in range(call.index + 1, max(call.end, call.index + 1))):
            continue
        return call
    return None


def _forward_culprit(trace: Trace) -> Optional[Culprit]:
    hard = {c.index for c in trace.calls
            if trace.out_level(c) == HARD and trace.in_level(c) < HARD}
    call = _innermost_first(trace, hard)
    how = "its output holds NaN/inf while its inputs are finite"
    if call is not None and trace.in_level(call) == SOFT:
        producer = _soft_origin(trace, call)
        if producer == ROOT_INPUT:
            bad = [(lab, s, SOFT) for lab, s, src in call.inputs
                   if trace.level(s) == SOFT and src == ROOT_INPUT]
            return _bad_batch(trace, bad)
        if producer is not None and producer.index < call.index < producer.end:
            how = (f"its own code (between its submodules) made -inf from finite inputs; "
                   f"{call.name} turned it into NaN/inf")
            call = producer
        elif producer is not None:
            how = (f"its output holds -inf (its inputs are finite), which "
                   f"{call.name} turned into NaN/inf")
            call = producer
        else:
            how = "it turned -inf in its inputs into NaN/inf"
    if call is None:
        soft = {c.index for c in trace.calls
                if trace.out_level(c) == SOFT and trace.in_level(c) == CLEAN}
        call = _innermost_first(trace, soft)
        how = "its output holds -inf while its inputs are finite"
    if call is None:
        return None
    f = _blame(trace, call, Phase.FORWARD)
    if call.end > call.index + 1 and how.startswith("its output holds NaN"):
        how += " (in its own code: no submodule of it went non-finite from finite inputs)"
    f.detail["how"] = how
    out_slots = [s for _, s in call.outputs if trace.level(s) != CLEAN]
    f.culprit_slot = out_slots[0] if out_slots else None
    return f


def _soft_origin(trace: Trace, call: Call, depth: int = 0) -> Optional[int]:
    """The module that produced the -inf a call received, from finite inputs of its own."""
    for _, slot, src in call.inputs:
        if trace.level(slot) != SOFT:
            continue
        if src == ROOT_INPUT:
            return ROOT_INPUT
        if src == UNKNOWN:  # no module returned it: made by the code of a module around it
            found = _made_around(trace, call)
            if found is not None:
                return found
        if src < 0 or depth > len(trace.calls):
            continue
        producer = trace.calls[src]
        level = trace.in_level(producer)
        if level == CLEAN:
            return producer
        if level == SOFT:
            found = _soft_origin(trace, producer, depth + 1)
            if found is not None:
                return found
    return None


def _made_around(trace: Trace, call: Call) -> Optional[Call]:
    """Who made the -inf a call received from no module's output (``h = x + mlp(ln1(x))`` in
    the parent's own forward): an earlier sibling whose output holds -inf from finite inputs
    (the parent's code passed it on), else the innermost enclosing call whose inputs are
    finite (its own code made it)."""
    for sib in trace.calls[call.parent + 1:call.index]:
        if sib.parent == call.parent and trace.out_level(sib) == SOFT and \
                trace.in_level(sib) == CLEAN:
            return sib
    up = call.parent
    while up >= 0:
        parent = trace.calls[up]
        if trace.in_level(parent) == CLEAN:
            return parent
        up = parent.parent
    return None


def _backward_culprit(trace: Trace) -> Optional[Culprit]:
    ranked = []
    for call in trace.calls:
        fired = [f for s, f in call.grad_in if trace.bad(s)]
        if fired:
            ranked.append((min(fired), -call.index, call))
    for _, _, call in sorted(ranked, key=lambda r: (r[0], r[1])):
        if any(trace.bad(s) for s, _ in call.grad_out):
            continue
        f = _blame(trace, call, Phase.BACKWARD)
        bad = [s for s, _ in sorted(call.grad_in, key=lambda x: x[1]) if trace.bad(s)]
        f.culprit_slot = bad[0]
        f.detail["how"] = ("its backward made NaN/inf gradients "
                           f"({', '.join(sorted({trace.slots[s].label for s in bad})[:4])}) "
                           "from a finite grad_output")
        return f
    return None


def _blame(trace: Trace, call: Call, phase: Phase) -> Culprit:
    f = Culprit(phase, call=call, module=call.name, module_type=type(call.module).__name__)
    f.detail["weights_nonfinite"] = _nonfinite_weights(call)
    return f


def _culprit_slots(call: Call, phase: Phase) -> tuple[list, list]:
    """Slots of what goes into and out of the culprit: its forward, or its backward (whose
    input is grad_output and outputs are grad_input and its own parameters' gradients)."""
    if phase == Phase.FORWARD:
        return [s for _, s, _ in call.inputs], [s for _, s in call.outputs]
    return [s for s, _ in call.grad_out], [s for s, _ in call.grad_in]


def _describe(trace: Trace, f: Culprit) -> None:
    """The culprit's abs max in and out, and a summary of each tensor (run precision)."""
    ins, outs = _culprit_slots(f.call, f.phase)
    f.in_absmax = _max_abs(trace.rows, ins)
    f.out_absmax = _max_abs(trace.rows, outs, finite_only=False)
    f.detail["run"] = {"inputs": [trace.summary(s) for s in ins][:16],
                       "outputs": [trace.summary(s) for s in outs][:16]}


def _max_abs(rows: np.ndarray, slots: list, finite_only: bool = True) -> float:
    """Largest abs max over slots; with finite_only, of the finite ones when there are any."""
    if not slots:
        return math.nan
    values = rows["absmax"][slots].astype(np.float64)
    finite = values[np.isfinite(values)]
    if finite_only and len(finite):
        return float(finite.max())
    return float(np.nanmax(values)) if not np.isnan(values).all() else math.nan


def _nonfinite_weights(call: Call) -> list[str]:
    """The culprit's own parameters and buffers that already hold NaN/inf (poisoned state)."""
    named = list(call.module.named_parameters()) + list(call.module.named_buffers())
    return [n for n, t in named if stats.measurable(t) and not bool(torch.isfinite(t).all())]


def _loss_or_nothing(trace: Trace) -> Culprit:
    cap = trace.cap
    grads_bad = [i for i, g in cap.grads.items() if stats.measurable(g)
                 and not bool(torch.isfinite(g).all())]
    loss_bad = any(not bool(torch.isfinite(loss).all()) for loss, _ in cap.losses)
    if not grads_bad and not loss_bad:
        return Culprit(Phase.NONE, summary="the replay of this micro-batch stayed finite")
    f = Culprit(Phase.LOSS)
    f.detail["output_grad_nonfinite"] = bool(grads_bad)
    f.detail["loss_nonfinite"] = loss_bad
    if grads_bad:
        f.detail["output_grad"] = _output_grad_detail(trace, grads_bad)
    loss_info = _loss_info(cap)
    f.detail["loss"] = loss_info
    f.in_absmax = _max_abs(trace.rows, [s for _, s in trace.calls[0].outputs]) \
        if trace.calls else math.nan
    dtype = loss_info.get("dtype")
    scale = loss_info.get("grad_fp32")
    if loss_bad:
        f.summary = (f"the model output is finite but the loss ({dtype}) is not: the loss "
                     "computation outside the model (or its targets) overflowed")
    elif loss_info.get("grad_nonfinite") and dtype in ("float16", "bfloat16") and scale:
        f.summary = (f"the loss is finite but the gradient arriving at it, {scale:g} (the "
                     f"loss scale), overflows {dtype}: compute the loss in float32")
        f.fp32_finite = math.isfinite(scale)
        f.fp32_absmax = scale
    else:
        f.summary = ("the model output is finite but the gradient of the loss with respect "
                     "to it is not: the loss's backward, outside the model, overflowed")
    return f


# Model output values listed where the loss's gradient is non-finite (the values its derivative
# is infinite at: a sigmoid saturated to exactly 1.0 in fp16 shows as [1.0]).
OUTPUT_VALUES_SHOWN = 4


def _output_grad_detail(trace: Trace, bad: list[int]) -> dict:
    """The gradient the loss's backward sent into the model's first bad output: how many
    elements are non-finite, the largest finite magnitude (far below 65504 beside inf says a
    singularity, not a scale too high) and the output's values where it is non-finite.
    Runs on the event only (host reads are fine here)."""
    i = bad[0]
    grad = trace.cap.grads[i]
    finite = torch.isfinite(grad)
    out: dict[str, Any] = {"index": i, "nonfinite": int((~finite).sum()),
                           "numel": int(grad.numel()),
                           "dtype": str(grad.dtype).replace("torch.", "")}
    kept = grad[finite]
    out["finite_absmax"] = float(kept.abs().max().float()) if kept.numel() else 0.0
    value = trace.outputs[i] if i < len(trace.outputs) else None
    if isinstance(value, torch.Tensor) and value.shape == grad.shape:
        at = value.detach()[~finite].float().unique()
        out["output_values"] = [float(v) for v in at[:OUTPUT_VALUES_SHOWN]]
        out["output_values_n"] = int(at.numel())
    return out


def _loss_info(cap: Capture) -> dict:
    """dtype and value of this micro-batch's loss, and the gradient that reached it."""
    if not cap.losses:
        return {}
    # The first loss that went wrong (a step may add several), else the first.
    loss, holder = next((x for x in cap.losses if not bool(torch.isfinite(x[0]).all())),
                        cap.losses[0])
    info: dict[str, Any] = {"dtype": str(loss.dtype).replace("torch.", ""),
                            "value": float(loss.float().sum())}
    scale = holder.get("scale")
    if scale is not None:
        # GradScaler multiplies the loss by S in fp32, so the gradient reaching the loss is S
        # itself, cast to the loss's dtype: it overflows an fp16 loss once S > 65504.
        info["grad_fp32"] = float(scale)
        info["grad"] = float(torch.tensor(scale, dtype=torch.float32).to(loss.dtype))
        info["grad_nonfinite"] = not math.isfinite(info["grad"])
    return info


# ---------------------------------------------------------------------------------------------
# the culprit alone: exact statistics in the run's precision and in fp32


class _Target:
    """A lean second pass: re-run the step, keep only the culprit call's inputs (and the
    grad_output it receives), the RNG and autocast state it ran in."""

    def __init__(self, trace: Trace, call: Call, backward: bool):
        self.trace = trace
        self.module = call.module
        self.nth = call.nth
        self.backward = backward
        self.seen = 0
        self.args: Optional[tuple] = None
        self.kwargs: Optional[dict] = None
        self.rng: Optional[dict] = None
        self.autocast: Optional[tuple] = None
        self.grad_out: dict[int, torch.Tensor] = {}
        self.requires_grad: set[int] = set()

    def run(self) -> "_Target":
        cap = self.trace.cap
        set_rng(cap.rng)
        with patches.PatchSet() as handles:
            self.handles = handles
            handles.add(self.module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.add(self.module.register_forward_hook(self._post, with_kwargs=True))
            with torch.enable_grad(), autocast(cap.autocast):
                output = self.trace.root(*cap.args, **cap.kwargs)
            if self.backward:
                outs = list(tensors_in(output))
                pairs = [(t, cap.grads[i]) for i, t in enumerate(outs)
                         if i in cap.grads and isinstance(t, torch.Tensor) and t.requires_grad]
                params = [p for p in self.trace.root.parameters() if p.requires_grad]
                if pairs and params:
                    torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs],
                                        allow_unused=True)
        if self.args is None:
            raise RuntimeError("the second pass did not reach the culprit (the replay diverged)")
        return self

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.seen == self.nth and self.args is None:
            self.args, self.kwargs = args, kwargs
            self.rng = rng_state(self.trace.devices)
            device = self.trace.cap.autocast[0]
            enabled, dtype = _autocast_now(device)
            self.autocast = (device, enabled, dtype, torch.is_autocast_cache_enabled())
            self.requires_grad = {id(t) for _, t in labeled(args, kwargs)
                                  if isinstance(t, torch.Tensor) and t.requires_grad}
        self.seen += 1

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.seen - 1 != self.nth or not self.backward or self.grad_out:
            return
        for i, t in enumerate(tensors_in(output)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self.handles.add(t.register_hook(partial(self._grad, i)))

    def _grad(self, index: int, grad: torch.Tensor) -> None:
        prev = self.grad_out.get(index)
        self.grad_out[index] = grad.detach() if prev is None else prev + grad.detach()


def _culprit_check(trace: Trace, f: Culprit) -> None:
    """Re-run the culprit alone, as it ran and in fp32; exact statistics of both.

    The run-precision re-run (same inputs, RNG, autocast state and grad_output) reproduces
    the replay's numbers and replaces the culprit's sampled rows with exact ones; the fp32
    re-run (autocast off, inputs ``.float()``, an fp32 copy of a half module) gives the
    verdict: finite means an fp32 island around the module fixes the step.
    """
    call, backward = f.call, f.phase == Phase.BACKWARD
    try:
        target = _Target(trace, call, backward).run()
        f.culprit_inputs = list(labeled(target.args, target.kwargs))
        prefix = "" if call.module is trace.root else f"{call.name}."
        qualified = {n: trace.param_names.get(id(p), prefix + n)
                     for n, p in call.module.named_parameters()}
        run = _Local(target, qualified, backward)
        measured = run.measure(call.module, target.args, target.kwargs, target.autocast)
        _replace_rows(trace, call, measured)
        module = _fp32_module(call.module)
        off = (target.autocast[0], False, None, False)
        fp32 = run.measure(module, to_fp32(target.args), to_fp32(target.kwargs), off, fp32=True)
    except Exception as exc:  # noqa: BLE001 - some modules refuse fp32 inputs; say so
        f.detail["fp32_error"] = f"{type(exc).__name__}: {exc}"
        return
    f.fp32_finite, f.fp32_absmax = _finite(run.results), _absmax(run.results)
    if not backward:
        _probe_ops(f, call.module, target)
    owner = type(call.module).__name__
    positions = {label: i for i, (label, _, _) in enumerate(call.inputs)}
    rows = []
    for kind, label, index, row in fp32:
        if kind in (Kind.INPUT, Kind.GRAD_INPUT):  # the replay's /tensors id for it
            index = positions.get(label, index)
        name = label if kind == Kind.PARAM_GRAD else call.name
        rows.append((Slot(kind, name, index, owner, call.nth, label, call.index), row))
    f.fp32_rows = rows
    into = (Kind.INPUT, Kind.GRAD_OUTPUT)
    f.detail["fp32"] = {
        "inputs": [_row_summary(r, s.label) for s, r in rows if s.kind in into][:16],
        "outputs": [_row_summary(r, s.label) for s, r in rows if s.kind not in into][:16],
        "copied_module": module is not call.module,
    }


def _probe_ops(f: Culprit, module: torch.nn.Module, target: _Target) -> None:
    """Which op inside a forward culprit went non-finite first (``opprobe``): tells a mask
    constant that fp16 cannot hold from a product that overflows."""
    from .opprobe import first_nonfinite_op

    set_rng(target.rng)
    try:
        op = first_nonfinite_op(module, target.args, target.kwargs, autocast(target.autocast))
    except Exception as exc:  # noqa: BLE001 - the probe only adds detail; it must not fail
        f.detail["op_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return
    if op is not None:
        f.detail["op"] = op


class _Local:
    """The culprit module alone: forward, or forward and backward from its grad_output."""

    def __init__(self, target: _Target, qualified: dict, backward: bool):
        self.target = target
        self.qualified = qualified
        self.backward = backward
        self.results: list = []  # outputs (forward) or gradients (backward) of the last run

    def measure(self, module: torch.nn.Module, args: Any, kwargs: Any, state: tuple,
                fp32: bool = False) -> list:
        """[(kind, label, index, exact stats row)] of what went in and came out."""
        set_rng(self.target.rng)
        with autocast(state), torch.autograd.set_detect_anomaly(False):
            if self.backward:
                measured = self._backward(module, args, kwargs, fp32)
            else:
                with torch.no_grad():
                    out = module(*args, **kwargs)
                self.results = [t for t in tensors_in(out) if stats.measurable(t)]
                measured = [(Kind.INPUT, label, i, t) for i, (label, t) in enumerate(
                    (lab, t) for lab, t in labeled(args, kwargs) if stats.measurable(t))]
                measured += [(Kind.OUTPUT, f"out.{i}", i, t) for i, t in enumerate(self.results)]
        return [(kind, label, i, row) for kind, label, i, t in measured
                for row in [stats.exact(t)] if row is not None]

    def _backward(self, module: torch.nn.Module, args: Any, kwargs: Any, fp32: bool) -> list:
        wanted = self.target.requires_grad

        def leaf(original: Any, t: Any) -> Any:
            if isinstance(t, torch.Tensor) and id(original) in wanted and t.is_floating_point():
                t = t.detach().requires_grad_(True)
            return t

        args = _zip_map(self.target.args, args, leaf)
        kwargs = _zip_map(self.target.kwargs, kwargs, leaf)
        leaves = [(label, t) for label, t in labeled(args, kwargs) if t.requires_grad]
        with torch.enable_grad():
            out = module(*args, **kwargs)
        outs = list(tensors_in(out))
        pairs = [(i, outs[i], g.float() if fp32 else g)
                 for i, g in sorted(self.target.grad_out.items())
                 if i < len(outs) and isinstance(outs[i], torch.Tensor) and outs[i].requires_grad]
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not pairs or not (leaves or params):
            raise RuntimeError("the culprit's backward could not be re-run (no gradient "
                               "reached it)")
        wrt = [t for _, t in leaves] + [p for _, p in params]
        grads = torch.autograd.grad([t for _, t, _ in pairs], wrt, [g for _, _, g in pairs],
                                    allow_unused=True)
        self.results = [g for g in grads if g is not None]
        measured = [(Kind.GRAD_OUTPUT, f"out.{i}", i, g) for i, _, g in pairs]
        measured += [(Kind.GRAD_INPUT, label, i, g)
                     for i, ((label, _), g) in enumerate(zip(leaves, grads)) if g is not None]
        measured += [(Kind.PARAM_GRAD, self.qualified.get(n, n), 0, g)
                     for (n, _), g in zip(params, grads[len(leaves):]) if g is not None]
        return measured


def _replace_rows(trace: Trace, call: Call, measured: list) -> None:
    """Swap the culprit's sampled rows for the exact ones of its run-precision re-run."""
    exact = {(int(kind), label): row for kind, label, _, row in measured}
    prefix = "" if call.module is trace.root else f"{call.name}."
    params = {trace.param_names.get(id(p), prefix + n) for n, p in call.module.named_parameters()}
    for slot, meta in enumerate(trace.slots):
        if meta.call == call.index or (meta.kind == Kind.PARAM_GRAD and meta.label in params):
            row = exact.get((int(meta.kind), meta.label))
            if row is not None and int(row["numel"]) == int(trace.rows[slot]["numel"]):
                trace.rows[slot] = row


def _fp32_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module itself if it is fp32 already, else an fp32 copy (the original is untouched)."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        return module
    return copy.deepcopy(module).float()


def _zip_map(original: Any, converted: Any, fn: Any, depth: int = 0) -> Any:
    if isinstance(converted, torch.Tensor):
        return fn(original, converted)
    if depth < 4 and type(converted) in (tuple, list):
        return type(converted)(_zip_map(o, c, fn, depth + 1) for o, c in zip(original, converted))
    if depth < 4 and type(converted) is dict:
        return {k: _zip_map(original[k], v, fn, depth + 1) for k, v in converted.items()}
    return converted


def _autocast_now(device_type: str) -> tuple:
    return torchcompat.autocast_state(device_type)


def _finite(tensors: list) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if stats.measurable(t))


def _absmax(tensors: list) -> float:
    mags = [float(t.detach().abs().float().nan_to_num(nan=math.inf).max())
            for t in tensors if stats.measurable(t)]
    return max(mags, default=math.nan)


# ---------------------------------------------------------------------------------------------
# small helpers shared with forensics


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The eager module inside DDP/DataParallel/torch.compile wrappers.

    The replay runs it directly: a DDP forward would start collectives that the other ranks
    are not running, and a compiled one would recompile with the replay's hooks.
    """
    return torchcompat.unwrap(module)


def to_fp32(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.is_floating_point() else value
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(to_fp32(v, depth + 1) for v in value)
    if depth < 4 and type(value) is dict:
        return {k: to_fp32(v, depth + 1) for k, v in value.items()}
    return value


def rng_state(devices: list) -> dict:
    """The CPU generator's state and that of each listed CUDA device (host copies, no sync)."""
    state: dict[Any, torch.Tensor] = {"cpu": torch.get_rng_state()}
    for d in devices:
        state[d] = torch.cuda.get_rng_state(d)
    return state


def set_rng(state: dict) -> None:
    for key, value in state.items():
        if key == "cpu":
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value, key)


def autocast(state: tuple):
    device_type, enabled, dtype, cache = state
    return torch.autocast(device_type, dtype=getattr(torch, dtype or "float16", torch.float16),
                          enabled=enabled, cache_enabled=cache)
