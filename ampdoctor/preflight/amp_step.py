"""``check_amp_step``: the AMP contract of one training step, checked by running the step.

The recorder tells GradScaler misuses apart at run time; this puts the same checks in a
team's own tests, so that a refactor of the training step cannot silently break the contract::

    def train_step(model, optimizer, scaler, batch):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def test_amp_step():
        check_amp_step(train_step, model, optimizer, scaler, batch)   # quiet when correct

How it runs. The step is called twice (a scaler re-created per call, or gradients never
zeroed, only show on the second call) inside a ``Recorder`` writing to a temporary file
that is deleted afterwards, plus a listener on the same patch points (``patches``) for what
the recorder has no event for. The first call is made to skip: just before GradScaler looks
for inf/NaN, one gradient element is set to inf. A correct step survives a skip, and two of
the contracts (the LR scheduler waits for a real optimizer step; ``.grad`` is zeroed even
after a skipped step) can only be seen on one; a scaler at 65536 whose first real step is a
calibration skip is then no special case. The second call runs on whatever state the first
left, as in training. Afterwards the model (parameters, buffers, ``.grad``, train/eval
flags), optimizer, scaler, LR schedulers the step stepped, and the RNGs are restored bit for
bit (``snapshot.Snapshot``).

Which checks apply: with a GradScaler, all of them; without one (bf16, or fp32), those that do
not need a scaler (gradients zeroed, a scaler created inside the step, fp16 autocast without
a scaler, an fp16 loss). One optimizer per step is assumed, and ``train_step`` is one whole
optimizer step (with its micro-batches, if it accumulates).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..diagnosis import fixes
from ..diagnosis.facts import Facts
from ..diagnosis.rules import PREFLIGHT_CHECKS, PREFLIGHT_EXCEPTION
from ..record import patches
from ..record.listener import ScalerDoor
from ..record.recorder import Recorder, RecorderConfig
from ..runfile import schema, store
from ..runfile.schema import DType, Event
from .snapshot import Snapshot

CALLS = 2  # a re-created scaler and un-zeroed gradients show on the second call

# Every violation id check_amp_step reports, with what it means (docs/before-a-long-run.md's table).
VIOLATIONS = {
    "clip_before_unscale": "a clip (clip_grad_norm_, clip_grads_with_norm_, clip_grad_value_) "
                           "ran on scaled gradients, before scaler.unscale_",
    "step_bypasses_scaler": "optimizer.step() called directly while a GradScaler scales the loss",
    "step_without_update": "scaler.step(optimizer) with no scaler.update() after it",
    "unscale_twice": "scaler.unscale_ more than once per optimizer step",
    "backward_unscaled": "a loss backwarded without scaler.scale beside a scaled one",
    "backward_after_unscale": "a scaled loss backwarded after scaler.unscale_ in the same step",
    "scaled_grads_in_loss": "torch.autograd.grad of the scaled loss used in a loss unscaled",
    "scaler_recreated": "a GradScaler created inside the step",
    "grad_not_zeroed": "the previous step's gradients still in .grad when backward begins",
    "scheduler_on_skipped_step": "the LR scheduler stepped although GradScaler skipped the step",
    "fp16_without_scaler": "fp16 autocast with no GradScaler scaling the loss",
    "fp16_loss": "the loss reaching backward is float16",
    "call_order": "GradScaler raised: its calls came in the wrong order or number",
    "fp16_params_with_scaler": "fp16 parameters under a GradScaler (it cannot unscale them)",
    "bf16_params_with_scaler": "bf16 parameters under a GradScaler",
    "constant": "a constant fp16 cannot hold (a -1e9 mask) written into an fp16 tensor",
    "bce": "BCELoss on probabilities under autocast",
}

@dataclass
class Violation:
    """One broken rule of the AMP contract: its id, what happened, and the fixes."""

    id: str
    text: str
    fixes: list = field(default_factory=list)  # fixes.Fix
    raised: bool = False  # the step's exception is this violation's doing

    def render(self) -> str:
        out = [f"{self.id}: {self.text}"]
        for fx in self.fixes:
            out.append(f"  fix [{fx.id}]: {fx.text}")
            out += ["      " + line for line in fx.snippet.splitlines()]
        return "\n".join(out)


class AmpContractError(AssertionError):
    """Raised by ``check_amp_step``: the first line names every violation, the next lines say
    what happened and give each fix with its snippet. ``.violations`` holds them."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        head = (f"AMP step contract broken ({len(violations)}): "
                + ", ".join(v.id for v in violations))
        super().__init__("\n".join([head] + [v.render() for v in violations]))


AmpContractError.__module__ = "ampdoctor.testing"  # where users import it from


def check_amp_step(train_step: Callable[..., Any], model: torch.nn.Module, optimizer: Any,
                   scaler: Any = None, batch: Any = None) -> None:
    """Run ``train_step(model, optimizer, scaler, batch)`` twice under watch; raise
    ``AmpContractError`` (an ``AssertionError``) if it breaks the AMP contract, return None
    if not. The caller's objects are unchanged afterwards. An exception of the step that is
    not one of GradScaler's or autocast's own is raised as it is, after the restore.

    Example::

        check_amp_step(train_step, model, optimizer, torch.amp.GradScaler("cuda"), batch)
        check_amp_step(bf16_step, model, optimizer, None, batch)     # bf16: no scaler
    """
    snap = Snapshot(model, optimizer, scaler)
    watch = _StepWatch(optimizer, snap)
    with tempfile.TemporaryDirectory(prefix="ampdoctor-step-") as tmp:
        path = os.path.join(tmp, "step.h5")
        try:
            error = _run(train_step, (model, optimizer, scaler, batch), path, watch)
        finally:
            snap.restore()
        if watch.faults:
            raise RuntimeError(f"ampdoctor: internal error while watching the step "
                               f"({watch.faults[0]})")
        with store.load(path) as run:
            found = _violations(Facts(run), watch, error)
    if error is not None and not any(v.raised for v in found):
        _annotate(error, found, watch)
        raise error
    if found:
        order = list(VIOLATIONS)
        found.sort(key=lambda v: order.index(v.id) if v.id in order else len(order))
        raise AmpContractError(found) from error


def _annotate(error: Exception, found: list[Violation], watch: "_StepWatch") -> None:
    """Say what ampdoctor knows about an exception of the step's own."""
    if not hasattr(error, "add_note"):  # Python < 3.11
        return
    if watch.calls == 1 and watch.forced:
        error.add_note("ampdoctor: this first call was made to skip (one gradient set to inf "
                       "before GradScaler checked them, as an overflow or GradScaler's "
                       "calibration does at the start of training), and the step raised on "
                       "it: a step must survive a skipped one")
    if found:
        error.add_note("ampdoctor: before this exception the step also broke the AMP "
                       "contract: " + ", ".join(v.id for v in found))


def _run(train_step: Callable[..., Any], args: tuple, path: str,
         watch: "_StepWatch") -> Optional[Exception]:
    """The calls, recorded into ``path``; the step's exception, if it raised one."""
    model, optimizer = args[:2]
    # The scaler is found as it scales (as under `ampdoctor record`): a step that ignores the
    # one it is given and makes its own is then watched on the one it uses.
    rec = Recorder(model, optimizer, None, RecorderConfig(path=path, every=0, forensics=False))
    rec.start()
    error: Optional[Exception] = None
    status = schema.STATUS_FINISHED
    try:
        watch.attach()  # after the recorder: these wrappers wrap the recorder's
        try:
            for call in range(1, CALLS + 1):
                watch.begin(call)
                train_step(*args)
                watch.end()
        except Exception as exc:  # noqa: BLE001 - judged by the caller, re-raised if not AMP's
            error = exc
            rec.record_exception(type(exc), exc)
            status = schema.STATUS_EXCEPTION + type(exc).__name__
        finally:
            watch.detach()
    finally:
        rec.close(status)
    return error


def _violations(f: Facts, watch: "_StepWatch", error: Optional[Exception]) -> list[Violation]:
    """The listener's findings, then what the recorder saw: its misuse events (through its
    own rules), the scalers created, the autocast and loss dtypes; and the step's exception
    when it is one of AMP's own."""
    ctx = f.fix_context()
    out = [Violation(vid, text, fixes.make(ids, ctx)) for vid, text, ids in watch.found]
    for rule in PREFLIGHT_CHECKS:
        finding = rule(f)
        if finding is not None:
            out.append(Violation(finding.kind, finding.summary, finding.fixes))
    created = f.events(Event.SCALER_CREATED)
    if len(created):
        out.append(Violation("scaler_recreated", f"A GradScaler was created {len(created)} "
                             f"times in {watch.calls} calls of the step: each new scaler "
                             "starts again at init_scale and skips steps to recalibrate, and "
                             "its growth never accumulates.",
                             fixes.make(["create_scaler_once"], ctx)))
    if f.autocast_dtype == "float16" and not watch.scaled:
        out.append(Violation("fp16_without_scaler", "The step runs fp16 autocast and no "
                             "(enabled) GradScaler scales its loss: gradients below 6e-8 "
                             "flush to zero in fp16.", fixes.make(["add_grad_scaler"], ctx)))
    if f.n and bool((f.steps["loss_dtype"] == DType.FLOAT16).any()):
        out.append(Violation("fp16_loss", "The loss reaching backward is float16: it was "
                             "computed from fp16 outputs outside autocast (inside, losses "
                             "run in fp32), and an fp16 sum over a batch passes 65504 easily.",
                             fixes.make(["loss_in_fp32"], ctx)))
    if error is not None:
        out += _exception(f, error, out)
    return out


def _exception(f: Facts, error: Exception, found: list[Violation]) -> list[Violation]:
    """The step raised: one of GradScaler's or autocast's own errors
    (``rules.PREFLIGHT_EXCEPTION``)? A call-order error that a violation above explains is told
    in that violation."""
    finding = PREFLIGHT_EXCEPTION(f)
    if finding is None:
        return []
    raised = f"The step raised {type(error).__name__}: {error}"
    cause = next((v for v in found if v.id in ("unscale_twice", "step_without_update")), None)
    if finding.kind == "call_order" and cause is not None:
        cause.text += f" {raised}"
        cause.raised = True
        return []
    why = finding.summary.split(" The script raised")[0]
    return [Violation(finding.kind, f"{why} {raised}", finding.fixes, raised=True)]


class _StepWatch:
    """A patch listener (see ``patches``) for what the recorder has no event for: stale
    gradients, ``step`` without ``update``, the LR scheduler on a skipped step; and the
    forced skip of the first call."""

    def __init__(self, optimizer: Any, snapshot: Snapshot):
        self.optimizer = optimizer
        self.snapshot = snapshot
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.found: list[tuple[str, str, list[str]]] = []  # (id, text, fix ids)
        self.faults: list[str] = []
        self.scaled = False  # an enabled GradScaler scaled a loss
        self.calls = 0
        self.forced = False  # this call's skip was made by setting a gradient to inf
        self._patches = patches.PatchSet()
        self._skipped_before = False  # an earlier call was a skipped step

    def attach(self) -> None:
        door = ScalerDoor(fault=self.fault, on_scale=self.on_scale,
                          before_unscale=self.before_unscale,
                          enter_scaler_step=self.enter_scaler_step,
                          exit_scaler_step=self.exit_scaler_step, after_update=self.after_update)
        patches.patch_scaler(self._patches, door)
        patches.patch_backward(self._patches, self.fault, self.before_backward)
        patches.hook_optimizers(self._patches, self.fault, self.before_optimizer_step, None)
        patches.patch_schedulers(self._patches, self.fault, self.before_scheduler_step)

    def detach(self) -> None:
        self._patches.remove()

    def begin(self, call: int) -> None:
        self.calls = call
        self.backward_seen = False
        self.scaler_steps = 0
        self.updates = 0
        self.skipped = False
        self.in_scaler_step = False
        self.stepped_inside = False
        self.forced = False

    def end(self) -> None:
        if self.scaler_steps > self.updates:
            self._found("step_without_update", "scaler.step(optimizer) ran without "
                        "scaler.update() after it: the next step raises, and the scale never "
                        "adapts.", ["fix_scaler_calls"])
        self._skipped_before = self._skipped_before or self.skipped

    def _found(self, vid: str, text: str, fix_ids: list[str]) -> None:
        if not any(found[0] == vid for found in self.found):
            self.found.append((vid, text, fix_ids))

    def fault(self, exc: BaseException, where: str) -> None:
        self.faults.append(f"{where}: {type(exc).__name__}: {exc}")

    # -- what the patches report ---------------------------------------------------------

    def before_backward(self, tensors: Any) -> None:
        if self.backward_seen:
            return  # later micro-batches accumulate on purpose
        self.backward_seen = True
        if self.calls < 2:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        # One host read for all of them (a test helper may sync; the recorder may not).
        stale = sum(torch.stack([g.ne(0).any().to(grads[0].device) for g in grads]).tolist()
                    ) if grads else 0
        if stale:
            after = (" (it was skipped: the inf GradScaler found stays in .grad and every later "
                     "step overflows)" if self._skipped_before else "")
            self._found("grad_not_zeroed", f"{stale} of {len(self.params)} parameters "
                        "still held the previous step's gradients when this step's backward "
                        f"began{after}: new gradients are added to them.",
                        ["zero_grad_every_step"])

    def on_scale(self, scaler: Any, outputs: Any, out: Any) -> None:
        if getattr(scaler, "_enabled", True):
            self.scaled = True

    def before_unscale(self, scaler: Any, optimizer: Any) -> None:
        self._force_skip(scaler, optimizer)

    def enter_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        self._force_skip(scaler, optimizer)
        self.scaler_steps += 1
        self.in_scaler_step = True
        self.stepped_inside = False

    def exit_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        self.in_scaler_step = False
        if not self.stepped_inside and getattr(scaler, "_enabled", True):
            self.skipped = True

    def after_update(self, scaler: Any) -> None:
        self.updates += 1

    def before_optimizer_step(self, optimizer: Any) -> None:
        if self.in_scaler_step and optimizer is self.optimizer:
            self.stepped_inside = True

    def before_scheduler_step(self, scheduler: Any) -> None:
        self.snapshot.add_scheduler(scheduler)
        if self.skipped and getattr(scheduler, "optimizer", None) is self.optimizer:
            self._found("scheduler_on_skipped_step", f"{type(scheduler).__name__}.step() ran "
                        "although GradScaler skipped the optimizer step: the schedule "
                        "advances without training (and warmup ends early).",
                        ["scheduler_after_real_step"])

    def _force_skip(self, scaler: Any, optimizer: Any) -> None:
        """First call: one gradient element set to inf just before GradScaler checks them,
        so that this step is skipped (restored afterwards with everything else)."""
        if self.calls != 1 or self.forced or not getattr(scaler, "_enabled", True):
            return
        for p in self.params:
            g = p.grad
            if g is not None and g.is_floating_point() and g.layout == torch.strided and g.numel():
                with torch.no_grad():
                    g[(0,) * g.dim()] = math.inf
                self.forced = True
                return
