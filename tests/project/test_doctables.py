"""The doc tables written from the code's tables (``docs/doctables.py``) are what it writes: the
README's command table, from ``cli.py``'s ``COMMAND_TABLE``, the verdict tables of the
README and docs/verdicts.md, from ``diagnosis/verdict.py``'s ``TABLE``, and docs/commands.md's
``--apply`` table, from ``record/apply/prescription.py``'s ``FORMS``. A verdict or form added,
dropped or reworded in the code, a command without its row, or a row edited by hand, fails
here with the command that rewrites them."""

import importlib.util
import os
import shutil

import pytest
from conftest import ROOT


def doctables():
    spec = importlib.util.spec_from_file_location("doctables", os.path.join(ROOT, "docs",
                                                                          "doctables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doc_tables_are_what_the_generator_writes():
    tables = doctables()
    stale = tables.stale()
    assert not stale, f"{', '.join(stale)}: run `{tables.COMMAND}` and commit what it writes"


def test_every_verdict_has_its_row_in_both_tables():
    tables = doctables()
    readme, rules = tables.verdicts(), tables.verdict_rules()
    for v in tables.TABLE:
        assert f"\n| `{v.id}` | {v.doc} |" in readme and v.doc.strip(), v.id
        assert f"\n| `{v.id}` | `{v.family}.py`" in rules or v.family == "engine", v.id


def test_every_apply_form_has_its_row_in_its_own_spelling():
    tables = doctables()
    table = tables.apply_forms()
    for name, form in tables.FORMS.items():
        shown = f"`{name}={form.placeholder}`" if form.placeholder else f"`{name}`"
        row = next(line for line in table.splitlines() if shown in line.split(" | ")[0])
        host = tables.FORMS[form.with_row] if form.with_row else form
        assert host.doc and not host.with_row and row.endswith(f" | {host.doc} |"), name
    assert len(table.splitlines()) == 2 + sum(not f.with_row for f in tables.FORMS.values())


def test_a_row_edited_by_hand_or_left_out_is_named(tmp_path):
    tables = doctables()
    for doc, _, _ in tables.TABLES:
        os.makedirs(tmp_path / os.path.dirname(doc), exist_ok=True)
        shutil.copy(os.path.join(ROOT, doc), tmp_path / doc)
    assert tables.stale(str(tmp_path)) == []
    readme = (tmp_path / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `compiler` |"))
    (tmp_path / "README.md").write_text(readme.replace(row + "\n", ""))
    verdicts = tmp_path / "docs" / "verdicts.md"
    verdicts.write_text(verdicts.read_text().replace("| `diverged` | `progress.py`",
                                                     "| `diverged` | `trends.py`"))
    commands = tmp_path / "docs" / "commands.md"
    commands.write_text(commands.read_text().replace("| `use_bf16` | every fp16",
                                                     "| `use_bf16` | any fp16"))
    assert tables.stale(str(tmp_path)) == ["README.md (verdicts)",
                                           os.path.join("docs", "verdicts.md")
                                           + " (verdict-rules)",
                                           os.path.join("docs", "commands.md")
                                           + " (apply-forms)"]


def test_a_command_without_its_row_stops_the_generator(monkeypatch):
    tables = doctables()
    rows = [r for r in tables.cli.COMMAND_TABLE if not r[0].startswith("`ampdoctor dump")]
    assert len(rows) == len(tables.cli.COMMAND_TABLE) - 1
    monkeypatch.setattr(tables.cli, "COMMAND_TABLE", tuple(rows))
    with pytest.raises(SystemExit, match="COMMAND_TABLE has no row for dump"):
        tables.commands()
