"""The settings of ``ampdoctor record``, carried from the parent (``launch``) to each process
of the command (``child``) in ``AMPDOCTOR_*`` environment variables.

torch-free, as ``launch`` is. ``launch`` re-exports every name here (``launch.Settings``,
``launch.ENV_OUTPUT``...), which is where the rest of the package reads them.

Example::

    env = Settings(output="/tmp/run.h5", every=10, fp8_trial=60.0).to_env()
    Settings.from_env(env).fp8_trial        # 60.0
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Optional

from ...errors import RecordError
from ..apply import prescription
from ..apply.prescription import Prescription

ENV_OUTPUT = "AMPDOCTOR_OUTPUT"
ENV_EVERY = "AMPDOCTOR_EVERY"
ENV_FP8_TRIAL = "AMPDOCTOR_FP8_TRIAL"
ENV_FORCE = "AMPDOCTOR_FORCE"
ENV_QUIET = "AMPDOCTOR_QUIET"
# The --apply arguments, as JSON (set by `record` only, with ENV_ACTIVE).
ENV_APPLY = "AMPDOCTOR_APPLY"
# Set by `record` only: the child side starts when it sees this (and its sitecustomize runs).
ENV_ACTIVE = "AMPDOCTOR_RECORD"
# Taken (removed from the environment) by the first Python of the command that imports torch:
# that process leaves a file even if it never trains; the processes it starts do not.
ENV_TOP = "AMPDOCTOR_TOP"
# Set by `record`: its own pid, which the command's torch processes watch (lifeline.py).
ENV_LAUNCHER = "AMPDOCTOR_LAUNCHER"
# Set by `record`: the list file (record/command/written.py) where each child notes the run file it
# created, so that `record` speaks of its own node's files only.
ENV_SESSION = "AMPDOCTOR_SESSION"


@dataclass(frozen=True)
class Settings:
    """What a recording needs to know, carried from ``record`` to the child processes."""

    output: str  # absolute path of the run file
    every: Optional[int] = None  # sampled-tier interval; None: the recorder's default
    fp8_trial: Optional[float] = None  # the fp8 trial's seconds; None: the recorder's default
    quiet: bool = False  # the parent's two lines (children print nothing anyway)
    shown: str = ""  # the output as the user typed it, for messages
    apply: tuple[Prescription, ...] = ()  # --apply: the fixes the children apply
    session: Optional[str] = None  # the list of files this record's children wrote (written.py)

    def to_env(self) -> dict[str, str]:
        """What the children need: where to write, how often to sample, the fixes to apply,
        the switch, and where to note the files they write."""
        env = {ENV_ACTIVE: "1", ENV_OUTPUT: self.output}
        if self.every is not None:
            env[ENV_EVERY] = str(self.every)
        if self.fp8_trial is not None:
            env[ENV_FP8_TRIAL] = repr(float(self.fp8_trial))
        if self.apply:
            env[ENV_APPLY] = prescription.to_env(self.apply)
        if self.session:
            env[ENV_SESSION] = self.session
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional["Settings"]:
        """The settings of a recorded child process, or None outside ``ampdoctor record``."""
        if environ.get(ENV_ACTIVE) != "1" or not environ.get(ENV_OUTPUT):
            return None
        every = environ.get(ENV_EVERY)
        try:
            apply = tuple(prescription.from_env(environ.get(ENV_APPLY)))
        except RecordError as exc:  # `record` checked them: only a hand-set variable gets here
            sys.stderr.write(f"ampdoctor: nothing applied: {exc}\n")
            apply = ()
        return cls(output=environ[ENV_OUTPUT],
                   every=int(every) if every and every.strip().isdigit() else None,
                   fp8_trial=_seconds(environ.get(ENV_FP8_TRIAL)),
                   shown=environ[ENV_OUTPUT], apply=apply,
                   session=environ.get(ENV_SESSION) or None)


def _seconds(text: Optional[str]) -> Optional[float]:
    """A budget from the environment: a number of seconds >= 0, else None (the default)."""
    try:
        return float(text) if text and 0 <= float(text) < float("inf") else None
    except ValueError:
        return None
