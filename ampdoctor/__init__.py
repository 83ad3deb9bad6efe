"""ampdoctor: find out why fp16/bf16 mixed-precision training went wrong, where, and what to change.

Three doors into one library::

    ampdoctor record -o run.h5 -- python train.py      # any script, no code change
    ampdoctor diagnose run.h5                           # verdict, evidence, fix
    ampdoctor report run.h5 --baseline fp32.h5 -o report.html   # release material
    ampdoctor compare fp32.h5 amp.h5                    # fp32 parity

    with ampdoctor.watch(model, optimizer, scaler) as rec:   # a notebook or your own loop
        ...train...
    rec.diagnose()

Before a long run: ``ampdoctor.parity(model, batch, torch.bfloat16)`` (which modules lose
precision under autocast) and ``ampdoctor.testing.check_amp_step`` (the AMP contract of your
training step, in your own tests).

Importing ampdoctor imports neither torch nor h5py: ``watch`` pulls in torch when called, and
``load``/``diagnose`` need only numpy and h5py, so a run file can be read anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from . import display
from .errors import AmpDoctorError, FormatTooNewError, RunFileError
from .version import __version__

if TYPE_CHECKING:  # the annotations below; at run time these load on first use (__getattr__)
    from .diagnosis.verdict import Diagnosis
    from .preflight.parity_result import ParityResult
    from .record.recorder import Recorder
    from .release.comparison import Comparison
    from .release.fp8 import Fp8Readiness
    from .release.readiness import Readiness
    from .release.report import ReleaseReport
    from .runfile.store import Run

__all__ = [
    "AmpDoctorError",
    "Comparison",
    "Diagnosis",
    "FormatTooNewError",
    "Fp8Readiness",
    "ParityResult",
    "Readiness",
    "Recorder",
    "ReleaseReport",
    "Run",
    "RunFileError",
    "compare",
    "diagnose",
    "fp16_readiness",
    "fp8_readiness",
    "load",
    "parity",
    "release_report",
    "watch",
    "write_report",
    "__version__",
]


def _load_renderers() -> object:
    import importlib

    return importlib.import_module("ampdoctor.render")


# The composition root: data objects print through renderers they never import.
display.set_loader(_load_renderers)


def watch(model: Any = None, optimizer: Any = None, scaler: Any = None, path: str = "run.h5",
          every: int | None = None, **options: Any) -> "Recorder":
    """Record a training loop into ``path``; a context manager, or call ``rec.close()``.

    Example::

        scaler = torch.amp.GradScaler("cuda")
        with ampdoctor.watch(model, optimizer, scaler, path="run.h5") as rec:
            for x, y in loader:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer); scaler.update(); optimizer.zero_grad()
        rec.diagnose()

    See ``ampdoctor.record.recorder.RecorderConfig`` for every option.
    """
    from .record.recorder import Recorder, RecorderConfig

    config = RecorderConfig(path=path, every=every, **options)
    return Recorder(model, optimizer, scaler, config).start()


def load(path: Any) -> "Run":
    """Read a run file (see ``ampdoctor.runfile.store.load``)."""
    from .runfile.store import load as _load

    return _load(path)


def diagnose(run: Any, *, rank: Optional[int] = None,
             rules: Optional[Iterable[Callable]] = None, baseline: Any = None) -> "Diagnosis":
    """Diagnose a run: a path, a list of rank files' paths, or a loaded ``Run``. ``rank``: one
    rank file of a torchrun job on its own; ``rules``: the rules to try (default
    ``ampdoctor.diagnosis.rules.RULES``); ``baseline``: the same training in bf16 or fp32 (a
    path or a ``Run``) that a run in fp8 is measured against (``fp8_drift``).

    Example::

        d = ampdoctor.diagnose("run.h5")
        d.verdict, d.first_bad, [fx.id for fx in d.fixes]
        ampdoctor.diagnose("run.h5", rank=3)     # rank 3's own diagnosis
        ampdoctor.diagnose("fp8.h5", baseline="bf16.h5")
    """
    from .diagnosis.engine import diagnose as _diagnose

    return _diagnose(run, rank=rank, rules=rules, baseline=baseline)


def compare(base: Any, amp: Any, **options: Any) -> "Comparison":
    """fp32 parity: a baseline run (fp32 or bf16) against a mixed-precision run of the same
    training, paths or loaded ``Run`` objects (see ``ampdoctor.release.comparison``).

    Example::

        c = ampdoctor.compare("fp32.h5", "amp.h5")
        c.verdict            # 'match', 'drift' or 'diverged'
        c.divergence_step, c.speedup, c.memory_ratio
    """
    from .release.comparison import compare as _compare

    return _compare(base, amp, **options)


def parity(model: Any, batch: Any, dtype: Any = "bfloat16", loss_fn: Any = None) -> "ParityResult":
    """Before switching a model to bf16 or fp16: which modules lose precision under autocast?
    One batch runs in fp32 and in ``dtype`` (``torch.bfloat16`` or ``torch.float16``), each
    module judged alone on its fp32 inputs; ranked worst first, a verdict each (``ok``,
    ``lossy``, ``overflows``) and the fp32-island fix for the worst (see
    ``ampdoctor.preflight.layer_parity``). The model, its ``.grad`` and the RNG are unchanged.

    Example::

        r = ampdoctor.parity(model, x, torch.bfloat16)
        r = ampdoctor.parity(model, x, torch.float16, loss_fn=lambda out: F.cross_entropy(out, y))
        print(r)                    # or display(r) in Jupyter
        [(m.name, m.verdict, m.sqnr_db) for m in r.modules[:3]], r.to_dict()
    """
    from .preflight.layer_parity import parity as _parity

    return _parity(model, batch, dtype, loss_fn)


def release_report(run: Any, baseline: Any = None, **options: Any) -> "ReleaseReport":
    """What ``ampdoctor report`` shows: diagnosis, summary figures, precision decision, fp16
    readiness and, with a baseline, fp32 parity; with ``parity=`` (a ``ParityResult`` or its
    JSON file), the layer parity section (see ``ampdoctor.release.report``).

    Example::

        with ampdoctor.release_report("amp.h5", baseline="fp32.h5") as r:
            r.decision.recommendation, r.summary.peak_grad_norm, r.comparison.verdict
    """
    from .release.report import release_report as _release_report

    return _release_report(run, baseline, **options)


def write_report(run: Any, path: str = "report.html", *, baseline: Any = None,
                 parity: Any = None, fmt: str = "html",
                 plots_dir: Optional[str] = None) -> "ReleaseReport":
    """``ampdoctor report`` from a notebook: the release report of ``run`` written to ``path``
    (HTML, or ``fmt="markdown"``/``"json"``), with a ``baseline`` and ``parity`` as the
    command takes them; returns the ``ReleaseReport`` (see ``ampdoctor.render.files``).

    Example::

        r = ampdoctor.write_report("amp.h5", "report.html", baseline="fp32.h5")
        r.diagnosis.verdict
    """
    from .render.files import write_report as _write_report

    return _write_report(run, path, baseline=baseline, parity=parity, fmt=fmt,
                         plots_dir=plots_dir)


def fp16_readiness(run: Any) -> "Readiness":
    """Which layers of a run (a path or a loaded ``Run``) would overflow or flush to zero in
    fp16, and the advice that follows; most useful on an fp32 or bf16 run before switching.

    Example::

        r = ampdoctor.fp16_readiness("fp32.h5")
        r.status, r.advice, [(x.name, x.kind, x.absmax) for x in r.overflowing]
    """
    from .release.readiness import fp16_readiness as _readiness
    from .runfile.store import opened

    with opened(run, "fp16_readiness") as loaded:
        return _readiness(loaded)


def fp8_readiness(run: Any) -> "Fp8Readiness":
    """What each fp8 recipe (tensorwise, delayed, rowwise, mxfp8) would do to each Linear
    layer of a run (a path or a loaded ``Run``) of any precision: the shares flushed and
    saturated and the SQNR of its input, weight and output gradient, a status per layer, and
    per recipe the layers to keep in high precision: those the fp8 trial at the recording's
    close measured (``decided_by`` "trial"), else ranked from the statistics. See docs/fp8.md.

    Example::

        r = ampdoctor.fp8_readiness("bf16.h5")
        r.to_dict()["recipes"]["tensorwise"]["keep_high_precision"]
    """
    from .release.fp8 import fp8_readiness as _fp8
    from .runfile.store import opened

    with opened(run, "fp8_readiness") as loaded:
        return _fp8(loaded)


def __getattr__(name: str) -> Any:
    # Classes are imported on first use so that `import ampdoctor` stays light.
    if name == "Run":
        from .runfile.store import Run

        return Run
    if name == "Diagnosis":
        from .diagnosis.verdict import Diagnosis

        return Diagnosis
    if name == "Comparison":
        from .release.comparison import Comparison

        return Comparison
    if name == "ParityResult":
        from .preflight.parity_result import ParityResult

        return ParityResult
    if name == "ReleaseReport":
        from .release.report import ReleaseReport

        return ReleaseReport
    if name == "Fp8Readiness":
        from .release.fp8 import Fp8Readiness

        return Fp8Readiness
    if name == "Readiness":
        from .release.readiness import Readiness

        return Readiness
    if name == "Recorder":
        from .record.recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
