"""The release report's data: diagnosis, summary figures, dtype decision, fp16 readiness, parity.

numpy only. ``release_report`` gathers what a release note about a mixed-precision training
run needs, from the library's own answers (``engine.diagnose``, ``readiness``, ``comparison``)
plus the run's headline numbers and the hardware it ran on; ``render/release.py`` renders it as
one self-contained HTML page or as Markdown, with ``render/plots.py`` drawing the curves.

Example::

    with ampdoctor.release_report("amp.h5", baseline="fp32.h5") as r:
        r.decision.recommendation        # 'bf16 autocast'
        r.summary.skip_rate, r.comparison.verdict
        open("report.html", "w").write(r.html())   # in Jupyter, ``r`` displays the page
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ..diagnosis.verdict import TABLE, canonical
from ..display import render
from ..runfile.schema import STEPS, Event, flag
from .comparison import Comparison, compare, median_step_time, peak_memory
from .fp8 import Fp8Readiness, fp8_readiness
from .fp8pays import fp8_pays
from .readiness import Readiness, fp16_readiness, plain, precision

# The /steps columns a report reads: the diagnosis's, the step time and the memory (not the
# wall clock: 80 MB of a month-long run).
STEP_COLUMNS = tuple(n for n in STEPS.names or () if n != "time")

# Verdicts whose cause is fp16's range: another dtype (or fp32 islands) is the remedy.
# The JSON report's first keys, as parity's JSON has its own: what makes a report file
# recognisably ampdoctor's (render/files.py's is_report, which report --force relies on).
REPORT_FORMAT = "ampdoctor-report"
REPORT_VERSION = 1

RANGE_VERDICTS = {v.id for v in TABLE if v.report == "range"}
# Verdicts that are bugs in the script or its data: no dtype fixes them.
BUG_VERDICTS = {v.id for v in TABLE if v.report == "bug"}

# NVIDIA compute capability (major, minor) -> architecture. bf16 tensor cores start at sm80.
GENERATIONS = [((12, 0), "Blackwell"), ((10, 0), "Blackwell"), ((9, 0), "Hopper"),
               ((8, 9), "Ada Lovelace"), ((8, 0), "Ampere"), ((7, 5), "Turing"),
               ((7, 0), "Volta"), ((6, 0), "Pascal"), ((5, 0), "Maxwell")]
BF16_CAPABILITY = (8, 0)


@dataclass
class Summary:
    """The run's headline numbers."""

    steps: int
    last_step: Optional[int] = None
    skipped: int = 0
    calibration_skips: int = 0  # skipped steps in a row from the first one (GradScaler probing)
    skipped_after: int = 0  # skipped steps after that
    skip_rate: Optional[float] = None  # skipped_after / steps after calibration
    probing_allowance: Optional[int] = None  # skips after calibration GradScaler's probing
    #                                          explains (the diagnosis' allowance)
    nonfinite_loss: int = 0
    first_nonfinite_loss: Optional[int] = None
    nonfinite_grad: int = 0
    first_nonfinite_grad: Optional[int] = None
    peak_grad_norm: Optional[float] = None
    peak_grad_norm_step: Optional[int] = None
    init_scale: Optional[float] = None
    final_scale: Optional[float] = None
    min_scale: Optional[float] = None
    min_scale_step: Optional[int] = None
    final_loss: Optional[float] = None
    min_loss: Optional[float] = None
    peak_memory: Optional[int] = None
    memory_measure: str = ""
    median_step_time: Optional[float] = None
    sampled_steps: int = 0


@dataclass
class Decision:
    """Which precision to ship, for the hardware the run saw, and why."""

    device: str  # 'NVIDIA A100-SXM4-80GB (sm80, Ampere)' or 'CPU (x86_64)'
    device_type: str
    run_dtype: str  # 'float16', 'bfloat16' or 'float32' (readiness.precision)
    scaler: bool
    recommendation: str  # 'bf16 autocast', 'fp16 autocast + GradScaler', ...
    reasons: list[str] = field(default_factory=list)
    capability: Optional[str] = None  # '8.0'
    generation: Optional[str] = None  # 'Ampere'
    bf16_supported: Optional[bool] = None  # None: not known from this run
    fix_first: Optional[str] = None  # a bug to fix before any dtype choice matters
    autocast: bool = False  # False with a half run_dtype: the weights themselves are half
    # whether the GPU multiplies fp8 in hardware (None: not known, a CPU); the reason that says
    # when fp8 pays, for which layers ("" without fp8 figures): fp8pays.py
    fp8_matmuls: Optional[bool] = None
    fp8: str = ""


@dataclass
class ReleaseReport:
    """Everything ``ampdoctor report`` shows. Keeps the run open for plots: close it after."""

    diagnosis: Any  # diagnosis.verdict.Diagnosis
    summary: Summary
    decision: Decision
    readiness: Readiness
    comparison: Optional[Comparison] = None
    parity: Any = None  # preflight.parity_result.ParityResult, when one was given
    fp8: Optional[Fp8Readiness] = None  # what each fp8 recipe would do, per Linear layer
    fp8_watch: Any = None  # diagnosis.fp8watch.Fp8Watch: the Linears at risk in fp8
    run: Any = field(default=None, repr=False)  # store.Run, for plots
    notes: list[str] = field(default_factory=list)
    _owned: bool = field(default=False, repr=False)  # the run was loaded here: close it

    def to_dict(self) -> dict:
        return plain({"format": REPORT_FORMAT, "version": REPORT_VERSION,
                      "diagnosis": self.diagnosis.to_dict(), "summary": asdict(self.summary),
                      "decision": asdict(self.decision), "readiness": self.readiness.to_dict(),
                      "comparison": self.comparison.to_dict() if self.comparison else None,
                      "parity": self.parity.to_dict() if self.parity is not None else None,
                      "fp8": self.fp8.to_dict() if self.fp8 is not None else None,
                      "fp8_watch": self.fp8_watch.to_dict() if self.fp8_watch is not None
                      else None,
                      "notes": list(self.notes)})

    def html(self) -> str:
        """The self-contained page ``ampdoctor report`` writes (draws the figures)."""
        return render(self, "html")

    def markdown(self) -> str:
        return render(self, "markdown")

    def _repr_html_(self) -> str:
        return self.html()

    def close(self) -> None:
        if self._owned and self.run is not None:
            self.run.close()

    def __enter__(self) -> "ReleaseReport":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def release_report(run: Any, baseline: Any = None, parity: Any = None,
                   **compare_options: Any) -> ReleaseReport:
    """Gather the release report of a run (a path or a loaded ``Run``), optionally against a
    baseline (fp32 or bf16) run of the same training; options go to ``compare``. ``parity``:
    a ``ParityResult`` (``ampdoctor.parity``) or the JSON file ``ampdoctor parity --format
    json`` wrote, shown as the layer parity section."""
    from ..diagnosis import engine, fp8watch, ranks
    from ..runfile.paths import resolve
    from ..runfile.store import Run, load

    if isinstance(parity, (str, os.PathLike)):
        from ..preflight.parity_result import load as load_parity

        parity = load_parity(os.fspath(parity))

    notes, measured = [], None
    if isinstance(run, Run):
        loaded, owned, d = run, False, engine.diagnose(run)
    elif isinstance(run, (str, os.PathLike)):
        paths = resolve(os.fspath(run))
        if len(paths) == 1:  # one file: read once, for the diagnosis and the report
            loaded, owned = load(paths[0], STEP_COLUMNS), True
            try:
                measured = _measured(loaded, narrow=baseline is None)
                d = engine.diagnose(loaded)
            except BaseException:
                loaded.close()
                raise
        else:
            d = engine.diagnose(paths)
            loaded, owned = load(paths[0], STEP_COLUMNS), True
            ranks.combine_into(loaded, paths[1:])  # FSDP without clip: global grad norms
            notes.append(f"Curves and figures are rank {loaded.rank}'s ({loaded.path}); the "
                         f"diagnosis reads all {len(paths)} ranks.")
    else:
        raise TypeError(f"release_report() takes a path or a Run, not {type(run).__name__}")
    try:
        readiness = fp16_readiness(loaded)
        comparison = compare(baseline, loaded, **compare_options) if baseline is not None \
            else None
        fp8, watch = fp8_readiness(loaded), fp8watch.read(loaded)
        decision = decide(loaded, d.verdict, readiness)
        decision.fp8_matmuls, decision.fp8 = fp8_pays(decision, fp8, watch)
        if decision.fp8:
            decision.reasons.append(decision.fp8)
        report = ReleaseReport(diagnosis=d, summary=summarize(loaded, measured), decision=decision,
                               readiness=readiness, comparison=comparison, parity=parity,
                               fp8=fp8, fp8_watch=watch, run=loaded, notes=notes)
    except BaseException:
        if owned:
            loaded.close()
        raise
    report._owned = owned
    return report


# ---------------------------------------------------------------------------------------------
# Summary figures


def _measured(run: Any, narrow: bool) -> tuple:
    """The summary's memory and step time (``summarize``'s ``measured``), taken first; with
    ``narrow``, the run then holds only the /steps columns the diagnosis reads (a month-long
    run's step times and memory are 120 MB; one read later is read again then)."""
    from ..diagnosis.engine import STEP_COLUMNS as READ

    out = (peak_memory(run), median_step_time(run))
    if narrow and hasattr(run.steps, "narrowed"):
        run.steps = run.steps.narrowed(READ)
    return out


def summarize(run: Any, measured: Optional[tuple] = None) -> Summary:
    """Headline numbers of a loaded ``Run``. ``measured``: its ``(peak_memory(run),
    median_step_time(run))`` where they were taken already."""
    s = run.steps
    out = Summary(steps=int(len(s)))
    if not len(s):
        return out
    steps = s["step"]
    out.last_step = int(steps[-1])
    out.sampled_steps = int(np.sum(s["sampled"] == 1))
    bad_loss = (s["flags"] & flag(Event.NONFINITE_LOSS)) != 0
    _skips(out, run, bad_loss)
    bad_grad = (s["flags"] & flag(Event.NONFINITE_GRAD)) != 0
    out.nonfinite_loss, out.first_nonfinite_loss = _count_first(steps, bad_loss)
    out.nonfinite_grad, out.first_nonfinite_grad = _count_first(steps, bad_grad)
    out.peak_grad_norm, out.peak_grad_norm_step = _peak(steps, s["grad_norm"])
    loss = s["loss"]  # read as stored: no copy of a month-long curve
    finite = np.isfinite(loss)
    if finite.any():
        out.final_loss = float(loss[len(loss) - 1 - int(np.argmax(finite[::-1]))])
        out.min_loss = float(np.min(loss, where=finite, initial=np.inf))
    _scales(out, run, s)
    (out.peak_memory, out.memory_measure), out.median_step_time = \
        measured if measured is not None else (peak_memory(run), median_step_time(run))
    return out


def _skips(out: Summary, run: Any, bad_loss: np.ndarray) -> None:
    """Skipped steps, with GradScaler's initial calibration told apart as the diagnosis tells
    it (``diagnosis.scale.scale_story``): skips from the first step, with a finite loss, until
    the scale fits are how GradScaler works, so the rate that matters starts after them."""
    from ..diagnosis.scale import scale_story

    s = run.steps
    skipped = s["skipped"] == 1
    out.skipped = int(skipped.sum())
    story = scale_story(s, run.scaler, bad_loss)
    calib = story.calib_len if story.has_scaler and story.calib_benign else 0
    out.calibration_skips = calib
    out.skipped_after = int(skipped[calib:].sum())
    rest = len(skipped) - calib
    out.skip_rate = out.skipped_after / rest if rest else None
    out.probing_allowance = story.allowed_post if story.has_scaler else None


def _count_first(steps: np.ndarray, mask: np.ndarray) -> tuple[int, Optional[int]]:
    idx = np.flatnonzero(mask)
    return int(len(idx)), (int(steps[idx[0]]) if len(idx) else None)


def _peak(steps: np.ndarray, values: np.ndarray) -> tuple[Optional[float], Optional[int]]:
    ok = np.isfinite(values)  # the values as stored: no float64 copy of a month-long curve
    if not ok.any():
        return None, None
    i = int(np.argmax(np.where(ok, values, -np.inf)))
    return float(values[i]), int(steps[i])


def _scales(out: Summary, run: Any, s: np.ndarray) -> None:
    scale = s["scale"]  # as stored, like _peak's values
    ok = np.isfinite(scale)
    if not ok.any():
        return
    after = s["scale_after"]
    first, last = int(np.argmax(ok)), len(ok) - 1 - int(np.argmax(ok[::-1]))
    out.init_scale = float(scale[first])
    out.final_scale = float(after[-1]) if np.isfinite(after[-1]) else float(scale[last])
    low = np.where(ok, scale, np.inf)
    i = int(np.argmin(low))
    out.min_scale, out.min_scale_step = float(low[i]), int(s["step"][i])
    if out.final_scale < out.min_scale:
        out.min_scale, out.min_scale_step = out.final_scale, int(s["step"][-1])


# ---------------------------------------------------------------------------------------------
# Hardware and dtype decision


def generation(capability: tuple[int, int]) -> Optional[str]:
    """NVIDIA architecture of a compute capability: ``generation((8, 6)) == 'Ampere'``."""
    for cap, name in GENERATIONS:
        if tuple(capability) >= cap:
            return name
    return None


def decide(run: Any, verdict: str, readiness: Readiness) -> Decision:
    """Recommend a precision for this training on the hardware it ran on."""
    dev = run.device or {}
    ac = run.autocast or {}
    scaler = run.scaler is not None and run.scaler.enabled
    d = Decision(device=_device_text(dev), device_type=dev.get("type") or "unknown",
                 run_dtype=precision(run), scaler=scaler, recommendation="",
                 autocast=bool(ac.get("enabled")))
    cap = dev.get("capability")
    if dev.get("type") == "cuda" and cap and len(cap) >= 2:
        d.capability = f"{cap[0]}.{cap[1]}"
        d.generation = None if _is_rocm(dev) else generation((int(cap[0]), int(cap[1])))
        d.bf16_supported = dev.get("bf16_supported")
        if d.bf16_supported is None and not _is_rocm(dev):
            d.bf16_supported = (int(cap[0]), int(cap[1])) >= BF16_CAPABILITY
    d.device = _device_text(dev, d)
    if verdict in BUG_VERDICTS:
        d.fix_first = (f"The diagnosis is {verdict}: a bug in the training script or its data, "
                       "which no precision fixes. Apply its fixes first.")
    d.recommendation, d.reasons = _recommend(d, verdict, readiness)
    return d


def _is_rocm(dev: dict) -> bool:
    name = str(dev.get("name") or "")
    return any(k in name for k in ("AMD", "Instinct", "Radeon"))


def _device_text(dev: dict, d: Optional[Decision] = None) -> str:
    kind = dev.get("type") or "unknown device"
    name = dev.get("name") or kind
    if kind == "cpu":
        return f"CPU ({name})"
    if d is None or not d.capability:
        return str(name)
    gen = f", {d.generation}" if d.generation else ""
    return f"{name} (compute capability {d.capability}{gen})"


def _recommend(d: Decision, verdict: str, r: Readiness) -> tuple[str, list[str]]:
    """(recommendation, reasons): the hardware first, then what this run showed."""
    reasons = [_hardware_reason(d)]
    if verdict == "nonfinite":
        reasons.append("The run went non-finite for a reason the diagnosis could not classify: "
                       "this advice rests on the recorded ranges alone.")
    half_weights = d.run_dtype != "float32" and not d.autocast
    if canonical(verdict) in ("lost_updates", "adam_eps") or half_weights:
        reasons.append("Half-precision weights lose small updates (and fp16 an Adam eps "
                       "below 6e-8): keep the weights and optimizer state in fp32 and let "
                       "autocast cast the compute.")
        if d.bf16_supported is False:
            return "fp16 autocast + GradScaler, with fp32 weights", reasons
        return _bf16(d).replace("bf16 autocast", "bf16 autocast with fp32 weights"), reasons
    if d.run_dtype == "float16":
        return _after_fp16(d, verdict, r, reasons)
    if d.run_dtype == "bfloat16":
        return _after_bf16(d, verdict, r, reasons)
    return _after_fp32(d, r, reasons)


def _after_fp16(d: Decision, verdict: str, r: Readiness,
                reasons: list[str]) -> tuple[str, list[str]]:
    failed = verdict in RANGE_VERDICTS
    reasons.append(f"This fp16 run failed by fp16's range ({verdict})." if failed else
                   "This fp16 run " + ("is healthy." if verdict == "healthy" else
                                       f"is diagnosed {verdict}."))
    if r.status != "unknown":
        reasons.append(r.advice)
    if verdict == "grad_underflow" and not d.scaler and r.status == "needs_scaler":
        reasons.append("A GradScaler lifts these gradients back into fp16's range; bf16 "
                       "needs none.")
        return _either(d), reasons
    if failed or r.status in ("overflow", "underflow", "nonfinite"):
        if d.bf16_supported is False:
            reasons.append("Without bf16 on this GPU, keep fp16 and apply the diagnosis' "
                           "fixes (fp32 islands, init scale, learning rate).")
            return "fp16 autocast + GradScaler, with the diagnosis' fixes", reasons
        reasons.append("bf16 has fp32's exponent range: no overflow at 65504, no gradient "
                       "underflow, no GradScaler.")
        return _bf16(d), reasons
    if r.status == "tight" and d.bf16_supported:
        return "bf16 autocast", reasons
    return "fp16 autocast + GradScaler", reasons


def _after_bf16(d: Decision, verdict: str, r: Readiness,
                reasons: list[str]) -> tuple[str, list[str]]:
    if d.bf16_supported is False:
        reasons.append("This GPU has no bf16 units, so bf16 runs emulated and slow.")
        reasons.append(r.advice)
        if r.status in ("ready", "needs_scaler"):
            return "fp16 autocast + GradScaler", reasons
        return "fp16 autocast + GradScaler, with fp32 islands", reasons
    reasons.append("This bf16 run " + ("is healthy." if verdict == "healthy" else
                                       f"is diagnosed {verdict}."))
    if r.status != "unknown":
        reasons.append(f"For fp16 instead: {r.advice}")
    return _bf16(d), reasons


def _after_fp32(d: Decision, r: Readiness, reasons: list[str]) -> tuple[str, list[str]]:
    """An fp32 run: its recorded ranges say what fp16 would do."""
    if r.status == "unknown":
        reasons.append("No per-layer statistics were recorded, so fp16's range is not known: "
                       "bf16 is the safe choice where the hardware has it.")
    else:
        reasons.append(r.advice)
    if r.status in ("overflow", "underflow", "nonfinite", "unknown"):
        if d.bf16_supported is False:
            return "fp16 autocast + GradScaler, with fp32 islands", reasons
        return _bf16(d), reasons
    if d.bf16_supported is None:
        reasons.append("Both fit: fp16 + GradScaler keeps 3 more mantissa bits; bf16 needs no "
                       "scaler but an Ampere (sm80) or newer GPU.")
    return _either(d), reasons


def _either(d: Decision) -> str:
    """Where fp16 with a GradScaler and bf16 both work: bf16 if the GPU has it."""
    if d.bf16_supported is None:
        return "bf16 autocast on an Ampere (sm80) or newer GPU, else fp16 autocast + GradScaler"
    return "bf16 autocast" if d.bf16_supported else "fp16 autocast + GradScaler"


def _bf16(d: Decision) -> str:
    return "bf16 autocast" if d.bf16_supported else \
        "bf16 autocast (on an Ampere, sm80, or newer GPU)"


def _hardware_reason(d: Decision) -> str:
    if d.device_type == "cuda":
        if d.bf16_supported:
            return (f"{d.device} has bf16 tensor cores (Ampere, sm80, or newer), so bf16 "
                    "autocast runs at fp16's speed.")
        if d.bf16_supported is False:
            return (f"{d.device} predates Ampere (sm80): no bf16 tensor cores, so fp16 with a "
                    "GradScaler is the fast mixed precision here.")
        return f"{d.device}: whether it has bf16 units was not recorded."
    if d.device_type == "cpu":
        return (f"Recorded on {d.device}: CPU autocast runs fp16 and bf16 alike, and the GPU "
                "a release trains on is not known from this run; bf16 needs an Ampere (sm80) "
                "or newer NVIDIA GPU.")
    return f"Recorded on {d.device}: the report knows no bf16 rule for this device type."
