"""Inside a module: the first torch op whose result went non-finite, and how. Two probes.

``first_nonfinite_op`` (forensic replays): inside a culprit module, which op failed and how.

The forensic replay names the module whose output went non-finite from finite inputs. A
module's forward holds many ops (a projection, q @ k^T, a mask, a softmax), and which one
failed tells failure classes apart that look the same at the module's boundary: a product
that overflows (``matmul`` making +inf and -inf: an unstable op), a mask constant that fp16
cannot hold (``mul`` by -1e9 making only -inf), a softmax over rows that are -inf everywhere
(NaN from fully masked rows). So the culprit is run once more on its captured inputs, in the
step's own autocast state, under a ``TorchFunctionMode`` that looks at each op's result.

Recorder side (imports torch). Runs only on a forensic replay, never on a normal step: each op
costs one host sync there, which an event can afford.

``StepProbe`` (sampled steps): an overflow that never reaches a module's output. A hand-written
RMSNorm in fp16 squares a residual stream that passed 256: ``x * x`` is inf, its mean inf, and
``x / sqrt(inf)`` exactly 0. No NaN, no skipped step; the norm's output is finite and mostly
zeros, and the model stops learning. On a sampled step the probe runs as a
``TorchFunctionMode`` over the root module's forward (entered by its forward pre-hook, left by a
global forward hook that runs even when the forward raises) and keeps, per floating tensor an
op returns, its min and max (one ``torch.aminmax`` on the device, no host read), with the op
and the module calls open at the time (the sampled tier's global module hooks). At the step's
end ``stage`` queues them in the sampled step's ``readback.HostRead``, read with the step's
other statistics in one copy per device (the sampled step's drain), and the function it returns
names each module whose output stayed finite although an op inside it made inf/NaN from finite
inputs (``Hidden``).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from ..runfile.detail import OpRecord
from .readback import HostRead
from .sampler import tensors_in

_KINDS = ("nan", "posinf", "neginf")


def first_nonfinite_op(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None,
                       context: Any = None) -> Optional[OpRecord]:
    """Re-run ``module(*args, **kwargs)`` inside ``context`` (the step's autocast state, as a
    context manager) and describe the first op that created a kind of non-finite value its
    inputs did not hold.

    Returns None when every op stayed finite. The dict holds: ``op`` (name), ``created`` (kinds
    among nan/posinf/neginf), ``dtype`` of the result, ``counts`` of each kind, ``numel``,
    ``in_absmax`` (largest finite input magnitude), ``big_scalar`` (largest finite Python
    constant passed to the op), ``in_nan``/``in_posinf``/``in_neginf`` (what the inputs held),
    ``index`` (how many ops ran before it), ``mask_operand`` (an input is an additive mask:
    one negative constant where it is not 0).
    """
    probe = _Probe()
    with torch.no_grad(), context if context is not None else contextlib.nullcontext(), probe:
        module(*args, **(kwargs or {}))
    return probe.found


class _Probe(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: Optional[OpRecord] = None
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None:
            outs = [t for t in tensors_in(out) if _floating(t)]
            if outs:
                self.ops += 1
                self.found = _describe(func, args, kwargs, outs, self.ops - 1)
        return out


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and \
        t.layout == torch.strided and t.device.type != "meta" and t.dtype.itemsize > 1


def _presence(tensors: list) -> tuple[list[int], float]:
    """Counts of NaN, +inf, -inf over ``tensors`` and their largest finite magnitude."""
    counts = [0, 0, 0]
    biggest = math.nan
    for t in tensors:
        x = t.detach()
        stats = torch.stack([torch.isnan(x).sum(), (x == math.inf).sum(), (x == -math.inf).sum()])
        c = stats.tolist()
        counts = [a + int(b) for a, b in zip(counts, c)]
        fin = x[torch.isfinite(x)]
        if fin.numel():
            m = float(fin.abs().max())
            biggest = m if math.isnan(biggest) else max(biggest, m)
    return counts, biggest


def _scalars(value: Any, depth: int = 0) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if depth < 3 and isinstance(value, (tuple, list)):
        return [x for v in value for x in _scalars(v, depth + 1)]
    if depth < 3 and isinstance(value, dict):
        return [x for v in value.values() for x in _scalars(v, depth + 1)]
    return []


def _describe(func: Any, args: tuple, kwargs: dict, outs: list,
              index: int) -> Optional[OpRecord]:
    out_counts, _ = _presence(outs)
    if not any(out_counts):
        return None
    inputs = [t for t in tensors_in((args, kwargs)) if _floating(t)]
    in_counts, in_absmax = _presence(inputs)
    consts = _scalars((args, kwargs))
    explicit = {"nan": any(math.isnan(c) for c in consts),
                "posinf": any(c == math.inf for c in consts),
                "neginf": any(c == -math.inf for c in consts)}
    created = [k for k, o, i in zip(_KINDS, out_counts, in_counts)
               if o and not i and not explicit[k]]
    if not created:
        return None  # the inputs (or an explicit inf constant) already held these values
    finite = [abs(c) for c in consts if math.isfinite(c)]
    name = getattr(func, "__name__", None) or str(func)
    return OpRecord(op=name.strip("_") or name, created=created,
                    dtype=str(outs[0].dtype).replace("torch.", ""),
                    counts=dict(zip(_KINDS, out_counts)),
                    numel=int(sum(t.numel() for t in outs)),
                    in_absmax=None if math.isnan(in_absmax) else in_absmax,
                    big_scalar=max(finite) if finite else None,
                    in_nan=bool(in_counts[0]), in_posinf=bool(in_counts[1]),
                    in_neginf=bool(in_counts[2]), index=index,
                    mask_operand=any(_mask_like(t) for t in inputs))


def _mask_like(t: torch.Tensor) -> bool:
    """An additive mask: every non-zero value one and the same negative constant (0 where a
    position is kept, -1e4 or -1e9 where it is masked). A dense activation is not."""
    x = t.detach()
    nonzero = x[x != 0]
    if not nonzero.numel():
        return False
    first = nonzero.reshape(-1)[0]
    return bool(first < 0) and bool((nonzero == first).all())


# ---------------------------------------------------------------------------------------------
# Sampled steps: overflows hidden inside a module

# Tensors measured per sampled step at most (two 0-dim device tensors each); a forward with
# more is probed up to there (what came before is still judged).
MAX_TENSORS = 1 << 16
# Findings kept per step: low-precision ones first, then in execution order.
MAX_HIDDEN = 4
_NAN, _POSINF, _NEGINF = 1, 2, 4  # the bits of a finding's ``created`` (as /stats nonfinite)
# Measurement indices that are not measurements: not known (an operand changed in place by
# the op, seen first there), and taken as finite (a parameter). -1 also indexes the extra
# finite entry at the end of ``_bits``' work array.
UNKNOWN, FINITE = -2, -1


@dataclass
class Call:
    """One call of a module inside the probed forward: its output's measurements."""

    module: torch.nn.Module
    name: str
    outputs: list = field(default_factory=list)  # measurement index per floating output
    done: bool = False  # its forward returned (the outputs are known)


@dataclass
class Hidden:
    """A module whose output stayed finite although an op inside it made inf/NaN."""

    module: torch.nn.Module
    name: str
    op: str  # "mul"
    inner: str  # the innermost module running the op (``name`` or one inside it)
    created: int  # _NAN | _POSINF | _NEGINF
    dtype: str  # of the op's result: "float16"
    index: int  # ops probed before it in the step
    ops: int = 1  # ops of the step that created a non-finite value inside this module


class StepProbe(TorchFunctionMode):
    """The sampled step's op probe (see the module docstring). One per recorder; ``reset``
    after each step's ``finish``.

    Example::

        probe = StepProbe()
        probe.open_call(model, "Net"); probe.enter(model, "Net")   # the root's pre-hooks
        ...forward: open_call / close_call around every module call...
        probe.close_call(model, output); probe.leave(model)  # the root's post-hook
        probe.finish()                                   # [Hidden(...)], one read per device
    """

    def __init__(self) -> None:
        super().__init__()
        self.busy = 0  # > 0 while ampdoctor's own hook code runs inside the forward
        self.inert = False  # left on a mode stack it could not be popped from: pass through
        # what stopped it, for good: the probe never lets a failure of its own reach the
        # forward it watches (the recorder says so at the step's end)
        self.error: Optional[BaseException] = None
        self._root: Optional[torch.nn.Module] = None  # the root that entered the mode
        self.reset()

    def reset(self) -> None:
        # per measurement: min and max on the tensor's device; or, for a view of a measured
        # tensor (a reshape, a transpose, a slice), the index of that measurement and None
        self._lo: list = []
        self._hi: list = []
        self._known: dict[tuple[int, int], tuple[weakref.ref, int]] = {}
        # per op: (func, calls open, first output measurement, outputs, inputs, explicit,
        # its first result's dtype)
        self._ops: list[tuple] = []
        self._stack: list[Call] = []
        self._open: tuple = ()
        self.full = False

    # -- the mode, entered and left by the root's hooks ---------------------------------------

    @property
    def active(self) -> bool:
        return self._root is not None

    def enter(self, root: torch.nn.Module, name: str) -> None:
        """The root's forward begins (its pre-hook, the last to run before it)."""
        if self._root is None and not self.inert:
            if not self._stack:  # (a root discovered in this very call: no pre-hook saw it)
                self.open_call(root, name)
            self.__enter__()
            self._root = root

    def leave(self, root: torch.nn.Module) -> None:
        """The root's forward returned (or raised): the mode is popped."""
        if self._root is root:
            self.abort()

    def abort(self) -> None:
        """Pop the mode if it is on top of the stack; otherwise (a mode pushed inside the
        forward and left there) it stays, inert, rather than pop someone else's."""
        if self._root is None:
            return
        self._root = None
        if _get_current_function_mode() is self:
            self.__exit__(None, None, None)
        else:
            self.inert = True

    # -- module calls (global module hooks) ----------------------------------------------------

    def open_call(self, module: torch.nn.Module, name: str) -> None:
        self._stack.append(Call(module, name))
        self._open = tuple(self._stack)

    def close_call(self, module: torch.nn.Module, output: Any) -> None:
        """A module call returned: its floating outputs are measured (most already were, as
        the result of its last op)."""
        if not any(c.module is module for c in self._stack):
            return  # (its call began before the hooks were in place)
        while self._stack[-1].module is not module:
            self._stack.pop()  # calls whose post-hook never came (an exception in between)
        call = self._stack.pop()
        self._open = tuple(self._stack)
        if not self.active or self.full or self.inert:
            return
        self.busy += 1
        try:
            call.outputs = [self._measured(t) for t in tensors_in(output) if _probed(t)]
            call.done = True
        except Exception as exc:  # noqa: BLE001 - see _failed
            self._failed(exc)
        finally:
            self.busy -= 1

    # -- every op ------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.busy or self.full or self.inert or not self._open or _compiling():
            return out  # (a region dynamo traces gets nothing of ours in its graph)
        try:
            self._record(func, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - see _failed
            self._failed(exc)
        return out

    def _failed(self, exc: BaseException) -> None:
        """Stop probing (the op's result goes back untouched); ``error`` says why."""
        self.error, self.inert = exc, True

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = [t for t in _results(out) if _probed(t)]
        if outs:
            operands = [t for t in _operands(args, kwargs) if _probed(t)]
            ins = [self._before(t, outs) for t in operands]
            first, measured = len(self._lo), False
            for t in outs:
                parent = _view_of(t, operands, ins, func)
                if parent is None:
                    self._measure(t)
                    measured = True
                else:
                    self._derive(t, parent)
            if measured:  # (a view of finite values is finite: it cannot make one)
                self._ops.append((func, self._open, first, len(outs), ins,
                                  _explicit(args, kwargs), outs[0].dtype))
            self.full = len(self._lo) >= MAX_TENSORS

    def _before(self, t: torch.Tensor, outs: list) -> int:
        """An operand's measurement from before the op. One the op changed in place (it is
        also its result) was measured at its previous version, if at all (else UNKNOWN)."""
        if not any(t is o for o in outs):
            return self._measured(t)
        hit = self._known.get((id(t), t._version - 1))
        return hit[1] if hit is not None and hit[0]() is t else UNKNOWN

    def _measured(self, t: torch.Tensor) -> int:
        """The measurement of ``t`` as it is now: the one made when an op returned it, else
        a new one (a buffer, the batch, a tensor changed in place). A parameter is taken as
        finite: a non-finite weight fails the run where the other tiers see it (its norm on
        this very step, a NaN loss), and measuring every weight would double the probe."""
        if isinstance(t, torch.nn.Parameter):
            return FINITE
        hit = self._known.get((id(t), t._version))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return self._measure(t)

    def _measure(self, t: torch.Tensor) -> int:
        lo, hi = torch.aminmax(t.detach())
        return self._add(t, lo, hi)

    def _derive(self, t: torch.Tensor, parent: int) -> int:
        """``t`` holds ``parent``'s values (a view, a copy): what it says, it says too (a
        view of part of a tensor holding inf may not: counted non-finite, never a creator)."""
        return self._add(t, parent, None)

    def _add(self, t: torch.Tensor, lo: Any, hi: Any) -> int:
        self._lo.append(lo)
        self._hi.append(hi)
        i = len(self._lo) - 1
        self._known[(id(t), t._version)] = (weakref.ref(t), i)
        return i

    # -- the step's end ------------------------------------------------------------------------

    def finish(self) -> list[Hidden]:
        """Read the measurements (one copy per device) and name the modules whose output
        stayed finite although an op inside them made inf/NaN from finite inputs."""
        read = HostRead()
        hidden = self.stage(read)
        read.run()
        return hidden()

    def stage(self, read: HostRead) -> Callable[[], list[Hidden]]:
        """``finish`` in two halves: the measurements queued in ``read`` (the sampled step's
        one copy per device, shared with its statistics), the ``Hidden`` from the returned
        function once ``read`` has run. Resets the probe now."""
        try:
            if not self._ops or self.error is not None:
                return list
            ops, host_bits = self._ops, self._bits(read)
        finally:
            self.reset()

        def hidden() -> list[Hidden]:
            bits = host_bits()
            found: dict[int, Hidden] = {}
            for index, (func, calls, first, n, ins, explicit, dtype) in enumerate(ops):
                made = int(np.bitwise_or.reduce(bits[first:first + n]))
                if not made or explicit or not ins or any(i == UNKNOWN or bits[i] for i in ins) \
                        or "empty" in _name(func):
                    continue  # finite; an inf the inputs or a constant brought; garbage
                call = _finite_owner(calls, bits)
                if call is None:
                    continue  # it reached the model's output: the other tiers see it
                key = id(call.module)
                if key in found:
                    found[key].ops += 1
                    continue
                found[key] = Hidden(call.module, call.name, _name(func), calls[-1].name, made,
                                    str(dtype).replace("torch.", ""), index)
            low = sorted(found.values(), key=lambda h: (h.dtype not in _LOW, h.index))
            return low[:MAX_HIDDEN]
        return hidden

    def _bits(self, read: HostRead) -> Callable[[], np.ndarray]:
        """Per measurement: _NAN | _POSINF | _NEGINF, from its min and max (queued in
        ``read``; the returned function gives them once it has run)."""
        measured = self._lo
        groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for i, t in enumerate(measured):
            if isinstance(t, torch.Tensor):
                groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
        queued = []
        for by_dtype in groups.values():
            members = [i for group in by_dtype.values() for i in group]
            both = torch.cat([torch.stack([torch.stack([measured[i] for i in group]),
                                           torch.stack([self._hi[i] for i in group])]).double()
                              for group in by_dtype.values()], dim=1)
            queued.append((members, read.add(both)))

        def bits() -> np.ndarray:
            lo = np.zeros(len(measured))
            hi = np.zeros(len(measured))
            for members, pending in queued:
                lo[members], hi[members] = pending.value[0], pending.value[1]
            nan = np.isnan(lo) | np.isnan(hi)
            lo, hi, nan = np.append(lo, 0.0), np.append(hi, 0.0), np.append(nan, False)  # FINITE
            out = (nan * _NAN | (hi == math.inf) * _POSINF | (lo == -math.inf) * _NEGINF
                   ).astype(np.int64)
            for i, parent in enumerate(measured):
                if not isinstance(parent, torch.Tensor):
                    out[i] = 0 if parent == FINITE else out[parent]  # (parents come first)
            return out  # (with the FINITE entry last)
        return bits


_LOW = ("float16", "bfloat16")
_compiling = torch.compiler.is_compiling


def _finite_owner(calls: tuple, bits: np.ndarray) -> Optional[Call]:
    """The innermost open call whose output came back finite."""
    for call in reversed(calls):
        if call.done and call.outputs and not any(i == UNKNOWN or bits[i] for i in
                                                  call.outputs):
            return call
    return None


# Copies of one operand's values, in its dtype.
_COPIES = ("contiguous", "clone", "detach")


def _view_of(t: torch.Tensor, operands: list, ins: list, func: Any) -> Optional[int]:
    """The measurement ``t`` takes its values from: an operand of the same dtype whose storage
    it shares (a view), or the one operand of a copy. None: ``t`` is new values."""
    for x, i in zip(operands, ins):
        if i == UNKNOWN or x is t or x.dtype != t.dtype:
            continue
        try:
            if x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                return i
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
            return None
    if len(ins) == 1 and ins[0] != UNKNOWN and operands[0].dtype == t.dtype and \
            _name(func) in _COPIES:
        return ins[0]
    return None


# Tensor types the probe measures: a subclass (a user's own, a quantised or wrapper type) may
# refuse aminmax or give it another meaning; the sampled tier says so once for its outputs.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _probed(t: Any) -> bool:
    """A plain dense floating tensor with values, not an inference tensor (an evaluation inside
    the step, with no version counter to key it by), in the order cheapest first: this runs
    on every op's every tensor. Not an fp8 (or fp4) one: one byte per element, no aminmax on a
    CPU (``aminmax_cpu`` not implemented for Float8_e4m3fn), and a saturating cast in front of
    it that makes no inf (torchao's Float8Linear: the probe sees its high-precision side)."""
    return type(t) in _PLAIN and t.is_floating_point() and t.layout is torch.strided and \
        not t.is_meta and t.dtype.itemsize > 1 and t.numel() > 0 and not t.is_inference()


def _results(out: Any) -> tuple:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(t for t in out if isinstance(t, torch.Tensor))
    return ()


def _operands(args: tuple, kwargs: dict) -> list:
    """Tensor operands, one level into lists (``torch.cat([a, b])``); never ``out=``."""
    found = []
    for a in list(args) + [v for k, v in kwargs.items() if k != "out"]:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            found += [t for t in a if isinstance(t, torch.Tensor)]
    return found


def _explicit(args: tuple, kwargs: dict) -> bool:
    """An inf or NaN passed as a Python number (``masked_fill(mask, float("-inf"))``): the
    non-finite value is the caller's, not an overflow."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, float) and not math.isfinite(a):
            return True
        if isinstance(a, (tuple, list)) and any(isinstance(x, float) and not math.isfinite(x)
                                                for x in a):
            return True
    return False


def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return name.strip("_") or name


