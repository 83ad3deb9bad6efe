"""Diagnosis → text, JSON or Markdown; run-file inspection → text (``dump``).

Reporters take data objects, never paths. No torch, no h5py.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from .. import safe
from ..diagnosis.rankview import lines as rank_lines
from ..diagnosis.verdict import Diagnosis
from ..display import renders
from ..numfmt import fmt

FORMATS = ("text", "json", "markdown")


def render(d: Diagnosis, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(d.to_dict(), indent=2, allow_nan=False, default=str) + "\n"
    if fmt == "markdown":
        return render_markdown(d)
    return safe.terminal(render_text(d))


def _cell(v: Any) -> str:
    """A run-table value: text as it is, a number through ``fmt``."""
    return v if isinstance(v, str) else fmt(v)


def where_text(first_bad: dict | None) -> str:
    """'step 12, module blocks.0.attn, forward' (the parts a finding knows)."""
    if not first_bad:
        return ""
    parts = []
    if first_bad.get("step") is not None:
        parts.append(f"step {first_bad['step']}")
    if first_bad.get("module"):
        parts.append(f"module {first_bad['module']}")
    if first_bad.get("phase"):
        parts.append(f"{first_bad['phase']}")
    return ", ".join(parts)


WIDTH = 100


def _wrap(text: str, indent: str, width: int = WIDTH) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) or [indent]


def _run_line(run: dict) -> str:
    parts = [f"{run.get('steps', 0)} steps recorded", f"{run.get('skipped_steps', 0)} skipped",
             f"status {run.get('status')}",
             f"autocast {run.get('autocast_dtype') or 'off'}"]
    scale = run.get("loss_scale")
    if scale:
        parts.append(f"loss scale {fmt(scale.get('init'))} -> {fmt(scale.get('final'))}")
    parts.append(f"{run.get('sampled_steps', 0)} sampled, {run.get('replays', 0)} replayed")
    return ", ".join(parts)


def split_causes(d: Diagnosis) -> tuple[list[dict], list[dict]]:
    """The causal chain (root, then consequences) and the other causes also found."""
    chain = [c for c in d.causes if c["role"] in ("root", "consequence")]
    also = [c for c in d.causes if c["role"] == "also"]
    return chain, also


def _bullet(text: str) -> list[str]:
    lines = _wrap(text, "    ")
    lines[0] = "  - " + lines[0][4:]
    return lines


def first_sentence(cause: dict) -> str:
    return cause["text"].split(". ")[0].rstrip(".") + "."


def also_text(cause: dict) -> str:
    """Another cause found beside the verdict: its id, where, and its first sentence."""
    where = where_text(cause.get("first_bad"))
    return cause["verdict"] + (f" at {where}" if where else "") + f": {first_sentence(cause)}"


@renders(Diagnosis, "text")
def render_text(d: Diagnosis) -> str:
    run = d.run
    lines = [f"ampdoctor: {run.get('path') or 'run'}", f"  {_run_line(run)}", ""]
    lines.append(f"verdict: {d.verdict}  (confidence {d.confidence:.2f})")
    lines += _wrap(d.summary, "  ")
    if d.first_bad:
        lines.append(f"  first bad: {where_text(d.first_bad)}")
    chain, also = split_causes(d)
    if len(chain) > 1:
        lines.append("  chain: " + " -> ".join(c["verdict"] for c in chain))
    for c in also:
        lines += _wrap(f"also: {also_text(c)}", "  ")
    lines += _warning_text(d)
    if d.evidence:
        lines += ["", "evidence:"]
        for e in d.evidence:
            lines += _bullet(e.text)
    if d.rank_view:
        lines += ["", "ranks:"]
        for line in rank_lines(d.rank_view):
            lines += _bullet(line)
    if d.history and d.history.get("step"):
        lines += ["", "around the first bad step:",
                  "  step       loss        scale       lr          grad_norm  skipped"]
        h = d.history
        for i, step in enumerate(h["step"]):
            lines.append(f"  {step:<10} {fmt(h['loss'][i]):<11} {fmt(h['scale'][i]):<11} "
                         f"{fmt(h['lr'][i]):<11} {fmt(h['grad_norm'][i]):<10} "
                         f"{'yes' if h['skipped'][i] else ''}")
    if d.fixes:
        lines += ["", "what to change:"]
        for fx in d.fixes:
            lines += _wrap(f"[{fx.id}] {fx.text}", "  ")
            for code in fx.snippet.splitlines():
                lines.append(f"      {code}".rstrip())
            lines += [x for part in fix_lines(fx) for x in _wrap(part, "    ")]
        if any(fx.apply for fx in d.fixes):
            lines += [""] + _wrap(TRY_IT, "  ")
    for note in d.notes:
        lines.append("")
        lines += _wrap(f"note: {note}", "")
    return "\n".join(lines) + "\n"


@renders(Diagnosis, "markdown")
def render_markdown(d: Diagnosis) -> str:
    """Markdown for a pull request or an issue. Every text of the diagnosis goes through
    ``safe``'s Markdown escapers (names and exception texts come from the run file); the
    headings, bold, lists and code spans around them are this renderer's own."""
    text, code = safe.md_text, safe.md_code
    out = [f"## ampdoctor: {code(d.verdict)} (confidence {d.confidence:.2f})", "",
           text(d.summary), ""]
    if d.first_bad:
        out += [f"**First bad:** {text(where_text(d.first_bad))}", ""]
    chain, also = split_causes(d)
    if len(chain) > 1:
        out += ["**Chain:** " + " → ".join(code(c["verdict"]) for c in chain), ""]
    for c in also:
        where = where_text(c.get("first_bad"))
        out += [f"**Also:** {code(c['verdict'])}" + (f" at {text(where)}" if where else "")
                + f": {text(first_sentence(c))}", ""]
    out += _warning_markdown(d)
    if d.evidence:
        out += ["### Evidence", ""] + [f"- {text(e.text)}" for e in d.evidence] + [""]
    if d.rank_view:
        out += ["### Ranks", ""] + [f"- {text(line)}" for line in rank_lines(d.rank_view)] + [""]
    if d.fixes:
        out += ["### What to change", ""] + _fixes_markdown(d.fixes)
    out += ["### Run", "", "| | |", "|---|---|"]
    for key in ("path", "status", "steps", "skipped_steps", "sampled_steps", "replays",
                "autocast_dtype", "torch"):
        out.append(f"| {key} | {text(_cell(d.run.get(key)))} |")
    scale = d.run.get("loss_scale")
    if scale:
        out.append(f"| loss scale | {fmt(scale.get('init'))} → {fmt(scale.get('final'))} |")
    for note in d.notes:
        out += ["", f"> {text(note)}"]
    return "\n".join(out) + "\n"


def _fixes_markdown(fixes: list) -> list[str]:
    out = []
    for fx in fixes:
        out += [f"- **{safe.md_text(fx.id)}**: {safe.md_text(fx.text)}"]
        if fx.snippet:
            out += [""] + safe.md_fence(fx.snippet, "python") + [""]
        for part in fix_lines(fx):
            if fx.apply and part.startswith("try it"):
                out.append(f"  try it: {safe.md_code('--apply ' + fx.apply)}")
            else:
                out.append(f"  {safe.md_text(part)}")
    if any(fx.apply for fx in fixes):
        out += ["", safe.md_text(TRY_IT)]
    return out + [""]


# Said once under the fixes, when one of them can be applied from outside the code.
TRY_IT = ("Each --apply tries its fix on the whole run with no code change: ampdoctor record "
          "--apply FIX -o fixed.h5 -- <your command>, then ampdoctor compare run.h5 fixed.h5.")


def fix_lines(fx: Any) -> list[str]:
    """Under a fix: where its numbers come from, how to apply it (or why it cannot be from
    outside the code), and what the replay of the failing step found when it tried it."""
    out = []
    if fx.source:
        out.append(f"numbers: {fx.source}")
    if fx.apply:
        out.append(f"try it: --apply {fx.apply}")
    elif fx.apply_note:
        out.append(f"--apply: none ({fx.apply_note})")
    if fx.tried and fx.outcome:
        out.append(f"tried: {fx.outcome}")
    return out


def _warning_text(d: Diagnosis) -> list[str]:
    """The early warning: a ``warning:`` block under a healthy verdict, or the step from which
    it would have fired on a failed run (``forecast.warning_lines``)."""
    from ..diagnosis.forecast import warning_lines

    found = warning_lines(d.forecast, d.healthy)
    if not found:
        return []
    if not d.healthy:
        return [""] + _wrap(f"early warning: {found[0]}", "")
    return ["", "warning:"] + _bullet(found[0]) + [x for fix in found[1:]
                                                   for x in _wrap(fix, "    ")]


def _warning_markdown(d: Diagnosis) -> list[str]:
    from ..diagnosis.forecast import warning_lines

    found = [safe.md_text(x) for x in warning_lines(d.forecast, d.healthy)]
    if not found:
        return []
    if not d.healthy:
        return [f"**Early warning:** {found[0]}", ""]
    return ["### Early warning", "", f"**{found[0]}**", ""] + [f"- {x}" for x in found[1:]] \
        + [""]


def render_dump(info: dict) -> str:
    """What ``ampdoctor dump`` prints: attributes, configuration, tables and sizes."""
    lines = [f"{info['path']}: ampdoctor run, format version {info['format_version']}, "
             f"{info['file_bytes']} bytes", "", "attributes:"]
    for key, value in info["attrs"].items():
        lines.append(f"  {key}: {value}")
    lines += ["", "meta:"]
    for key, value in info.get("meta", {}).items():
        lines.append(f"  {key}: {json.dumps(value, default=str)}")
    found = dict(info.get("summary") or {})
    if found:
        points = found.pop("scale_points", None)
        lines += ["", "summary:"] + [f"  {key}: {value}" for key, value in found.items()
                                     if key != "path"]
        if points is not None:
            shown = ", ".join(f"{step}: {fmt(value)}" for step, value in points[:8])
            lines.append(f"  scale change points: {shown}" + (" ..." if len(points) > 8 else ""))
    lines += ["", "tables:", f"  {'name':<10} {'rows':>9} {'stored':>10}  columns"]
    for name, t in info["tables"].items():
        if t is None:
            lines.append(f"  {name:<10} MISSING")
            continue
        cols = ", ".join(t["columns"])
        if t.get("damaged"):
            cols = "UNEXPECTED COLUMNS OR SHAPE: " + cols
        lines.append(f"  {name:<10} {t['rows']:>9} {t['stored_bytes']:>10}  {cols}")
    return safe.terminal("\n".join(lines) + "\n")
