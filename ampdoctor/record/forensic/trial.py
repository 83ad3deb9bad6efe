"""Re-run a saved step with a change applied, and say whether it comes out finite.

A ``Trial`` names the change; ``rerun(capture, trial, names)`` re-runs one captured
micro-batch under it (``rerun_step`` every micro-batch of a step) and returns an ``Outcome``:

1. the root's forward, from the captured RNG state, in the captured autocast state or the
   trial's (``autocast``: another dtype, or off), with autocast off and fp32 inputs around
   the named modules (``fp32_modules``: an fp32 island; a module whose parameters are half
   runs on fp32 casts of them, through which gradients still reach the real ones);
2. the loss, recomputed from the replayed output by each torch loss function the real step
   called after the model (``losscall``), in the precision it ran in or in fp32
   (``loss_fp32``: inputs ``.float()``, autocast off);
3. the backward, with ``torch.autograd.grad`` (``.grad`` is never written): from each
   recomputed loss with the gradient that reached it in the real step (the loss scale and any
   weight or 1/accumulation factor included; ``scale`` replaces the loss scale; where that
   gradient is the scale overflowing a half loss, the scale itself), or, when no loss could
   be recomputed, from the gradient that reached the root's outputs.

``Outcome.finite`` is True when the outputs, the recomputed loss and every parameter gradient
are finite; ``first`` says where it first was not ("forward", "loss", "backward").

The caller owns the observer-effect guarantee, as for a replay: ``Forensics.trial`` and
``Forensics.rerun`` fork the RNG, restore module buffers and mark the recorder as replaying.

Example::

    rec.forensics.rerun(12)                                       # as the step ran
    rec.forensics.rerun(12, Trial("island", fp32_modules=("blocks.3.attn",)))
    rec.forensics.rerun(12, Trial("bf16", autocast="bfloat16", scale=1.0))
    # Outcome(trial='bf16', finite=True, first='', loss=2.31, grads='finite', ...)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ...runfile.detail import TrialOutcome
from .. import stats
from ..sampler import tensors_in
from ..torchcompat import autocast_state
from .isolated import set_rng
from .losscall import Missing, bound, relation
from .trace import Capture, autocast, outputs_of, reaches, root_name, unwrap


@dataclass(frozen=True)
class Trial:
    """A change applied to a re-run of the saved step (the default changes nothing)."""

    name: str = "as recorded"
    autocast: Optional[str] = None  # None: as recorded; "float16", "bfloat16", or "off"
    fp32_modules: tuple = ()  # names of modules run with autocast off, on fp32 inputs
    loss_fp32: bool = False  # the torch loss functions recomputed in fp32
    scale: Optional[float] = None  # the loss scale of the backward (None: as recorded)


AS_RECORDED = Trial()
LOSS_FP32 = Trial("loss in fp32", loss_fp32=True)


# What one re-run under a trial gave: declared with the run file it goes into.
Outcome = TrialOutcome


def rerun(cap: Capture, t: Trial, names: dict) -> Outcome:
    """Re-run one captured micro-batch under ``t`` (see the module docstring). ``names``:
    the recorder's module -> name map (for ``fp32_modules``)."""
    return rerun_grads(cap, t, names)[0]


def rerun_grads(cap: Capture, t: Trial, names: dict, pairs_out: Optional[list] = None
                ) -> tuple[Outcome, list]:
    """``rerun``, and the gradient of each of the root's parameters that require grad, in
    ``parameters()`` order (None: unused; [] where no backward ran): what a trial that
    measures the change, not only its finiteness, compares (``fp8trial``). ``pairs_out``,
    where given, receives the (tensor, gradient) pairs the backward ran from (detached)."""
    root = unwrap(cap.root)
    out = Outcome(t.name)
    outs = forward(cap, t, names)
    out.output_finite = _finite(outs)
    losses = _losses(cap, outs, t, out)
    pairs = _backward_pairs(cap, outs, losses, t, out)
    if pairs_out is not None:
        pairs_out += [(x.detach(), g.detach()) for x, g in pairs]
    params = [p for p in root.parameters() if p.requires_grad]
    grads: Sequence = []
    if pairs and params:
        grads = torch.autograd.grad([x for x, _ in pairs], params, [g for _, g in pairs],
                                    allow_unused=True)
        out.grads = _grad_state([g for g in grads if g is not None])
    elif not params:
        out.note = (out.note + " " if out.note else "") + "no parameter requires grad"
    out.first = "forward" if not out.output_finite else "loss" if out.loss_finite is False \
        else "backward" if out.grads == "non-finite" else ""
    out.finite = out.first == ""
    return out, list(grads)


def forward(cap: Capture, t: Trial, names: dict, args: Optional[tuple] = None,
            kwargs: Optional[dict] = None) -> list:
    """The root's forward of one captured micro-batch under ``t``, from its RNG state: the
    output tensors, in the graph (the caller owns the replay's guarantees, as for ``rerun``).
    ``args``/``kwargs``: in place of the captured ones (a chained re-run's)."""
    set_rng(cap.rng)
    with torch.enable_grad(), torch.autograd.set_detect_anomaly(False), \
            _islands(names, t.fp32_modules, cap.autocast[0]), \
            autocast(_forward_state(cap.autocast, t)):
        output = unwrap(cap.root)(*(cap.args if args is None else args),
                                  **(cap.kwargs if kwargs is None else kwargs))
    return list(tensors_in(output))


def rerun_step(captures: list, t: Trial, names: dict) -> Outcome:
    """Every micro-batch of a step under ``t``: finite when each one is; the loss summed;
    ``micro`` the first one that was not finite (-1: none). Gradients are judged per
    micro-batch (a sum that overflows a half ``.grad`` is not re-run here). A step of
    several models is re-run as one chain (``rerun_chain``)."""
    if len({id(unwrap(c.root)) for c in captures}) > 1:
        return rerun_chain(captures, t, names)
    total = Outcome(t.name, finite=True)
    losses: list = []
    for micro, cap in enumerate(captures):
        one = rerun(cap, t, names)
        if one.loss is not None:
            losses.append(one.loss)
        _merge(total, one)
        if total.micro < 0 and not one.finite:
            total.micro, total.first, total.finite = micro, one.first, False
            total.output_finite, total.loss_finite, total.grads = (
                one.output_finite, one.loss_finite, one.grads)
        elif total.finite:
            total.output_finite, total.loss_finite, total.grads = (
                one.output_finite, one.loss_finite, one.grads)
        total.backward_from = total.backward_from or one.backward_from
    total.loss = sum(losses) if losses else None
    return total


def _merge(total: Outcome, one: Outcome) -> None:
    """One call's loss functions, loss dtype and notes into a step's outcome."""
    total.loss_fns += [n for n in dict.fromkeys(one.loss_fns) if n not in total.loss_fns]
    total.loss_dtype = total.loss_dtype or one.loss_dtype
    total.note = total.note or one.note
    total.unjudged = total.unjudged or one.unjudged


def rerun_chain(captures: list, t: Trial, names: dict) -> Outcome:
    """A step of several models (a generator feeding a discriminator; a frozen extractor
    feeding a Gram matrix) under ``t``, as one chain:

    1. every call's forward in order; a later call's input that is an earlier call's output
       (or a view or cast of one) is taken from that call's re-run, so the change reaches it;
       any other input with a graph (the generator's samples, shifted and scaled by the
       training code, which cannot be run again) is taken as recorded, detached, and the
       model that made it is judged on its forward only (said in ``note``);
    2. each torch loss function recomputed from whichever calls' outputs it took;
    3. one backward from the recomputed losses, and from the recorded output gradient of each
       call whose output went neither into a loss recomputed nor into a later call, to every
       model's parameters and the trained tensors given as inputs (a style-transfer image).

    ``micro`` is the first call that was not finite."""
    total = Outcome(t.name)
    outs: list[list] = []
    fed: dict[int, str] = {}  # earlier call -> "rebuilt" or "cut" (its output fed a later one)
    for micro, cap in enumerate(captures):
        args, kwargs = _chained_inputs(cap, captures[:micro], outs, fed)
        outs.append(forward(cap, t, names, args, kwargs))
        if not _finite(outs[-1]):
            total.micro, total.first, total.output_finite = micro, "forward", False
            return total
    total.output_finite = True
    pairs: list = []
    used: set[int] = set()
    values: list = []
    for micro, cap in enumerate(captures):
        one = Outcome(t.name)
        losses = _losses(cap, outs[micro], t, one, outs[:micro][::-1])
        values += [v for _, v in losses]
        _merge(total, one)
        used |= {micro - back for call, _ in losses for back in call.calls_used()}
        pairs += _loss_pairs(cap, losses, t, total)
    for micro, cap in enumerate(captures):
        if micro not in used and micro not in fed:
            pairs += _output_pairs(cap, outs[micro], t)
    if values:
        total.loss_finite = _finite(values)
        total.loss = float(sum(float(v.detach().float().sum()) for v in values))
    cut = sorted({root_name(names, captures[i].root) for i, how in fed.items() if how == "cut"})
    if cut:
        total.note = total.note + " " if total.note else ""
        total.note += (f"the training code computed the next model's input from {', '.join(cut)}"
                      "'s output: not re-run, so its backward is not judged, its forward is")
    wrt = _trained(captures)
    if pairs and wrt:
        grads = torch.autograd.grad([x for x, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True)
        total.grads = _grad_state([g for g in grads if g is not None])
    total.backward_from = "loss" if values else "output" if pairs else ""
    total.first = "loss" if total.loss_finite is False else \
        "backward" if total.grads == "non-finite" else ""
    total.finite = total.first == ""
    return total


def _chained_inputs(cap: Capture, earlier: list, outs: list, fed: dict) -> tuple[tuple, dict]:
    """``cap``'s arguments for a chained re-run (``rerun_chain``): an earlier call's output
    (or a view or cast of one) from that call's re-run, any other tensor with a graph
    detached; ``fed`` notes which earlier calls fed this one, and how."""
    alive = [outputs_of(c) for c in earlier]

    def swap(x: torch.Tensor) -> torch.Tensor:
        if x.grad_fn is None:
            return x
        for i in reversed(range(len(earlier))):
            made = relation(x, alive[i])
            if made is not None:
                fed.setdefault(i, "rebuilt")
                return made.rebuild(outs[i])
        for i in reversed(range(len(earlier))):
            if reaches(x, earlier[i].output_nodes):
                fed[i] = "cut"
        return x.detach()

    return _map(cap.args, swap), _map(cap.kwargs, swap)


def _map(value: Any, fn: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_map(v, fn, depth + 1) for v in value)
    if depth < 4 and type(value) is dict:
        return {k: _map(v, fn, depth + 1) for k, v in value.items()}
    return value


def _trained(captures: list) -> list:
    """Every re-run model's parameters that require grad, and the leaf inputs that do (a
    trained image or embedding), each once."""
    out: dict[int, torch.Tensor] = {}
    for cap in captures:
        for p in unwrap(cap.root).parameters():
            if p.requires_grad:
                out.setdefault(id(p), p)
        for x in tensors_in((cap.args, cap.kwargs)):
            if x.requires_grad and x.is_leaf:
                out.setdefault(id(x), x)
    return list(out.values())


# ---------------------------------------------------------------------------------------------
# the forward


def _forward_state(recorded: tuple, t: Trial) -> tuple:
    device, enabled, dtype, cache = recorded
    if t.autocast is None:
        return recorded
    if t.autocast == "off":
        return device, False, dtype, cache
    # No cast cache: an event decided inside the next step's autocast block (or after the
    # replay's own forward) would otherwise hand this dtype the weights cast to the other.
    return device, True, t.autocast, False


@contextlib.contextmanager
def _islands(names: dict, wanted: tuple, device: str) -> Iterator[None]:
    """Autocast off and fp32 inputs inside each module named in ``wanted`` for the re-run's
    forward; a half module runs on fp32 casts of its parameters and buffers (the real ones are
    put back after it; the gradient reaches them through the casts)."""
    by_name = {n: m for m, n in names.items()}
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise KeyError(f"no module named {', '.join(missing)} in the recorded model")
    handles, swapped = [], []
    try:
        for name in wanted:
            module = by_name[name]
            swapped += _cast_state(module)
            island = _Island(device)
            handles.append(module.register_forward_pre_hook(island.enter, with_kwargs=True))
            handles.append(module.register_forward_hook(island.leave, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()
        for table, key, value in reversed(swapped):
            table[key] = value


def _cast_state(module: torch.nn.Module) -> list:
    """Half parameters and buffers of ``module`` replaced by fp32 casts (differentiable: the
    gradient reaches the real parameter); returns what to put back."""
    swapped = []
    for m in module.modules():
        tables: tuple[dict, ...] = (m._parameters, m._buffers)
        for table in tables:
            for key, value in list(table.items()):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                        value.dtype != torch.float32:
                    swapped.append((table, key, value))
                    table[key] = value.float()
    return swapped


class _Island:
    """Forward pre-hook and hook of one island: autocast off inside, inputs cast to fp32;
    outputs cast back to the input dtype only where autocast was off outside too (a .half()
    model, whose next layers take half inputs)."""

    def __init__(self, device: str):
        self.device = device
        self.stack: list = []

    def enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        dtype = next((t.dtype for t in tensors_in((args, kwargs))
                      if t.is_floating_point()), None)
        outside = autocast_state(self.device)[0]
        ctx = torch.autocast(self.device, enabled=False)
        ctx.__enter__()
        self.stack.append((ctx, dtype, outside))
        return _float(args), _float(kwargs)

    def leave(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        ctx, dtype, outside = self.stack.pop()
        ctx.__exit__(None, None, None)
        if outside or dtype is None or dtype == torch.float32:
            return None
        return _cast(output, dtype)


def _float(value: Any) -> Any:
    """``value`` with its floating tensors in fp32, kept in the graph (unlike trace.to_fp32)."""
    return _map(value, lambda t: t.float() if t.is_floating_point() else t)


def _cast(value: Any, dtype: torch.dtype, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_cast(v, dtype, depth + 1) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# the loss and the backward


def _losses(cap: Capture, outs: list, t: Trial, out: Outcome, earlier: Sequence = ()) -> list:
    """(LossCall, recomputed value) for each loss call that could be rebuilt; the outcome's
    loss fields filled in. ``earlier``: the step's earlier calls' re-run outputs, the latest
    first (a chained re-run's)."""
    done = []
    for call in cap.loss_calls:
        try:
            args, kwargs = call.arguments(outs, earlier)
        except Missing as exc:
            out.note = f"{call.name} not recomputed: {exc}"
            continue
        state = call.autocast
        if t.loss_fp32:
            args, kwargs = _float(args), _float(kwargs)
            state = (state[0], False, state[2], False)
        with torch.enable_grad(), autocast(state):
            value = call.fn(*args, **kwargs)
        done.append((call, value))
        if not out.unjudged and not _finite([value]):
            out.unjudged = _held_nonfinite(call)
    if not done:
        if not cap.loss_calls:
            out.note = out.note or ("no torch loss function was called after the model: the "
                                    "loss (computed by hand, or inside it) is not recomputed")
        return done
    values = [v for _, v in done]
    out.loss_fns = [c.name for c, _ in done]
    out.loss_finite = _finite(values)
    out.loss = float(sum(float(v.detach().float().sum()) for v in values))
    out.loss_dtype = str(values[0].dtype).replace("torch.", "")
    return done


def _held_nonfinite(call: Any) -> str:
    """Why a loss recomputed non-finite says nothing of the change: an argument held as the
    step had it (a style Gram matrix computed under no_grad in the run's precision, by code
    a re-run does not repeat) is itself NaN/inf. "" when none is."""
    for label, x in bound(call, call.args, call.kwargs).items():
        if isinstance(x, torch.Tensor) and x.is_floating_point() and stats.measurable(x) and \
                not bool(torch.isfinite(x).all()):
            return (f"{call.name}'s {label} holds NaN/inf as the step had it, made by code the "
                    "re-run does not repeat: the trial cannot judge the loss")
    return ""


def _backward_pairs(cap: Capture, outs: list, losses: list, t: Trial, out: Outcome) -> list:
    """(tensor, gradient) to run the backward from: the recomputed losses with the gradient
    the real step sent into each, else the root's outputs with the gradient that reached them."""
    pairs = _loss_pairs(cap, losses, t, out)
    if pairs:
        out.backward_from = "loss"
        return pairs
    pairs = _output_pairs(cap, outs, t)
    if pairs:
        out.backward_from = "output"
    return pairs


def recorded_scale(cap: Capture) -> Optional[float]:
    """The loss scale the step's backward ran at (None: unscaled)."""
    return next((h.get("scale") for _, h in cap.losses if h.get("scaled")), None)


def _factor(cap: Capture, t: Trial) -> tuple[Optional[float], float]:
    """(the recorded loss scale, the factor ``t.scale`` changes it by)."""
    recorded = recorded_scale(cap)
    return recorded, (t.scale / recorded if t.scale is not None and recorded else 1.0)


def _loss_pairs(cap: Capture, losses: list, t: Trial, out: Outcome) -> list:
    recorded, factor = _factor(cap, t)
    return [(v, _loss_grad(call, v, recorded, factor, out)) for call, v in losses
            if 0 in call.grads and v.requires_grad]


def _output_pairs(cap: Capture, outs: list, t: Trial) -> list:
    factor = _factor(cap, t)[1]
    return [(o, _grad_for(cap.grads[i], o, factor)) for i, o in enumerate(outs)
            if i in cap.grads and isinstance(o, torch.Tensor) and o.requires_grad]


def _loss_grad(call: Any, value: torch.Tensor, scale: Optional[float], factor: float,
               out: Outcome) -> torch.Tensor:
    """The gradient to send into a recomputed loss: the one that reached it in the real step,
    unless that is non-finite under a loss scale (the scale overflowed the loss's half dtype):
    then the scale itself, in the recomputed loss's dtype (inf again where that is half,
    finite in fp32). A factor the code applied after the loss function (a division by the
    batch or the micro-batches) cannot be read from an inf: it is taken as 1, and said."""
    grad = call.grads[0]
    if scale is None or bool(torch.isfinite(grad).all()):
        return _grad_for(grad, value, factor)
    note = (f"the gradient that reached {call.name} was the loss scale overflowing "
            f"{str(grad.dtype).replace('torch.', '')}; the loss scale itself was sent in (a "
            "factor applied after the loss function is not known, taken as 1)")
    out.note = out.note or note
    return torch.full_like(value, scale * factor)


def _grad_for(grad: torch.Tensor, value: torch.Tensor, factor: float) -> torch.Tensor:
    g = grad.to(dtype=value.dtype, device=value.device)
    if g.shape != value.shape:
        g = g.expand_as(value) if g.numel() == 1 else g.reshape(value.shape)
    return g * factor if factor != 1.0 else g


def _finite(tensors: list) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in tensors if stats.measurable(x))


def _grad_state(grads: list) -> str:
    if not grads:
        return "not run"
    if not _finite(grads):
        return "non-finite"
    return "zero" if all(not bool(g.any()) for g in grads) else "finite"

