"""The early warning in fp8 terms, end to end (issue 36 items 5 and 6): ``fixtures/fp8/
outlier_growing.py`` recorded through the CLI, then ``top``, ``report`` (Markdown with its
figures, and JSON) read as a user reads them. The outlier is flagged in ``top`` while the fp8
run's loss still matches fp32's; a run without the outlier gets no fp8 line; ``record
--fp8-trial`` sets the trial's budget."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from testenv import PYTHON, ROOT, python_env

import ampdoctor

SCRIPT = os.path.join(ROOT, "fixtures", "fp8", "outlier_growing.py")
# The fixture's gain after 20 of its 60 steps: a run of 21 steps with this peak follows the
# 60-step run's first 21 steps exactly (same seed, same draws), and ends where it stood then.
AT_20 = repr(1000 ** (20 / 59))

pytestmark = pytest.mark.slow


def cli(*args, env=None, cwd=None):
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=dict(python_env(), **(env or {})),
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8watch")
    out = {}
    for name, env, extra in (("base", {}, ()), ("flat", {"PEAK": "1"}, ("--fp8-trial", "0")),
                             ("early", {"STEPS": "21", "PEAK": AT_20},
                              ("--fp8-trial", "7", "--apply", "fp8=tensorwise"))):
        if "--apply" in extra:
            pytest.importorskip("torchao")
        out[name] = str(d / f"{name}.h5")
        cli("record", "-o", out[name], "--every", "10", "-q", *extra, "--", PYTHON, SCRIPT,
            env=env, cwd=str(d))
    out["dir"] = str(d)
    return out


def test_top_shows_the_growing_outlier_while_the_fp8_runs_loss_still_matches_fp32(runs):
    """The run in tensorwise fp8, as it stood at step 20: top names fc2 (the Linear that reads
    the outlier channel) at risk since step 20, while its loss is within compare's 2 % of the
    fp32 run's (it diverges from step 52: tests/integration/test_fp8_keep.py)."""
    page = cli("top", "--once", runs["early"])
    lines = page.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("fp8 headroom:"))
    assert "at risk" in lines[at] and lines[at + 2].split()[0] == "fc2", page
    assert lines[at + 2].split()[-1] == "20"  # since
    assert float(lines[at + 2].split()[1]) < -1  # headroom, binades
    fp8, base = (ampdoctor.load(runs[n]).steps["loss"] for n in ("early", "base"))
    assert len(fp8) == 21 and abs(fp8[20] - base[20]) / base[20] < 0.02
    assert np.abs(fp8 - base[:21]).max() / base[:21].min() < 0.02


def test_the_report_draws_the_headroom_of_the_layers_at_risk_and_says_when_fp8_pays(runs):
    cli("report", runs["base"], "--format", "markdown", "--plots-dir", "plots", "-o",
        "report.md", cwd=runs["dir"])
    text = open(os.path.join(runs["dir"], "report.md")).read()
    assert os.path.exists(os.path.join(runs["dir"], "plots", "fp8_headroom.png"))
    assert "Early warning at step 50" in text and "fc2 from step 20" in text
    # item 6: per recipe the layers to keep in bf16 and those that keep their precision
    assert "| tensorwise | trial | 2: head, fc2 |" in text and text.count("| 1: fc1 |") >= 2
    assert "fp8 pays only on a GPU with fp8 matmuls" in text and "| fp8 matmuls |" in text
    report = json.loads(cli("report", runs["base"], "--format", "json", "-o", "-"))
    watch = report["fp8_watch"]
    assert watch["at_risk"][0]["layer"] == "fc2" and watch["first_warned"]["fc2"] == 20
    assert watch["at_risk"][0]["kurtosis"] > 50  # one channel of 128 holds the tensor
    assert report["decision"]["fp8_matmuls"] is None  # a CPU: the GPU is not known
    assert "under tensorwise, 1 of 3 Linears in fp8" in report["decision"]["fp8"]


def test_the_report_json_carries_the_fp8_readiness_in_the_issues_shape(runs):
    """Issue 36 item 6: ``report --format json``'s ``fp8`` is ``fp8_readiness(path).to_dict()``,
    per recipe the layers to keep and per layer its status and each operand's shares."""
    report = json.loads(cli("report", runs["base"], "--format", "json", "-o", "-"))
    assert report["fp8"] == json.loads(json.dumps(ampdoctor.fp8_readiness(runs["base"])
                                                  .to_dict()))
    for recipe in ("tensorwise", "delayed", "rowwise", "mxfp8"):
        part = report["fp8"]["recipes"][recipe]
        assert all(isinstance(n, str) for n in part["keep_high_precision"])
        assert set(part["layers"]) == {"fc1", "fc2", "head"}
        for layer in part["layers"].values():
            assert isinstance(layer["status"], str)
            assert set(layer["tensors"]) == {"input", "weight", "grad_output"}
            for t in layer["tensors"].values():
                assert {"flushed", "saturated", "sqnr_db"} <= set(t)
    assert report["fp8"]["recipes"]["tensorwise"]["keep_high_precision"] == ["head", "fc2"]


def test_a_run_without_the_outlier_gets_no_fp8_line_and_the_trial_follows_its_budget(runs):
    page = cli("top", "--once", runs["flat"])
    assert "fp8 headroom" not in page
    text = cli("report", runs["flat"], "--format", "markdown", "-o", "-")
    assert "Early warning" not in text
    report = json.loads(cli("report", runs["flat"], "--format", "json", "-o", "-"))
    assert report["fp8_watch"]["at_risk"] == [] and report["fp8_watch"]["first_warned"] == {}
    # --fp8-trial 0: no trial, the statistics decide; --fp8-trial 7: the trial's budget
    assert ampdoctor.fp8_readiness(runs["flat"]).trial == {}
    assert ampdoctor.fp8_readiness(runs["base"]).trial["budget"] == 30
    assert ampdoctor.fp8_readiness(runs["early"]).trial["budget"] == 7
