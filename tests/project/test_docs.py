"""Every command the documents show still parses, and every file and link they name is there.

README.md and docs/*.md are read the way a user reads them, and checked this far, no further:

- Each ``ampdoctor SUBCOMMAND ...`` line of a code block (``&&``-chained ones included) is
  parsed by the real click CLI: ``make_context`` converts and checks every argument and option
  against the command's declaration and runs nothing. Run files need not exist to be parsed
  (no argument is ``exists=True``), so ``run.h5``, ``fp32.h5`` and ``check.py:make`` stand as
  written. Blocks marked ```text are what a command printed, not commands. A backquoted span
  of the prose that starts with ``ampdoctor SUBCOMMAND`` must name a real command and only its
  real options (prose often names a command without its arguments).
- Every ``fixtures/``, ``benchmarks/``, ``tests/`` or ``.ci/`` path and every ``ampdoctor/...py``
  module a document names exists (a pattern such as ``fixtures/formats/v<N>.h5`` is not a
  path), and so does every test a ``tests/folder/x.py::test_name`` names.
- Every ``python benchmarks/X.py ARGS`` a document quotes, and every ``python fixtures/X.py
  ARGS`` that a quoted ``ampdoctor record -- ...`` runs, is parsed by that script's own
  argparse: in one child process each script runs as ``__main__`` with the quoted arguments
  until its ``ArgumentParser.parse_args`` returns, and is stopped there. That shows the flags
  and values are accepted; nothing is trained, measured or timed. Whether a benchmark still
  runs to the end is tests/project/test_benchmarks.py's job for the ones it runs at tiny sizes (see
  docs/development.md for which), and the figures are the commands' own, never this test's.
  ``bash benchmarks/gpu_check.sh`` has no argparse: the flags quoted for it must appear in it.
- Every relative link resolves: its file exists, and its ``#anchor`` is a heading there.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess

import click
from conftest import PYTHON, ROOT, python_env

from ampdoctor import cli

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
TEXT = {name: open(os.path.join(ROOT, name), encoding="utf-8").read() for name in DOCS}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
OUTPUT, CODE = "text", "python"  # fence labels whose lines are not shell commands
# ampdoctor/ only as a module (`ampdoctor/loss` is a TensorBoard tag, not a path)
PATH = re.compile(r"(?<![\w/.-])((?:fixtures|benchmarks|tests|\.ci)/[\w./-]*\w"
                  r"|ampdoctor/[\w/]+\.py)(?![\w/<])")
SCRIPT = re.compile(r"(?:benchmarks|fixtures)/\S+\.(?:py|sh)")
RUNS_A_SCRIPT = re.compile(r"\b(?:python3?|bash) (?:benchmarks|fixtures)/")
PLACEHOLDERS = {"W": "128"}  # `preflight_cost.py --width W`: the text gives widths 128 and 512


def shell_lines(text: str) -> list[str]:
    """The lines of every code block that may hold a command (not output, not Python)."""
    return [line for label, body in FENCE.findall(text) if label not in (OUTPUT, CODE)
            for line in body.splitlines()]


def prose_spans(text: str) -> list[str]:
    """The backquoted spans outside code blocks, a span broken over lines joined with a space."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]


def commands(line: str) -> list[list[str]]:
    """Each command of a shell line, as words: `a && b | c` is three, `# ...` is a comment."""
    out: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word in ("&&", "||", "|", ";"):
            out.append([])
        elif out[-1] or not re.fullmatch(r"[A-Z_]+=\S*", word):  # OMP_NUM_THREADS=1 cmd
            out[-1].append(word)
    return [words for words in out if words]


def ampdoctor_commands(name: str) -> list[list[str]]:
    return [words for line in shell_lines(TEXT[name]) for words in commands(line)
            if words[0] == "ampdoctor"]


def test_every_ampdoctor_command_in_a_code_block_parses():
    shown, problems = set(), []
    for name in DOCS:
        for words in ampdoctor_commands(name):
            sub, args = words[1], words[2:]
            command = cli.cli.commands.get(sub)
            if command is None:
                problems.append(f"{name}: no command {sub!r}: {shlex.join(words)}")
                continue
            try:
                command.make_context(sub, list(args))
            except click.ClickException as e:
                problems.append(f"{name}: {shlex.join(words)}: {e.format_message()}")
            shown.add(sub)
    assert not problems, "\n".join(problems)
    assert shown == set(cli.cli.commands), set(cli.cli.commands) - shown


def options(command: click.Command) -> set[str]:
    return {o for p in command.params if isinstance(p, click.Option)
            for o in p.opts + p.secondary_opts} | {"--help"}


def test_every_ampdoctor_command_in_the_prose_is_real():
    problems, seen = [], 0
    for name in DOCS:
        for span in prose_spans(TEXT[name]):
            words = span.split()
            if len(words) < 2 or words[0] != "ampdoctor":
                continue
            seen += 1
            command = cli.cli.commands.get(words[1])
            if command is None:
                problems.append(f"{name}: no command {words[1]!r}: `{span}`")
                continue
            ours = words[2:words.index("--")] if "--" in words else words[2:]
            flags = {w.split("=")[0] for w in ours if w.startswith("-")}
            unknown = flags - options(command)
            if unknown:
                problems.append(f"{name}: `{span}`: {sorted(unknown)} not options of {words[1]}")
    assert not problems, "\n".join(problems)
    assert seen > 10  # the spans were found at all


def test_every_path_a_doc_names_exists():
    missing, named = [], 0
    for name in DOCS:
        for path in set(PATH.findall(TEXT[name])):
            named += 1
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{name}: {path}")
        for path, test in set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", TEXT[name])):
            if f"def {test}(" not in open(os.path.join(ROOT, path)).read():
                missing.append(f"{name}: {path}::{test}")
    assert not missing, "\n".join(sorted(missing))
    assert named > 30


def quoted_scripts() -> list[tuple[str, str, str, list[str]]]:
    """(doc, interpreter, script, arguments) of every script a document quotes running."""
    found = []
    for name in DOCS:
        spans = [s for s in prose_spans(TEXT[name]) if RUNS_A_SCRIPT.search(s)]
        for line in shell_lines(TEXT[name]) + spans:
            for words in commands(line):
                if words[:2] == ["ampdoctor", "record"] and "--" in words:
                    words = words[words.index("--") + 1:]  # the command it records
                if len(words) > 1 and words[0] in ("python", "python3", "bash") \
                        and SCRIPT.fullmatch(words[1]):
                    args = [PLACEHOLDERS.get(w, w) for w in words[2:]]
                    found.append((name, words[0], words[1], args))
    return found


# Run each script as __main__ up to its parse_args, then stop it (see the module docstring).
PARSE_ONLY = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

real = argparse.ArgumentParser.parse_args

def parse_then_stop(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_then_stop
results = []
for script, args in json.loads(sys.argv[1]):
    sys.argv, err = [script, *args], io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        results.append("ran to the end without parsing its arguments")
    except Parsed:
        results.append(None)
    except SystemExit as e:
        results.append(f"exit {e.code}: {err.getvalue().strip()[-400:]}")
    except Exception as e:
        results.append(f"{type(e).__name__}: {e}")
print(json.dumps(results))
"""


def test_every_quoted_script_accepts_its_arguments():
    quoted = quoted_scripts()
    assert {script for _, _, script, _ in quoted} >= {"benchmarks/overhead.py",
                                                      "benchmarks/gpu_check.sh"}
    problems, to_parse = [], []
    for name, interpreter, script, args in quoted:
        path = os.path.join(ROOT, script)
        if not os.path.exists(path):
            problems.append(f"{name}: {script} does not exist")
            continue
        source = open(path).read()
        flags = [a.split("=")[0] for a in args if a.startswith("-")]
        if interpreter == "bash":
            problems += [f"{name}: {script} has no {f}" for f in flags if f not in source]
        elif args and "parse_args(" not in source:
            problems.append(f"{name}: {script} is quoted with {args} but parses no arguments")
        elif args:
            to_parse.append((name, script, args))
    if to_parse:
        proc = subprocess.run([PYTHON, "-c", PARSE_ONLY,
                               json.dumps([(s, a) for _, s, a in to_parse])], cwd=ROOT,
                              env=python_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        for (name, script, args), result in zip(to_parse, json.loads(proc.stdout)):
            if result:
                problems.append(f"{name}: {script} {shlex.join(args)}: {result}")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(name: str) -> set[str]:
    prose = FENCE.sub("", TEXT[name])
    return {slug(h) for h in re.findall(r"^#+ (.+)$", prose, re.M)}


def test_every_relative_link_resolves():
    broken, links = [], 0
    for name in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", TEXT[name])):
            if re.match(r"\w+://", target):
                continue
            links += 1
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path \
                else name
            if not os.path.exists(os.path.join(ROOT, resolved)):
                broken.append(f"{name}: {target}: no file {resolved}")
            elif anchor and anchor not in anchors(resolved):
                broken.append(f"{name}: {target}: no heading #{anchor} in {resolved}")
    assert not broken, "\n".join(broken)
    assert links > 20


def test_each_doc_says_what_it_covers_and_links_back():
    for name in DOCS[1:]:
        text = TEXT[name]
        head = text.split("\n## ", 1)[0]
        assert text.startswith("# "), name
        assert "](../README.md)" in head, f"{name}: no link back to the README at its top"
        assert len(head.split("\n\n")[1]) > 80, f"{name}: no line saying what it covers"


def layout_sections() -> dict[str, str]:
    """docs/development.md's layout block by subpackage: {"record": its text, "": the top}."""
    text = open(os.path.join(ROOT, "docs", "development.md")).read()
    block = text.split("Layout of `ampdoctor/`", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    sections: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        head = re.match(r"(\w+)/\s", line)
        if head:
            name = head.group(1)
        elif not line.startswith(" "):
            name = ""  # an unindented line without "pkg/" names top-level modules
        sections[name] = sections.get(name, "") + line + "\n"
    return sections


def test_the_development_layout_names_every_module():
    sections = layout_sections()
    package = os.path.join(ROOT, "ampdoctor")
    missing = []
    for entry in sorted(os.listdir(package)):
        path = os.path.join(package, entry)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
            for sub in sorted(os.listdir(path)):
                if sub == "__init__.py" or sub.startswith("."):
                    continue
                if sub.endswith(".py") or os.path.isdir(os.path.join(path, sub)) \
                        and sub != "__pycache__":
                    shown = sub if sub.endswith(".py") else sub + "/"
                    if not re.search(rf"(?<![\w/]){re.escape(shown)}",
                                     sections.get(entry, "")):
                        missing.append(f"{entry}/{shown}")
        elif entry.endswith(".py") and entry != "__main__.py":
            if not re.search(rf"(?<![\w/]){re.escape(entry)}", sections.get("", "")):
                missing.append(entry)
    assert not missing, f"docs/development.md's layout leaves out {missing}"


def test_the_development_test_table_names_every_test_file():
    """docs/development.md's table of tests has a row per folder of tests/ naming each of its
    test files: a file added to a folder, or a folder added, fails here until the table says
    what it runs on."""
    text = open(os.path.join(ROOT, "docs", "development.md")).read()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([\w/]+)/` \| ([^|]*) \|", text, re.M)}
    tests = os.path.join(ROOT, "tests")
    missing = []
    for here, _dirs, names in os.walk(tests):
        folder = os.path.relpath(here, tests)
        for name in sorted(n for n in names if n.startswith("test_") and n.endswith(".py")):
            if f"`{name}`" not in rows.get(folder, ""):
                missing.append(f"{folder}/{name}")
    assert not missing, f"docs/development.md's test table leaves out {missing}"
