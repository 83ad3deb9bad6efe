"""The small pieces the reports are built of: numbers as people read them, tables in text,
Markdown and HTML, a run's label.

``render/release.py`` (the release report, fp32 parity) and ``render/fix_outcome.py`` (a run
against its fix) show their values through these, so a step time or a loss scale reads the
same in both.

Example::

    text_table(("step", "loss"), [(0, "1.434"), (99, "0.9102")], indent="  ")
    # ['  step  loss', '  0     1.434', '  99    0.9102']
"""

from __future__ import annotations

import math
from typing import Optional

from .. import safe
from ..numfmt import fmt

# ---------------------------------------------------------------------------------------------
# Numbers as people read them


def nbytes(n: Optional[int]) -> str:
    if not n:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def seconds(t: Optional[float]) -> str:
    if t is None or not math.isfinite(t):
        return "-"
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def ratio(x: Optional[float]) -> str:
    return f"{x:.2f}x" if x is not None and math.isfinite(x) else "-"


def scale(x: Optional[float]) -> str:
    """A loss scale, with its power of two when it is one (GradScaler's always are)."""
    if x is None or not math.isfinite(x) or x <= 0:
        return fmt(x)
    exp = math.log2(x)
    if exp == int(exp):
        return (f"{x:.0f}" if 1 <= x < 1e9 else fmt(x)) + f" (2**{int(exp)})"
    return fmt(x)


def step(x: Optional[int]) -> str:
    return "-" if x is None else f"step {x}"


def run_label(info: dict) -> str:
    """'run.h5 (float16 + GradScaler, CPU x86_64)', with what ``record --apply`` applied:
    ``info`` is ``comparison.describe``'s."""
    dev = info.get("device_name") or info.get("device")
    if info.get("device") == "cpu":
        dev = f"CPU {dev}" if dev and dev != "cpu" else "CPU"
    applied = "".join(f", --apply {x}" for x in info.get("applied") or [])
    return (f"{info['path']} ({info['dtype']}" + (" + GradScaler" if info.get("scaler") else "")
            + f", {dev}{applied})")


# ---------------------------------------------------------------------------------------------
# Tables


def text_table(head: tuple, rows: list[tuple], indent: str = "") -> list[str]:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = indent + "  ".join(f"{{:<{w}}}" for w in widths)
    return [line.format(*head).rstrip()] + [line.format(*map(str, r)).rstrip() for r in rows]


def md_table(head: tuple, rows: list[tuple]) -> list[str]:
    """A (GFM) table, every cell through ``safe.md_text``: a cell is text, never markup."""
    cell = safe.md_text
    return (["| " + " | ".join(cell(h) for h in head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


esc = safe.html


def kv_table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def html_table(head: tuple, rows: list[tuple]) -> str:
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"
