"""ampdoctor: find out why fp16/bf16 mixed-precision training went wrong, where, and what to change.

Three doors into one library::

    ampdoctor record -o run.h5 -- python train.py      # any script, no code change
    ampdoctor diagnose run.h5                           # verdict, evidence, fix

    with ampdoctor.watch(model, optimizer, scaler) as rec:   # a notebook or your own loop
        ...train...
    rec.diagnose()

Importing ampdoctor imports neither torch nor h5py: ``watch`` pulls in torch when called, and
``load``/``diagnose`` need only numpy and h5py, so a run file can be read anywhere.
"""

from __future__ import annotations

from typing import Any

from .errors import AmpDoctorError, FormatTooNewError, RunFileError

__version__ = "0.1.0"

__all__ = [
    "AmpDoctorError",
    "Diagnosis",
    "FormatTooNewError",
    "Recorder",
    "Run",
    "RunFileError",
    "diagnose",
    "load",
    "watch",
    "__version__",
]


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

    See ``ampdoctor.recorder.Recorder`` for every option.
    """
    from .recorder import Recorder

    return Recorder(model, optimizer, scaler, path=path, every=every, **options).start()


def load(path: Any) -> "Run":
    """Read a run file (see ``ampdoctor.store.load``)."""
    from .store import load as _load

    return _load(path)


def diagnose(run: Any, **options: Any) -> "Diagnosis":
    """Diagnose a run: a path, a list of rank files' paths, or a loaded ``Run``."""
    from .analyze import diagnose as _diagnose

    return _diagnose(run, **options)


def __getattr__(name: str) -> Any:
    # Classes are imported on first use so that `import ampdoctor` stays light.
    if name == "Run":
        from .store import Run

        return Run
    if name == "Diagnosis":
        from .analyze import Diagnosis

        return Diagnosis
    if name == "Recorder":
        from .recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
