"""The learning rate measured by a trial: an LR range test on the run's own first state, run
at the first failure whose loss went non-finite, or at the first step whose loss rose to
``RISE`` times the first step's without one (issue 40).

**Kept at the start.** At the run's first optimizer step, before it updates anything,
``RangeTest.before_step`` copies the weights and the optimizer's state to the CPU: once per
run, one host sync, within ``STATE_BYTES`` (a model and state above it are not kept, and the
snapshot says so: the dose is then a bound). The recorder keeps no later state: the run's own
steps are never copied again.

**On the failure.** After the replay of the first event whose loss is non-finite (or, without
a scaler, whose gradient is), ``after_replay`` trains again from the kept state on the failing
step's micro-batches (its batch, as captured: the recorder keeps no other, so the one batch is
repeated), ``STEPS`` optimizer steps per rung, at a geometric ladder of LRs down from the LR
the step failed at: a decade at a time (at most ``DECADES``) to the first rung that trains
(``LrRange.trains``, in ``runfile/payloads.py``: every loss finite and the last one lower than
the first by a margin), then the half-decade above it (the highest that trains, if it does)
and, where that one does not, the half-decade below it: the rung below the highest that trains
is the margin the diagnosis prescribes. A rung ends at its first non-finite loss or gradient;
the ladder ends at ``SECONDS``. Each rung's losses (the loss at the kept state first, then
after each step) go into the snapshot (``detail.lr_range``), in the order they ran; the
diagnosis's ``lrrange.py`` picks the LR.

**On a divergence with no non-finite value.** A run whose loss blows up without ever going
inf or NaN (litgpt at LR 10: 6.2 to 1700 and back) has no failing step to replay. Without a
scaler the recorder reads each step's loss before ``optimizer.step`` while the tier is armed
(``skips.check_before_step``): ``on_loss`` is handed that value (no read of its own), and the
first step whose loss is ``RISE`` times the first step's runs the same ladder, from the same
kept state, on that step's batch (its captures: the backward is done, the weights not yet
stepped). Under a GradScaler no loss is read on the host before the step; a blow-up there
overflows fp16 and takes the path above. The result goes into /meta ``lr_range``, with
``trigger`` saying what rose, as no replay ran and no snapshot holds it. One test per run
either way: the first of the two.

**On copies, never on the run.** The trial trains leaf copies of the weights through
``torch.func.functional_call`` with a new optimizer of the run's class loaded from the kept
state; the run's parameters, ``.grad`` and optimizer are never touched. It runs inside a
replay's guarantees (``Forensics.guarded``: RNG forked, buffers put back, the user's hooks set
aside), with the global optimizer-step hooks (ampdoctor's own and the user's) set aside
around the copies' steps. The loss is each torch loss function the step called, recomputed
from the copies' output and scaled as the step scaled it (a scaled loss whose gradients
overflow is tried again at a lower scale, as GradScaler would); the user's own clip
(``max_norm``) is applied as the run applies it. Several calls combined by hand (litgpt's
chunks, summed over the targets not ignored) are combined as ``losssum.combination`` verified
they give the loss the run recorded at the failing step, and the record says which
(``loss``); where none does, no trial. A loss the model returns (a Hugging Face
model given labels) is backwarded from as the step did; a loss written by hand after the model
cannot be recomputed: then no trial, and the snapshot says why.

Example (what ``Forensics`` does after the replay of the failing step)::

    forensics.lrrange.after_replay(step, captures, finding, scale, why, loss_nonfinite)
    finding.detail.lr_range
    # {'state': 'start', 'steps': 12, 'rungs': [{'factor': 1.0, 'lr': 0.5,
    #  'losses': [2.79, 2.75, ..., 'nan'], 'finite': False}, {'factor': 0.1, ...}], ...}
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any, Iterator, Optional

import torch
from torch.optim import optimizer as optimizer_hooks

from ...runfile.payloads import LrRange, LrRung
from ...runfile.schema import Event, Phase
from ..apply import lrfactors
from ..sampler import tensors_in
from .isolated import set_rng
from .losssum import Way, combination
from .trace import Capture, autocast, unwrap
from .trial import AS_RECORDED, Outcome, Trial, _factor, _grad_for, _loss_pairs, _losses

STATE_BYTES = 256 << 20  # weights + optimizer state copied to the CPU at the first step
STEPS = LrRange.STEPS  # optimizer steps per rung
DECADES = 10  # decade rungs at most: down to 1e-9 of the failing LR
SECONDS = 20.0  # the whole ladder's time budget
BACKOFF = 2.0 ** -4  # a scaled step whose gradients overflow is tried again at this x scale
RETRIES = 3
# A finite loss this many times the first step's is a divergence (diagnosis/curve.py's
# ``stuck`` is 3x its level before the jump too): the test runs there, once
RISE = 3.0

NOT_KEPT_TOO_BIG = "the weights and optimizer state were over {mib} MiB ({have} MiB)"


class NotRecomputed(Exception):
    """The step's loss call could not be rebuilt on the copies' output (an argument taken
    from the output in a way the trial cannot follow): no rung can be measured."""


class Start:
    """The weights and optimizer state before the run's first update, on the CPU."""

    def __init__(self, optimizer: Any, step: int):
        self.step = step
        self.params = [p.detach().to("cpu", copy=True) for p in _params(optimizer)]
        self.state = _to_cpu(optimizer.state_dict())


class RangeTest:
    """The LR range test of one recorder's forensic tier (see the module docstring).
    ``forensics``: its ``Forensics`` (``guarded``, ``watched``, ``strict``)."""

    def __init__(self, forensics: Any):
        self.forensics = forensics
        self.start: Optional[Start] = None
        self.not_kept: Optional[str] = None  # why no state was kept
        self.clip: Optional[dict] = None  # the user's clip call, as last seen
        self.done = False
        self.first: Optional[float] = None  # the first step's loss (on_loss)

    def before_step(self, optimizer: Any, step: int, clip: Optional[dict]) -> None:
        """The primary optimizer is about to step: the user's clip noted; the state kept once,
        at the first step (one sync, copies to the CPU)."""
        self.clip = clip
        if self.start is not None or self.not_kept is not None:
            return
        if self.forensics.watched.sharding is not None:  # never replayed, so never tried
            self.not_kept = f"the model is sharded ({self.forensics.watched.sharding.name})"
            return
        try:
            size = sum(_nbytes(p) for p in _params(optimizer)) + sum(
                _nbytes(v) for s in optimizer.state.values() for v in dict(s).values())
            if size > STATE_BYTES:
                self.not_kept = NOT_KEPT_TOO_BIG.format(mib=STATE_BYTES >> 20, have=size >> 20)
                return
            self.start = Start(optimizer, step)
        except Exception as exc:  # noqa: BLE001 - the run goes on without the trial
            if self.forensics.strict:
                raise
            self.not_kept = f"copying them failed: {type(exc).__name__}: {exc}"[:300]

    def on_loss(self, step: int, loss: float, captures: list) -> None:
        """A finite loss the recorder read before the step is applied (no read here): the
        first step's kept as the reference; the first one at ``RISE`` times it runs the test
        on this step's ``captures`` into /meta ``lr_range`` (see the module docstring)."""
        if self.done or not math.isfinite(loss):
            return
        if self.first is None:
            self.first = loss
            return
        if not (self.first > 0 and loss >= RISE * self.first) or not captures or \
                self.forensics.unsafe(captures):
            return
        optimizer = self._optimizer()
        if optimizer is not None and not any(x != 0 for x in lrfactors.ran_with(optimizer)):
            return  # a warm-up step at LR 0: its LR is not the one to try
        self.done = True
        began = time.perf_counter()
        try:
            result = self.run(step, list(captures), None)
        except Exception as exc:  # noqa: BLE001 - a trial must never stop the training run
            if self.forensics.strict:
                raise
            result = LrRange(note=f"the trial failed: {type(exc).__name__}: {exc}"[:300])
        result.trigger = (f"the loss rose to {loss:.4g}, {loss / self.first:.3g}x the first "
                          f"step's {self.first:.4g}, with no non-finite value")
        result.event_step = step
        result.seconds = round(time.perf_counter() - began, 4)
        self.forensics.journal.meta("lr_range", result, step)

    def after_replay(self, step: int, captures: list, finding: Any, scale: Optional[float],
                     why: Event, loss_nonfinite: Optional[bool]) -> None:
        """The failing step's replay is done: the range test into ``finding.detail``, once per
        run, at the first event whose loss (without a scaler, or its gradient) is non-finite
        and whose batch is not the cause."""
        failed = loss_nonfinite is True or why in (Event.NONFINITE_LOSS, Event.NONFINITE_GRAD)
        if self.done or not failed or finding.phase == Phase.INPUT or not captures or \
                finding.detail.stale_grads or finding.detail.input_modified:
            return
        optimizer = self._optimizer()
        if optimizer is not None and not any(x != 0 for x in lrfactors.ran_with(optimizer)):
            return  # a warm-up step at LR 0: its failure is not the LR's; a later one may be
        self.done = True
        began = time.perf_counter()
        try:
            result = self.run(step, captures, scale)
        except Exception as exc:  # noqa: BLE001 - a trial must never stop the training run
            if self.forensics.strict:
                raise
            result = LrRange(note=f"the trial failed: {type(exc).__name__}: {exc}"[:300])
        result.seconds = round(time.perf_counter() - began, 4)
        finding.detail.lr_range = result

    def run(self, step: int, captures: list, scale: Optional[float]) -> LrRange:
        """The ladder from the kept state on ``captures`` (see the module docstring)."""
        optimizer = self._optimizer()
        why = self._cannot(captures, optimizer)
        if why:
            return LrRange(note=why)
        assert self.start is not None and optimizer is not None
        event_lrs = [lr for lr in lrfactors.ran_with(optimizer)]
        top = max((x for x in event_lrs if math.isfinite(x)), default=math.nan)
        if not top > 0:
            return LrRange(note="the failing step's LR was not known (an LR held on the device)")
        clip = self.clip.get("max_norm") if self.clip and self.clip.get("how") in (
            None, "clip_grad_norm_", "clip_grads_with_norm_") else None
        called = [c for c in captures if c.loss_calls]
        combined = combination(called) if called else None
        if combined is not None and combined.why:
            return LrRange(note=f"the trial's loss cannot be put in the run's units: "
                           f"{combined.why}"[:300])
        ways = dict(zip(map(id, called), combined.ways if combined else []))
        out = LrRange(state="start", state_step=self.start.step, event_step=step, lr=top,
                     batch="the failing step's batch, repeated", steps=STEPS, rungs=[],
                     optimizer=type(optimizer).__name__,
                     max_norm=float(clip) if isinstance(clip, (int, float)) else None,
                     loss=combined.described if combined else None)
        began = time.perf_counter()

        def tried(exponent: float) -> Optional[bool]:
            """The rung at 10**-exponent of the failing LR: trained or not (None: stopped)."""
            if time.perf_counter() - began > SECONDS:
                out.stopped = f"the time budget of {SECONDS:g} s"
                return None
            rung = self._rung(optimizer, captures, event_lrs, 10.0 ** -exponent, scale,
                              out.max_norm, ways)
            out.rungs = (out.rungs or []) + [rung]
            if not math.isfinite(rung.losses[0]):
                out.stopped = ("the loss at the kept state is non-finite on this batch: no "
                                  "LR can be told from another")
                return None
            return LrRange.trains(rung)

        try:
            return self._ladder(out, tried)
        except NotRecomputed as exc:
            return LrRange(note=f"the loss could not be recomputed from the copies' output "
                           f"({exc})"[:300])

    @staticmethod
    def _ladder(out: LrRange, tried: Any) -> LrRange:
        """The rungs, a decade at a time down to the first that trains, then the half-decade
        above it and, where that one does not train, the half-decade below it."""
        for k in range(DECADES):  # a decade at a time, down to the first that trains
            done = tried(k)
            if done is None or (done and k == 0):
                return out  # (the failing LR itself trained: no lower LR to find)
            if done:
                # the half-decade above it, the highest that trains; then the margin below
                if tried(k - 0.5) is False:
                    tried(k + 0.5)
                return out
        return out

    def _optimizer(self) -> Any:
        opts = self.forensics.watched.optimizers
        return opts[0] if opts else None

    def _cannot(self, captures: list, optimizer: Any) -> str:
        """Why no trial can run ("" where one can)."""
        if self.start is None:
            return f"no state was kept: {self.not_kept}" if self.not_kept else \
                "no state was kept: the recorder saw no optimizer step before the failure"
        if optimizer is None or len(self.forensics.watched.optimizers) > 1:
            return "the run has several optimizers: a trial of one LR is not one of the run"
        if len({id(unwrap(c.root)) for c in captures}) > 1:
            return "the step runs several models: the trial trains one"
        if not all(c.loss_calls or _model_losses(c) for c in captures):
            return ("no torch loss function was called after the model and the model returns "
                    "no loss (the loss is written by hand), so a trial cannot recompute it "
                    "from the copies' output")
        params = _params(optimizer)
        if len(params) != len(self.start.params) or any(
                p.shape != q.shape for p, q in zip(params, self.start.params)):
            return "the optimizer's parameters changed since the first step"
        names = _names(unwrap(captures[0].root))
        if any(id(p) not in names for p in params):
            return "the optimizer trains tensors outside the model"
        return ""

    def _rung(self, optimizer: Any, captures: list, event_lrs: list, factor: float,
              scale: Optional[float], max_norm: Optional[float], ways: dict) -> LrRung:
        """One rung: ``STEPS`` steps from the kept state at each group's failing LR times
        ``factor``; its losses (the kept state's first), finite, skipped steps, seconds."""
        began = time.perf_counter()
        assert self.start is not None
        root = unwrap(captures[0].root)
        params = _params(optimizer)
        copies = [q.to(p.device, copy=True).requires_grad_(p.requires_grad)
                  for p, q in zip(params, self.start.params)]
        trial_opt = _new_optimizer(optimizer, copies, self.start.state)
        for g, lr in zip(trial_opt.param_groups, event_lrs):
            g["lr"] = _like(g["lr"], lr * factor)
        names = _names(root)
        weights = {names[id(p)]: c for p, c in zip(params, copies)}
        trained = [c for c in copies if c.requires_grad]
        s = scale if scale is not None and scale > 0 else None
        losses: list = []
        skipped, finite = 0, True
        with self.forensics.guarded(captures), _optimizer_hooks_aside():
            for i in range(STEPS + 1):
                loss, grads, s, skips = _step(root, weights, captures, trained, s,
                                              i == STEPS, ways)
                losses.append(loss)
                skipped += skips
                if not math.isfinite(loss) or (grads is None and i < STEPS):
                    finite = False
                    break
                if i == STEPS:
                    break
                _clip(grads, max_norm)
                for c, g in zip(trained, grads):
                    c.grad = g
                trial_opt.step()
                for c in trained:  # (not zero_grad: the recorder patches it)
                    c.grad = None
        lr = max(float(x) * factor for x in event_lrs if math.isfinite(x))
        return LrRung(factor=float(f"{factor:.4g}"), lr=lr, finite=finite, losses=losses,
                      skipped=skipped, seconds=round(time.perf_counter() - began, 4))


def _step(root: torch.nn.Module, weights: dict, captures: list, trained: list,
          scale: Optional[float], measure_only: bool,
          ways: dict) -> tuple[float, Any, Optional[float], int]:
    """The loss at the copies (mean over the micro-batches) and, unless ``measure_only``,
    their gradients unscaled, summed over the micro-batches (None: non-finite at every
    scale tried); the scale left, and the steps tried again at a lower scale.
    ``ways``: how each capture's loss calls give its loss (``losssum.Way``)."""
    for retry in range(RETRIES + 1):
        total: list = [None] * len(trained)
        values: list = []
        for cap in captures:
            value, micro = _micro(root, weights, cap, trained, scale, measure_only,
                                  ways.get(id(cap), Way()))
            values.append(value)
            for i, g in enumerate(micro or ()):
                if g is not None:
                    total[i] = g if total[i] is None else total[i] + g
        loss = sum(values) / len(values)
        if measure_only or not math.isfinite(loss):
            return loss, None, scale, retry
        grads = [g if g is not None else torch.zeros_like(c) for g, c in zip(total, trained)]
        if scale is not None:
            grads = [g / scale for g in grads]
        if all(bool(torch.isfinite(g).all()) for g in grads):
            return loss, grads, scale, retry
        if scale is None or scale <= 1.0:
            break
        scale = max(scale * BACKOFF, 1.0)
    return loss, None, scale, RETRIES


def _micro(root: torch.nn.Module, weights: dict, cap: Capture, trained: list,
           scale: Optional[float], measure_only: bool,
           way: Way) -> tuple[float, Optional[tuple]]:
    """One micro-batch at the copies: its recomputed loss (its loss calls combined as
    ``way``), and the copies' gradients at ``scale`` (the gradient the real step
    sent into the loss, rescaled to it)."""
    set_rng(cap.rng)
    with torch.enable_grad(), autocast(cap.autocast), _slots_kept(root):
        output = torch.func.functional_call(root, weights, cap.args, cap.kwargs)
    out = Outcome("lr_range")
    outs = list(tensors_in(output))
    if cap.loss_calls:
        losses = _losses(cap, outs, AS_RECORDED, out)
        if out.loss is None or len(losses) < len(cap.loss_calls):
            # (not a non-finite loss: none was computed, or not all that make it)
            raise NotRecomputed(out.note or "no loss call could be rebuilt")
        value = way.loss([v for _, v in losses])
        pairs = _loss_pairs(cap, losses, Trial(scale=scale), out) if losses else []
    else:  # the model returns its loss (a Hugging Face model given labels)
        factor = _factor(cap, Trial(scale=scale))[1]
        at = [i for i in _model_losses(cap) if i < len(outs) and outs[i].requires_grad]
        value = float(sum(float(outs[i].detach().float().sum()) for i in at)) if at else math.nan
        pairs = [(outs[i], _grad_for(cap.grads[i], outs[i], factor)) for i in at]
    if measure_only or not math.isfinite(value):
        return value, None
    if not pairs:
        return math.nan, None
    grads = torch.autograd.grad([x for x, _ in pairs], trained, [g for _, g in pairs],
                                allow_unused=True)
    return value, grads


def _model_losses(cap: Capture) -> list[int]:
    """The outputs of ``cap`` that are a loss the model computed: one value, with the
    gradient the real step sent into it."""
    return [i for i, meta in enumerate(cap.output_meta) if meta is not None and i in cap.grads
            and math.prod(meta.shape) == 1]


def _clip(grads: list, max_norm: Optional[float]) -> None:
    """The user's ``clip_grad_norm_(max_norm)``, on the copies' gradients (computed here:
    the run's patched clip would be told of it)."""
    if not max_norm or not grads:
        return
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    total = torch.linalg.vector_norm(norms)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def _new_optimizer(optimizer: Any, copies: list, state: dict) -> Any:
    """An optimizer of ``optimizer``'s class over ``copies``, in its groups, loaded from the
    kept state (a deep copy: the rungs each start from it)."""
    groups, at = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": copies[at:at + n]})
        at += n
    cls = type(optimizer)
    try:
        made = cls(groups, **dict(optimizer.defaults))
    except TypeError:
        made = cls(groups)
    made.load_state_dict(copy.deepcopy(state))
    return made


@contextlib.contextmanager
def _slots_kept(root: torch.nn.Module) -> Iterator[None]:
    """Every module's parameter and buffer slots put back as they were. ``functional_call``
    swaps the copies in by name and back out name by name; a module reached by two names
    (Lightning Fabric's ``_FabricModule`` holds the model as ``_forward_module`` and
    ``_original_module``) is swapped twice on the way in, so the second swap's "original" is
    the copy, and the way out left the copies in the model: litgpt at LR 10 then trained
    tensors its optimizer never stepped. Written back into the slots' dicts (no
    ``__setattr__``, which such wrappers forward)."""
    slots: list[tuple[dict[str, Any], dict[str, Any]]] = \
        [(m._parameters, dict(m._parameters)) for m in root.modules()] + \
        [(m._buffers, dict(m._buffers)) for m in root.modules()]
    try:
        yield
    finally:
        for table, before in slots:
            for key, value in before.items():
                if table.get(key) is not value:
                    table[key] = value


@contextlib.contextmanager
def _optimizer_hooks_aside() -> Iterator[None]:
    """The global optimizer-step hooks (the recorder's, the user's) do not see the copies'
    optimizer: taken out while the trial runs, put back in their order."""
    tables: list[dict] = [optimizer_hooks._global_optimizer_pre_hooks,
                          optimizer_hooks._global_optimizer_post_hooks]
    saved = [dict(t) for t in tables]
    for t in tables:
        t.clear()
    try:
        yield
    finally:
        for t, items in zip(tables, saved):
            added = dict(t)
            t.clear()
            t.update(items)
            t.update(added)


def _params(optimizer: Any) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _names(root: torch.nn.Module) -> dict:
    return {id(p): n for n, p in root.named_parameters()}


def _like(old: Any, value: float) -> Any:
    """An LR as the group holds it (a tensor LR stays a tensor)."""
    if isinstance(old, torch.Tensor):
        return torch.tensor(value, dtype=old.dtype, device=old.device)
    return value


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _to_cpu(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if depth < 6 and isinstance(value, dict):
        return {k: _to_cpu(v, depth + 1) for k, v in value.items()}
    if depth < 6 and isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v, depth + 1) for v in value)
    return copy.deepcopy(value)
