"""No module of ``ampdoctor/`` over ``LIMIT`` lines without its reason at the top: a module
that long either splits along what its docstring already groups, or says in its docstring,
in a paragraph beginning "Why one module:", why it stays whole."""

import ast
import glob
import os

from conftest import ROOT

LIMIT = 600
REASON = "Why one module:"


def long_modules_without_a_reason(root: str) -> list[str]:
    found = []
    for path in sorted(glob.glob(os.path.join(root, "ampdoctor", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        lines = text.count("\n") + (not text.endswith("\n") and bool(text))
        if lines > LIMIT and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            found.append(f"{os.path.relpath(path, root)} ({lines} lines)")
    return found


def test_every_module_over_the_limit_says_why_it_is_one():
    assert long_modules_without_a_reason(ROOT) == []


def test_a_long_module_without_its_reason_is_named(tmp_path):
    package = tmp_path / "ampdoctor" / "sub"
    package.mkdir(parents=True)
    body = "\n".join(f"x{i} = {i}" for i in range(LIMIT))
    (package / "long.py").write_text(f'"""A long module."""\n{body}\n')
    (package / "reasoned.py").write_text(f'"""A long module.\n\n{REASON} it is."""\n{body}\n')
    (package / "short.py").write_text('"""Short."""\nx = 1\n')
    assert long_modules_without_a_reason(str(tmp_path)) == [
        f"ampdoctor{os.sep}sub{os.sep}long.py ({LIMIT + 1} lines)"]
