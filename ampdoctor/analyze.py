"""Run → Diagnosis: what went wrong, where, on what evidence, and what to change.

numpy only: this module (like ``store`` reading and ``report``) never imports torch.

The engine is a list of small rules over ``Facts`` (views of a run computed once, streaming
the big stats table). Each rule returns a ``Finding`` or None. Findings are either root causes
or consequences (a scale collapse is the consequence of an overflowing op); the verdict is the
strongest root cause, and the consequences become the causal chain in ``causes``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np

from . import schema
from .schema import Event, Kind, Phase, Source, flag

VERDICTS = (
    "healthy",
    "grad_underflow",
    "lr_overflow",
    "unstable_op",
    "adam_eps",
    "bad_input",
    "clip_order",
    "scale_collapse",
    "nonfinite",
    "no_training",
)


@dataclass
class Evidence:
    """One number that decided something, with where and when it was seen."""

    text: str
    key: str = ""
    value: Optional[float] = None
    step: Optional[int] = None
    module: Optional[str] = None


@dataclass
class Fix:
    id: str
    text: str
    snippet: str = ""


@dataclass
class Finding:
    """What one rule concluded."""

    verdict: str
    confidence: float
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    first_bad: Optional[dict] = None
    root: bool = True  # False: a consequence of some other cause (scale collapse, underflow)
    priority: int = 50  # among root causes, the higher wins


@dataclass
class Diagnosis:
    """The answer for one run (or the ranks of one run). Rendered by ``report``.

    In a notebook it displays itself; ``str(d)`` is the text ``ampdoctor diagnose`` prints.
    """

    verdict: str
    confidence: float
    summary: str
    first_bad: Optional[dict]
    causes: list[dict]
    evidence: list[Evidence]
    fixes: list[Fix]
    run: dict
    notes: list[str] = field(default_factory=list)
    history: dict = field(default_factory=dict)  # scale/LR/loss around the first bad step

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    def to_dict(self) -> dict:
        """Plain JSON-safe data: NaN becomes null, infinities the strings "inf"/"-inf"."""
        return _finite(json.loads(json.dumps(asdict(self), default=_jsonable)))

    def __str__(self) -> str:
        from .report import render_text

        return render_text(self)

    def _repr_markdown_(self) -> str:
        from .report import render_markdown

        return render_markdown(self)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# ---------------------------------------------------------------------------------------------
# Facts: what every rule may look at, computed once


class Facts:
    """Derived views of a ``Run``. Properties are computed on first use and cached."""

    def __init__(self, run: Any):
        self.run = run
        self.steps = run.steps
        self.meta = run.meta
        self._cache: dict[str, Any] = {}

    def _memo(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def has_scaler(self) -> bool:
        return bool(np.any(~np.isnan(self.steps["scale"]))) if self.n else False

    @property
    def autocast_dtype(self) -> Optional[str]:
        ac = self.meta.get("autocast")
        if isinstance(ac, dict) and ac.get("enabled"):
            return ac.get("dtype")
        return None

    @property
    def skipped(self) -> np.ndarray:
        return self.steps["skipped"] == 1

    @property
    def bad_loss(self) -> np.ndarray:
        return (self.steps["flags"] & flag(Event.NONFINITE_LOSS)) != 0

    @property
    def bad_grad(self) -> np.ndarray:
        return (self.steps["flags"] & flag(Event.NONFINITE_GRAD)) != 0

    def first(self, mask: np.ndarray) -> Optional[int]:
        idx = np.flatnonzero(mask)
        return int(self.steps["step"][idx[0]]) if len(idx) else None

    def snapshots(self) -> np.ndarray:
        return self.run.snapshots

    def tensor_info(self) -> dict[int, tuple[int, str, str]]:
        t = self.run.tensors
        return self._memo("tinfo", lambda: {int(i): (int(k), str(n), str(ty)) for i, k, n, ty in
                                            zip(t["id"], t["kind"], t["name"], t["type"])})

    def first_nonfinite_sampled(self) -> Optional[dict]:
        """The first non-finite tensor in the sampled tier: step, module, phase."""
        return self._memo("fns", self._first_nonfinite_sampled)

    def _first_nonfinite_sampled(self) -> Optional[dict]:
        info = self.tensor_info()
        names = ("step", "tensor", "seq", "source", "nonfinite")
        for chunk in self.run.stats.chunks(names=names):
            hit = np.flatnonzero((chunk["nonfinite"] > 0) & (chunk["source"] == Source.SAMPLED))
            if not len(hit):
                continue
            step = chunk["step"][hit[0]]
            rows = chunk[hit][chunk["step"][hit] == step]
            kinds = np.array([info.get(int(t), (-1, "", ""))[0] for t in rows["tensor"]])
            for kind, phase in ((Kind.INPUT, "input"), (Kind.OUTPUT, "forward"),
                                (Kind.GRAD_OUTPUT, "backward"), (Kind.PARAM_GRAD, "backward"),
                                (Kind.BUFFER, "buffer")):
                sel = rows[kinds == kind]
                if len(sel):
                    first = sel[np.argsort(sel["seq"])[0]]
                    return {"step": int(step), "module": info[int(first["tensor"])][1],
                            "phase": phase}
        return None

    def window(self, step: int, before: int = 5, after: int = 2) -> dict:
        """Scale, LR and loss around ``step`` (for the report)."""
        s = self.steps
        sel = (s["step"] >= step - before) & (s["step"] <= step + after)
        return {k: [_num(v) for v in s[k][sel]] for k in ("step", "loss", "scale", "lr",
                                                          "grad_norm", "skipped")}


def _num(v: Any) -> Any:
    v = v.item() if isinstance(v, np.generic) else v
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (math.inf if v > 0 else -math.inf)
    return v


# ---------------------------------------------------------------------------------------------
# Rules


def rule_no_training(f: Facts) -> Optional[Finding]:
    if f.n:
        return None
    status = f.run.status
    if status.startswith("exception:"):
        summary = (f"The script raised {status.split(':', 1)[1]} before its first optimizer "
                   "step; nothing was trained.")
    else:
        summary = "No optimizer step was recorded: the script never trained (or was stopped " \
                  "before its first step)."
    return Finding("no_training", 1.0, summary, priority=100)


def rule_first_nonfinite(f: Facts) -> Optional[Finding]:
    """Fallback root cause: where the first non-finite value appeared."""
    snaps = f.snapshots()
    bad = f.bad_loss | f.bad_grad | f.skipped
    first_step = f.first(bad)
    if first_step is None:
        return None
    located = None
    if len(snaps):
        s = snaps[0]
        phase = Phase(int(s["phase"])).name.lower()
        located = {"step": int(s["step"]), "module": s["module"] or None, "phase": phase}
    if located is None:
        located = f.first_nonfinite_sampled()
    ev = [Evidence(f"first non-finite loss or gradient at step {first_step}", "first_bad_step",
                   float(first_step), first_step)]
    if located:
        where = f"in {located['module']} ({located['phase']})" if located.get("module") \
            else f"in the {located['phase']}"
        ev.append(Evidence(f"first non-finite value {where} at step {located['step']}",
                           "first_module", None, located["step"], located.get("module")))
    return Finding("nonfinite", 0.3, "Non-finite values appeared; the cause could not be "
                   "classified further.", ev, first_bad=located or {"step": first_step,
                                                                    "module": None,
                                                                    "phase": None},
                   priority=1)


def rule_healthy(f: Facts) -> Optional[Finding]:
    return Finding("healthy", 0.6, "No failure: no non-finite loss or gradient reached the "
                   "weights, and the loss scale behaved normally.", priority=0)


RULES: list[Callable[[Facts], Optional[Finding]]] = [
    rule_no_training,
    rule_first_nonfinite,
]


# ---------------------------------------------------------------------------------------------
# Entry points


def diagnose(run: Any, *, rules: Optional[Iterable[Callable]] = None) -> Diagnosis:
    """Diagnose a run: a path, a list of rank-file paths, or a loaded ``Run``.

    Example::

        d = ampdoctor.diagnose("run.h5")
        d.verdict, d.first_bad, [fx.id for fx in d.fixes]
    """
    from .store import Run, load

    if isinstance(run, (str, os.PathLike, list, tuple)):
        from . import ranks  # run.h5 absent, run.rank{R}.h5 beside it: diagnosed together

        paths = ranks.resolve(run) if isinstance(run, (str, os.PathLike)) else list(run)
        if len(paths) > 1:
            return ranks.diagnose_files(paths, rules=rules)
        with load(paths[0]) as loaded:
            return diagnose(loaded, rules=rules)
    if not isinstance(run, Run):
        raise TypeError(f"diagnose() takes a path or a Run, not {type(run).__name__}")
    facts = Facts(run)
    findings = [x for rule in (rules if rules is not None else RULES)
                for x in [rule(facts)] if x is not None]
    return _conclude(facts, findings)


def _conclude(f: Facts, findings: list[Finding]) -> Diagnosis:
    roots = sorted((x for x in findings if x.root), key=lambda x: -x.priority)
    top = roots[0] if roots else rule_healthy(f)
    consequences = [x for x in findings if not x.root]
    causes = [{"verdict": top.verdict, "role": "root", "text": top.summary}]
    causes += [{"verdict": x.verdict, "role": "consequence", "text": x.summary}
               for x in consequences]
    evidence = list(top.evidence) + [e for x in consequences for e in x.evidence]
    fixes = list(top.fixes) + [fx for x in consequences for fx in x.fixes
                               if fx.id not in {y.id for y in top.fixes}]
    history = f.window(top.first_bad["step"]) if top.first_bad and f.n else {}
    return Diagnosis(verdict=top.verdict, confidence=round(top.confidence, 2),
                     summary=top.summary, first_bad=top.first_bad, causes=causes,
                     evidence=evidence, fixes=fixes, run=run_summary(f), notes=_notes(f),
                     history=history)


def run_summary(f: Facts) -> dict:
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
        "autocast_dtype": f.autocast_dtype,
        "scaler": f.meta.get("scaler"),
        "optimizer": f.meta.get("optimizer"),
        "device": f.meta.get("device"),
        "torch": (f.meta.get("torch") or {}).get("version"),
        "argv": run.attrs.get("argv"),
    }


def _notes(f: Facts) -> list[str]:
    notes = []
    status = f.run.status
    if status == "interrupted":
        last = int(f.steps["step"][-1]) if f.n else None
        notes.append(f"The run was interrupted (its writer never closed the file); the last "
                     f"recorded step is {last}." if last is not None else
                     "The run was interrupted before its first recorded step.")
    elif status.startswith("exception:"):
        notes.append(f"The training script raised {status.split(':', 1)[1]}.")
    return notes
