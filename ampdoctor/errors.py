"""One exception root for everything ampdoctor tells a user; the CLI maps these to exit codes.

Bugs are not wrapped: they keep their tracebacks. A user error is one sentence that names the
input and, where there is one, the fix.
"""

from __future__ import annotations


class AmpDoctorError(Exception):
    """A problem with what the user gave ampdoctor (a file, an option, a command)."""

    exit_code = 2


class RunFileError(AmpDoctorError):
    """A path that is not a readable ampdoctor run file."""


class FormatTooNewError(RunFileError):
    """A run file written by a newer ampdoctor than this one."""


class EmptyRunError(RunFileError):
    """A readable run file that holds no optimizer step: there is nothing to diagnose."""


class RecordError(AmpDoctorError):
    """``ampdoctor record`` cannot start: bad output path, existing file, no command."""


class OutputError(AmpDoctorError):
    """An output path ampdoctor will not write: a symbolic link, a device, someone else's
    file, or one of its own without ``--force`` (``ampdoctor/outputs.py``)."""


class RecorderFault(Exception):
    """An internal failure while recording; raised only in strict mode (ampdoctor's own tests)."""


class RunNotFoundError(RunFileError):
    """A run file that did not appear in the time ``ampdoctor top`` or ``export`` waited."""


class MissingExtraError(AmpDoctorError):
    """An optional dependency is not installed (``pip install 'ampdoctor[EXTRA]'``)."""
