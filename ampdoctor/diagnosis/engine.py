"""Run → Diagnosis: what went wrong, where, on what evidence, and what to change.

numpy only: like all of the analysis side (``runfile``, ``release``, ``render``), it never
imports torch.

The engine is a list of small rules (``rules.RULES``) over ``Facts`` (``facts.py``: views of a
run computed once, streaming the big stats table). Each rule returns a ``Finding`` or None.
Findings are root causes or consequences (a scale collapse is the consequence of an
overflowing op); the verdict is the strongest root cause, the consequences and any other
roots become the causal chain in ``causes``. When no rule fires the run is healthy, with
notes on what could not be checked.

Verdict ids are a public contract (JSON, exit codes, tests, README):
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import asdict
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..errors import AmpDoctorError, FormatTooNewError, RunFileError
from ..numfmt import count, fmt
from ..runfile.paths import resolve
from ..runfile.schema import STEPS
from . import fixes, forecast, fp8, fp8ranks, job, jobfiles, objectives, proofs, ranks, rankview
from .facts import Facts
from .notes import notes
from .progress import flat_warning, recovered_spike
from .rules import RULES
from .verdict import EMPTY, VERDICTS, Diagnosis, Evidence, Finding

__doc__ += "\n".join(f"    {k:<17} {v}" for k, v in VERDICTS.items()) + "\n"
__all__ = ["EMPTY", "RULES", "VERDICTS", "Diagnosis", "Evidence", "Finding", "diagnose"]

# The /steps columns a diagnosis reads: every one but the wall clock, the step time and the
# memory (a month-long run's are 200 of its 620 MB). One it asks for later is read then.
STEP_COLUMNS = tuple(n for n in STEPS.names or () if n not in ("time", "dt", "peak_mem"))

# ---------------------------------------------------------------------------------------------
# Entry points


def diagnose(run: Any, *, rules: Optional[Iterable[Callable]] = None,
             rank: Optional[int] = None, baseline: Any = None) -> Diagnosis:
    """Diagnose a run: a path or a loaded ``Run``. The rank files of a torchrun job (``run.h5``
    absent, ``run.rank{R}.h5`` beside it) are diagnosed together; ``rank`` diagnoses one of
    them on its own. ``baseline`` (a path or a ``Run``): the same training in bf16 (or fp32)
    that a run in fp8 is measured against (``fp8_drift``).

    Example::

        d = ampdoctor.diagnose("run.h5")
        d.verdict, d.first_bad, [fx.id for fx in d.fixes]
        ampdoctor.diagnose("run.h5", rank=3)     # rank 3's own diagnosis
        ampdoctor.diagnose("fp8.h5", baseline="bf16.h5")
    """
    from ..runfile.store import Run, load

    if isinstance(run, (str, os.PathLike, list, tuple)):
        paths = resolve(os.fspath(run)) if isinstance(run, (str, os.PathLike)) else list(run)
        if rank is not None:
            paths = [_rank_file(run, paths, rank)]
        if len(paths) > 1:
            if baseline is not None:
                raise AmpDoctorError(f"{run} is {len(paths)} rank files: a baseline is "
                                     "compared with one (--rank R names it)")
            return diagnose_files(paths, rules=rules)
        with load(paths[0], STEP_COLUMNS) as loaded:
            return diagnose(loaded, rules=rules, rank=rank, baseline=baseline)
    if not isinstance(run, Run):
        raise TypeError(f"diagnose() takes a path or a Run, not {type(run).__name__}")
    if rank is not None and run.rank != rank:
        raise AmpDoctorError(f"{run.path or 'the run'} is rank {run.rank}'s file, not rank "
                             f"{rank}'s")
    facts = Facts(run)
    if baseline is not None:
        facts.baseline = _baseline(baseline)
    return _diagnosed(facts, rules)


def _diagnosed(facts: Facts, rules: Optional[Iterable[Callable]]) -> Diagnosis:
    """The rules over one run's facts (``baseline`` or ``fp8_ranks`` already set), concluded."""
    run = facts.run
    chosen = rules if rules is not None else RULES
    findings = [x for rule in chosen for x in [rule(facts)] if x is not None]
    d = ranks.per_shard(_conclude(facts, findings), run.sharding)
    # The early warning never changes the verdict: healthy, it looks ahead from the last step;
    # failed, it says what it saw before the first bad step and from when it would have warned.
    step = (d.first_bad or {}).get("step")
    if d.healthy:
        d.forecast = forecast.for_diagnosis(run, None)
    elif step is not None:
        d.forecast = forecast.for_diagnosis(run, int(step))
    return d


def unmet_premises(run: Any, d: Diagnosis) -> list[str]:
    """The fixes ``d`` offers whose declared premise (``fixes/premises.py``) fails on ``run``
    (a path or a ``Run``; of a job's rank files, the rank its failure began on), read at the
    verdict's first bad step and module: ``["use_bf16: re-run in fp32, ..."]``; empty where
    every premise holds."""
    from ..runfile.store import load

    if not isinstance(run, (str, os.PathLike)):
        where = d.first_bad or {}
        ctx = Facts(run).fix_context(where.get("module"), step=where.get("step"))
        return [f"{fx.id}: {why}" for fx in d.fixes if (why := fixes.unmet(fx, ctx))]
    paths = resolve(os.fspath(run))
    rank = (d.first_bad or {}).get("rank")
    path = next((p for p in paths if paths_rank(p) == rank), paths[0])
    with load(path) as loaded:
        return unmet_premises(loaded, d)


def _baseline(baseline: Any) -> fp8.Baseline:
    """The baseline's steps and fp8 layers, read (a path) or taken (a ``Run``)."""
    from ..runfile.store import Run, load

    if isinstance(baseline, Run):
        return fp8.Baseline.of(baseline)
    with load(os.fspath(baseline)) as loaded:
        return fp8.Baseline.of(loaded)


def _rank_file(run: Any, paths: list[str], rank: int) -> str:
    """The file of ``rank`` among a run's files (by name, else by its recorded rank)."""
    from ..runfile import summary

    if len(paths) == 1 and not isinstance(run, (list, tuple)):
        return paths[0]  # one file: diagnose() checks that it is that rank's
    named = [p for p in paths if paths_rank(p) == rank]
    if named:
        return named[0]
    for p in paths:
        s = summary.read(p)
        if s is not None and s.rank == rank:
            return p
    have = [r for r in (paths_rank(p) for p in paths) if r is not None]
    shown = run if isinstance(run, (str, os.PathLike)) else "the run"
    raise AmpDoctorError(f"{os.fspath(shown)} has no file for rank {rank}"
                         + (f" ({ranks.ranks_text(sorted(have))} found)" if have else ""))


def paths_rank(path: str) -> Optional[int]:
    """The rank in a rank file's name (``run.rank3.h5`` -> 3), else None."""
    match = re.search(r"\.rank(\d+)\.[^.]*$", os.fspath(path))
    return int(match.group(1)) if match else None


def diagnose_files(paths: Iterable[str], *, rules: Optional[Iterable[Callable]] = None,
                   full: bool = False, nodes: bool = True) -> Diagnosis:
    """Diagnose the rank files of one run together; returns one ``Diagnosis``.

    Each rank's summary is read from its node summary (``runfile/nodes.py``: one small file
    per node, where one is there and no older than the rank's file), else from the rank
    file's own ``/summary`` (a few milliseconds a file), and only the ranks that matter are
    read in full, one at a time (``job.chosen``: where a value went non-finite first, and a
    few whose loss scale or skip count disagrees), so time and memory stay small for
    thousands of ranks. A file without a usable summary (format 1, a flush cut short) is read
    in full for its part; one that cannot be read at all (cut short, not a run file) is left
    out, and a note names it. ``full=True`` reads and diagnoses every rank (the reference the
    fast path is tested against, and ``benchmarks/scale_diagnose.py`` times): the same
    verdict, first bad step and rank. ``nodes=False`` passes the node summaries over.

    Example::

        d = engine.diagnose_files(paths.rank_files("run.h5"))
        d.first_bad["rank"], d.run["ranks"], d.rank_view["origins"]
    """
    paths = list(paths)
    if full:
        return _diagnose_all(paths, rules)
    found = _node_summaries(paths, nodes)
    facts, left_out = _all_facts(paths, found)
    ranks.read_own_flags([f.outline for f in facts], ranks.own_flag_in_file)
    chosen = job.chosen(facts, job.base_rank(facts))
    shares = _norm_shares(facts)
    agreed: dict = {}  # the fp8 operands compared across the ranks, once (``_agreement``)
    diagnoses: dict[str, Diagnosis] = {}
    for i, f in enumerate(facts):  # one at a time, each closed before the next: flat memory
        if any(c is f for c in chosen):
            try:
                diagnoses[f.path], facts[i] = _diagnose_rank(
                    f.path, rules, shares, lambda run: _agreement(run, facts, agreed))
            except RunFileError as exc:  # its summary stands for it, as for a rank not chosen
                left_out.append(str(exc))
                continue
            facts[i].outline["own_bad"] = f.outline["own_bad"]  # read once, above
    read = [f.rank for f in chosen]  # the base rank first
    scales = job.compare_scales(facts, _steps_history)
    per_rank = [(f.outline, diagnoses.get(f.path), None) for f in facts]
    d = ranks.merge(per_rank, divergence=scales, scaled=any(f.scaled for f in facts))
    _job_notes(d, facts, read, shares)
    d.notes += _agreement_notes(agreed.get("found"))
    d.notes += jobfiles.notes(found, left_out, len(paths))
    d.rank_view = rankview.build(facts, origin=d.run["origin_rank"], scales=scales, full=read)
    return d


def _node_summaries(paths: list[str], use: bool) -> Any:
    from ..runfile import nodes

    return nodes.lookup(paths) if use and len(paths) > 1 else nodes.Found()


def _all_facts(paths: list[str], found: Any) -> tuple[list[job.RankFacts], list[str]]:
    """Every rank's facts, by rank, and why each file left out could not be read (one file
    cut short must not stop the diagnosis of the others)."""
    facts, left_out = [], []
    for p in paths:
        try:
            facts.append(_facts(p, found.summaries.get(p)))
        except FormatTooNewError:
            raise  # an upgrade reads them all: said once, not left out rank by rank
        except RunFileError as exc:
            left_out.append(str(exc))
    if not facts:
        raise RunFileError(left_out[0])
    facts.sort(key=lambda f: f.rank)
    return facts, left_out


def _facts(path: str, known: Any = None) -> job.RankFacts:
    """One rank from its summary (its node summary's, or its own); from the file itself
    where it has none to trust."""
    from ..runfile.store import load, summary

    s = known if known is not None else summary.read(path)
    if s is not None:
        return job.from_summary(s)
    with load(path) as run:
        return job.from_run(run)


def _diagnose_rank(path: str, rules: Optional[Iterable[Callable]],
                   shares: Optional[ranks.NormShares], agreement: Callable[[Any], Any]
                   ) -> tuple[Diagnosis, job.RankFacts]:
    from ..runfile.store import load

    with load(path, STEP_COLUMNS) as run:
        if shares is not None:
            shares.apply(run.steps)
        return _with_ranks(run, rules, agreement(run)), job.from_run(run)


def _agreement(run: Any, facts: list[job.RankFacts], agreed: dict) -> Any:
    """The job's fp8 operands compared across its rank files (``fp8ranks.compare``), computed
    once, when the first rank read in full declares some (a job without fp8 layers opens no
    other file for it; one with them, each other file once, beside this one)."""
    if "found" not in agreed:
        agreed["found"] = fp8ranks.compare([f.path for f in facts], loaded=run) \
            if fp8ranks.declares(run) else None
    return agreed["found"]


def _with_ranks(run: Any, rules: Optional[Iterable[Callable]], agreement: Any) -> Diagnosis:
    """One rank file diagnosed with what the job's rank files say together (the fp8 operands
    several ranks hold, compared: ``fp8ranks.Agreement``)."""
    facts = Facts(run)
    facts.fp8_ranks = agreement
    return _diagnosed(facts, rules)


def _agreement_notes(agreement: Any) -> list[str]:
    """What the comparison of the fp8 operands across ranks found, where they all agreed
    (a disagreement is ``fp8_amax_mismatch``'s)."""
    if agreement is None or agreement.mismatched or not agreement.steps:
        return []
    n = len(agreement.operands)
    return [f"{n} fp8 operand{'s' if n > 1 else ''} that several ranks hold whole (by the "
            "recorded layout: a DDP weight, a replicated DTensor) compared across the "
            f"{agreement.files} rank files on {agreement.steps} sampled steps: amaxes and "
            "scales bit-equal."]


def _norm_shares(facts: list[job.RankFacts]) -> Optional[ranks.NormShares]:
    """A sharded run's global gradient norms (``ranks.NormShares``), read rank by rank from
    /steps alone; None when no rank recorded a share."""
    from ..runfile.store import load_steps

    if not any(f.local_norm_steps for f in facts):
        return None
    shares = ranks.NormShares(max(f.world_size for f in facts))
    for f in facts:
        shares.add(load_steps(f.path))
    return shares


def _steps_history(path: str) -> job.History:
    """A rank's loss scale at each step, from its /steps (when its summary cannot say)."""
    from ..runfile.store import load_steps

    steps = load_steps(path)
    scales = {int(k): float(v) for k, v in zip(steps["step"], steps["scale"])
              if not np.isnan(v)}
    keys = np.array(sorted(scales), dtype=np.int64)
    return keys, np.array([scales[k] for k in keys.tolist()], dtype=np.float64)


def _job_notes(d: Diagnosis, facts: list[job.RankFacts], chosen: list[int],
               shares: Optional[ranks.NormShares]) -> None:
    if shares is not None and shares.combined:
        d.notes.append(_combined_note(shares.combined, len(facts)))
    rest = len(facts) - len(chosen)
    if rest > 0:
        d.notes.insert(1, f"Read in full: {ranks.ranks_text(chosen)}; the other {rest} rank "
                          "files were read from their summaries (steps, skips, first bad step, "
                          "loss scale, status), so their own notes are not listed: "
                          "`ampdoctor diagnose RUN --rank R` diagnoses one rank.")
    d.notes += job.summary_notes(facts, chosen)
    unread = job.unreproduced_unread(facts, chosen)
    if unread:
        d.notes.append(f"{unread} more ranks had a non-finite loss that a replay found finite; "
                       "only the first "
                       f"{job.UNREPRODUCED_FULL} were read in full for how many of their steps "
                       "did not reproduce: `--rank R` tells the others.")


def _combined_note(steps: int, files: int) -> str:
    return (f"The global gradient norm of {steps} steps was combined from the {files} ranks' "
            "shards (no clip_grad_norm_ ran on them): the square root of the sum of each "
            "rank's squared share.")


def _diagnose_all(paths: list[str], rules: Optional[Iterable[Callable]]) -> Diagnosis:
    """Every rank loaded and diagnosed (all open at once): the reference for the fast path."""
    from ..runfile.store import load

    per_rank = []
    facts = []
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(load(path)) for path in paths]
        combined = ranks.combine_grad_norms(runs)
        agreement = fp8ranks.compare_runs(runs)
        outlines = [ranks.outline(run) for run in runs]
        by_path = {r.path: r for r in runs}
        ranks.read_own_flags(outlines, lambda o, step: ranks.own_flag(by_path[o["path"]].steps,
                                                                       step))
        for run, outline in zip(runs, outlines):
            per_rank.append((outline, _with_ranks(run, rules, agreement), ranks.scales(run)))
            facts.append(job.from_run(run, outline))
        scales = job.compare_scales(sorted(facts, key=lambda f: f.rank),
                                    lambda p: job.history_of(by_path[p]))
    per_rank.sort(key=lambda item: item[0]["rank"])
    facts.sort(key=lambda f: f.rank)
    d = ranks.merge(per_rank)
    if combined:
        d.notes.append(_combined_note(combined, len(runs)))
    d.notes += _agreement_notes(agreement)
    d.rank_view = rankview.build(facts, origin=d.run["origin_rank"], scales=scales,
                                 full=[f.rank for f in facts])
    return d


def _conclude(f: Any, findings: list[Finding]) -> Diagnosis:
    """The strongest root cause is the verdict; consequences and other roots form the chain.
    A finding whose premise failed takes no part: it is listed under ``rejected``, with why."""
    rejected = [x for x in findings if x.failed]
    findings = [x for x in findings if not x.failed]
    roots = sorted((x for x in findings if x.root), key=lambda x: -x.priority)
    consequences = [x for x in findings if not x.root]
    if not roots and consequences:
        # Something went wrong and no rule could tell why: the most telling consequence
        # becomes the verdict, honest about its low confidence.
        top = max(consequences, key=lambda x: x.verdict == "scale_collapse")
        consequences.remove(top)
        top.summary += " " + _missing(f)
        top.confidence = min(top.confidence, 0.4)
    elif roots:
        top = roots[0]
    else:
        top = _healthy(f)
        unjudged = next((x for x in rejected if x.verdict == "not_learning"), None)
        if unjudged is not None:  # no failure, but whether it learned could not be judged
            top.summary += (" Whether the run learned was not judged: "
                            f"{unjudged.failed[0].fact}.")
            top.confidence = min(top.confidence, UNJUDGED_CONFIDENCE)
    causes = [_cause(top, "root")]
    causes += [_cause(x, "consequence") for x in consequences]
    # Other roots are worth knowing; the honest fallbacks (non-finite values no class
    # explains, a flat loss no cause explains) are not, next to one.
    also = [x for x in roots[1:] if x.verdict not in (top.verdict,) + FALLBACKS + EMPTY
            and not _explained_by(top, x)]
    causes += [_cause(x, "also") for x in also]
    evidence = list(top.evidence)
    seen_ev = {(e.key, e.text) for e in evidence}
    for e in (e for x in consequences for e in x.evidence):
        if (e.key, e.text) not in seen_ev:  # a consequence may restate the root's numbers
            seen_ev.add((e.key, e.text))
            evidence.append(e)
    seen = {fx.id for fx in top.fixes}
    fixes = list(top.fixes)
    # After the script's own misuse, or weights loaded non-finite, what followed (a scale
    # collapse) is fixed by fixing the calls or the checkpoint: a precision change for the
    # consequence would not apply; nor after targets that make the loss non-finite in fp32 too.
    own = top.verdict in ("clip_order", "nonfinite") or top.kind == "targets"
    for x in (consequences if not own else []) + also:
        for fx in x.fixes:
            if fx.id not in seen:
                seen.add(fx.id)
                fixes.append(fx)
    fixes = proofs.apply(f, top, fixes, evidence)  # the trials of the saved step, and the order
    summary = top.summary + (proofs.island_outcome(fixes) if top.verdict == "unstable_op"
                             else "")
    history = f.window(top.first_bad["step"]) if top.first_bad and top.first_bad.get(
        "step") is not None and f.n else {}
    return Diagnosis(verdict=top.verdict, confidence=round(top.confidence, 2),
                     summary=summary, first_bad=top.first_bad, causes=causes,
                     evidence=evidence, fixes=fixes, run=run_summary(f),
                     notes=notes(f, top) + [_rejected_note(x) for x in rejected],
                     history=history, premises=list(top.premises),
                     rejected=[_rejected(x) for x in rejected])


def _rejected(x: Finding) -> dict:
    return {"verdict": x.verdict, "confidence": round(x.confidence, 2), "summary": x.summary,
            "premises": [asdict(p) for p in x.premises]}


def _rejected_note(x: Finding) -> str:
    """Why a verdict a rule found is not given: its failed premises, as measured."""
    why = "; ".join(p.fact for p in x.failed)
    return f"Not {x.verdict}: {why}."


def _explained_by(top: Finding, x: Finding) -> bool:
    """Is ``x`` only a symptom of ``top``: located at a module whose output ``top`` accounts
    for, or every step it points at is one ``top`` explains?"""
    module = (x.first_bad or {}).get("module")
    if module is not None and module in top.explains_modules:
        return True
    steps = [e.step for e in x.evidence if e.step is not None]
    if x.first_bad and x.first_bad.get("step") is not None:
        steps.append(x.first_bad["step"])
    return bool(top.explains) and bool(steps) and all(int(t) in top.explains for t in steps)


# Verdicts that say no cause was found: never listed as "also" beside a cause.
FALLBACKS = ("nonfinite", "not_learning")
# A healthy verdict whose loss jumped and then stayed above half its start
# (progress.flat_warning) is no more sure than this.
FLAT_CONFIDENCE = 0.6
# ... nor one whose flat loss could not be judged (not_learning's premise failed: several
# models' losses averaged into one curve).
UNJUDGED_CONFIDENCE = 0.6
# ... nor one whose loss jumped 5x or more and came back (progress.recovered_spike).
SPIKE_CONFIDENCE = 0.75


def _healthy(f: Any) -> Finding:
    """No rule fired. When a spike left the loss above half its start, the headline says so
    (a warning: the loss fell, but not far; one that did not fall is not_learning's)."""
    found = Finding("healthy", _healthy_confidence(f), _healthy_summary(f), _checked(f))
    warning = flat_warning(f) if f.n else None
    if warning is not None:
        found.summary = ("No numeric failure was found, but the loss did not fall far: "
                         f"{warning.text}. ampdoctor cannot tell a run that stopped learning "
                         "from one whose loss is not meant to fall (a fine-tune at its optimum, "
                         "a GAN); if it should have fallen, see the notes.")
        found.confidence = min(found.confidence, FLAT_CONFIDENCE)
        found.evidence.insert(0, warning)
    spike = recovered_spike(f) if f.n and warning is None else None
    if spike is not None:
        found.confidence = min(found.confidence, SPIKE_CONFIDENCE)
        found.evidence.insert(0, spike)
        found.fixes = fixes.make(["lower_lr"], f.fix_context(step=spike.step))
        for fx in found.fixes:
            fx.text = ("Optional (the run recovered; one bad batch needs no change): if such "
                       "spikes recur, " + fx.text[:1].lower() + fx.text[1:])
    return found


def _cause(x: Finding, role: str) -> dict:
    out = {"verdict": x.verdict, "role": role, "text": x.summary,
           "confidence": round(x.confidence, 2)}
    if x.premises:
        out["premises"] = [asdict(p) for p in x.premises]
    if x.kind:
        out["kind"] = x.kind
    if x.first_bad:
        out["first_bad"] = x.first_bad
    return out


def _healthy_summary(f: Any) -> str:
    if not f.n:
        return ""
    body = "no non-finite loss or gradient reached the weights" + (
        ", and the loss scale behaved normally." if f.has_scaler else ".")
    stopped = f.stopped
    if stopped is None:
        return "No failure: " + body
    return (f"No failure in the {f.n} steps recorded: {body} But ampdoctor stopped recording "
            f"at step {stopped['step']} after an internal error: what followed is not covered.")


def _checked(f: Any) -> list[Evidence]:
    """What a healthy verdict rests on: the numbers that were looked at."""
    if not f.n:
        return []
    s = f.steps
    finite = int(np.isfinite(s["loss"]).sum())
    skipped = count(int(f.skipped.sum()), "step")
    ev = [Evidence(f"{finite} of {f.n} losses finite, {skipped} skipped",
                   "finite_losses", float(finite))]
    if f.has_scaler:
        st = f.story
        ev.append(Evidence(f"loss scale {fmt(st.init_scale)} -> {fmt(st.final_scale)} (lowest "
                           f"{fmt(st.min_scale)})", "loss_scale", st.final_scale))
    reduced = f.reduced
    under = reduced.layer_under
    measured = np.isfinite(under)
    if measured.any() and f.low_precision:
        worst = int(np.nanargmax(np.where(measured, under, -1)))
        ev.append(Evidence(f"gradients measured on {f.sampled_steps} sampled steps: the worst "
                           f"layer, {f.tensor_names[worst]}, has {under[worst]:.1%} of its "
                           f"non-zero gradient in the {f.low_precision} subnormal band",
                           "worst_layer_underflow", float(under[worst]), None,
                           f.tensor_names[worst]))
    upd = reduced.upd_log[np.isfinite(reduced.upd_log)]
    if len(upd):
        ev.append(Evidence(f"update ratio |dW|/|W| ~{10 ** float(np.median(upd)):.2g} per step "
                           "(median over the sampled steps)", "update_ratio",
                           10 ** float(np.median(upd))))
    return ev + objectives.evidence(f, f.objectives)


def _healthy_confidence(f: Any) -> float:
    """How sure "healthy" is: it rests on what was measured."""
    if not f.n:
        return 0.0
    conf = 0.6
    if f.sampled_steps >= 2:
        conf += 0.2
    if f.run.status == "finished":
        conf += 0.1
    return conf


def _missing(f: Any) -> str:
    """What would have told the root cause, and why it is not in this run."""
    missing = []
    located = [s for s in f.snapshots if s["phase"] not in ("none", "unknown")]
    recorder = f.meta.get("recorder") if isinstance(f.meta.get("recorder"), dict) else {}
    if not located:
        if recorder.get("forensics") is False:
            missing.append("forensic replay was off, so the op that first went non-finite "
                           "was not searched for")
        elif f.snapshots:
            missing.append(f"the {len(f.snapshots)} forensic replays found every value finite "
                           "(the overflow is in a parameter's gradient, or did not reproduce)")
        elif f.run.sharding is not None and f.run.sharding.replay == "off":
            missing.append("forensic replay is off for a sharded model (a rank replaying "
                           "alone would hang the job), and each rank's batch was finite")
        else:
            missing.append("no forensic replay was recorded for the failing steps")
    if not f.sampled_steps:
        missing.append("no sampled step (per-layer statistics) was recorded")
    elif f.reduced.first_nonfinite is None:
        missing.append("the sampled steps saw no non-finite value")
    return ("The root cause could not be told: " + "; ".join(missing) + ".") if missing else \
        "No recorded signal points to one cause."


def run_summary(f: Any) -> dict:
    s = f.steps
    run = f.run
    return {
        "path": run.path,
        "status": run.status,
        "rank": run.attrs.get("rank", 0),
        "world_size": run.attrs.get("world_size", 1),
        "steps": int(f.n),
        "last_step": int(s["step"][-1]) if f.n else None,
        "skipped_steps": int(np.sum(f.skipped)) if f.n else 0,
        "sampled_steps": f.sampled_steps if f.n else 0,
        "replays": len(f.snapshots),
        "autocast_dtype": f.autocast_dtype,
        "low_precision": f.low_precision,
        "loss_scale": {"init": _num(f.story.init_scale), "final": _num(f.story.final_scale),
                       "min": _num(f.story.min_scale)} if f.n and f.has_scaler else None,
        "scaler": f.meta.get("scaler"),
        "optimizer": f.meta.get("optimizer"),
        "param_dtypes": f.param_dtypes,
        "device": f.meta.get("device"),
        "torch": (f.meta.get("torch") or {}).get("version"),
        "argv": run.attrs.get("argv"),
        "applied": [a.arg for a in run.applied],
    }


def _num(x: float) -> Optional[float]:
    return float(x) if x is not None and math.isfinite(x) else None
