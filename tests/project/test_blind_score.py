"""The blind corpus (fixtures/blind/) and its scorer (benchmarks/blind_score.py) agree.

Every script of the corpus has an expert verdict, every failure has a --fix case, every
verdict is one the README tables, and the scorer counts its totals as it says. Nothing here
records a run (that is the scorer's own job: benchmarks/results/blind_before.json).
"""

import importlib.util
import json
import os
import re
import sys

import pytest
from conftest import ROOT

BLIND = os.path.join(ROOT, "fixtures", "blind")


def scorer():
    spec = importlib.util.spec_from_file_location(
        "blind_score", os.path.join(ROOT, "benchmarks", "blind_score.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["blind_score"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def expected():
    with open(os.path.join(BLIND, "expected.json")) as f:
        return json.load(f)


def test_every_script_has_an_expert_verdict_and_every_failure_a_fix_case():
    cases = expected()
    scripts = sorted(name for name in os.listdir(BLIND) if name.endswith(".py"))
    assert sorted({key.split()[0] for key in cases}) == scripts
    for key, case in cases.items():
        assert case["reason"].strip(), key
        if " " not in key and case["verdict"] != "healthy":
            assert cases[f"{key} --fix"]["verdict"] == "healthy", key


def test_every_expected_verdict_is_in_the_readme_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        tabled = set(re.findall(r"^\| `(\w+)` \|", f.read(), flags=re.M))
    assert {case["verdict"] for case in expected().values()} <= tabled


def test_only_keeps_one_script_and_its_fix_run():
    module = scorer()
    assert list(module.load_cases("masked_row_nan")) == [
        "masked_row_nan.py",
        "masked_row_nan.py --fix",
    ]
    assert list(module.load_cases("healthy_gan.py")) == ["healthy_gan.py"]
    with pytest.raises(SystemExit, match="no case named"):
        module.load_cases("no_such_script")


def test_totals_count_failures_false_alarms_and_confident_verdicts():
    module = scorer()
    rows = [
        module.Row("a.py", "unstable_op", "unstable_op", 0.95, True, 1.0, ""),
        module.Row("a.py --fix", "healthy", "nonfinite", 0.4, False, 1.0, ""),
        module.Row("b.py", "healthy", "healthy", 0.7, True, 1.0, ""),
        module.Row("c.py", "mask_overflow", "unstable_op", 0.9, False, 1.0, ""),
        module.Row("d.py", "lr_overflow", "error: record wrote no file", None, False, 1.0, ""),
    ]
    assert module.totals(rows) == {
        "failures_right": [1, 3],
        "healthy_no_false_alarm": [1, 2],
        "confident_right": [1, 2],
    }
