"""Fixes proven on the saved step: what the forensic replay's trials found, on each fix, in
the evidence, and in the fixes' order.

At the event the recorder tried the fixes one step can test on the failing step
(``record/proofs.py``: an fp32 island around the culprit, bf16 instead of fp16, the loss in
fp32, the logits form) and kept each outcome in the snapshot (``detail["trials"]``); a loss
whose backward is singular had the clamp of its op's input tried on the held values
(``singular.clamp_trial``). ``apply`` gives each fix of a diagnosis its ``tried``,
``outcome`` ("with this fix, step 12 is finite (loss 2.31)", "still non-finite at step 12 (in
the backward): not enough on its own", or why it was not tried) and ``finite``, says the
same in the evidence, and ranks the fixes:

1. the verdict's own first fix stays first, unless a trial found it does not help;
2. then the fixes a trial made finite, then those not tried, then those a trial found not
   enough, each group in the verdict's order.

Example::

    d = ampdoctor.diagnose("run.h5")
    [(fx.id, fx.tried, fx.finite) for fx in d.fixes]
    # [('fp32_island', True, True), ('scale_attention', False, None), ('use_bf16', True, True)]
"""

from __future__ import annotations

from typing import Any

from ..numfmt import fmt
from . import singular
from .fixes import Fix
from .verdict import Evidence, Finding

# A fix tried through another one's trial (the same change to the step).
TRIAL_OF = {"norm_in_fp32": "fp32_island"}
WHERE = {"forward": "in the forward", "loss": "in the loss", "backward": "in the backward"}


def apply(f: Any, top: Finding, fixes: list[Fix], evidence: list[Evidence]) -> list[Fix]:
    """``fixes`` (the diagnosis's, in its order) with the trials' outcomes filled in and
    ranked as the module docstring says; a line of ``evidence`` per tried fix."""
    trials = found(f, top)
    if not trials:
        return fixes
    for fx in fixes:
        t = trials.get(TRIAL_OF.get(fx.id, fx.id))
        if not isinstance(t, dict):
            continue
        if not t.get("tried"):
            if t.get("note"):
                fx.outcome = f"not tried: {t['note']}"
            continue
        fx.tried, fx.finite = True, bool(t.get("finite"))
        fx.outcome = t.get("outcome") or outcome(t)
        evidence.append(Evidence(f"tried {fx.id} on the saved step: {fx.outcome}",
                                 f"trial_{fx.id}", 1.0 if fx.finite else 0.0, t.get("step")))
    return ranked(fixes)


def found(f: Any, top: Finding) -> dict[str, dict]:
    """The trials of the replay of ``top``'s first bad step (or the first replay after it),
    with the clamp of a singular loss's op."""
    step = (top.first_bad or {}).get("step")
    if step is None:
        return {}
    out: dict[str, dict] = {}
    for s in f.snapshots:
        trials = s["detail"].get("trials")
        if s["step"] >= step and isinstance(trials, dict) and trials:
            out = {k: v for k, v in trials.items() if isinstance(v, dict)}
            break
    if top.kind == "loss_backward":
        sing = singular.measured(f, step)
        clamp = singular.clamp_trial(sing) if sing is not None else None
        if clamp is not None:
            out["clamp_loss_input"] = clamp
    return out


def outcome(t: dict) -> str:
    """A trial's result in one clause, for the fix and the evidence."""
    step = t.get("step")
    if t.get("finite"):
        loss = t.get("loss")
        shown = f" (loss {fmt(loss)})" if isinstance(loss, (int, float)) else ""
        if t.get("at_scale") is not None:
            shown += (f" at loss scale {fmt(t['at_scale'])} (at the recorded "
                      f"{fmt(t.get('recorded_scale'))} its gradients overflow fp16, and "
                      "GradScaler lowers the scale by itself)")
        return f"with this fix, step {step} is finite{shown}"
    where = WHERE.get(str(t.get("first")), "")
    return f"still non-finite at step {step}{f' ({where})' if where else ''}: not enough on its own"


def ranked(fixes: list[Fix]) -> list[Fix]:
    """The verdict's first fix first unless a trial found it not enough; then tried and
    finite, not tried, tried and not enough (stable within each)."""
    if not fixes:
        return fixes
    keep = [] if _failed(fixes[0]) else [fixes[0]]
    rest = fixes[len(keep):]
    return keep + sorted(rest, key=_rank)


def _failed(fx: Fix) -> bool:
    return fx.tried and fx.finite is False


def _rank(fx: Fix) -> int:
    if fx.tried and fx.finite:
        return 0
    return 2 if _failed(fx) else 1

