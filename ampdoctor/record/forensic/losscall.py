"""The loss as the training step computed it: a call of a torch loss function after the model
(``torch.nn.functional.cross_entropy`` and the others of ``LOSSES``, which the ``nn.*Loss``
modules call), held for the step so that a forensic replay can compute it again on the
replayed output, in the run's precision or in fp32, and read its targets.

**Capture: every step, references only, no host read.** ``patches.patch_losses`` sees each
call; while the forensic tier is armed, ``capture`` turns one that follows a root call (not
inside it: a loss the model computes itself is replayed with the model) into a ``LossCall``:

* an argument that is a root output, a view of one, or a dtype cast of either (``logits``,
  ``logits.view(-1, V)``, ``logits.float()``) is not held at all: a ``FromOutput`` says how to
  rebuild it from the replayed output (which output, the cast, the view's geometry); so is one
  made from an output by ops that only move elements, through a copy (``rearranged``: litgpt's
  chunks of ``logits[..., :-1, :].reshape(-1, V)``, which copies), as those ops to do again;
* an argument the training code computed from the outputs otherwise (a product of two
  outputs, as a contrastive loss's logits) is not held (``Derived``): a re-run cannot make it
  again, and starts its backward from the outputs;
* any other tensor argument (the targets, class weights, a mask) is held by reference while
  the step's held loss arguments stay under ``HELD_BYTES``, by weak reference beyond (a
  replay can use it only if the user's loop still holds it);
* the result, detached, and the gradient that reaches it in backward (a tensor hook that
  holds a dict and nothing else, removed with the step's other hooks).

Everything is dropped at the step's end with the capture. A loss written by hand (no torch
loss function) is not captured: the replay cannot recompute it and says so.

**On the event** (host reads allowed): ``LossCall.arguments`` gives the call's arguments for a
re-run, the replayed outputs put in; ``check_targets`` reads its targets (every one
``ignore_index``, class indices out of range, NaN/inf, probabilities outside [0, 1]).

Example (what ``forensics`` does after a root call)::

    call = losscall.capture("cross_entropy", F.cross_entropy, (logits, y), {}, loss,
                            [trace.outputs_of(cap)], budget, hooks)
    args, kwargs = call.arguments(replayed_outputs)      # logits rebuilt, y as held
    check_targets(call, args, kwargs)   # TargetsCheck(fn='cross_entropy', all_ignored=True, ...)
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from ...runfile.detail import TargetsCheck
from ..torchcompat import autocast_state

# The loss functions of torch.nn.functional seen through the door (``patches.patch_losses``).
LOSSES = ("cross_entropy", "nll_loss", "binary_cross_entropy",
          "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "smooth_l1_loss",
          "huber_loss", "kl_div", "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss",
          "multilabel_soft_margin_loss", "multilabel_margin_loss", "multi_margin_loss",
          "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss",
          "triplet_margin_loss", "ctc_loss")
CLASS_INDEX = ("cross_entropy", "nll_loss")  # targets are class indices (or probabilities)
PROBABILITY = ("binary_cross_entropy", "binary_cross_entropy_with_logits")
HELD_BYTES = 64 << 20  # loss arguments held by reference per step (targets, weights, masks)
EARLIER_CALLS = 8  # earlier root calls of the step whose outputs a loss argument may be


class Missing(Exception):
    """A loss argument a re-run needs is gone (held weakly and freed, or not rebuildable)."""


@dataclass(frozen=True)
class FromOutput:
    """A loss argument made from root output ``index``: itself, ``cast`` to (dtype, device),
    then viewed as ``view`` = (size, stride, storage offset) of a tensor laid out as
    ``base`` = (stride, storage offset). ``back``: of the root call the loss follows (0), or
    of the one ``back`` calls before it in the step (a discriminator's output on real data,
    then its output on fakes, then the loss of both)."""

    index: int
    cast: Optional[tuple] = None
    view: Optional[tuple] = None
    base: tuple = ()
    back: int = 0
    # ops that only move elements, done again in order on the output (``rearranged``), and
    # the shape they end at: a copy of a view, as ``logits[:, :-1].reshape(-1, V)`` makes
    path: tuple = ()
    shape: tuple = ()

    def rebuild(self, outputs: list) -> torch.Tensor:
        t = outputs[self.index] if self.index < len(outputs) else None
        if not isinstance(t, torch.Tensor):
            raise Missing(f"the model's output {self.index} is not a tensor in the replay")
        if self.cast is not None:
            t = t.to(dtype=self.cast[0], device=self.cast[1])
        if self.path:
            try:
                for step in self.path:
                    t = _redo(t, step)
            except (RuntimeError, IndexError, ValueError) as exc:
                raise Missing(f"the replayed output could not be rearranged as the real one "
                              f"was ({exc})") from exc
            if tuple(t.shape) != self.shape:
                raise Missing("the replayed output rearranged as the real one was has shape "
                              f"{list(t.shape)}, not {list(self.shape)}")
        if self.view is not None:
            if (tuple(t.stride()), t.storage_offset()) != self.base:
                raise Missing("the replayed output is laid out differently from the real one")
            t = t.as_strided(*self.view)
        return t


@dataclass(frozen=True)
class Weak:
    """A loss argument held by weak reference (over ``HELD_BYTES``)."""

    ref: Any

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is None:
            raise Missing("a loss argument over the held budget was freed before the event")
        return t


@dataclass(eq=False)
class LossCall:
    """One call of a torch loss function in the real step, as ``capture`` holds it."""

    name: str  # "cross_entropy"
    fn: Callable  # the original torch function (never the patched one)
    args: tuple = field(repr=False)  # tensors as held: a tensor, a FromOutput or a Weak
    kwargs: dict = field(repr=False)
    autocast: tuple = field(repr=False)  # (device_type, enabled, dtype, cache) at the call
    value: torch.Tensor = field(repr=False)  # its result, detached
    grads: dict = field(default_factory=dict, repr=False)  # {0: gradient that reached it}

    def arguments(self, outputs: list, earlier: Sequence[list] = ()) -> tuple[tuple, dict]:
        """The call's arguments for a re-run, ``outputs`` (the replayed root outputs) put in
        for what came from the model, ``earlier`` (the step's earlier calls' replayed outputs,
        the latest first) for what came from those. Raises ``Missing``."""
        return (tuple(_get(a, outputs, earlier) for a in self.args),
                {k: _get(v, outputs, earlier) for k, v in self.kwargs.items()})

    def calls_used(self) -> set[int]:
        """Which root calls' outputs it takes, counted back from the one it follows (0)."""
        return {a.back for a in list(self.args) + list(self.kwargs.values())
                if isinstance(a, FromOutput)}

    def held(self) -> list[tuple[str, torch.Tensor]]:
        """(label, tensor) of the arguments held by reference (the targets, mostly)."""
        named = [(f"args.{i}", a) for i, a in enumerate(self.args)]
        named += [(f"kwargs.{k}", v) for k, v in self.kwargs.items()]
        return [(label, t) for label, t in named if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class Derived:
    """A loss argument computed from the model's outputs by ops other than a view or a cast
    (open_clip's ``logit_scale * image_features @ text_features.T``): not held (it carries
    the real step's graph, freed by its backward), and not rebuilt: the replay cannot repeat
    the code that made it, so a re-run starts its backward from the model's outputs."""

    shape: tuple

    def get(self) -> torch.Tensor:
        raise Missing(f"a loss argument (shape {list(self.shape)}) was computed from the "
                      "model's outputs by the training code, which the replay cannot repeat")


def _get(value: Any, outputs: list, earlier: Sequence[list]) -> Any:
    if isinstance(value, FromOutput):
        if not value.back:
            return value.rebuild(outputs)
        if value.back > len(earlier):
            raise Missing("a loss argument is an earlier model call's output, which this "
                          "re-run of one call does not make")
        return value.rebuild(earlier[value.back - 1])
    if isinstance(value, (Weak, Derived)):
        return value.get()
    return value


def capture(name: str, fn: Callable, args: tuple, kwargs: dict, out: Any, calls: list,
            budget: list, hooks: list) -> Optional[LossCall]:
    """A ``LossCall`` of this call (None when its result is not a loss with a graph).
    ``calls``: the outputs of the root call the loss follows, then of the step's earlier root
    calls, the latest first (``trace.outputs_of``: a freed output stands in by its node);
    ``budget``: [bytes left to hold this step]; ``hooks``: where the gradient hook's handle
    goes (removed at the step's end). Python only: no host read, nothing copied."""
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return None
    alive = calls[:EARLIER_CALLS + 1]
    device = out.device.type
    enabled, dtype = autocast_state(device)
    call = LossCall(name, fn, tuple(_hold(a, alive, budget) for a in args),
                    {k: _hold(v, alive, budget) for k, v in kwargs.items()},
                    (device, enabled, dtype, torch.is_autocast_cache_enabled()), out.detach())
    # The hook holds the dict and nothing else (a reference to ``out`` from its own hook would
    # be a cycle through autograd's C++ hook table that Python's collector cannot see).
    hooks.append(out.register_hook(partial(_keep_grad, call.grads)))
    return call


def _keep_grad(grads: dict, grad: Optional[torch.Tensor]) -> None:
    if grad is None:
        return
    grad = grad.detach()
    grads[0] = grad if 0 not in grads else grads[0] + grad


def _hold(value: Any, calls: list, budget: list) -> Any:
    """``calls``: each root call's outputs, the one the loss follows first."""
    if not isinstance(value, torch.Tensor):
        return value
    for back, outputs in enumerate(calls):
        made = relation(value, outputs)
        if made is not None:
            return replace(made, back=back) if back else made
    if value.grad_fn is not None:
        return Derived(tuple(value.shape))
    nbytes = value.numel() * value.element_size()
    if nbytes <= budget[0]:
        budget[0] -= nbytes
        return value
    return Weak(weakref.ref(value))


def relation(t: torch.Tensor, outputs: list) -> Optional[FromOutput]:
    """How ``t`` was made from one of the root call's ``outputs``, if it was: the output
    itself, a view of it (or of what it views), a cast of it, or a view of such a cast.
    Reads only Python-side metadata (identity, autograd nodes, strides)."""
    for i, o in enumerate(outputs):
        if t is o:
            return FromOutput(i)
    base = t._base
    if base is not None:
        for i, o in enumerate(outputs):
            if isinstance(o, torch.Tensor) and (base is o or (o._base is not None
                                                              and base is o._base)):
                return FromOutput(i, view=_geometry(t), base=_layout(o))
    cast = base if base is not None else t
    fn = cast.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return rearranged(t, outputs)
    source, nr = fn.next_functions[0]
    for i, o in enumerate(outputs):  # o: a tensor, or a freed one's stand-in (its node)
        if getattr(o, "grad_fn", None) is not None and source is o.grad_fn \
                and o.output_nr == nr and o.shape == cast.shape:
            view = _geometry(t) if cast is not t else None
            return FromOutput(i, cast=(cast.dtype, cast.device), view=view,
                              base=_layout(cast) if view else ())
    return rearranged(t, outputs)


def rearranged(t: torch.Tensor, outputs: list) -> Optional[FromOutput]:
    """``t`` made from an output by ops that only move elements, through copies (litgpt's
    ``logits[..., :-1, :].reshape(-1, V).split(128)``: the slice is not contiguous over the
    batch, so the reshape copies, and each chunk is a view of that copy, not of the output),
    as the ops to do again: read from the autograd nodes back from ``t`` to an output's
    (``_REDO``), each one's shape from the node after it. None where a node on the way does
    arithmetic, or its shape is not known. Python only: node attributes, no tensor read."""
    node: Any = t.grad_fn
    nr = t.output_nr
    shape = tuple(t.shape)
    dtype: Optional[torch.dtype] = t.dtype
    path: list = []
    for _ in range(PATH_STEPS):
        if node is None:
            return None
        for i, o in enumerate(outputs):
            if path and getattr(o, "grad_fn", None) is node and o.output_nr == nr and \
                    tuple(o.shape) == shape:
                return FromOutput(i, path=tuple(reversed(path)), shape=tuple(t.shape))
        kind = type(node).__name__
        if kind == "ToCopyBackward0":  # a cast: to the dtype after it, known once only
            if dtype is None:
                return None
            step, shape_in, dtype = ("to", dtype), shape, None
        elif kind in _REDO:
            try:
                step, shape_in = _REDO[kind](node, nr, shape)
            except (AttributeError, IndexError, TypeError, ValueError):
                return None
        else:
            return None
        if shape_in is None or not node.next_functions:
            return None
        path.append(step)
        shape = shape_in
        node, nr = node.next_functions[0]
    return None


PATH_STEPS = 12  # nodes walked back from a loss argument to an output, at most


def _int(v: Any) -> int:
    """A saved SymInt as read (``end=-1`` of ``[:-1]`` reads as 2**64 - 1)."""
    v = int(v)
    return v - (1 << 64) if v >= 1 << 63 else v


def _sizes(node: Any) -> tuple:
    return tuple(_int(x) for x in node._saved_self_sym_sizes)


def _reshape_of(node: Any, nr: int, shape: tuple) -> tuple:
    return ("reshape", shape), _sizes(node)


def _unsqueeze_of(node: Any, nr: int, shape: tuple) -> tuple:
    d = _int(node._saved_dim) % len(shape)
    return ("reshape", shape), shape[:d] + shape[d + 1:]


def _transpose_of(node: Any, nr: int, shape: tuple) -> tuple:
    a, b = _int(node._saved_dim0) % len(shape), _int(node._saved_dim1) % len(shape)
    before = list(shape)
    before[a], before[b] = shape[b], shape[a]
    return ("transpose", a, b), tuple(before)


def _permute_of(node: Any, nr: int, shape: tuple) -> tuple:
    dims = tuple(_int(d) % len(shape) for d in node._saved_dims)
    before = [0] * len(shape)
    for j, d in enumerate(dims):
        before[d] = shape[j]
    return ("permute", dims), tuple(before)


_REDO: dict = {
    # node -> (the forward op, the shape before it), given its output nr and the shape after
    "CloneBackward0": lambda node, nr, shape: (("clone",), shape),
    "AliasBackward0": lambda node, nr, shape: (("clone",), shape),
    "ViewBackward0": _reshape_of, "UnsafeViewBackward0": _reshape_of,
    "ReshapeAliasBackward0": _reshape_of, "SqueezeBackward0": _reshape_of,
    "SqueezeBackward1": _reshape_of, "SqueezeBackward2": _reshape_of,
    "UnsqueezeBackward0": _unsqueeze_of,
    "ExpandBackward0": lambda node, nr, shape: (("expand", shape), _sizes(node)),
    "TransposeBackward0": _transpose_of,
    "TBackward0": lambda node, nr, shape: (("transpose", 0, 1), tuple(reversed(shape))),
    "PermuteBackward0": _permute_of,
    "SliceBackward0": lambda node, nr, shape: (
        ("slice", _int(node._saved_dim), _int(node._saved_start), _int(node._saved_end),
         _int(node._saved_step)), _sizes(node)),
    "SelectBackward0": lambda node, nr, shape: (
        ("select", _int(node._saved_dim), _int(node._saved_index)), _sizes(node)),
    "SplitBackward0": lambda node, nr, shape: (
        ("split", _int(node._saved_split_size), _int(node._saved_dim), nr), _sizes(node)),
    "SplitWithSizesBackward0": lambda node, nr, shape: (
        ("split", [_int(x) for x in node._saved_split_sizes], _int(node._saved_dim), nr),
        _sizes(node)),
    # not a move, but a function of the output alone along one dim, in the dtype it returned
    # (autocast runs it in fp32): ``ctc(logits.log_softmax(-1).transpose(0, 1), ...)``
    "LogSoftmaxBackward0": lambda node, nr, shape: (
        ("log_softmax", _int(node._saved_dim), node._saved_result.dtype), shape),
    "SoftmaxBackward0": lambda node, nr, shape: (
        ("softmax", _int(node._saved_dim), node._saved_result.dtype), shape),
}


def _redo(t: torch.Tensor, step: tuple) -> torch.Tensor:
    """One op of a ``FromOutput.path`` on the replayed tensor."""
    kind, *a = step
    if kind == "to":
        return t.to(a[0])
    if kind == "clone":
        return t.clone()
    if kind == "reshape":
        return t.reshape(a[0])
    if kind == "expand":
        return t.expand(a[0])
    if kind == "transpose":
        return t.transpose(a[0], a[1])
    if kind == "permute":
        return t.permute(a[0])
    if kind == "slice":
        return torch.ops.aten.slice.Tensor(t, *a)
    if kind == "select":
        return t.select(a[0], a[1])
    if kind == "split":
        return t.split(a[0], a[1])[a[2]]
    if kind == "log_softmax":
        return t.log_softmax(a[0], dtype=a[1])
    if kind == "softmax":
        return t.softmax(a[0], dtype=a[1])
    raise ValueError(f"no op {kind!r}")


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.stride()), t.storage_offset()


# ---------------------------------------------------------------------------------------------
# on the event: the targets


def bound(call: LossCall, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by parameter name, defaults filled in ({} if they do not bind)."""
    try:
        b = inspect.signature(call.fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    b.apply_defaults()
    return dict(b.arguments)


def check_targets(call: LossCall, args: tuple, kwargs: dict) -> Optional[TargetsCheck]:
    """What the targets of a loss call hold (event only: host reads), with ``problem``: one
    sentence on what makes the loss non-finite whatever the precision, or None."""
    a = bound(call, args, kwargs)
    if call.name == "ctc_loss":
        return _ctc_targets(call, a)
    target, inp = a.get("target"), a.get("input")
    if not isinstance(target, torch.Tensor) or not target.numel():
        return None
    t = target.detach()
    out = TargetsCheck(fn=call.name, numel=int(t.numel()),
                       dtype=str(t.dtype).replace("torch.", ""))
    n = out.numel
    if call.name in CLASS_INDEX and not t.is_floating_point():
        return _class_targets(out, t, inp, a)
    if not t.is_floating_point():
        return out
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        return replace(out, nonfinite=bad, problem=f"{bad} of the {n} targets are NaN/inf")
    if not (call.name in PROBABILITY or (call.name == "kl_div" and not a.get("log_target"))):
        return replace(out, nonfinite=bad)
    high = 1.0 if call.name in PROBABILITY else None
    outside = int(((t < 0.0) | (t > high)).sum()) if high is not None else int((t < 0.0).sum())
    problem = (f"{outside} of the {n} targets of {call.name} lie "
               + ("outside [0, 1]" if high is not None else "below 0")) if outside else None
    return replace(out, nonfinite=bad, outside=outside, problem=problem)


def _class_targets(out: TargetsCheck, t: torch.Tensor, inp: Any, a: dict) -> TargetsCheck:
    """Class-index targets: how many are ignore_index, how many out of range."""
    ignore = a.get("ignore_index", -100)
    ignore = int(ignore) if isinstance(ignore, int) else -100
    ignored = int((t == ignore).sum())
    reduction = a.get("reduction", "mean")
    n, problem = out.numel, None
    classes = wrong = None
    if isinstance(inp, torch.Tensor) and inp.ndim:
        classes = int(inp.shape[0] if inp.ndim == 1 else inp.shape[1])
        wrong = int(((t != ignore) & ((t < 0) | (t >= classes))).sum())
        if wrong:
            problem = (f"{wrong} of the {n} targets are outside 0..{classes - 1} "
                       "(the number of classes) and not ignore_index")
    if ignored == n and reduction == "mean":
        problem = (f"every one of the {n} targets is ignore_index ({ignore}): "
                   "the mean over no targets is 0/0 = NaN")
    return replace(out, problem=problem, ignore_index=ignore, ignored=ignored,
                   reduction=reduction, classes=classes, out_of_range=wrong,
                   all_ignored=ignored == n)


def _ctc_targets(call: LossCall, a: dict) -> Optional[TargetsCheck]:
    """CTC's targets: a label sequence of L labels with r adjacent repeats needs L + r frames
    (a blank between repeats); one that needs more than its input has cannot be aligned, and
    its loss is +inf in any precision (unless ``zero_infinity``)."""
    t, lengths, frames = a.get("targets"), a.get("target_lengths"), a.get("input_lengths")
    if not isinstance(t, torch.Tensor) or not isinstance(lengths, torch.Tensor) or \
            not isinstance(frames, torch.Tensor) or t.is_floating_point():
        return None
    lengths, frames = lengths.detach().long().reshape(-1), frames.detach().long().reshape(-1)
    t = t.detach().long()
    out = TargetsCheck(fn=call.name, numel=int(t.numel()), dtype=str(t.dtype).replace("torch.", ""))
    if lengths.numel() != frames.numel():
        return out
    rows = [t[i, :int(n)] for i, n in enumerate(lengths)] if t.ndim == 2 else \
        list(t.reshape(-1).split([int(n) for n in lengths]))
    needed = torch.tensor([int(r.numel()) + int((r[1:] == r[:-1]).sum()) for r in rows])
    short = int((needed > frames).sum())
    if not short or a.get("zero_infinity"):
        return replace(out, unalignable=short)
    worst = int(torch.argmax(needed - frames))
    return replace(out, unalignable=short, problem=(
        f"{short} of the {len(rows)} label sequences cannot be aligned to their input: one "
        f"needs {int(needed[worst])} frames (its labels and a blank between repeats) where the "
        f"input has {int(frames[worst])}, so CTC's loss is +inf"))
