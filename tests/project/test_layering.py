"""The package's layering (see .importlinter and the README's Development section): the
contracts hold, a new import cycle or torch on the analysis side breaks them, no module
imports another subpackage's private names, and each subpackage's docstring names every module
and room in it (where a newcomer looks first)."""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("importlinter", reason="import-linter comes with the test extra")
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache", "--config"]


def lint(root: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run(LINT + [os.path.join(root, ".importlinter")], cwd=root, env=env,
                          capture_output=True, text=True)


def copy_package(tmp_path) -> str:
    root = str(tmp_path / "repo")
    shutil.copytree(os.path.join(ROOT, "ampdoctor"), os.path.join(root, "ampdoctor"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, ".importlinter"), root)
    return root


def append(root: str, module: str, line: str) -> None:
    with open(os.path.join(root, "ampdoctor", *module.split(".")) + ".py", "a") as f:
        f.write("\n" + line + "\n")


def test_the_contracts_hold():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


# One bad import per contract, each of which breaks it (one copy, one lint: ~5 s a run).
BAD = [
    # verdict.py is a leaf that engine imports: importing engine back closes a cycle
    ("diagnosis.verdict", "from . import engine  # noqa", "No import cycles"),
    ("diagnosis.facts", "import torch  # noqa", "The analysis side imports neither torch"),
    ("diagnosis.rules.misuse", "import matplotlib  # noqa", "Only render.plots imports matplotlib"),
    ("release.readiness", "import h5py  # noqa", "Only runfile imports h5py"),
    # the run file reading the diagnosis: upward, and a cycle between subpackages
    ("runfile.store", "from ..diagnosis import facts  # noqa", "Layers:"),
]


def test_a_bad_import_breaks_its_contract(tmp_path):
    root = copy_package(tmp_path)
    for module, line, _ in BAD:
        append(root, module, line)
    proc = lint(root)
    assert proc.returncode != 0, proc.stdout
    lines = proc.stdout.splitlines()
    for _, _, contract in BAD:
        status = [x for x in lines if x.startswith(contract) or contract in x]
        assert any("BROKEN" in x for x in status) or any(
            contract in x and "BROKEN" in y for x, y in zip(lines, lines[1:])), \
            (contract, proc.stdout)
    assert f"{len(BAD)} broken" in proc.stdout, proc.stdout


def private_imports_across_subpackages(package_dir: str) -> list[str]:
    """``from ..other import _name`` where ``other`` is another subpackage of ampdoctor."""
    found = []
    for path in glob.glob(os.path.join(package_dir, "**", "*.py"), recursive=True):
        parts = os.path.relpath(path, os.path.dirname(package_dir)).split(os.sep)[:-1]
        for node in ast.walk(ast.parse(open(path).read())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            target = parts[: len(parts) - node.level + 1] + (node.module or "").split(".")
            for alias in node.names:
                names = [p for p in target + [alias.name] if p]
                private = any(n.startswith("_") and not n.startswith("__") for n in names)
                if private and names[:2] != parts[:2]:
                    found.append(f"{path}:{node.lineno} {'.'.join(names)}")
    return found


def test_no_private_names_are_imported_across_subpackages(tmp_path):
    assert private_imports_across_subpackages(os.path.join(ROOT, "ampdoctor")) == []
    root = copy_package(tmp_path)
    append(root, "live.follow", "from ..runfile.store import _open_swmr  # noqa")
    assert len(private_imports_across_subpackages(os.path.join(root, "ampdoctor"))) == 1


# One bad import per contract of the rooms inside record/ and diagnosis/, each of which breaks
# it (a forensic module importing the recorder closes a cycle too: the recorder imports it).
BAD_ROOMS = [
    # the recorder reaching past the forensic room's entry points
    ("record.hooks", "from .forensic import trial  # noqa", "record/forensic/ is entered"),
    # the forensic tier calling back into the recorder
    ("record.forensic.trial", "from .. import recorder  # noqa", "record/: command/ above"),
    ("diagnosis.rules.trends", "from .. import engine  # noqa", "diagnosis/rules/ imports the"),
    # the engine's side reaching into a rule module past the package's RULES
    ("diagnosis.notes", "from .rules import misuse  # noqa", "diagnosis/rules/ has one door"),
    # one rule family borrowing another's helper instead of a fact beside facts.py
    ("diagnosis.rules.hidden", "from . import learning  # noqa", "diagnosis/rules/: a rule"),
]


def test_a_bad_import_breaks_its_rooms_contract(tmp_path):
    root = copy_package(tmp_path)
    for module, line, _ in BAD_ROOMS:
        append(root, module, line)
    proc = lint(root)
    assert proc.returncode != 0, proc.stdout
    lines = proc.stdout.splitlines()
    for _, _, contract in BAD_ROOMS:
        status = [x if x.endswith(("KEPT", "BROKEN")) else x + " " + y  # a name wrapped
                  for x, y in zip(lines, lines[1:] + [""]) if x.startswith(contract)]
        assert status and status[0].endswith("BROKEN"), (contract, proc.stdout)


def test_each_subpackages_docstring_names_every_module_in_it():
    unnamed = []
    for init in glob.glob(os.path.join(ROOT, "ampdoctor", "*", "**", "__init__.py"),
                          recursive=True):
        folder = os.path.dirname(init)
        with open(init) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        # ``name``, ``name.attr``, ``name/`` (a room) or ``name()``
        named = {re.split(r"[./(]", n)[0] for n in re.findall(r"``([\w./()]+)``", doc)}
        for entry in sorted(os.listdir(folder)):
            name = entry[:-3] if entry.endswith(".py") else entry
            room = os.path.isfile(os.path.join(folder, entry, "__init__.py")) or \
                entry == "_bootstrap"
            if (entry.endswith(".py") or room) and entry != "__init__.py" and name not in named:
                unnamed.append(os.path.relpath(os.path.join(folder, entry), ROOT))
    assert not unnamed, f"not named in their package's docstring: {unnamed}"
