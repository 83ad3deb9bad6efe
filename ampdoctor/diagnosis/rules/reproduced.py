"""Is it the numbers or the machine? What the forensic replays say about reproduction.

A replay re-runs the failing step on the same batch, weights and RNG state, and compares it
with what the real step saw (``record/forensic/reproduced.py`` writes the snapshot's ``recorded``,
``rerun``, ``reproduced``, ``loss_fp32`` and ``targets``). Two verdicts come of it:

* ``not_reproducible`` (``rule_not_reproducible``): the first failing step that was replayed
  was non-finite (its loss, or its gradients with no GradScaler to skip them, or a skip that
  is not GradScaler calibrating) and its replay is finite everywhere. The numbers do not make
  the NaN: a device fault or silent data corruption, a nondeterministic kernel, or code the
  replay does not run. Evidence: the step, what it saw against what the replay gave, how many
  of the run's non-finite steps did not reproduce (per rank in a multi-rank run: ``ranks``).
  One such skip in an otherwise healthy run (GradScaler threw it away, nothing else failed) is
  healthy with a note (``notes``), never a data verdict.
* ``compiler`` (``rule_compiler``): the first failing step replayed was a compiled model's, its
  eager replay is finite, and compiled again (``record/forensic/compiled_replay.py``: the
  snapshot's ``compiled``) it is non-finite. The compiler makes the NaN, not the machine: the
  region and the first non-finite op named, the rungs of backends that were finite and not,
  the fixes tried on the step (the region run eagerly, a backend that keeps it finite). Such
  a replay is never ``unreproduced``.
* ``bad_input`` of kind ``targets`` (``rule_bad_targets``): the loss, recomputed by the torch
  loss function on a finite model output, is non-finite in fp32 too and its targets say why
  (every one ``ignore_index``: the mean over nothing is 0/0): not the precision, the data.

What the replays say, read once for these rules, ``fallbacks``, the notes and the rank
merge, is in ``diagnosis/reproduced.py`` (``first_replay``, ``unreproduced``, ``premises``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...numfmt import fmt
from ...runfile.detail import Recorded, TargetsCheck, TrialOutcome
from ...runfile.payloads import CompiledOp, CompiledReplay, CompiledRung, SnapshotDetail
from .. import fixes, singular
from ..facts import Facts
from ..reproduced import (
    _num,
    began_here,
    compiled_reproduced,
    failing,
    first_replay,
    lone_skip,
    on_failing,
    premises,
    unreproduced,
)
from ..verdict import PRIORITY, Evidence, Finding, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": (),
         "stats": ()}

STEPS_LISTED = 8  # steps named in a count's evidence



# ---------------------------------------------------------------------------------------------
# not_reproducible


def rule_not_reproducible(f: Facts) -> Optional[Finding]:
    """The first replayed failure did not reproduce (see the module docstring); rejected
    where ``premises`` fail."""
    first = first_replay(f)
    if first is None or not unreproduced(first):
        return None
    bad = failing(f)
    unrep = [s for s in on_failing(f, bad) if unreproduced(s)]
    skipped = [bool(f.skipped[f.index_of(s["step"])]) for s in unrep]
    if lone_skip(f, bad, unrep, skipped):
        return None  # GradScaler threw the one bad step away: healthy, with a note
    step = first["step"]
    rank = int(f.run.attrs.get("rank", 0))
    world = int(f.run.attrs.get("world_size", 1))
    ev = [Evidence(_seen_text(first, world), "recorded_nonfinite", None, step),
          Evidence(_replay_text(first), "replay_finite", None, step),
          _count(f, bad, unrep, world, rank)]
    again = SnapshotDetail.from_json(first["detail"]).compiled
    ran = [r.backend for r in (again.rungs if again else None) or [] if r.finite]
    if ran:  # a compiled model: compiled again, the step is finite too (not the compiler)
        ev.append(Evidence(f"step {step} compiled again ({', '.join(ran)}) is finite too: not "
                           "the compiler", "compiled_finite", None, step))
    applied = not f.has_scaler or not skipped[0]
    explains = {s["step"] for s in unrep}
    if applied:
        later = [f.step_at(int(i)) for i in np.flatnonzero(bad) if f.step_at(int(i)) > step]
        explains |= set(later)
        if later:
            poisoned = [s["step"] for s in f.snapshots if s["step"] in later
                        and SnapshotDetail.from_json(s["detail"]).weights_nonfinite]
            seen = (f" (the replays of steps {', '.join(map(str, poisoned[:STEPS_LISTED]))} "
                    "find the weights non-finite)") if poisoned else ""
            ev.append(Evidence(f"no GradScaler skipped step {step}: what it computed reached the "
                               f"weights, and {len(later)} non-finite steps followed{seen}",
                               "weights_poisoned", float(len(later)), step))
    where = f"rank {rank}" if world > 1 else "this device"
    origin = began_here(first) or world == 1
    cause = (f"a device fault or silent data corruption on {where}, a nondeterministic "
             "kernel, or code outside the model that the replay does not run" if origin else
             "another rank (the gradients' all-reduce brings its NaN here: see its file), or "
             "a fault on this one")
    summary = (f"The failure did not reproduce: step {step} was non-finite, but its replay on "
               "the same batch, weights and RNG state is finite. The numbers do not make this "
               f"NaN; it points at the machine: {cause}. Not the data, not the precision.")
    ctx = f.fix_context(step=step)
    ctx.rank = rank if world > 1 else None
    return Finding("not_reproducible", 0.75 if len(unrep) > 1 else 0.6, summary, ev,
                   fixes.make(["test_device", "rerun_elsewhere", "deterministic_algorithms"],
                              ctx), first_bad(step, None, None),
                   priority=PRIORITY["not_reproducible"], explains=frozenset(explains),
                   premises=premises(f, first))


def _seen_text(snap: dict, world: int) -> str:
    """What the real step saw, as the snapshot measured it on the event."""
    seen = SnapshotDetail.from_json(snap["detail"]).recorded or Recorded()
    parts = []
    if seen.loss_nonfinite:
        parts.append("its loss was non-finite")
    if seen.output_nonfinite:
        parts.append("the model's output held NaN/inf when the event fired")
    elif seen.output_nonfinite is False:
        parts.append("the model's output was finite when the event fired")
    elif parts:
        parts.append("the model's output was no longer held when the event fired (not "
                     "measured)")
    if not parts:
        parts.append("its gradients were non-finite" + (
            " (on this rank the loss was finite: they may have come through the all-reduce)"
            if world > 1 else ""))
    return f"step {snap['step']} as it ran: " + ", ".join(parts)


def _replay_text(snap: dict, end: str = ": it did not reproduce") -> str:
    """What the replay gave, from its snapshot (never more than it measured)."""
    d = SnapshotDetail.from_json(snap["detail"])
    again = d.rerun or TrialOutcome()
    text = (f"replay of step {snap['step']} on the same batch, weights and RNG: the batch is "
            "finite (checked), the model's output is finite")
    fns = again.loss_fns
    if again.loss_finite and fns:
        text += (f", the loss recomputed by {', '.join(map(str, fns))} is "
                 f"{fmt(_num(again.loss))}")
        grads = again.grads
        if grads in ("finite", "zero"):
            text += f" and every gradient is {'exactly zero' if grads == 'zero' else 'finite'}"
            if d.rerun_scale is not None:  # the recorded scale overflowed them
                text += f" at loss scale {fmt(d.rerun_scale)}"
    elif d.loss_not_recomputed:
        text += f" (the loss was not recomputed: {d.loss_not_recomputed})"
    else:
        text += ", and so is every gradient of its backward"
    return text + end


def _count(f: Facts, bad: np.ndarray, unrep: list, world: int, rank: int) -> Evidence:
    steps = [s["step"] for s in unrep]
    replayed = len(on_failing(f, bad))
    listed = ", ".join(str(s) for s in steps[:STEPS_LISTED]) + (", ..." if len(steps) >
                                                                 STEPS_LISTED else "")
    where = f" on rank {rank}" if world > 1 else ""
    return Evidence(f"{len(steps)} of the {replayed} replayed non-finite steps{where} did not "
                    f"reproduce (steps {listed}); the run had {int(bad.sum())} non-finite "
                    "steps", "unreproduced_steps", float(len(steps)), steps[0])


# ---------------------------------------------------------------------------------------------
# compiler

RUNG_TEXT = {"aot_eager": "aot_eager (dynamo's and AOT autograd's graph, each op eager)",
             "decomposed": "inductor's decompositions (each op eager)",
             "inductor": "inductor (the default backend)"}
RUNG_NAME = {"aot_eager": "dynamo's graph", "decomposed": "inductor's decompositions",
             "inductor": "inductor's kernels"}
FIRST_TEXT = {"forward": "in the forward", "loss": "in the loss", "backward": "in the backward"}


def rule_compiler(f: Facts) -> Optional[Finding]:
    """The first replayed failure is finite eagerly and non-finite compiled (see the module
    docstring)."""
    first = first_replay(f)
    if first is None or not compiled_reproduced(first):
        return None
    step = first["step"]
    got = SnapshotDetail.from_json(first["detail"]).compiled or CompiledReplay()
    region = got.region or ", ".join(got.regions)
    op = got.op or CompiledOp()
    rungs = got.rungs or []
    ev = [Evidence(_seen_text(first, 1), "recorded_nonfinite", None, step),
          Evidence(_replay_text(first, end=": eager PyTorch computes this step finite"),
                   "replay_finite", None, step, region)]
    ev += [_rung(r, step, region) for r in rungs]
    if op.op:
        ev.append(Evidence(_op_text(op), "compiled_op", None, step, op.module or region))
    alone = got.alone
    if alone is not None and len(got.regions) > 1:
        ev.append(Evidence(f"compiled one at a time, {', '.join(alone) or 'none'} of "
                           f"the {len(got.regions)} compiled regions reproduce alone",
                           "compiled_regions", float(len(alone)), step))
    bad = failing(f)
    later = [f.step_at(int(i)) for i in np.flatnonzero(bad) if f.step_at(int(i)) > step]
    skipped = f.has_scaler and bool(f.skipped[f.index_of(step)])
    explains = {step} | (set() if skipped else set(later))
    by_backend = {r.backend: r.finite for r in rungs}
    failed = [b for b, fin in by_backend.items() if fin is False]
    finite = [b for b, fin in by_backend.items() if fin]
    lowest = got.backend or (failed[0] if failed else "")
    summary = (f"The compiler, not the numbers: step {step} was non-finite, its replay run "
               f"eagerly on the same batch, weights and RNG is finite, and compiled again it "
               f"is non-finite from {RUNG_NAME.get(lowest, lowest)} on "
               f"({', '.join(failed)}): torch.compile of {region} makes this "
               "NaN" + (f", first at {op.op}" if op.op else "")
               + (f" (decomposed from {op.decomposed_from})" if op.decomposed_from else "")
               + "." + (f" Compiled with {', '.join(finite)} the step is finite."
                        if finite else "")
               + " Not the device, not the precision.")
    ctx = f.fix_context(module=region, step=step)
    ctx.compiled = {"region": region, "op": op.op or None, "op_module": op.module,
                    "decomposed_from": op.decomposed_from,
                    "finite_backend": finite[-1] if finite else None}
    ids = ["compiler_disable"] + (["compile_backend"] if finite else []) + ["report_compiler_bug"]
    return Finding("compiler", 0.85, summary, ev, fixes.make(ids, ctx),
                   first_bad(step, region, got.op.graph if got.op else None),
                   priority=PRIORITY["compiler"], explains=frozenset(explains))


def _rung(r: CompiledRung, step: int, region: str) -> Evidence:
    backend = r.backend
    outcome = r.outcome or TrialOutcome()
    text = f"step {step} compiled again with {RUNG_TEXT.get(backend, backend)}: "
    if r.finite is None:
        text += f"not run ({r.error or 'no outcome'})"
    elif r.finite:
        loss = _num(outcome.loss)
        text += "finite" + (f" (loss {fmt(loss)})" if loss is not None else "")
    else:
        where = FIRST_TEXT.get(outcome.first, "")
        text += "non-finite" + (f" {where}" if where else "")
    return Evidence(text, f"compiled_{backend}", None if r.finite is None else
                    float(bool(r.finite)), step, region)


def _op_text(op: CompiledOp) -> str:
    text = f"the first op of the compiled {op.graph} graph whose output is " \
        f"non-finite from finite inputs: {op.op}"
    if op.decomposed_from:
        text += f", decomposed from {op.decomposed_from}"
    if op.module:
        text += f", in {op.module}"
    if op.source:
        text += f" ({op.source})"
    return text


# ---------------------------------------------------------------------------------------------
# bad_input, kind targets


def rule_bad_targets(f: Facts) -> Optional[Finding]:
    """A non-finite loss on a finite output whose fp32 recomputation is non-finite too, and
    whose targets say why."""
    snap = next((s for s in f.snapshots if s["phase"] == "loss" and _target_problem(s)), None)
    if snap is None:
        return _zero_count(f)
    d = SnapshotDetail.from_json(snap["detail"])
    target = _target_problem(snap) or TargetsCheck()
    fp32 = d.loss_fp32 or TrialOutcome()
    step = snap["step"]
    ev = [Evidence(f"replay of step {step}: the batch and the model's output are finite "
                   "(checked)", "output_finite", None, step),
          Evidence(f"the targets of {target.fn or 'the loss'} at step {step}: "
                   f"{target.problem}",
                   "targets", None, step)]
    if fp32.loss_finite is False:
        zero = fp32.grads == "zero"
        ev.append(Evidence(f"recomputed in fp32 the loss is still {fmt(_num(fp32.loss))}"
                           + (" and every gradient is exactly zero" if zero else "")
                           + ": not the precision (turning AMP off would not change it)",
                           "loss_fp32_nonfinite", None, step))
    steps = _nonfinite_losses(f, ev)
    ctx = f.fix_context(step=step)
    ctx.data = {"kind": "targets", "step": step, **target.to_json()}
    summary = ("The targets are the cause, not the precision: at step "
               f"{step} {target.problem}. The model's output is finite, and the loss is "
               "non-finite in fp32 as well" + (", with every gradient exactly zero (nothing to "
                                               "skip, the weights unharmed)"
                                               if fp32.grads == "zero" else "")
               + ": leave AMP as it is and keep such batches out.")
    return Finding("bad_input", 0.9, summary, ev, fixes.make(["check_data"], ctx),
                   first_bad(step, None, "loss"), priority=PRIORITY["bad_input"],
                   kind="targets", explains=frozenset(steps))


def _nonfinite_losses(f: Facts, ev: list[Evidence]) -> list[int]:
    """The steps whose loss was non-finite, and (onto ``ev``) how many, how many skipped."""
    steps = [f.step_at(int(i)) for i in np.flatnonzero(f.loss_bad)]
    if steps:
        skipped = int(f.skipped[f.loss_bad].sum())
        ev.append(Evidence(f"{len(steps)} of {f.n} steps had a non-finite loss (first step "
                           f"{steps[0]}); {skipped} of them skipped", "nonfinite_loss_steps",
                           float(len(steps)), steps[0]))
    return steps


def _zero_count(f: Facts) -> Optional[Finding]:
    """A hand-written loss that divides by a count the batch gives (a masked mean: the sum
    over labelled tokens over their number), 0 on some batches: 0/0 in any precision. Told
    by the denominator read from the loss's graph on a later non-finite step
    (``singular.zero_count``); the replay found every module output finite."""
    if f.failure_index is None:
        return None
    found = singular.zero_count(f, f.failure_step)
    if found is None:
        return None
    at, zeros = found
    first = f.failure_step
    ev = [Evidence(f"replay of step {first}: every module output is finite; the loss is not",
                   "output_finite", None, first),
          Evidence(f"at step {at} a division in the loss (written by hand: its denominator read "
                   "from the autograd graph before that step's backward) divides by exactly 0 "
                   f"({zeros} of its denominators), a value no gradient reaches from the "
                   "model: a count taken from the batch (a mask's sum, the labelled tokens) "
                   "that is 0, so the loss is 0/0 in fp32 too: not the precision",
                   "zero_count", float(zeros), at)]
    steps = _nonfinite_losses(f, ev)
    problem = ("the loss divides by a count from the batch that is 0 (a mean over no "
               "labelled token)")
    ctx = f.fix_context(step=at)
    ctx.data = {"kind": "targets", "step": at, "problem": problem, "zero_count": True}
    summary = (f"The batches are the cause, not the precision: from step {first} some "
               "batches leave the hand-written loss nothing to average over (its denominator, "
               "a count from the batch, is 0), so it is 0/0 in fp32 as well; GradScaler skips "
               "each such step and halves the scale. Leave AMP as it is; clamp the count or "
               "skip those batches.")
    return Finding("bad_input", 0.85, summary, ev, fixes.make(["check_data"], ctx),
                   first_bad(first, None, "loss"), priority=PRIORITY["bad_input"],
                   kind="targets", explains=frozenset(steps))


def _target_problem(snap: dict) -> Optional[TargetsCheck]:
    """The first loss call whose targets hold a problem, if the fp32 recomputation did not
    make the loss finite."""
    d = SnapshotDetail.from_json(snap["detail"])
    if d.loss_fp32 is None or d.loss_fp32.loss_finite is not False:
        return None
    return next((t for t in d.targets if t.problem), None)
