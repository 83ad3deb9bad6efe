"""The README's promises: its two setup commands are the ones CI and users run, it stays the
front door (the reference lives in docs/), and the figures of every document name their command.
"""

import glob
import os
import re

from conftest import ROOT

README = open(os.path.join(ROOT, "README.md")).read()
CI = open(os.path.join(ROOT, ".ci", "run")).read()
DOCS = {os.path.relpath(p, ROOT): open(p).read()
        for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))}


def test_ci_runs_the_readme_test_command():
    assert "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q" in README
    assert "pip install -q torch==2.13.0 -e '.[test]'" in CI
    assert "python -m pytest -q" in CI


def test_the_test_processes_take_one_thread_each():
    """Two workers on two cores, and the training processes their tests start: a thread per
    core in each made OpenMP's threads wait on each other (three times the CPU time)."""
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"' in CI
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0) > 1:  # conftest.py's default
        import torch

        threads = os.environ.get("OMP_NUM_THREADS")
        assert threads and torch.get_num_threads() == int(threads), threads


def test_readme_example_command_pins_torch_and_records_then_diagnoses():
    line = next(l for l in README.splitlines() if "ampdoctor record" in l and "pip install" in l)
    assert "torch==2.13.0" in line
    script = re.search(r"python (fixtures/\S+\.py)", line).group(1)
    assert os.path.exists(os.path.join(ROOT, script))
    assert line.endswith("ampdoctor diagnose run.h5")


def test_numbers_in_the_docs_name_their_command():
    """Every measured ratio (1.23x) in the README or in docs/*.md sits in a `## ` section that
    names a benchmark."""
    assert DOCS
    for name, text in {"README.md": README, **DOCS}.items():
        for section in ("\n" + text).split("\n## "):
            if re.search(r"\d\.\d+x\b", section):
                assert "benchmarks/" in section, f"{name}: {section.strip().splitlines()[0]}"


def test_the_readme_is_the_front_door_and_links_every_doc():
    """Issue 22: the README is what a newcomer reads first (about 200 lines); the reference is
    in docs/, and each of those is reached from it."""
    assert len(README.splitlines()) <= 250, "move the reference into docs/"
    for name in DOCS:
        assert f"]({name})" in README or f"]({name}#" in README, name
