"""One instrumented re-run of a captured root call: who went non-finite first, would fp32 help.

``forensics`` captures each step's root-module calls; on an event ``search`` hands them, in
order, to ``explain(capture, context, ...)`` until one explains the event (forward or backward
culprit, bad batch or loss; if none does and ``.grad`` is non-finite anyway, it was left over
from an earlier step, or summed past fp16 across micro-batches: ``accum``). ``explain``

1. re-runs the root's forward from the captured RNG state, in the captured autocast state,
   with a forward pre/post hook on every named module, measuring every module input and
   output (``stats.Collector``: NaN/inf presence and abs max exact, counts sampled):
   ``trace.Trace``;
2. runs backward from the gradient that arrived at the root output in the real step, with
   ``torch.autograd.grad`` (``.grad`` is never written), measuring every module's
   grad_output, grad_input and the gradient of each parameter;
3. names the culprit (``culprit.decide``): the first module, in execution order, whose output is
   non-finite while its inputs are finite, preferring the innermost one that explains it;
   else the first module in backward order whose grad_input (or own parameter gradient) is
   non-finite while its grad_output is finite; else the batch or the loss (a batch that
   autograd computed in this step, from an earlier root's output, is the op's that made it:
   ``computed``);
4. re-runs the culprit alone (``culprit_rerun.check_culprit``), once as it ran (exact
   statistics in the run's precision) and once in fp32: autocast off, inputs ``.float()``, an
   fp32 copy of the module if its parameters are half; for a backward culprit, its backward
   from the same grad_output.

The culprit's inputs (and its grad_output) are not held during the instrumented pass, which
keeps the replay's memory close to the training step's: a second, lean pass re-runs the
step from the same RNG state and keeps only the culprit's.

How a module's own backward is isolated, and why -inf is not always an accident: see
``trace.py``. A tensor holding -inf among other values ("soft") is followed: when a module
turns it into NaN/+inf, the module that produced the -inf from finite inputs is the culprit.

The caller owns the observer-effect guarantee (``forensics``: RNG forked, buffers restored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...runfile.schema import Phase
from .. import stats
from ..watched import Watched
from . import reproduced
from .accum import explain as explain_accumulation
from .accum import overflow
from .computed import computed_input
from .culprit import Culprit, bad_batch, decide, describe
from .culprit_rerun import check_culprit
from .kept import versions
from .trace import HARD, Capture, Trace, feeds, root_name


@dataclass(frozen=True)
class ReplayContext:
    """What a replay needs of the recorder: the model (``watched``: its module and parameter
    names, its trained parameters), the CUDA devices whose RNG the replay may draw from, and
    whether an exception in the re-run raises (``strict``) or becomes part of the finding."""

    watched: Watched
    devices: list
    strict: bool = False

    @property
    def names(self) -> dict:
        """Modules to their qualified names (the recorder's)."""
        return self.watched.names

    @property
    def param_names(self) -> dict:
        """Parameter ids to their qualified names."""
        return self.watched.param_names


def explain(cap: Capture, ctx: ReplayContext, root: str) -> tuple["Trace", Culprit]:
    """Replay one captured root call (``root``: its name) and decide what went non-finite
    first. The caller forks the RNG and restores module buffers around this call. An
    exception in the re-run (the user's code may refuse to run twice) becomes part of the
    finding, unless ``ctx.strict``.
    """
    trace = Trace(cap, ctx.names, root, ctx.devices, ctx.param_names or {})
    trace.strict = ctx.strict
    bad_inputs = trace.measure_batch()
    if any(level == HARD for _, _, level in bad_inputs):
        return trace, computed_input(trace, bad_inputs) or bad_batch(trace, bad_inputs)
    trace.run()
    finding = decide(trace, bad_inputs)
    if finding.call is not None and finding.phase in (Phase.FORWARD, Phase.BACKWARD):
        check_culprit(trace, finding)
        describe(trace, finding)
    return trace, finding


def check_batch(cap: Capture, names: dict, root_name: str) -> tuple["Trace", Optional[Culprit]]:
    """Measure the captured batch only (no model code runs, no collective): a finding of
    phase input when it holds NaN/inf, else None. What a sharded model gets instead of a
    replay."""
    trace = Trace(cap, names, root_name, [], {})
    bad = [b for b in trace.measure_batch() if b[2] == HARD]
    return trace, (computed_input(trace, bad) or bad_batch(trace, bad) if bad else None)


def search(captures: list, ctx: ReplayContext, scale: Optional[float], stale_check: bool,
           earlier: bool) -> tuple[Optional[Trace], Culprit, int]:
    """Replay the micro-batches in order until one explains the event; (trace, finding,
    micro). ``scale``: the loss scale at the event; ``stale_check``: with none explained, is
    ``.grad`` non-finite anyway; ``earlier``: an earlier step failed (stale gradients can only
    come from one)."""
    names = ctx.names
    last: Optional[tuple] = None
    unreproduced: Optional[tuple] = None  # the first micro-batch the replay did not repeat
    forward_only: list[int] = []  # micro-batches whose output gradient was not kept
    through: Optional[tuple] = None  # a model whose output fed a later model: its finding
    for micro, cap in enumerate(captures):
        for _, holder in cap.losses:
            holder["scale"] = scale if holder.get("scaled") else None
        trace, finding = explain(cap, ctx, root_name(names, cap.root))
        modified = versions((cap.args, cap.kwargs)) != cap.versions
        if modified:
            finding.detail.input_modified = True
        elif finding.phase == Phase.LOSS:
            _examine(cap, trace, finding, ctx)
        if forward_only:
            finding.detail.micro_batches_forward_only = list(forward_only)
        if finding.phase == Phase.LOSS and feeds(cap, captures[micro + 1:]):
            # The gradient at this model's output came through a model called after it
            # (a generator's, through its discriminator): replay that one before blaming
            # the loss.
            through = through or (trace, finding, micro)
            continue
        if finding.phase not in (Phase.NONE, Phase.UNKNOWN):
            if through is not None and finding.phase != Phase.LOSS:
                finding.detail.fed_by = root_name(names, captures[through[2]].root)
            return trace, finding, micro
        if through is not None:
            continue
        if finding.detail.reproduced is False and unreproduced is None:
            unreproduced = (trace, finding, micro)
        if cap.grads_dropped:
            forward_only.append(micro)
        last = (trace, finding, micro)
    if through is not None:  # no model after it located the failure either
        return through
    if unreproduced is not None:  # its loss or output was non-finite: never stale grads
        return unreproduced
    if last is None:  # _run replays only a step with captures
        raise RuntimeError("no micro-batch to replay")
    return _none_located(last, captures, ctx, stale_check, earlier)


def _none_located(last: tuple, captures: list, ctx: ReplayContext, stale_check: bool,
                  earlier: bool) -> tuple[Optional[Trace], Culprit, int]:
    """``search``'s answer where no micro-batch's replay located the failure, from the last
    one replayed: an accumulation overflow, stale gradients, a batch changed in place, or a
    failure the replay did not repeat."""
    names = ctx.names
    trace, finding, micro = last
    stale = _stale_grads(ctx.watched) if stale_check else []
    accum = overflow(ctx.watched, captures, stale) if stale and len(captures) > 1 else None
    if accum:
        explain_accumulation(finding, accum, len(captures), names)
        return trace, finding, accum.micro
    if stale and earlier:
        finding.detail.stale_grads = stale
        finding.summary = (f"every micro-batch replays finite, yet .grad already holds "
                           f"NaN/inf ({', '.join(stale[:3])}): left over from an earlier "
                           "step whose gradients were not zeroed (zero_grad skipped)")
    elif finding.phase == Phase.NONE and finding.detail.input_modified:
        finding.summary = ("the replay of every micro-batch stayed finite, but the batch "
                           "was changed in place after the step: the replay is not "
                           "faithful")
    elif finding.phase == Phase.NONE:
        finding.detail.recorded = reproduced.recorded(captures[micro])
        reproduced.not_reproduced(finding, finding.detail.recorded, None)
    return trace, finding, micro

def _examine(cap: Capture, trace: Trace, finding: Culprit, ctx: ReplayContext) -> None:
    """``reproduced.examine``; a re-run that fails in the user's code leaves the finding
    as the replay made it (and says why)."""
    try:
        reproduced.examine(cap, trace, finding, ctx.names)
    except Exception as exc:  # noqa: BLE001 - the replay's finding stands without it
        if ctx.strict:
            raise
        finding.detail.rerun_error = f"{type(exc).__name__}: {exc}"[:300]


def _stale_grads(watched: Watched) -> list[str]:
    """The trained parameters whose ``.grad`` holds NaN/inf (one sync per device: on the
    event only)."""
    named = [(watched.param_names.get(id(p), "param"), p.grad)
             for p in watched.trained_params() if p.grad is not None
             and stats.measurable(p.grad)]
    if not named:
        return []
    by_device: dict = {}
    for i, (_, g) in enumerate(named):
        by_device.setdefault(g.device, []).append(i)
    ok = [True] * len(named)
    for idx in by_device.values():  # event only: one sync per device
        flags = torch.stack([torch.isfinite(named[i][1]).all() for i in idx]).cpu()
        for i, flag in zip(idx, flags.tolist()):
            ok[i] = flag
    return [n for (n, _), good in zip(named, ok) if not good]
