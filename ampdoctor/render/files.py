"""Files the report commands write: checked before any work, written whole or not at all.

They keep the rules of ``ampdoctor/outputs.py``: only a new file, or with ``force`` a file of
the same kind that ampdoctor wrote; never through a symbolic link, never over a device, FIFO,
directory or someone else's file (a run file, the script being checked, a user's own PNG).

How a file of ampdoctor's own kind is recognised, from its first bytes (``outputs.head``):

- an HTML report: ``<!DOCTYPE html>``, then ``<meta name="generator" content="ampdoctor">``
  in its head;
- a Markdown report: its first line ``# ampdoctor release report: ...``;
- a JSON report: an object whose first key is ``"format": "ampdoctor-report"``;
- a figure: a PNG whose text chunk says ``Software: ampdoctor`` (``plots.png`` writes it);
- a parity result (``ampdoctor parity -o``): ``parity_result.is_parity_output``.

Everything else is the user's, even with ``--force``.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Iterable, Optional

from .. import outputs
from ..errors import AmpDoctorError
from ..release.report import REPORT_FORMAT
from .release import GENERATOR, render_release

PNG_SOFTWARE = "ampdoctor"  # plots.png's "Software" text chunk
_REPORT_HEADS = (
    re.compile(rb"\A<!DOCTYPE html>\n<html[^>]*><head>(<meta [^>]*>)*" + re.escape(
        GENERATOR.encode())),
    re.compile(rb"\A# ampdoctor release report: "),
    re.compile(rb'\A\{\s*"format": "' + REPORT_FORMAT.encode() + rb'"'),
)


def is_report(path: str) -> bool:
    """Is ``path`` a report ampdoctor wrote (HTML, Markdown or JSON), by its first bytes?"""
    first = outputs.head(path)
    return any(p.match(first) for p in _REPORT_HEADS)


def is_figure(path: str) -> bool:
    """Is ``path`` a PNG that ampdoctor drew (``plots.png``'s ``Software`` text chunk)?"""
    first = outputs.head(path)
    return first.startswith(b"\x89PNG\r\n\x1a\n") and \
        b"tEXtSoftware\x00" + PNG_SOFTWARE.encode() in first


def report_rules(force: bool = False) -> outputs.Rules:
    return outputs.Rules(ours=is_report, kind="a report ampdoctor wrote", force=force)


def figure_rules(force: bool = False) -> outputs.Rules:
    return outputs.Rules(ours=is_figure, kind="a figure ampdoctor drew", force=force,
                         fix="choose another --plots-dir")


def write_report(run: Any, path: str = "report.html", *, baseline: Any = None,
                 parity: Any = None, fmt: str = "html", plots_dir: Optional[str] = None,
                 force: bool = False) -> Any:
    """``ampdoctor report`` as one call: the release report of ``run`` (against ``baseline``,
    with ``parity``'s layer parity) written to ``path`` ('-': stdout) as ``fmt`` ("html",
    "markdown" or "json"), Markdown's figures into ``plots_dir``; returns the ``ReleaseReport``.
    The target is checked before any work, and never a file being reported on; an existing
    report (or figure) of ampdoctor's is replaced only with ``force``.

    Example::

        r = ampdoctor.write_report("amp.h5", "report.html", baseline="fp32.h5")
        r.diagnosis.verdict, r.comparison.verdict
    """
    from ..release.report import release_report

    if plots_dir is not None and fmt != "markdown":
        raise AmpDoctorError("plots_dir goes with the markdown format (an HTML report embeds "
                             "its figures)")
    named = [x for x in (run, baseline, parity) if isinstance(x, (str, os.PathLike))]
    rules = report_rules(force)
    check_target(path, protect=[os.fspath(x) for x in named], rules=rules)
    if plots_dir is not None:
        check_dir(plots_dir)
    with release_report(run, baseline, parity=parity) as r:
        images = write_plots(r, plots_dir, relative_to=path, force=force) \
            if plots_dir is not None else None
        text = render_release(r, fmt, images)
    write(path, text, rules)
    return r


def check_target(path: str, protect: Iterable[str] = (),
                 rules: Optional[outputs.Rules] = None) -> None:
    """Raise ``AmpDoctorError`` (one sentence) unless ``path`` can take a report ('-': stdout)
    under ``rules`` (default: a new file, or a report of ampdoctor's with force)."""
    if path == "-":
        return
    for other in protect:
        if os.path.exists(path) and os.path.exists(other) and os.path.samefile(path, other):
            raise AmpDoctorError(f"{path} is the run file being reported on: write the report "
                                 "to another file")
    outputs.check(path, rules or report_rules())


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


def write(path: str, text: str, rules: Optional[outputs.Rules] = None) -> None:
    """Write ``text`` to ``path`` whole, under ``rules`` (``check_target``'s), or to stdout
    for '-'."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    outputs.write_bytes(path, text.encode("utf-8"), rules or report_rules())


def write_plots(report: Any, directory: str, relative_to: str = "-",
                force: bool = False) -> dict[str, str]:
    """Draw the report's figures into ``directory`` as PNG files; return name -> link, the
    link relative to the file that will refer to them (``relative_to``; '-': the cwd). Every
    figure's file is checked before the first is written: a PNG of the user's there stops
    them all."""
    from . import plots

    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise AmpDoctorError(f"cannot create {directory}: {exc.strerror or exc}") from None
    base = os.getcwd() if relative_to == "-" else os.path.dirname(os.path.abspath(relative_to))
    rules = figure_rules(force)
    figs = plots.figures(report.run, report.diagnosis, report.readiness, report.comparison)
    targets = {name: os.path.join(directory, f"{name}.png") for name in figs}
    for path in targets.values():
        outputs.check(path, rules)
    links = {}
    for name, fig in figs.items():
        outputs.write_bytes(targets[name], plots.png(fig), rules)
        links[name] = os.path.relpath(os.path.abspath(targets[name]), base).replace(os.sep, "/")
    return links
