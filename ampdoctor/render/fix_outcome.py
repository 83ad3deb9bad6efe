"""A run against its fix (a ``Comparison`` of kind ``"fix"``) → text, Markdown, HTML.

``render/release.py`` hands a fix comparison here; the data is ``release/fix_outcome.py``'s.
Each run gets a column, so what the fix changed reads across a row: applied, verdict, first
bad step, non-finite and skipped steps, the first and last finite loss, the loss scale, step
time and memory; then both losses at the same steps.

Example::

    c = ampdoctor.compare("run.h5", "fixed.h5")
    print(text(c))      # what ``ampdoctor compare run.h5 fixed.h5`` prints
"""

from __future__ import annotations

import textwrap
from typing import Any, Optional

from .. import safe
from ..numfmt import fmt
from ..release import fix_outcome
from .diagnosis import where_text
from .tables import esc, html_table, md_table, nbytes, run_label, scale, seconds, text_table

WIDTH = 100
CLASSES = {"fixed": "ok", "both_healthy": "ok", "still_failing": "bad", "worse": "bad",
           "not_trained": "bad"}


def names(c: Any) -> tuple[str, str]:
    """Column heads: the file names, or the paths when those agree."""
    return fix_outcome.names(c.base["path"], c.amp["path"])


def rows(c: Any) -> list[tuple[str, str, str]]:
    """(what, first run, second run) for every row the runs have data for."""
    t = c.treatment
    b, a = t["base"], t["amp"]
    out = [("applied", _applied(b), _applied(a)),
           ("verdict", _verdict(b), _verdict(a)),
           ("first bad", where_text(b["first_bad"]) or "none",
            where_text(a["first_bad"]) or "none"),
           ("non-finite loss", _count(b["nonfinite"], b["steps"], b["first_nonfinite"]),
            _count(a["nonfinite"], a["steps"], a["first_nonfinite"])),
           ("skipped steps", _count(b["skipped"], b["steps"], b["first_skipped"]),
            _count(a["skipped"], a["steps"], a["first_skipped"])),
           ("first finite loss", _point(b["first_loss"]), _point(a["first_loss"])),
           ("last finite loss", _point(b["last_loss"]), _point(a["last_loss"]))]
    if b["scale"] or a["scale"]:
        out.append(("loss scale", _scale_story(b["scale"]), _scale_story(a["scale"])))
    st = c.step_time
    if st.get("base") and st.get("amp"):
        out.append(("median step time", seconds(st["base"]), seconds(st["amp"])))
    m = c.memory
    if m.get("base") and m.get("amp"):
        out.append((f"peak memory ({m.get('measure')})", nbytes(m["base"]), nbytes(m["amp"])))
    return out


def at_rows(c: Any) -> list[tuple[str, str, str]]:
    return [(str(x["step"]), fmt(x["base"]), fmt(x["amp"])) for x in c.treatment["at_steps"]]


def text(c: Any) -> str:
    nb, na = names(c)
    lines = [f"ampdoctor compare: {run_label(c.base)}", f"               vs {run_label(c.amp)}",
             "", f"verdict: {c.verdict}"]
    lines += textwrap.wrap(c.summary, WIDTH, initial_indent="  ", subsequent_indent="  ",
                           break_long_words=False, break_on_hyphens=False)
    lines += [""] + text_table(("", nb, na), rows(c), indent="  ")
    if c.treatment["at_steps"]:
        lines += ["", "loss at the same steps:"]
        lines += text_table(("step", nb, na), at_rows(c), indent="  ")
    for note in c.notes:
        lines += [""] + textwrap.wrap(f"note: {note}", WIDTH, break_long_words=False,
                                      break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def markdown(c: Any, level: int = 2) -> str:
    h = "#" * level
    nb, na = names(c)
    code, md = safe.md_code, safe.md_text
    out = [f"{h} What the fix changed: {code(c.verdict)}", "",
           f"{code(c.base['path'])} ({md(_dtype(c.base))}) vs {code(c.amp['path'])} "
           f"({md(_dtype(c.amp))})", "", md(c.summary), ""]
    out += md_table(("", nb, na), rows(c)) + [""]
    if c.treatment["at_steps"]:
        out += [f"{h}# Loss at the same steps", ""]
        out += md_table(("step", nb, na), at_rows(c)) + [""]
    for note in c.notes:
        out += [f"> {md(note)}", ""]
    return "\n".join(out).rstrip() + "\n"


def html(c: Any, figure: str = "") -> str:
    """The release report's section; ``figure``: the loss figure's HTML, if drawn."""
    nb, na = names(c)
    out = [f"<h2>What the fix changed: <code>{esc(c.verdict)}</code></h2>",
           f"<p><code>{esc(c.base['path'])}</code> ({esc(_dtype(c.base))}) vs "
           f"<code>{esc(c.amp['path'])}</code> ({esc(_dtype(c.amp))})</p>",
           f'<div class="verdict {CLASSES.get(c.verdict, "warn")}"><p>{esc(c.summary)}</p></div>',
           html_table(("", nb, na), rows(c))]
    if figure:
        out.append(figure)
    if c.treatment["at_steps"]:
        out += ["<h3>Loss at the same steps</h3>", html_table(("step", nb, na), at_rows(c))]
    out += [f'<p class="muted">Note: {esc(note)}</p>' for note in c.notes]
    return "\n".join(out)


def _dtype(info: dict) -> str:
    """'float16, --apply fp32_island=attn': ``comparison.describe``'s dtype and applied."""
    return ", ".join([info["dtype"], *(f"--apply {x}" for x in info.get("applied") or [])])


def _applied(o: dict) -> str:
    return ", ".join(f"--apply {x}" for x in o["applied"]) or "none"


def _verdict(o: dict) -> str:
    return f"{o['verdict']} (confidence {o['confidence']:.2f})"


def _count(n: int, of: int, first: Optional[int]) -> str:
    if not n:
        return "none"
    return f"all {of}" if n == of else f"{n} of {of}, from step {first}"


def _point(p: Optional[dict]) -> str:
    return "none" if p is None else f"{fmt(p['loss'])} (step {p['step']})"


def _scale_story(s: Optional[dict]) -> str:
    if s is None:
        return "no GradScaler"
    if s["initial"] == s["final"] == s["lowest"]:
        return f"{scale(s['final'])} throughout"
    out = f"{scale(s['initial'])} -> {scale(s['final'])}"
    if s["lowest"] < s["final"]:
        out += f", lowest {scale(s['lowest'])} (step {s['lowest_step']})"
    return out
