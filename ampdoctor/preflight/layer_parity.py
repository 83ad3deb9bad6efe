"""``ampdoctor.parity``: before switching a model to bf16 or fp16, which modules lose precision?

Each module is judged alone, so that errors do not pile up from one layer to the next:

1. **Reference pass** (fp32, autocast off): every module call is taped with its inputs and
   outputs (copies: an in-place op later cannot change them), the RNG state before and after
   it, and, with a ``loss_fn``, the gradients that reach its outputs and inputs in backward
   (``torch.autograd.grad``: ``.grad`` is never written).
2. **Autocast pass** (the whole model in ``dtype``): only the dtype of each call's inputs and
   outputs is kept, so that a module judged alone is given its inputs in the precision autocast
   really gives them (a norm after a Linear sees bf16; the residual stream stays fp32), and the
   whole model's output error is known.
3. **Each module alone**: its fp32 inputs, rounded to those dtypes, go through its own code
   under autocast while each child module it calls is replaced by the child's fp32 output
   (rounded the same way): what the module *produces* (its outputs, and the tensors it hands
   to its children) is the work of its own ops, and is compared with fp32. A container whose
   output is one of its children's (``Sequential``) is left out; it has nothing of its own.
   The cost is one forward of the model in all (each op runs once, in the module that owns
   it), twice with gradients (the fp32 and the low-precision backward of each module alone).

Dropout and other random ops see the RNG state they saw in the reference pass; BatchNorm
statistics and every RNG are restored afterwards, and ``.grad`` is never touched, so the
caller's model is unchanged. Python state a forward changes (a call counter) does change.

Example::

    r = ampdoctor.parity(model, x, torch.bfloat16)
    r = ampdoctor.parity(model, x, torch.float16, loss_fn=lambda out: F.cross_entropy(out, y))
    print(r); r.modules[0].name, r.modules[0].verdict, r.fixes
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from ..errors import AmpDoctorError
from ..record.forensic.isolated import rng_state, set_rng
from .parity_result import DTYPE_MAX, ModuleParity, ParityResult
from .snapshot import Snapshot

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16}
# fp16 gradients are compared at the loss scale a settled GradScaler would hold: the largest
# power of two that keeps the largest gradient at half of fp16's max, at most 2**24.
MAX_GRAD_SCALE = 2.0 ** 24


def parity(model: torch.nn.Module, batch: Any, dtype: Any = torch.bfloat16,
           loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> ParityResult:
    """Run ``batch`` through ``model`` in fp32 and under autocast in ``dtype``, module by
    module, and rank the modules by the precision they lose (see the module docstring).

    ``batch`` is what the model is called with: a tensor (``model(batch)``), a tuple or list
    (``model(*batch)``) or a dict (``model(**batch)``). ``loss_fn(output)`` returns a scalar
    loss; with it, gradients are compared too. The model's parameters must be fp32 (autocast
    keeps them so).
    """
    low = _dtype(dtype)
    model = _unwrap(model)
    device = _device(model)
    snap = Snapshot(model, params=False)  # buffers, train/eval flags, RNG
    try:
        tape = _reference(model, batch, loss_fn, device)
        amp_out, loss_low = _autocast_pass(model, batch, loss_fn, device, low, tape)
        scale = _grad_scale(tape, low) if tape.grads else None
        modules = _judge_all(tape, device, low, scale)
    finally:
        snap.restore()
    name = str(low).replace("torch.", "")
    rel, nonfinite = _output_error(tape.output, amp_out)
    return ParityResult(name, device.type, type(model).__name__, modules, rel, nonfinite,
                        tape.loss, loss_low, scale, _notes(model, tape, modules))


def _unwrap(model: Any) -> Any:
    """The user's model inside torch.compile, DDP or DataParallel: its module hooks fire in
    eager mode, and a wrapper's collectives would run on one process alone."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel",
                                                       "DataParallel"):
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def _dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str) and dtype.lower().replace("torch.", "") in DTYPES:
        return DTYPES[dtype.lower().replace("torch.", "")]
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    raise AmpDoctorError(f"parity compares fp32 with bfloat16 or float16, not {dtype}")


def _device(model: torch.nn.Module) -> torch.device:
    if not isinstance(model, torch.nn.Module):
        raise AmpDoctorError(f"parity needs a torch.nn.Module, not {type(model).__name__}")
    half = [n for n, p in model.named_parameters()
            if p.is_floating_point() and p.dtype != torch.float32]
    if half:
        raise AmpDoctorError(f"parity compares fp32 with autocast, but {half[0]} is "
                             f"{model.get_parameter(half[0]).dtype}: give it the fp32 model "
                             "(model.float())")
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _call(model: Callable, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


# ---------------------------------------------------------------------------------------------
# 1. the reference pass


@dataclass
class _Call:
    """One module call of the reference pass."""

    index: int
    module: torch.nn.Module
    name: str
    parent: Optional[int]
    spec: Any = None  # pytree spec of (args, kwargs)
    inputs: list = field(default_factory=list)  # leaves, tensors copied
    out_spec: Any = None
    outputs: list = field(default_factory=list)
    rng_pre: Any = None
    rng_post: Any = None
    children: list = field(default_factory=list)  # indices of the calls it made
    grad_in: dict = field(default_factory=dict)  # leaf position -> gradient (fp32)
    grad_out: dict = field(default_factory=dict)
    in_dtypes: Optional[list] = None  # per leaf, under autocast (None: not a float tensor)
    out_dtypes: Optional[list] = None


class _Tape:
    """Module hooks for the reference pass; ``calls`` in the order they began."""

    def __init__(self, model: torch.nn.Module, device: torch.device, grads: bool):
        self.device, self.grads = device, grads
        self.names = {m: n for n, m in model.named_modules()}
        self.calls: list[_Call] = []
        self.output: Any = None
        self.loss: Optional[float] = None
        self.param_gmax = 0.0  # largest parameter gradient (fp16's loss scale is set by it)
        self._stack: list[int] = []
        self._hooks: list = []
        for m in self.names:
            self._hooks.append(m.register_forward_pre_hook(self.pre, with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self.post, with_kwargs=True,
                                                       always_call=True))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        parent = self._stack[-1] if self._stack else None
        call = _Call(len(self.calls), module, self.names.get(module, ""), parent)
        leaves, call.spec = pytree.tree_flatten((args, kwargs))
        call.inputs = [_copy(t) for t in leaves]
        call.rng_pre = _rng(self.device)
        self._watch_grads(leaves, call.grad_in)
        if parent is not None:
            self.calls[parent].children.append(call.index)
        self.calls.append(call)
        self._stack.append(call.index)

    def post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call = self.calls[self._stack.pop()]
        leaves, call.out_spec = pytree.tree_flatten(output)
        call.outputs = [_copy(t) for t in leaves]
        call.rng_post = _rng(self.device, same_as=call.rng_pre)
        self._watch_grads(leaves, call.grad_out)

    def _watch_grads(self, leaves: list, into: dict) -> None:
        if not self.grads:
            return
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                def keep(g: torch.Tensor, i: int = i) -> None:
                    into[i] = g.detach().float().clone()
                self._hooks.append(t.register_hook(keep))


def _reference(model: torch.nn.Module, batch: Any, loss_fn: Optional[Callable],
               device: torch.device) -> _Tape:
    grads = loss_fn is not None and any(p.requires_grad for p in model.parameters())
    tape = _Tape(model, device, grads)
    try:
        with torch.autocast(device.type, enabled=False), torch.set_grad_enabled(grads):
            out = _call(model, batch)
            tape.output = pytree.tree_map(_copy, out)
            if loss_fn is not None:
                loss = _scalar(loss_fn(out))
                tape.loss = float(loss.detach())
                tape.grads = grads and loss.requires_grad
                if tape.grads:
                    params = [p for p in model.parameters() if p.requires_grad]
                    got = torch.autograd.grad(loss, params, allow_unused=True)  # not .grad
                    tape.param_gmax = max((float(g.abs().max()) for g in got
                                           if g is not None and g.numel()), default=0.0)
    finally:
        tape.remove()
    return tape


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise AmpDoctorError("loss_fn(output) must return a scalar tensor, not "
                             f"{type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}"
                                if isinstance(loss, torch.Tensor) else ""))
    return loss.reshape(())


# ---------------------------------------------------------------------------------------------
# 2. the autocast pass: what dtype each call's tensors really have


def _autocast_pass(model: torch.nn.Module, batch: Any, loss_fn: Optional[Callable],
                   device: torch.device, low: torch.dtype, tape: _Tape) -> tuple[Any, Any]:
    by_module: dict[int, list[_Call]] = {}
    for call in tape.calls:
        by_module.setdefault(id(call.module), []).append(call)
    seen: dict[int, int] = {}
    stack: list[Optional[_Call]] = []

    def pre(module, args, kwargs):
        k = seen.get(id(module), 0)
        seen[id(module)] = k + 1
        calls = by_module.get(id(module), [])
        call = calls[k] if k < len(calls) else None
        if call is not None:
            call.in_dtypes = _dtypes(pytree.tree_leaves((args, kwargs)))
        stack.append(call)

    def post(module, args, kwargs, output):
        call = stack.pop()
        if call is not None:
            call.out_dtypes = _dtypes(pytree.tree_leaves(output))

    hooks = []
    for m in tape.names:
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    _set_rng(device, tape.calls[0].rng_pre if tape.calls else None)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=low):
            out = _call(model, batch)
            loss = float(_scalar(loss_fn(out)).detach()) if loss_fn is not None else None
    finally:
        for h in hooks:
            h.remove()
    return pytree.tree_map(_copy, out), loss


def _dtypes(leaves: list) -> list:
    return [t.dtype if isinstance(t, torch.Tensor) and t.is_floating_point() else None
            for t in leaves]


# ---------------------------------------------------------------------------------------------
# 3. each module alone


@dataclass
class _Sums:
    """Error sums over the tensors a module produced (all its calls)."""

    numel: int = 0
    err2: float = 0.0
    ref2: float = 0.0
    absmax_ref: float = 0.0
    absmax_low: float = 0.0
    nonfinite: int = 0

    def add(self, low: torch.Tensor, ref: torch.Tensor) -> None:
        if low.shape != ref.shape or not ref.is_floating_point() or not ref.numel():
            return
        low, ref = low.detach().float(), ref.detach().float()
        diff = low - ref
        f64 = torch.float64
        # One host read per pair; the masked pass below only when something is inf/NaN.
        values = torch.stack([diff.square().sum(dtype=f64), ref.square().sum(dtype=f64),
                              ref.abs().amax().double(), low.abs().amax().double()]).tolist()
        bad = 0
        if not all(math.isfinite(v) for v in values):
            ok_ref, ok_low = torch.isfinite(ref), torch.isfinite(low)
            both = ok_ref & ok_low
            zero = torch.zeros((), device=ref.device)
            values = torch.stack([
                torch.where(both, diff, zero).square().sum(dtype=f64),
                torch.where(ok_ref, ref, zero).square().sum(dtype=f64),
                torch.where(ok_ref, ref.abs(), zero).amax().double(),
                torch.where(ok_low, low.abs(), zero).amax().double(),
                (ok_ref & ~ok_low).sum().double()]).tolist()
            bad = int(values[4])
        self.numel += ref.numel()
        self.err2 += values[0]
        self.ref2 += values[1]
        self.absmax_ref = max(self.absmax_ref, values[2])
        self.absmax_low = max(self.absmax_low, values[3])
        self.nonfinite += bad

    @property
    def rel_err(self) -> float:
        if self.ref2 > 0:
            return math.sqrt(self.err2 / self.ref2)
        return 0.0 if self.err2 == 0 else math.inf


def _judge_all(tape: _Tape, device: torch.device, low: torch.dtype,
               scale: Optional[float]) -> list[ModuleParity]:
    out: dict[str, tuple[_Call, _Sums, _Sums, int]] = {}
    for call in tape.calls:
        sums, gsums = _alone(tape, call, device, low, scale)
        key = call.name
        _, total, gtotal, n = out.get(key, (call, _Sums(), _Sums(), 0))
        for acc, part in ((total, sums), (gtotal, gsums)):
            acc.numel += part.numel
            acc.err2 += part.err2
            acc.ref2 += part.ref2
            acc.absmax_ref = max(acc.absmax_ref, part.absmax_ref)
            acc.absmax_low = max(acc.absmax_low, part.absmax_low)
            acc.nonfinite += part.nonfinite
        out[key] = (call, total, gtotal, n + 1)
    return [ModuleParity(name, type(call.module).__name__, n, s.numel, s.rel_err,
                         s.absmax_ref, s.absmax_low, s.nonfinite,
                         g.rel_err if g.numel else None, g.absmax_ref if g.numel else None,
                         g.nonfinite)
            for name, (call, s, g, n) in out.items() if s.numel]


def _alone(tape: _Tape, call: _Call, device: torch.device, low: torch.dtype,
           scale: Optional[float]) -> tuple[_Sums, _Sums]:
    """The module of ``call`` run alone in ``low``; with gradients, also in fp32 (the
    reference for its own backward)."""
    sums, gsums = _Sums(), _Sums()
    grads = tape.grads and bool(call.grad_out or any(tape.calls[c].grad_in
                                                     for c in call.children))
    run = _run_alone(tape, call, device, low, grads)
    for produced, ref in run.pairs:
        sums.add(produced, ref)
    if grads and scale is not None:
        ref_run = _run_alone(tape, call, device, None, True)
        low_grads = run.backward(scale)
        ref_grads = ref_run.backward(1.0)
        for g_low, g_ref in zip(low_grads, ref_grads):
            if g_low is not None and g_ref is not None:
                gsums.add(g_low.double() / scale, g_ref)
    return sums, gsums


class _Alone:
    """One judged-alone run: what the module produced, paired with fp32, and what its own
    backward needs (targets with their reference gradients, and what to differentiate)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.targets: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, grad)
        self.wrt: list[torch.Tensor] = []
        # Tensors the module did not make, with their version counter: its inputs as given,
        # and what its stubbed children returned. Handing them on (a container does only
        # that) is not judged; changing them in place (ReLU(inplace=True)) is. They are
        # kept alive here, so that no tensor the module makes can take a freed one's id.
        self.given: dict[int, tuple[torch.Tensor, int]] = {}

    def mine(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        kept = self.given.get(id(t))
        return kept is None or kept[0] is not t or kept[1] != t._version

    def hand(self, leaves: list, dtypes: list, wants: Callable[[int], bool]) -> list:
        """Fresh copies of taped leaves, rounded to ``dtypes``; those ``wants`` marks get an
        autograd leaf behind them (differentiated, in ``wrt``), and the copy handed on is a
        non-leaf, so that the module may change it in place as it did in the model."""
        out = []
        for i, (t, dtype) in enumerate(zip(leaves, dtypes)):
            if isinstance(t, torch.Tensor):
                t = t.to(dtype, copy=True) if dtype is not None and t.is_floating_point() \
                    else t.clone()
                if wants(i) and t.is_floating_point():
                    leaf = t.requires_grad_(True)
                    self.wrt.append(leaf)
                    t = leaf.clone()
                self.given[id(t)] = (t, t._version)
            out.append(t)
        return out

    def backward(self, scale: float) -> list[Optional[torch.Tensor]]:
        targets = [(t, g) for t, g in self.targets if t.requires_grad]
        if not targets or not self.wrt:
            return [None] * len(self.wrt)
        # sum <t, g>: its gradient is each g, as grad_outputs would pass it (cast to t's
        # dtype by the .float() backward), without the symbolic-shape machinery (and its
        # sympy import) that torch.autograd.grad loads for explicit grad_outputs
        surrogate = sum((t.float() * (g * scale)).sum() for t, g in targets)
        return list(torch.autograd.grad(surrogate, self.wrt, allow_unused=True))


def _run_alone(tape: _Tape, call: _Call, device: torch.device, low: Optional[torch.dtype],
               grads: bool) -> _Alone:
    run = _Alone()
    leaves = run.hand(call.inputs, _dtypes_for(call.in_dtypes, call.inputs, low),
                      lambda i: grads and i in call.grad_in)
    run.wrt += [p for p in call.module.parameters(recurse=False) if p.requires_grad] \
        if grads else []
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    _set_rng(device, call.rng_pre)
    with _stubbed(tape, call, low, grads, run), \
            torch.set_grad_enabled(grads), \
            torch.autocast(device.type, dtype=low or torch.bfloat16, enabled=low is not None):
        out = call.module(*args, **kwargs)
    for i, (t, ref) in enumerate(zip(pytree.tree_leaves(out), call.outputs)):
        if run.mine(t) and isinstance(ref, torch.Tensor):
            run.pairs.append((t, ref))
            if i in call.grad_out:
                run.targets.append((t, call.grad_out[i]))
    return run


@contextlib.contextmanager
def _stubbed(tape: _Tape, call: _Call, low: Optional[torch.dtype], grads: bool,
             run: _Alone) -> Iterator[None]:
    """While ``call``'s module runs alone, each child module it calls returns its fp32
    reference output (in the dtype autocast gave it), and the tensors the module hands it
    are kept to be compared with what the child got in the reference pass."""
    queues: dict[int, list[_Call]] = {}
    for c in call.children:
        queues.setdefault(id(tape.calls[c].module), []).append(tape.calls[c])
    saved: dict[int, tuple[torch.nn.Module, Any]] = {}

    def stub_for(module: torch.nn.Module, original: Callable) -> Callable:
        def stub(*args: Any, **kwargs: Any) -> Any:
            queue = queues[id(module)]
            if not queue:  # the module called it more often than in fp32: really run it
                return original(*args, **kwargs)
            child = queue.pop(0)
            for i, t in enumerate(pytree.tree_leaves((args, kwargs))):
                if run.mine(t) and i < len(child.inputs) and \
                        isinstance(child.inputs[i], torch.Tensor):
                    run.pairs.append((t, child.inputs[i]))
                    if i in child.grad_in:
                        run.targets.append((t, child.grad_in[i]))
            _set_rng(tape.device, child.rng_post)
            leaves = run.hand(child.outputs, _dtypes_for(child.out_dtypes, child.outputs, low),
                              lambda i: grads and i in child.grad_out)
            return pytree.tree_unflatten(leaves, child.out_spec)
        return stub

    for c in call.children:
        module = tape.calls[c].module
        if id(module) not in saved:
            saved[id(module)] = (module, module.__dict__.get("forward"))
            module.forward = stub_for(module, module.forward)
    try:
        yield
    finally:
        for module, before in saved.values():
            if before is None:
                del module.forward
            else:
                module.forward = before


def _dtypes_for(dtypes: Optional[list], leaves: list, low: Optional[torch.dtype]) -> list:
    """The dtypes autocast gave these leaves (fp32 in the fp32 run, or where the autocast
    pass took another path)."""
    if low is None or dtypes is None or len(dtypes) != len(leaves):
        return [None] * len(leaves)
    return dtypes


def _grad_scale(tape: _Tape, low: torch.dtype) -> float:
    """1 for bf16 (no loss scaling); for fp16, what a settled GradScaler would hold."""
    if low != torch.float16:
        return 1.0
    gmax = max((float(g.abs().max()) for c in tape.calls
                for g in list(c.grad_out.values()) + list(c.grad_in.values()) if g.numel()),
               default=tape.param_gmax)
    gmax = max(gmax, tape.param_gmax)
    if not gmax or not math.isfinite(gmax):
        return 2.0 ** 16
    return float(min(MAX_GRAD_SCALE, max(1.0, 2.0 ** math.floor(
        math.log2(DTYPE_MAX["float16"] / 2 / gmax)))))


def _output_error(ref: Any, low: Any) -> tuple[Optional[float], int]:
    s = _Sums()
    for a, b in zip(pytree.tree_leaves(low), pytree.tree_leaves(ref)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            s.add(a, b)
    return (s.rel_err, s.nonfinite) if s.numel else (None, 0)


def _notes(model: torch.nn.Module, tape: _Tape, modules: list[ModuleParity]) -> list[str]:
    notes = []
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training
           for m in model.modules()):
        notes.append("dropout is active (train mode): each module alone replays the masks of "
                     "the fp32 pass from its RNG state; model.eval() leaves dropout out")
    judged = {m.name for m in modules}
    skipped = sorted({c.name for c in tape.calls} - judged)
    if skipped:
        notes.append(f"left out, as they make no tensor of their own (containers such as "
                     f"Sequential hand on what their children make): {_names(skipped)}")
    return notes


def _names(names: list[str], most: int = 6) -> str:
    shown = [n or "(the model)" for n in names[:most]]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


# ---------------------------------------------------------------------------------------------
# tensors and RNG


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _rng(device: torch.device, same_as: Any = None) -> Any:
    state = rng_state([device] if device.type == "cuda" else [])
    if same_as is not None and all(torch.equal(v, same_as[k]) for k, v in state.items()):
        return same_as  # most modules draw nothing: share one copy
    return state


def _set_rng(device: torch.device, state: Any) -> None:
    if state is not None:
        set_rng(state)
