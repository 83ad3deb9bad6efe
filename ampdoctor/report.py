"""Diagnosis → text, JSON or Markdown; run-file inspection → text (``dump``).

Reporters take data objects, never paths. No torch, no h5py.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .analyze import Diagnosis

FORMATS = ("text", "json", "markdown")


def render(d: Diagnosis, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(d.to_dict(), indent=2, allow_nan=False, default=str) + "\n"
    if fmt == "markdown":
        return render_markdown(d)
    return render_text(d)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return str(v)


def _where(first_bad: dict | None) -> str:
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


def render_text(d: Diagnosis) -> str:
    run = d.run
    lines = [f"ampdoctor: {run.get('path') or 'run'}",
             f"  {run.get('steps', 0)} steps recorded, {run.get('skipped_steps', 0)} skipped, "
             f"status {run.get('status')}, autocast {run.get('autocast_dtype') or 'off'}"]
    lines.append("")
    lines.append(f"verdict: {d.verdict}  (confidence {d.confidence:.2f})")
    lines.append(f"  {d.summary}")
    if d.first_bad:
        lines.append(f"  first bad: {_where(d.first_bad)}")
    if len(d.causes) > 1:
        chain = " -> ".join(c["verdict"] for c in d.causes)
        lines.append(f"  chain: {chain}")
    if d.evidence:
        lines.append("")
        lines.append("evidence:")
        for e in d.evidence:
            lines.append(f"  - {e.text}")
    if d.history and d.history.get("step"):
        lines.append("")
        lines.append("around the first bad step:")
        lines.append("  step       loss        scale       lr          grad_norm  skipped")
        h = d.history
        for i, step in enumerate(h["step"]):
            lines.append(f"  {step:<10} {_fmt(h['loss'][i]):<11} {_fmt(h['scale'][i]):<11} "
                         f"{_fmt(h['lr'][i]):<11} {_fmt(h['grad_norm'][i]):<10} "
                         f"{'yes' if h['skipped'][i] else ''}")
    if d.fixes:
        lines.append("")
        lines.append("what to change:")
        for fx in d.fixes:
            lines.append(f"  [{fx.id}] {fx.text}")
            for code in fx.snippet.splitlines():
                lines.append(f"      {code}")
    for note in d.notes:
        lines.append("")
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"


def render_markdown(d: Diagnosis) -> str:
    run = d.run
    out = [f"## ampdoctor: `{d.verdict}` (confidence {d.confidence:.2f})", "", d.summary, ""]
    if d.first_bad:
        out += [f"**First bad:** {_where(d.first_bad)}", ""]
    if len(d.causes) > 1:
        out += ["**Chain:** " + " → ".join(f"`{c['verdict']}`" for c in d.causes), ""]
    if d.evidence:
        out += ["### Evidence", ""] + [f"- {e.text}" for e in d.evidence] + [""]
    if d.fixes:
        out += ["### What to change", ""]
        for fx in d.fixes:
            out += [f"- **{fx.id}**: {fx.text}"]
            if fx.snippet:
                out += ["", "```python", fx.snippet, "```", ""]
        out += [""]
    out += ["### Run", "", "| | |", "|---|---|"]
    for key in ("path", "status", "steps", "skipped_steps", "autocast_dtype", "torch"):
        out.append(f"| {key} | {_fmt(run.get(key))} |")
    for note in d.notes:
        out += ["", f"> {note}"]
    return "\n".join(out) + "\n"


def render_dump(info: dict) -> str:
    """What ``ampdoctor dump`` prints: attributes, configuration, tables and sizes."""
    lines = [f"{info['path']}: ampdoctor run, format version {info['format_version']}, "
             f"{info['file_bytes']} bytes", "", "attributes:"]
    for key, value in info["attrs"].items():
        lines.append(f"  {key}: {value}")
    lines += ["", "meta:"]
    for key, value in info.get("meta", {}).items():
        lines.append(f"  {key}: {json.dumps(value, default=str)}")
    lines += ["", "tables:", f"  {'name':<10} {'rows':>9} {'stored':>10}  columns"]
    for name, t in info["tables"].items():
        if t is None:
            lines.append(f"  {name:<10} MISSING")
            continue
        cols = ", ".join(t["columns"])
        if t.get("damaged"):
            cols = "UNEXPECTED COLUMNS OR SHAPE: " + cols
        lines.append(f"  {name:<10} {t['rows']:>9} {t['stored_bytes']:>10}  {cols}")
    return "\n".join(lines) + "\n"
