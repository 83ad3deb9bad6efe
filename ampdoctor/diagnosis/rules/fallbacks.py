"""The fallbacks, the rules that speak where no failure class does: the script never trained
(``no_training``; ``recording_stopped`` when ampdoctor itself stopped first), a scale that
collapsed with no cause told (``scale_collapse``), non-finite values no class explains
(``nonfinite``). ``RULES`` tries ``no_training`` first and the other two after the trends."""

from __future__ import annotations

from typing import Optional

from ...numfmt import fmt
from ...runfile.payloads import SnapshotDetail
from .. import fixes, reproduced
from ..culprit import snapshot_at
from ..facts import Facts
from ..verdict import FAILED, PRIORITY, Evidence, Finding, Premise, first_bad

# The run's columns these rules read: /steps by name, /stats through the views of
# ``Facts.reduced`` (tests/diagnosis/rules/test_reads.py holds both to the run file's schema).
READS = {"steps": ("step",),
         "stats": ("first_nonfinite",)}

# ---------------------------------------------------------------------------------------------
# The training script stopped before its first step


def rule_no_training(f: Facts) -> Optional[Finding]:
    """No optimizer step was recorded at all."""
    if f.n:
        return None
    stopped = f.stopped
    if stopped is not None:  # the recorder faulted: the script may well have trained
        why = stopped["why"][:200]
        return Finding("recording_stopped", 1.0, f"ampdoctor stopped recording at step "
                       f"{stopped['step']}, before any step was kept, after an internal error "
                       f"({why}); training went on unrecorded, so there is nothing to "
                       "diagnose.", [Evidence(f"recorder error: {why}", "recorder_error",
                                              None, stopped["step"])],
                       priority=PRIORITY["recording_stopped"])
    exc = f.exception
    if exc is not None:
        summary = (f"The script raised {exc[0]} before its first optimizer step; nothing was "
                   "trained." + (f" ({exc[1][:200]})" if exc[1] else ""))
    else:
        summary = ("No optimizer step was recorded: the script never trained (or was stopped "
                   "before its first step).")
    # Below the exception and misuse rules: a script that died on its first step of an AMP
    # error (a -1e9 mask in fp16, fp16 weights under a scaler) is told by its error.
    return Finding("no_training", 1.0, summary, priority=PRIORITY["no_training"])


# ---------------------------------------------------------------------------------------------
# Consequences and fallbacks


def rule_loaded_nonfinite(f: Facts) -> Optional[Finding]:
    """Weights non-finite before the run's first update (a resume from a checkpoint saved
    after an earlier run went NaN, weights loaded so): the replay of a failing step finds a
    module's weights non-finite, and no step before it was applied. Not an op, not the LR,
    not the precision: the checkpoint."""
    if not f.n:
        return None
    for snap in f.snapshots:
        poisoned = SnapshotDetail.from_json(snap["detail"]).weights_nonfinite
        at = f.index_of(snap["step"])
        if not poisoned or f.step_at(at) != snap["step"] or (~f.skipped[:at]).any():
            continue
        step, module = snap["step"], snap["module"]
        names = ", ".join(f"{module}.{p}" if module else str(p) for p in list(poisoned)[:4])
        before = "the run's first step" if at == 0 else \
            f"step {step}, every step before it skipped"
        ev = [Evidence(f"the replay of step {step} found the weights {names} already NaN/inf "
                       f"at {before}: no update had touched them", "weights_loaded_nonfinite",
                       float(len(poisoned)), step, module)]
        fp32 = ", in fp32 too" if snap["fp32_finite"] == 0 else ""
        found = Finding("nonfinite", 0.9, "The weights were non-finite before the run's first "
                        "update: they were loaded or initialised so (a resumed checkpoint saved "
                        f"after an earlier run went NaN). The forward is NaN{fp32}; no op, LR or "
                        "precision change helps. Reload a checkpoint whose weights are finite.",
                        ev,
                        fixes.make(["reload_finite_checkpoint"],
                                   f.fix_context(module=module, step=step)),
                        first_bad(step, module, "forward"), priority=PRIORITY["misuse"] - 1,
                        kind="loaded_nonfinite")
        found.explains = frozenset(int(x) for x in f.steps["step"])
        return found
    return None


def rule_scale_collapse(f: Facts) -> Optional[Finding]:
    """The scale fell and kept falling (a consequence; the root when nothing else is known)."""
    story = f.story
    if not f.n or not story.collapsed:
        return None
    s = f.steps
    skipped = int(f.skipped.sum())
    ev = [Evidence(f"the loss scale fell from {fmt(story.init_scale)} to "
                   f"{fmt(story.final_scale)}; {skipped} of {f.n} steps were skipped"
                   + (f", the last {story.terminal_run} in a row" if story.terminal_run else ""),
                   "scale_fall", story.final_scale, int(s["step"][-1]))]
    first = f.failure_step
    return Finding("scale_collapse", 0.5, "GradScaler kept finding inf/NaN and halved its scale "
                   "again and again: every one of those steps was thrown away.", ev,
                   fixes.make(["use_bf16"], f.fix_context(step=first)),
                   first_bad(first, None, None), root=False)


def rule_nonfinite(f: Facts) -> Optional[Finding]:
    """Non-finite values that no rule explains (an honest fallback, low confidence)."""
    fi = f.failure_index
    # A non-finite loss, or non-finite gradients with no scaler to skip them; gradient
    # overflows that GradScaler skipped are its job (scale_collapse judges when they persist).
    if fi is None or not (f.loss_bad.any() or (not f.has_scaler and f.grad_bad.any())):
        return None
    if f.story.collapsed:
        return None  # scale_collapse speaks for it
    if reproduced.first_unreproduced(f) is not None:
        return None  # the replay of the failure is finite: never "non-finite values" then
    step = f.step_at(fi)  # (the failure step)
    snap = snapshot_at(f, step)
    loc = None
    ev = [Evidence(f"first non-finite loss or gradient at step {step}", "first_bad_step",
                   float(step), step)]
    if snap:
        loc = first_bad(step, snap["module"], snap["phase"])
        text = (f"replay of step {snap['step']}: first non-finite in the {snap['phase']} of "
                f"{snap['module']}")
        if snap["fp32_finite"] == 0:
            text += ", non-finite in fp32 too (its inputs or weights are out of range)"
        ev.append(Evidence(text, "culprit", None, snap["step"], snap["module"]))
    elif f.reduced.first_nonfinite:
        x = f.reduced.first_nonfinite
        loc = first_bad(step, x["module"], x["phase"])
        ev.append(Evidence(f"sampled step {x['step']}: first non-finite {x['phase']} value in "
                           f"{x['module']}", "sampled_first_nonfinite", None, x["step"],
                           x["module"]))
    loss_only = [s for s in f.snapshots if s["phase"] == "loss"]
    if loss_only:
        ev.append(Evidence(_loss_replay_text(loss_only[0]), "replay_loss_phase", None,
                           loss_only[0]["step"]))
        loc = loc or first_bad(step, None, "loss")
    summary = ("Non-finite values appeared and no failure class fits the evidence recorded "
               "(see the notes for what could not be checked).")
    norm = _norm_overflow(f)
    if norm is not None:
        ev.insert(0, Evidence(norm.fact, "norm_overflow", None, step))
        summary = (f"The gradient norm overflowed at step {step}: its loss was finite and the "
                   "replay found every gradient finite, but their norm was +inf. Gradients that "
                   "large are the numbers, not the machine; no failure class fits more.")
    return Finding("nonfinite", 0.3, summary, ev,
                   fixes.make(["check_data"], f.fix_context(step=step)),
                   loc or first_bad(step, None, None), priority=PRIORITY["nonfinite"])


def _norm_overflow(f: Facts) -> Optional[Premise]:
    """not_reproducible's failed ``same_quantity`` premise where it is a norm that overflowed
    over finite gradients (the first replayed failure), else None."""
    snap = reproduced.first_replay(f)
    if snap is None or not reproduced.unreproduced(snap):
        return None
    same = reproduced.premises(f, snap)[0]
    return same if same.status == FAILED and "+inf" in same.fact else None


def _loss_replay_text(snap: dict) -> str:
    """What a loss-phase replay measured, and no more: the output, the loss recomputed (or
    why not), the fp32 recomputation, the targets."""
    d = SnapshotDetail.from_json(snap["detail"])
    seen = d.recorded
    text = f"replay of step {snap['step']}: the batch and the model's outputs are finite"
    if seen is not None and seen.output_nonfinite is False:
        text += " (in the real step too)"
    if d.loss_recomputed is False and d.loss_not_recomputed:
        return text + (f"; the loss was non-finite in the real step and was not recomputed "
                       f"({d.loss_not_recomputed})")
    if d.loss_fp32 is not None and d.loss_fp32.loss_finite is False:
        text += "; the loss recomputed is non-finite, in fp32 too"
        return text + ("; its targets hold nothing invalid: the loss's formula" if d.targets
                       else "")
    return text + "; the loss is not"
