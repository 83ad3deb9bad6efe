"""The instrumented pass of a forensic replay: one captured root call (``Capture``) re-run
with a forward pre/post hook on every named module, measuring every module input and output
and, in backward, every grad_output, grad_input and parameter gradient (``Trace``); each
measured tensor is a ``Slot`` of a ``Call``, its statistics the collector's row of the same
index (``stats.Collector``: NaN/inf presence and abs max exact, counts sampled).

How a module's own backward is isolated: a hook on a module's input tensor would see that
tensor's *total* gradient (a residual branch adds to it). So the pre-hook hands the module
an alias (``x.view_as(x)``) of each input that requires grad (``_Aliases``); the alias has one
consumer, the module, and its gradient is exactly the module's grad_input. An alias is made
once per tensor object, so ``query is key`` stays true for self-attention, and values never
change.

-inf is not always an accident: an additive attention mask holds 0 and -inf by design. A
tensor whose only non-finite values are -inf and whose other values are all 0 counts as
finite (``tensor_level``: CLEAN); one holding -inf among other values is SOFT, NaN or +inf
HARD.

Example (what ``replay.explain`` does first)::

    trace = Trace(capture, names, "Net", devices=[], param_names={})
    bad = trace.measure_batch()      # (label, slot, level) of the non-finite batch tensors
    trace.run()                      # forward and backward, instrumented
    trace.level(trace.calls[3].outputs[0][1])
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ...runfile import schema
from ...runfile.detail import RowSummary
from ...runfile.schema import Kind
from .. import patches, stats, torchcompat
from ..sampler import tensors_in
from .isolated import set_rng

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
    # Weak references to the root's outputs: what the real step produced, measured only on
    # the event (the user's ``logits`` usually still holds them); never kept alive by us.
    outputs: list = field(default_factory=list)
    loss_calls: list = field(default_factory=list)  # losscall.LossCall: torch losses after it
    open: bool = False  # the call is still running: a loss computed now is inside the model
    # singular.Read: a hand-written loss's singular ops and their inputs, held on a watched
    # step (after a loss-backward event) from before its backward to the step's end
    singular: list = field(default_factory=list)
    output_meta: list = field(default_factory=list)  # a Gone per output (None: no graph)

    @property
    def output_nodes(self) -> list:
        """The outputs' grad_fn: where a loss's graph ends (``proofs.Prover``), and what a later
        model's inputs may be computed from (``feeds``)."""
        return [m.grad_fn for m in self.output_meta if m is not None]


@dataclass(frozen=True)
class Gone:
    """What a root output was in the graph, for when the tensor itself is freed (a loss on
    ``model(x).float()``: only the cast holds the output's node)."""

    grad_fn: Any
    output_nr: int
    shape: torch.Size


def root_name(names: dict, root: torch.nn.Module) -> str:
    """What the recorder calls a root (its class name where it has no name of its own)."""
    return names.get(root) or type(unwrap(root)).__name__


def outputs_of(cap: Capture) -> list:
    """The root call's outputs: each tensor while it lives, its ``Gone`` once freed."""
    meta = cap.output_meta
    return [t if (t := ref()) is not None else (meta[i] if i < len(meta) else None)
            for i, ref in enumerate(cap.outputs)]


FEED_NODES = 256  # graph nodes walked back from a later model's inputs (``feeds``)


def feeds(cap: Capture, later: list) -> bool:
    """Does a later root call of the step take a tensor computed from this call's output (a
    generator's samples given to the discriminator)? The gradient at its output then came
    through that model, not straight from the loss."""
    return any(reaches(t, cap.output_nodes) for other in later if other.root is not cap.root
               for t in tensors_in((other.args, other.kwargs)))


def reaches(t: Any, nodes: list) -> bool:
    """Was ``t`` computed from a tensor whose grad_fn is one of ``nodes``? Read from the
    graph: ``t``'s node walked back, at most ``FEED_NODES`` nodes."""
    if not nodes or not isinstance(t, torch.Tensor) or t.grad_fn is None:
        return False
    wanted = {id(n) for n in nodes}
    todo, seen = [t.grad_fn], set[int]()
    while todo and len(seen) < FEED_NODES:
        node = todo.pop()
        if id(node) in wanted:
            return True
        if id(node) in seen:
            continue
        seen.add(id(node))
        todo += [n for n, _ in node.next_functions if n is not None]
    return False


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
        slots: list[tuple[str, int]] = []
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

    def summary(self, slot: int) -> RowSummary:
        """A summary of one measured tensor, as the snapshot's detail keeps it."""
        row, meta = self.rows[slot], self.slots[slot]
        return row_summary(row, meta.label)


def row_summary(row: np.ndarray, label: str) -> RowSummary:
    dtype = schema.DType(int(row["dtype"])).name.lower()
    return RowSummary(label=label, dtype=dtype, numel=int(row["numel"]),
                      absmax=float(row["absmax"]), nan=int(row["nan"]),
                      posinf=int(row["posinf"]), neginf=int(row["neginf"]),
                      over16=int(row["over16"]), zeros=int(row["zeros"]))


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


def autocast(state: tuple):
    device_type, enabled, dtype, cache = state
    return torch.autocast(device_type, dtype=getattr(torch, dtype or "float16", torch.float16),
                          enabled=enabled, cache_enabled=cache)
