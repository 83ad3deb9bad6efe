"""Inside the Python processes of ``ampdoctor record -- <command>``: one recording per process.

The bootstrap ``sitecustomize`` calls ``start`` once torch has been imported. From then on a
``Recorder`` in discovery mode watches the process (the model is the outermost module called
with gradients on, the optimizer and scaler are found when used), and decides at exit what to
leave behind:

* a process that trained (called backward, scaled a loss or stepped an optimizer) has created
  its file at that moment: ``run.h5``, or ``run.rank{R}.h5`` when a process group of more
  than one rank exists; at exit the file gets its status, ``finished`` or
  ``exception:<Type>`` for an uncaught exception;
* the command's first Python that imported torch (``launch.ENV_TOP``) writes a file even if it
  never trained, unless another process of the recording wrote one (the torchrun launcher
  process, whose ranks did the training), so that ``diagnose`` can say the script never
  trained;
* every other process (DataLoader workers, helper interpreters) writes nothing.

A forked child (DataLoader workers on Linux) inherits the recorder: the recorder switches
itself off there and can never write into its parent's file (``exits._after_fork_in_child``).
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from typing import Any, Optional

from ...runfile import paths, schema
from ...runfile.meta import AppliedFix
from . import launch, lifeline, written

_SESSION: Optional["Session"] = None


class Session:
    """The recording of one process of the command."""

    def __init__(self, settings: launch.Settings):
        from ..recorder import BUDGET_SECONDS, Recorder, RecorderConfig

        self.settings = settings
        self.pid = os.getpid()
        self.top = os.environ.pop(launch.ENV_TOP, None) == "1"
        self.recorder = Recorder(config=RecorderConfig(
            path=self.file_name, every=settings.every, lazy=True, replaceable=True,
            fp8_trial=BUDGET_SECONDS if settings.fp8_trial is None else settings.fp8_trial))
        self.recorder.on_stop = self.stopped
        self.path: Optional[str] = None
        self.applied: list[AppliedFix] = []
        self.treatment: Any = None

    def treat(self) -> "Session":
        """``--apply``: the fixes installed (``treatment.py``) before the recorder starts, so
        that its hooks run inside the treatment's (the LR it reads is the user's, put back)."""
        if not self.settings.apply:
            return self
        try:
            from ..apply.treatment import Treatment

            self.treatment = Treatment(list(self.settings.apply), note=self.note_applied)
            self.treatment.install()
        except Exception as exc:  # noqa: BLE001 - the run is recorded, untreated, and says so
            self.applied = [AppliedFix(fix=p.name, arg=p.arg, error=f"{type(exc).__name__}: "
                                       f"{exc}") for p in self.settings.apply]
            warnings.warn(f"ampdoctor: --apply not applied ({type(exc).__name__}: {exc})",
                          RuntimeWarning, stacklevel=2)
        return self

    def note_applied(self, applied: list[AppliedFix]) -> None:
        """What the treatment applied, into /meta ``applied`` (once the recorder is on)."""
        self.applied = applied
        if self.recorder.active:
            self.recorder.note_applied(applied)

    def start(self) -> "Session":
        self.recorder.start()
        if self.applied:
            self.recorder.note_applied(self.applied)
        atexit.register(self.at_exit)
        return self

    def file_name(self, rank: int, world_size: int) -> str:
        """Called when training begins: this process's file."""
        path = self.settings.output
        if world_size > 1:
            path = paths.rank_path(path, rank)
        if os.path.exists(path) and not _placeholder(path):
            # Another process of this recording trained first (record cleared old runs).
            path = paths.pid_path(path, os.getpid())
        written.note(self.settings.session, path)  # for record's closing line: ours
        self.path = path
        return path

    def stopped(self, what: str, kept: int) -> None:
        """The recording stopped on a fault: ``record``'s closing line says why (a full disk
        leaves an unclosed file that would otherwise read as a killed process)."""
        if self.path is not None:
            written.note_fault(self.settings.session, self.path, what, kept)

    def others_wrote(self) -> bool:
        """Did another process of this recording leave a file? (This node's, as noted; all
        beside the output where there is no list.)"""
        noted = written.read(self.settings.session)
        if noted is None:
            return bool(paths.related_files(self.settings.output))
        return any(os.path.isfile(p) for p in noted)

    def at_exit(self) -> None:
        if os.getpid() != self.pid or self.recorder.closed:
            return
        rec = self.recorder
        exc_type, exc = _uncaught()
        status = schema.STATUS_FINISHED if exc_type is None else \
            schema.STATUS_EXCEPTION + exc_type.__name__
        keep = self.top and not rec.trained and not self.others_wrote()
        if exc_type is not None and (rec.trained or keep):
            rec.record_exception(exc_type, exc)
        rec.close(status, keep_empty=keep)


def _placeholder(path: str) -> bool:
    """A finished run with no step: what a never-training process of this recording left."""
    from ...runfile.store import load

    try:
        with load(path) as run:
            return len(run.steps) == 0 and run.status != "interrupted"
    except Exception:  # noqa: BLE001 - unreadable: not ours to replace
        return False


def _uncaught() -> tuple[Optional[type], Any]:
    """The exception that is ending the process, if any.

    Python sets ``sys.last_type`` when it prints an uncaught exception, before ``atexit``
    handlers run, whatever ``sys.excepthook`` the script installed. ``SystemExit`` is an exit,
    not a failure.
    """
    exc_type = getattr(sys, "last_type", None)
    if exc_type is None or issubclass(exc_type, SystemExit):
        return None, None
    return exc_type, getattr(sys, "last_value", None)


def start(settings: Optional[launch.Settings] = None) -> Optional[Session]:
    """Start recording this process (once); called by the bootstrap when torch is imported."""
    global _SESSION
    if _SESSION is not None:
        return _SESSION
    settings = settings or launch.Settings.from_env(os.environ)
    if settings is None:
        return None
    try:
        _SESSION = Session(settings).treat().start()
    except Exception as exc:  # noqa: BLE001 - a debugger must never stop the user's script
        warnings.warn(f"ampdoctor: not recording this process ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
        return None
    launcher = os.environ.get(launch.ENV_LAUNCHER, "")
    if launcher.isascii() and launcher.isdigit():  # below the command: stop when record is killed
        lifeline.watch(int(launcher), settings.session)
    return _SESSION
