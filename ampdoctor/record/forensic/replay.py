"""One instrumented re-run of a captured root call: who went non-finite first, would fp32 help.

``forensics`` captures each step's root-module calls; on an event it hands each one to
``explain(capture, names, ...)``, which

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

from typing import Optional

from ...runfile.schema import Phase
from .computed import computed_input
from .culprit import Culprit, bad_batch, decide, describe
from .culprit_rerun import check_culprit
from .trace import HARD, Capture, Trace


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
