"""A run in fp8 diagnosed against itself, end to end (issue 36 item 4): the fixtures of
``fixtures/fp8/`` recorded with ``ampdoctor record`` and diagnosed with no baseline. A sink
token that flushes most of a per-tensor cast (``fp8_flushed`` kind ``mostly``, the fixes tried
on the saved step by the fp8 trial), and a model too small for fp8 whose step the trial
re-runs in high precision (``fp8_drift`` kind ``self``); each ``--fix`` healthy."""

from __future__ import annotations

import os
import subprocess

import pytest
from testenv import PYTHON, ROOT, python_env

import ampdoctor

FP8 = os.path.join(ROOT, "fixtures", "fp8")


def diagnosed(tmp_path, script, every, *args):
    out = str(tmp_path / f"{script}{''.join(args)}.h5")
    cmd = [PYTHON, "-m", "ampdoctor", "record", "-o", out, "--every", str(every), "--force",
           "-q", "--", PYTHON, os.path.join(FP8, f"{script}.py"), *args]
    proc = subprocess.run(cmd, env=python_env(), capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    return ampdoctor.diagnose(out)


@pytest.mark.slow
def test_a_sink_token_mostly_flushed_and_rowwise_tried_on_the_saved_step(tmp_path):
    pytest.importorskip("torchao")
    d = diagnosed(tmp_path, "sink_token", 5)
    assert d.verdict == "fp8_flushed" and d.causes[0]["kind"] == "mostly", d.summary
    assert d.first_bad == {"step": 0, "module": "0", "phase": "forward"}
    rowwise, keep = d.fixes
    assert (rowwise.id, keep.id) == ("fp8_rowwise", "fp8_keep_layer")
    # measured on the saved step: row-wise leaves less of the casts' error than keeping the
    # first layer alone (the massive channels reach the second layer's input too)
    assert rowwise.tried and keep.tried and rowwise.proven and not keep.proven, (
        rowwise.outcome, keep.outcome)
    assert diagnosed(tmp_path, "sink_token", 5, "--fix").verdict == "healthy"


@pytest.mark.slow
def test_a_model_too_small_for_fp8_drifts_from_its_own_high_precision_rerun(tmp_path):
    pytest.importorskip("torchao")
    d = diagnosed(tmp_path, "small_drift", 20)
    assert d.verdict == "fp8_drift" and d.causes[0]["kind"] == "self", d.summary
    assert "to first order" in d.summary  # the loss is written by hand: .pow(2).mean()
    assert d.fixes[0].id == "fp8_keep_layer" and d.fixes[0].tried
    assert diagnosed(tmp_path, "small_drift", 20, "--fix").verdict == "healthy"
