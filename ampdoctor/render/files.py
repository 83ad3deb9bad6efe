"""Files the report commands write: checked before any work, written whole or not at all.

A report is derived material, so an existing report file is replaced; but never a run file
(``ampdoctor report run.h5 -o run.h5`` would destroy what was recorded), never a directory,
and never half-written (the text goes to a temporary file in the same directory, then is
renamed over the target).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Iterable, Optional

from ..errors import AmpDoctorError
from ..runfile.hdf5 import is_hdf5


def write_report(run: Any, path: str = "report.html", *, baseline: Any = None,
                 parity: Any = None, fmt: str = "html", plots_dir: Optional[str] = None) -> Any:
    """``ampdoctor report`` as one call: the release report of ``run`` (against ``baseline``,
    with ``parity``'s layer parity) written to ``path`` ('-': stdout) as ``fmt`` ("html",
    "markdown" or "json"), Markdown's figures into ``plots_dir``; returns the ``ReleaseReport``.
    The target is checked before any work, and never a file being reported on.

    Example::

        r = ampdoctor.write_report("amp.h5", "report.html", baseline="fp32.h5")
        r.diagnosis.verdict, r.comparison.verdict
    """
    from ..release.report import release_report
    from .release import render_release

    if plots_dir is not None and fmt != "markdown":
        raise AmpDoctorError("plots_dir goes with the markdown format (an HTML report embeds "
                             "its figures)")
    named = [x for x in (run, baseline, parity) if isinstance(x, (str, os.PathLike))]
    check_target(path, protect=[os.fspath(x) for x in named])
    if plots_dir is not None:
        check_dir(plots_dir)
    with release_report(run, baseline, parity=parity) as r:
        images = write_plots(r, plots_dir, relative_to=path) if plots_dir is not None else None
        text = render_release(r, fmt, images)
    write(path, text)
    return r


def check_target(path: str, protect: Iterable[str] = ()) -> None:
    """Raise ``AmpDoctorError`` (one sentence) unless ``path`` can take a report ('-': stdout)."""
    if path == "-":
        return
    if os.path.isdir(path):
        raise AmpDoctorError(f"{path} is a directory: name the report file to write")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise AmpDoctorError(f"cannot write {path}: there is no directory {parent}")
    if not os.access(parent, os.W_OK):
        raise AmpDoctorError(f"cannot write {path}: {parent} is not writable")
    if not os.path.exists(path):
        return
    for other in protect:
        if os.path.exists(other) and os.path.samefile(path, other):
            raise AmpDoctorError(f"{path} is the run file being reported on: write the report "
                                 "to another file")
    if is_hdf5(path):
        raise AmpDoctorError(f"{path} is an HDF5 file (a run file?): refusing to overwrite it "
                             "with a report")


def check_dir(path: str) -> None:
    """A directory for plot files: existing, or creatable in an existing parent."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise AmpDoctorError(f"{path} exists and is not a directory: name a directory for the "
                             "plots")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise AmpDoctorError(f"cannot create {path}: there is no directory {parent}")
    if not os.access(path if os.path.isdir(path) else parent, os.W_OK):
        raise AmpDoctorError(f"cannot write plots into {path}: not writable")


def write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, or to stdout for '-'."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str, data: bytes) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".ampdoctor-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise AmpDoctorError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_plots(report: Any, directory: str, relative_to: str = "-") -> dict[str, str]:
    """Draw the report's figures into ``directory`` as PNG files; return name -> link, the
    link relative to the file that will refer to them (``relative_to``; '-': the cwd)."""
    from . import plots

    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise AmpDoctorError(f"cannot create {directory}: {exc.strerror or exc}") from None
    base = os.getcwd() if relative_to == "-" else os.path.dirname(os.path.abspath(relative_to))
    links = {}
    figs = plots.figures(report.run, report.diagnosis, report.readiness, report.comparison)
    for name, fig in figs.items():
        path = os.path.join(directory, f"{name}.png")
        write_bytes(path, plots.png(fig))
        links[name] = os.path.relpath(os.path.abspath(path), base).replace(os.sep, "/")
    return links




def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
