"""The run's columns each rule module reads, declared in its ``READS`` and held to the run
file's schema: every /steps column a rule names (``f.steps["loss"]``) is one of
``runfile/schema.py``'s /steps columns and is declared, every view of /stats it reads
(``f.reduced.upd_log``) is one ``Facts.reduced`` has and is declared, and nothing is declared
that the module does not read. A rule that reads the recorder's device-side name
(``loss_mean``, ``record/steps.py``) fails here, not on a user's run."""

import ast
import glob
import os

from ampdoctor.diagnosis import rules
from ampdoctor.diagnosis.streamed import Reduced
from ampdoctor.runfile import schema

RULES_DIR = os.path.dirname(rules.__file__)
STEPS = set(schema.TABLES["steps"].names or ())
VIEWS = Reduced(n_steps=1, n_tensors=1)


def _is(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr


def _aliases(fn: ast.AST, attr: str) -> set[str]:
    """Names a function binds to ``<x>.<attr>`` (``s = f.steps``; ``st, k = f.reduced, ...``)."""
    out = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            out |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _is(v, attr)}
    return out


def read_in(source: str) -> dict[str, set[str]]:
    """The /steps columns (by name) and the /stats views a module's functions read."""
    steps: set[str] = set()
    stats: set[str] = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
            continue
        step_names, stat_names = _aliases(fn, "steps"), _aliases(fn, "reduced")
        for node in ast.walk(fn):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str) and (
                    _is(node.value, "steps") or getattr(node.value, "id", None) in step_names):
                steps.add(node.slice.value)
            if isinstance(node, ast.Attribute) and (
                    _is(node.value, "reduced") or getattr(node.value, "id", None) in stat_names):
                stats.add(node.attr)
    return {"steps": steps, "stats": stats}


def problems(name: str, source: str, declared: dict) -> list[str]:
    """What is wrong with a rule module's reads, one sentence each ([] when nothing is)."""
    read, out = read_in(source), []
    for column in sorted(read["steps"] - STEPS):
        out.append(f"{name} reads /steps {column!r}, which runfile/schema.py's /steps does not "
                   "have (the recorder's device-side name? record/steps.py maps them)")
    for view in sorted(read["stats"] - {v for v in read["stats"] if hasattr(VIEWS, v)}):
        out.append(f"{name} reads f.reduced.{view}, which Facts.reduced (streamed.Reduced) "
                   "does not have")
    for table in ("steps", "stats"):
        wanted, have = read[table], set(declared.get(table, ()))
        if wanted - have:
            out.append(f"{name} reads {table} {sorted(wanted - have)} not declared in its READS")
        if have - wanted:
            out.append(f"{name} declares {table} {sorted(have - wanted)} in READS but never "
                       "reads them")
    return out


def rule_modules() -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(RULES_DIR, "*.py"))
                  if not p.endswith("__init__.py"))


def test_each_rule_module_declares_what_it_reads_and_the_schema_has_it():
    found = []
    for path in rule_modules():
        module = __import__(f"ampdoctor.diagnosis.rules.{os.path.basename(path)[:-3]}",
                            fromlist=["READS"])
        with open(path, encoding="utf-8") as fh:
            found += problems(os.path.basename(path), fh.read(), module.READS)
    assert found == []


def test_every_rule_module_is_scanned():
    # RULES' functions come from these modules and no other
    assert {os.path.basename(p)[:-3] for p in rule_modules()} >= {
        fn.__module__.rsplit(".", 1)[-1] for fn in rules.RULES}
    assert len(rule_modules()) >= 10


def test_a_device_side_name_fails_with_a_sentence_that_names_it():
    source = ("def rule(f):\n"
              "    s = f.steps\n"
              "    return s['loss_mean'][-1] > f.steps['loss'][0] + f.reduced.no_such_view\n")
    found = problems("bad.py", source, {"steps": ("loss", "loss_mean"), "stats": ()})
    assert any("/steps 'loss_mean'" in p and "device-side" in p for p in found), found
    assert any("f.reduced.no_such_view" in p for p in found), found
    assert any("stats ['no_such_view'] not declared" in p for p in found), found
    assert not any("'loss'" in p for p in found), found  # a column the schema has


def test_an_undeclared_or_stale_read_is_named():
    source = "def rule(f):\n    st = f.reduced\n    return f.steps['lr'], st.upd_log\n"
    found = problems("r.py", source, {"steps": ("lr", "scale"), "stats": ()})
    assert found == ["r.py declares steps ['scale'] in READS but never reads them",
                     "r.py reads stats ['upd_log'] not declared in its READS"]
    assert problems("r.py", source, {"steps": ("lr",), "stats": ("upd_log",)}) == []
    assert {"lr", "scale", "loss"} <= STEPS
