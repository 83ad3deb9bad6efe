"""The doc tables written from the code's own tables, between markers in the Markdown:

    python docs/doctables.py           # rewrite every table that differs
    python docs/doctables.py --check   # exit 1 naming each table that differs; write nothing

- README.md, between ``<!-- begin: commands -->`` and ``<!-- end: commands -->``: a row per
  command of ``ampdoctor/cli.py``'s ``COMMAND_TABLE`` (a command of the CLI without its row
  stops the generator, naming it);
- README.md, between ``<!-- begin: verdicts -->`` and ``<!-- end: verdicts -->``: each verdict
  of ``ampdoctor/diagnosis/verdict.py``'s ``TABLE``, in its order, with its ``doc`` and
  ``doc_fixes``;
- docs/verdicts.md, between ``<!-- begin: verdict-rules -->`` and ``<!-- end: verdict-rules -->``:
  where each is decided (its ``family``, then every other rule module of ``diagnosis/rules/``
  that returns a ``Finding`` with its id) and what the release report reads into it
  (``report``);
- docs/commands.md, between ``<!-- begin: apply-forms -->`` and ``<!-- end: apply-forms -->``:
  a row per ``--apply`` form of ``ampdoctor/record/apply/prescription.py``'s ``FORMS``, in its
  order, with its ``doc`` (a form ``with_row`` another joins that one's row).

A verdict is declared once, in ``TABLE``, a command's row beside the CLI, an ``--apply`` form
in ``FORMS``; these tables are never edited by hand.
``tests/project/test_doctables.py`` (CI) fails while a table differs from what this writes.
Standard library and ampdoctor only.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ampdoctor import cli  # noqa: E402 - the checkout's own package
from ampdoctor.diagnosis.verdict import TABLE  # noqa: E402
from ampdoctor.record.apply.prescription import FORMS  # noqa: E402

RULES_DIR = os.path.join(ROOT, "ampdoctor", "diagnosis", "rules")
# What the release report's precision decision reads into a verdict (``Verdict.report``).
REPORT = {"range": "fp16's range failed: another dtype or fp32 islands",
          "bug": "a bug in the script or its data: fix it first, no dtype does",
          "neither": "—"}
COMMAND = "python docs/doctables.py"


def commands() -> str:
    """README.md's command table."""
    named = {m.group(1) for m in (re.match(r"`ampdoctor (\w+)", row[0])
                                  for row in cli.COMMAND_TABLE) if m}
    missing = sorted(set(cli.cli.commands) - named)
    if missing:
        raise SystemExit(f"ampdoctor/cli.py's COMMAND_TABLE has no row for {', '.join(missing)}")
    rows = ["| command | what it does | reference |", "|---|---|---|"]
    rows += [f"| {call} | {does} | {see} |" for call, does, see in cli.COMMAND_TABLE]
    return "\n".join(rows)


def verdicts() -> str:
    """README.md's verdict table."""
    rows = ["| verdict | meaning | main fix ids |", "|---|---|---|"]
    rows += [f"| `{v.id}` | {v.doc} | {v.doc_fixes} |" for v in TABLE]
    return "\n".join(rows)


def deciders(verdict: str, family: str) -> list[str]:
    """The rule modules that return a Finding with this id: its family first."""
    found = []
    for path in sorted(glob.glob(os.path.join(RULES_DIR, "*.py"))):
        with open(path, encoding="utf-8") as fh:
            if re.search(rf'\bFinding\(\s*"{verdict}"', fh.read()):
                found.append(os.path.basename(path)[:-3])
    return [family] + [m for m in found if m != family]


def verdict_rules() -> str:
    """docs/verdicts.md's table: where each verdict is decided, how the release report reads it."""
    rows = ["| verdict | decided in `diagnosis/rules/` | the release report reads it as |",
            "|---|---|---|"]
    for v in TABLE:
        where = ("`engine.py` (in `diagnosis/`: no rule fired)" if v.family == "engine" else
                 "; ".join(f"`{m}.py`" for m in deciders(v.id, v.family)))
        rows.append(f"| `{v.id}` | {where} | {REPORT[v.report]} |")
    return "\n".join(rows)


def apply_forms() -> str:
    """docs/commands.md's ``--apply`` table: a row per form, those ``with_row`` it joined."""
    rows = ["| `--apply` | what it changes |", "|---|---|"]
    for name, form in FORMS.items():
        if form.with_row:
            continue
        shared = [name] + [n for n, f in FORMS.items() if f.with_row == name]
        shown = ", ".join(f"`{n}={FORMS[n].placeholder}`" if FORMS[n].placeholder else f"`{n}`"
                          for n in shared)
        rows.append(f"| {shown} | {form.doc} |")
    return "\n".join(rows)


# (document, marker name, writer)
TABLES = [("README.md", "commands", commands),
          ("README.md", "verdicts", verdicts),
          (os.path.join("docs", "verdicts.md"), "verdict-rules", verdict_rules),
          (os.path.join("docs", "commands.md"), "apply-forms", apply_forms)]


def rewrite(text: str, name: str, table: str) -> str:
    """``text`` with the lines between ``name``'s markers replaced by ``table``."""
    begin, end = f"<!-- begin: {name} -->", f"<!-- end: {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"{name}: expected one {begin} and one {end}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n\n{table}\n\n{end}{tail}"


def stale(root: str = ROOT) -> list[str]:
    """The tables whose document differs from what ``TABLES`` writes ("README.md (verdicts)")."""
    out = []
    for doc, name, write in TABLES:
        with open(os.path.join(root, doc), encoding="utf-8") as fh:
            text = fh.read()
        if rewrite(text, name, write()) != text:
            out.append(f"{doc} ({name})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the doc tables from the code's tables.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each table that differs")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for item in found:
            print(f"{item} differs from the code's table: run `{COMMAND}`")
        return 1 if found else 0
    for doc, name, write in TABLES:
        path = os.path.join(ROOT, doc)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = rewrite(text, name, write())
        if new != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(new)
            print(f"wrote {doc} ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
