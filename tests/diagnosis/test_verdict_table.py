"""One table per verdict: ``verdict.TABLE`` declares each verdict once, and everything that
lists verdicts agrees with it.

A verdict that a rule emits must have a row; a row must have its rule in ``rules.RULES`` (in the
module its ``family`` names), a row in the README's verdict table and in docs/verdicts.md's, and
at least one fixture that shows it decided: a fixture run of fixtures/verdicts/expected.json
expecting it, or a named test. ``VERDICTS``, ``PRIORITY`` and the release report's
``RANGE_VERDICTS``/``BUG_VERDICTS`` are read from it.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re

from conftest import ROOT

from ampdoctor.diagnosis import rules
from ampdoctor.diagnosis.verdict import PRIORITY, TABLE, VERDICTS
from ampdoctor.release import report

DIAGNOSIS = os.path.join(ROOT, "ampdoctor", "diagnosis")
ROWS = {v.id: v for v in TABLE}


def emitted() -> dict[str, str]:
    """{verdict id: module} for every ``Finding("id", ...)`` written in diagnosis/."""
    found = {}
    for path in glob.glob(os.path.join(DIAGNOSIS, "**", "*.py"), recursive=True):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and node.args \
                    and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Finding" \
                    and isinstance(node.args[0], ast.Constant):
                found[node.args[0].value] = os.path.relpath(path, ROOT)
    return found


def test_every_verdict_a_rule_emits_has_one_row():
    made = emitted()
    assert len(made) >= 20, made  # the scan sees the rules' findings
    missing = {v: where for v, where in made.items() if v not in ROWS}
    assert not missing, f"verdicts with no row in verdict.TABLE: {missing}"
    assert len(ROWS) == len(TABLE), "a verdict declared twice"


def test_every_row_has_its_rule_in_RULES():
    by_module: dict[str, list[str]] = {}
    for rule in rules.RULES:
        by_module.setdefault(rule.__module__.rsplit(".", 1)[1], []).append(rule.__name__)
    for v in TABLE:
        source = open(os.path.join(DIAGNOSIS, "rules" if v.family != "engine" else "",
                                   f"{v.family}.py")).read()
        assert f'"{v.id}"' in source, f"{v.id}: no rule in diagnosis/{v.family}.py names it"
        if v.family != "engine":  # healthy: engine's when no rule fires
            assert v.family in by_module, f"{v.id}: no rule of {v.family}.py in rules.RULES"


def test_every_row_is_in_the_readme_and_the_verdicts_doc():
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme.split("\n## Verdicts", 1)[1].split("\n## ", 1)[0]
    doc = open(os.path.join(ROOT, "docs", "verdicts.md")).read()
    for v in TABLE:
        assert f"\n| `{v.id}` |" in table, f"the README's verdict table lacks {v.id}"
        row = re.search(rf"\n\| `{v.id}` \| (.*?) \| (.*?) \|\n", doc)
        assert row, f"docs/verdicts.md's verdict table lacks {v.id}"
        assert f"`{v.family}.py`" in row.group(1), (v.id, row.group(0))
        assert (row.group(2) == "—") == (v.report == "neither"), (v.id, row.group(0))


def test_every_row_has_a_fixture_that_shows_it():
    with open(os.path.join(ROOT, "fixtures", "verdicts", "expected.json")) as fh:
        expected = json.load(fh)
    for v in TABLE:
        assert v.fixtures, f"{v.id} has no fixture"
        for fixture in v.fixtures:
            if "::" in fixture:
                path, name = fixture.split("::")
                text = open(os.path.join(ROOT, path)).read()
                assert f"def {name}(" in text and v.id in text, (v.id, fixture)
            else:
                run = expected.get(fixture)
                assert run and run["verdict"] == v.id and not run.get("pending"), \
                    (v.id, fixture, run)


def test_the_tables_that_list_verdicts_are_read_from_it():
    assert list(VERDICTS) == [v.id for v in TABLE]
    for v in TABLE:
        assert v.report in ("range", "bug", "neither"), v
        assert (v.id in report.RANGE_VERDICTS) == (v.report == "range")
        assert (v.id in report.BUG_VERDICTS) == (v.report == "bug")
        assert PRIORITY.get(v.id) == v.priority
