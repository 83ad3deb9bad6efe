"""What a diagnosis says beside its verdict: what it could and could not tell from the run,
how the run ended, what a treated run was treated with, and risks worth knowing.

numpy only. ``engine._conclude`` calls ``notes(facts, top)`` once the verdict is chosen.

Example::

    from ampdoctor.diagnosis.facts import Facts
    notes(Facts(run), finding)   # ['Only 12 steps were recorded: ...', ...]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..numfmt import count, fmt
from ..runfile import schema
from ..runfile.detail import Isolation
from ..runfile.meta import AppliedFix
from ..runfile.payloads import SnapshotDetail
from ..runfile.run import one_line
from ..runfile.schema import Event
from . import ranks, reproduced
from .opprobe import hidden_note
from .restarts import resumed_note
from .thresholds import RUNAWAY_SCALE, SHORT_RUN
from .verdict import EMPTY, Finding


def notes(f: Any, top: Finding) -> list[str]:
    """What the diagnosis could and could not tell from this run, and risks worth knowing."""
    out = _status_notes(f)
    if top.verdict == "recording_stopped":  # its summary says it already
        out = [n for n in out if not n.startswith("ampdoctor stopped recording")]
    if not f.n:
        if top.verdict not in EMPTY:
            out.append("No optimizer step was completed (a step ends at scaler.update(), or at "
                       "optimizer.step() without a scaler), so no per-step data was recorded.")
        return out
    out += _applied_notes(f)
    out += _coverage_notes(f, top)
    # a sharded (FSDP) run: per-shard numbers, replay off

    out += ranks.sharding_notes(f.run.sharding, f.steps)
    out += _compiled_notes(f) + _isolation_notes(f)
    if not f.optimizers and np.all(f.skipped):
        out.append("The optimizer never stepped (every step was skipped), so its settings were "
                   "not recorded.")
    if top.verdict == "healthy":
        out += reproduced.notes(f) + _risks(f) + _flat_notes(f, top) + hidden_note(f)
        out += _spike_notes(top)
    return out + resumed_note(f)


def _spike_notes(top: Finding) -> list[str]:
    """A healthy run whose loss jumped and came back: said, with the fix left to the user."""
    spike = next((e for e in top.evidence if e.key == "loss_spike_recovered"), None)
    if spike is None:
        return []
    return [f"Healthy, but {spike.text}: a spike the run survived. If spikes like it recur, "
            "a lower peak LR or gradient clipping (the optional fix) keeps them away."]


def _flat_notes(f: Any, top: Finding) -> list[str]:
    """Where to look when the loss did not fall and nothing numeric explains it."""
    if not any(e.key == "loss_flat" for e in top.evidence):
        return []
    upd = f.reduced.upd_log[np.isfinite(f.reduced.upd_log)]
    moved = (f" The weights moved by ~{10 ** float(np.median(upd)):.2g} of their norm per step "
             "(median update ratio on the sampled steps).") if len(upd) else (
        " No sampled step measured how far the weights move: record with `--every N`.")
    return ["The loss did not fall and no precision signal explains it: look at the learning "
            "rate (too high bounces, too low crawls), the data (labels that do not match the "
            "inputs) and the loss (parameters it does not reach, or not in the optimizer)."
            + moved]


def _status_notes(f: Any) -> list[str]:
    status = f.run.status
    last = int(f.steps["step"][-1]) if f.n else None
    if status == "running":
        out = [f"The run is still being recorded; this covers the steps up to {last}, the "
               "writer's last flush." if last is not None else
               "The run is still being recorded and has no step yet."]
    elif status == "interrupted" or status.startswith(schema.STATUS_SIGNAL):
        how = "interrupted (its writer never closed the file)" if status == "interrupted" \
            else f"interrupted by {status.split(':', 1)[1]}"
        out = [f"The run was {how}; the last recorded step is {last}: whatever happened later "
               "is not in this file." if last is not None else
               f"The run was {how} before its first recorded step."]
    else:
        out = []
    if status.startswith("exception:"):
        exc = f.exception
        msg = f" ({exc[1][:160]})" if exc and exc[1] else ""
        out.append(f"The training script raised {status.split(':', 1)[1]}{msg}"
                   + (f" after step {last}." if last is not None else "."))
    damaged = getattr(f.run, "damaged", [])
    if damaged:
        out.append("Part of the file is damaged and was left out: table(s) "
                   f"{', '.join('/' + t for t in damaged)} could not be read.")
    for s in f.run.skipped_modules[:3]:
        out.append(f"ampdoctor left out a module it could not record, "
                   f"{str(s.get('module'))[:60]} ({str(s.get('why'))[:160]}); the rest of the "
                   "run is recorded.")
    errors = f.events(Event.RECORDER_ERROR)
    if len(errors):
        why = one_line(str(errors["text"][0]))[:160]
        out.append(f"ampdoctor stopped recording at step {int(errors['step'][0])} after an "
                   f"internal error ({why}); training went on, but what followed is not in "
                   "this file.")
    return out


def _coverage_notes(f: Any, top: Finding) -> list[str]:
    """Checks that lacked the data they need: no sampled step, a short run, no replay."""
    out = []
    recorder = f.meta.get("recorder") if isinstance(f.meta.get("recorder"), dict) else {}
    every = recorder.get("every")
    if not f.sampled_steps:
        why = (f" (the sampling interval, {every} steps, is longer than the run)"
               if every and every > f.n else "")
        out.append("No sampled step was recorded" + why + ": gradient underflow, LR-driven "
                   "growth, bf16 rounding and BatchNorm buffers could not be checked. Record "
                   "with `--every N` (N below the run length) to measure them.")
    elif f.sampled_steps < 3 and top.verdict == "healthy":
        out.append(f"Only {count(f.sampled_steps, 'sampled step')}: trends are measured on few "
                   "points.")
    if f.n < SHORT_RUN and top.verdict == "healthy":
        out.append(f"Only {f.n} steps were recorded: whether the loss falls is judged from "
                   f"{SHORT_RUN} steps on, and failures that build up over time (LR-driven "
                   "growth, scale probing) may not have shown yet.")
    elif top.verdict == "healthy" and not f.curve.judged:
        out += _unjudged_note(f)
    located = [s for s in f.snapshots if s["phase"] not in ("none", "unknown")]
    if f.failure_index is None or located or top.verdict in EMPTY:
        return out
    if recorder.get("forensics") is False:
        out.append("Forensic replay was off: the failing op could not be located and checked "
                   "in fp32.")
    elif recorder.get("max_replays") is not None and len(f.snapshots) >= \
            recorder["max_replays"]:
        out.append(f"The forensic replay budget ({recorder['max_replays']}) was spent on "
                   "earlier skipped steps, so the failing step was not replayed; the module "
                   "comes from sampled statistics, if any.")
    return out


def _unjudged_note(f: Any) -> list[str]:
    """Why the loss curve was not judged; a loss that reached exactly 0 has converged."""
    loss = f.steps["loss"].astype(float)
    fin = loss[np.isfinite(loss)]
    if len(fin) and fin[0] > 0 and np.all(fin >= 0) and np.any(fin == 0):
        step = f.first(np.isfinite(loss) & (loss == 0))
        return [f"The loss reached exactly 0 at step {step}: the model fits its data exactly "
                "(converged), so its exact zero gradients are not dead units."]
    return [f"Whether the loss fell was not judged: {f.curve.why}."] if f.curve.why else []


def _applied_notes(f: Any) -> list[str]:
    """A run treated with ``record --apply``: what was applied, and what could not be."""
    applied: list[AppliedFix] = f.run.applied  # (Facts.run is untyped: the records are not)
    if not applied:
        return []
    out = ["This run was treated with " + ", ".join(f"--apply {a.arg}" for a in applied)
           + " (ampdoctor record --apply): compare it with the untreated run, ampdoctor "
           "compare run.h5 fixed.h5."]
    for a in applied:
        if a.error:
            out.append(f"--apply {a.arg} could not be applied ({a.error}): this run "
                       "ran without it.")
        if a.missing:
            out.append(f"--apply fp32_island: no module named {', '.join(a.missing)} in the "
                       "model (names as diagnose shows them, e.g. blocks.0.attn): "
                       + ("those ran as before." if a.modules else
                          "no island was made."))
        for name, why in (a.skipped or {}).items():
            out.append(f"--apply fp32_island: {name} was left as it was: {why} (only "
                       "model.float() in the code makes it an island).")
    return out


def _isolation_notes(f: Any) -> list[str]:
    """A replay refused because the model's code would have written outside the run; one that
    ran without the user's hooks and did not repeat the failure, or found nothing: a hook that
    changes values did not act in it."""
    errors = [(s, str(SnapshotDetail.from_json(s["detail"]).replay_error or ""))
              for s in f.snapshots]
    refused = [(s, e) for s, e in errors if e.startswith("SideEffect: ")]
    if refused:
        s, error = refused[0]
        why = error[len("SideEffect: "):]
        return [f"Step {s['step']} was not replayed: {why}. Move that write out of the "
                "model's forward (or into a hook) to let ampdoctor locate the failure."]
    for s in f.snapshots:
        d = SnapshotDetail.from_json(s["detail"])
        iso = d.isolation or Isolation()
        unlocated = s["phase"] in ("none", "unknown") or d.reproduced is False
        aside = iso.hooks_set_aside + iso.hooks_not_installed
        if aside and unlocated:
            return [f"The replay of step {s['step']} ran without the user's "
                    f"{count(aside, 'hook')} (a replay never runs the user's hooks, so that "
                    "it cannot change what the training sees): a hook that changes values, "
                    "such as a gradient reversal or a clamp written as a hook, did not act "
                    "in it, which may be why it did not find the failure."]
    return []


def _compiled_notes(f: Any) -> list[str]:
    """What a torch.compile'd model kept out of the sampled statistics."""
    info = f.meta.get("compiled")
    if not isinstance(info, dict) or not info.get("regions"):
        return []
    where = ", ".join(str(r.get("module")) for r in info["regions"][:3])
    hooked = ", ".join(str(m) for m in (info.get("hooked") or [])[:3]) or "none"
    return [f"{where} ran under torch.compile: the outputs of the modules inside it were not "
            f"measured on sampled steps (module outputs measured: {hooked}); gradients, "
            "weights and forensic replays (run eagerly) cover every layer."]


def _risks(f: Any) -> list[str]:
    """Configurations that have not failed in this run but are known to (taxonomy Stage A)."""
    out = []
    s = f.steps
    if f.low_precision == "fp16" and not f.has_scaler and f.autocast_dtype == "float16":
        out.append("fp16 autocast without a GradScaler: gradients below 6e-8 flush to zero. "
                   "None were seen to underflow here, but a GradScaler (or bf16) is the safe "
                   "setup.")
    seen = s["loss_dtype"] != 0
    if seen.any() and np.mean(s["loss_dtype"][seen] == 2) >= 0.5:
        out.append("The loss is computed in float16 (outside autocast): a sum or mean over many "
                   "elements can pass 65504. Compute it in fp32.")
    if f.params_mostly("bfloat16") and not f.sampled_steps:
        out.append("The weights are bf16 and updated in place: updates below ~0.4 % of a weight "
                   "round away. Keep fp32 master weights if the loss stalls.")
    if f.has_scaler and f.story.final_scale >= RUNAWAY_SCALE:
        out.append(f"The loss scale grew to {fmt(f.story.final_scale)} without overflowing: "
                   "gradients this small are often zero or disconnected (a detached loss, "
                   "parameters missing from the optimizer, a loss weight of 0).")
    story = f.story
    if f.has_scaler and story.post_skips and story.benign:
        skipped = count(int(f.skipped.sum()), "step")
        if story.grew:  # a skip after the scale doubled: GradScaler probing upwards
            out.append(f"GradScaler skipped {skipped} ({story.calib_len} while calibrating, "
                       f"{story.post_skips} later, each with a finite loss): normal probing, "
                       "not a failure.")
        else:  # the scale never grew, so no skip was a probe of a higher scale
            out.append(f"GradScaler skipped {skipped} ({story.calib_len} while calibrating, "
                       f"{story.post_skips} later, each with a finite loss, the scale never "
                       "having grown): a batch now and then whose scaled gradients pass fp16's "
                       "range; each skip halved the scale. Not a failure unless it goes on.")
    elif f.has_scaler and story.post_skips and not reproduced.notes(f):  # (that note says it)
        out.append(f"GradScaler skipped {story.post_skips} steps after calibration, more often "
                   "than probing explains (gradients overflowing fp16 at the current scale); "
                   f"each skip halved the scale, now {fmt(story.final_scale)}. Not a failure yet: "
                   "watch for a falling scale.")
    elif f.has_scaler and f.story.calib_len:
        out.append(f"GradScaler skipped the first {count(f.story.calib_len, 'step')} while it "
                   "calibrated its scale: normal.")
    return out
