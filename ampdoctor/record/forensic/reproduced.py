"""Did the replay reproduce what the real step saw? The numbers, or the machine.

A replay that names no module and finds the batch finite (``replay.explain``: phase loss or
none) says nothing yet about the failure it was run for. ``recorded`` says what the real step
saw, measured on the event: its loss (captured), whether the model's output held NaN/inf (read
through the capture's weak references while the loop still holds it: None when it no longer
does), whether the gradient reaching the output did. ``examine`` then re-runs the
micro-batch as it ran (``trial.AS_RECORDED``: forward, the loss recomputed by each torch
loss function the step called after the model, backward from it) and compares:

* **the loss is non-finite again**: it is recomputed in fp32 as well (``trial.LOSS_FP32``)
  and its targets are read (``losscall.check_targets``). Non-finite in fp32 too means not the
  precision: the targets (every one ``ignore_index``, out of range, NaN) or the loss's
  formula. Phase loss, ``fp32_finite`` the fp32 verdict.
* **the real step was non-finite, the re-run is finite everywhere** (outputs, the recomputed
  loss, every gradient; the gradients at loss scale 1 where at the recorded scale they
  overflowed, ``rerun_scale``): it did not reproduce. ``reproduced`` False, phase none: a device
  fault or silent data corruption, a nondeterministic kernel, or code that the replay does not
  run (a loss written by hand, hooks, communication).
* otherwise the replay's own finding stands (``reproduced`` True, or None where nothing could
  be compared: no torch loss function, and the real output no longer held).

Only on the event: host reads and one more forward and backward per re-run.

Example (what ``replay.search`` does with a micro-batch's finding)::

    if finding.phase == Phase.LOSS:
        reproduced.examine(cap, trace, finding, names)
    finding.detail.reproduced     # False: the machine, not the numbers
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from ...numfmt import fmt
from ...runfile.detail import Recorded, TargetsCheck
from ...runfile.schema import Phase
from .. import stats
from . import losscall, trial
from .culprit import Culprit
from .trace import Capture, Trace

NO_LOSS_CALL = ("no torch loss function was called after the model (a loss written by hand, "
                "or one computed inside the model)")


def recorded(cap: Capture) -> Recorded:
    """What the real step saw, measured now (event only): loss, model output, the gradient at
    the output; each True (non-finite), False, or None (not seen, or no longer held)."""
    alive = [t for t in (r() for r in cap.outputs) if stats.measurable(t)]
    grads = [g for g in cap.grads.values() if stats.measurable(g)]
    return Recorded(loss_nonfinite=_any_bad([loss for loss, _ in cap.losses]),
                    output_nonfinite=_any_bad(alive), output_grad_nonfinite=_any_bad(grads),
                    loss_fns=[c.name for c in cap.loss_calls])


def _any_bad(tensors: list) -> Optional[bool]:
    if not tensors:
        return None
    return not all(bool(torch.isfinite(t).all()) for t in tensors)


def examine(cap: Capture, trace: Trace, f: Culprit, names: dict) -> None:
    """A loss-phase finding checked against a re-run of the micro-batch (see the module
    docstring): its phase, summary and detail updated in place."""
    seen = f.detail.recorded = recorded(cap)
    again = trial.rerun(cap, trial.AS_RECORDED, names) if cap.loss_calls else None
    if again is not None:
        f.detail.rerun = replace(again)
    if again is None or again.loss_finite is None:
        f.detail.loss_recomputed = False
        f.detail.loss_not_recomputed = again.note if again is not None else NO_LOSS_CALL
        if seen.output_nonfinite and _finite(trace.outputs):
            not_reproduced(f, seen, None)
        return
    f.detail.loss_recomputed = True
    held_bad = [c.name for c in cap.loss_calls if _input_held_bad(c)]
    if again.loss_finite is False and held_bad:
        # The loss was given a non-finite input that is not the model's output as the replay
        # knows it (made by code after the model): whether it reproduces cannot be told.
        f.detail.loss_input_nonfinite = held_bad
        f.summary = (f"the input given to {', '.join(held_bad)} already held NaN/inf in the "
                     "real step; it was not the model's output but made from it by code the "
                     "replay does not run, and the replayed model output is finite")
    elif again.loss_finite is False:
        _loss_again(cap, trace, f, names, again)
    elif seen.loss_nonfinite or seen.output_nonfinite:
        low = again if again.finite else None if _after_the_loss_calls(cap, seen) else \
            _at_scale_one(cap, names, again)
        if low is None:
            f.detail.reproduced = True
            return
        if low is not again:
            f.detail.rerun, f.detail.rerun_scale = replace(low), 1.0
        not_reproduced(f, seen, low)
    else:
        f.detail.reproduced = True


def _after_the_loss_calls(cap: Capture, seen: Recorded) -> bool:
    """The real step's loss was non-finite while its model output and every torch loss
    function's result were finite: what made it non-finite is code after those calls (an
    entropy term written by hand), which the re-run does not recompute. Its finite re-run at
    loss scale 1 then says nothing of the real step's failure."""
    return bool(seen.loss_nonfinite) and seen.output_nonfinite is not True and all(
        bool(torch.isfinite(c.value).all()) for c in cap.loss_calls)


def _at_scale_one(cap: Capture, names: dict, again: trial.Outcome) -> Optional[trial.Outcome]:
    """The re-run at loss scale 1 where the one as recorded was finite up to its gradients,
    which overflowed at the recorded scale (GradScaler's own calibration: at step 0's 65536 a
    finite step's gradients overflow fp16 too, and the scale falls by itself). Finite there,
    the real step's non-finite forward or loss did not reproduce; None where it is still not
    finite (the backward itself fails: the replay's finding stands)."""
    scale = trial.recorded_scale(cap)
    if again.first != "backward" or scale is None or scale <= 1.0:
        return None
    low = trial.rerun(cap, replace(trial.AS_RECORDED, scale=1.0), names)
    return low if low.finite else None


def not_reproduced(f: Culprit, seen: Recorded, again: Optional[trial.Outcome]) -> None:
    """The real step was non-finite and its replay is not: phase none, ``reproduced`` False."""
    f.phase = Phase.NONE
    f.module, f.module_type, f.call = "", "", None
    f.fp32_finite = None
    f.detail.reproduced = False
    what = []
    if seen.loss_nonfinite:
        what.append("its loss was non-finite")
    if seen.output_nonfinite:
        what.append("the model's output held NaN/inf")
    if not what:
        what.append("its gradients were non-finite")
    if seen.output_nonfinite is False:
        what.append("the model's output was finite")
    replay = "the model's output is finite"
    if again is not None and again.loss is not None:
        replay += (f", the loss recomputed by {', '.join(again.loss_fns)} is {fmt(again.loss)}"
                   f" and every gradient is {'zero' if again.grads == 'zero' else 'finite'}")
        if f.detail.rerun_scale is not None:
            replay += (f" at loss scale {fmt(f.detail.rerun_scale)} (at the recorded one a "
                       "finite step's gradients overflow too, and GradScaler lowers it)")
    f.summary = (f"the real step was non-finite ({'; '.join(what)}), but its replay on the "
                 f"same batch, weights and RNG is finite ({replay}): it did not reproduce (a "
                 "device fault, a nondeterministic kernel, or code the replay does not run)")


def _loss_again(cap: Capture, trace: Trace, f: Culprit, names: dict,
                again: trial.Outcome) -> None:
    """The recomputed loss is non-finite again: is it the precision (fp32 re-run) or not (the
    targets, the loss's formula)?"""
    fp32 = trial.rerun(cap, trial.LOSS_FP32, names)
    f.detail.loss_fp32 = replace(fp32)
    found = [t for t in (_targets(call, trace.outputs) for call in cap.loss_calls)
             if t is not None]
    f.detail.targets = found
    f.detail.reproduced = True
    f.phase = Phase.LOSS
    f.fp32_finite = fp32.loss_finite
    problem = next((t.problem for t in found if t.problem), None)
    head = (f"the model's output is finite but the loss ({', '.join(again.loss_fns)}, "
            f"{again.loss_dtype}) is not, in the replay too")
    if fp32.loss_finite is False:
        why = f"the targets: {problem}" if problem else \
            "the loss's formula at these values (its targets hold nothing invalid)"
        f.summary = (f"{head}; recomputed in fp32 it is still non-finite"
                     f"{' and every gradient is exactly zero' if fp32.grads == 'zero' else ''}"
                     f": not the precision, {why}")
    else:
        f.summary = (f"{head}; recomputed in fp32 it is finite ({fmt(fp32.loss)}): compute the "
                     "loss in fp32")


def _input_held_bad(call: losscall.LossCall) -> bool:
    """The loss's input (not its target) is held as the real step gave it, and holds NaN/inf."""
    a = losscall.bound(call, call.args, call.kwargs)
    t = a.get("input")
    return isinstance(t, torch.Tensor) and stats.measurable(t) and \
        not bool(torch.isfinite(t).all())


def _targets(call: losscall.LossCall, outputs: list) -> Optional[TargetsCheck]:
    try:
        args, kwargs = call.arguments(outputs)
    except losscall.Missing:
        return None
    return losscall.check_targets(call, args, kwargs)


def _finite(tensors: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if stats.measurable(t))
