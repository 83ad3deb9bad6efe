"""The README's promises: its two setup commands are the ones CI and users run."""

import os
import re

from conftest import ROOT

README = open(os.path.join(ROOT, "README.md")).read()
CI = open(os.path.join(ROOT, ".ci", "run")).read()


def test_ci_runs_the_readme_test_command():
    assert "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q" in README
    assert "pip install -q torch==2.13.0 -e '.[test]'" in CI
    assert "python -m pytest -q" in CI


def test_readme_example_command_pins_torch_and_records_then_diagnoses():
    line = next(l for l in README.splitlines() if "ampdoctor record" in l and "pip install" in l)
    assert "torch==2.13.0" in line
    script = re.search(r"python (fixtures/\S+\.py)", line).group(1)
    assert os.path.exists(os.path.join(ROOT, script))
    assert line.endswith("ampdoctor diagnose run.h5")


def test_numbers_in_the_readme_name_their_command():
    """Every measured ratio (1.23x) in the README sits in a section that names a benchmark."""
    for section in README.split("\n## ")[1:]:
        if re.search(r"\d\.\d+x\b", section):
            assert "benchmarks/" in section, section.splitlines()[0]
