"""Copies of the model beside its training, through ``ampdoctor record`` (fixtures/copies/): a
FLOP count on ``meta`` (Lightning's ``measure_flops``, what ``litgpt pretrain`` runs), a
``FlopCounterMode`` around the first step, a copy run under ``FakeTensorMode``, a model run and
dropped before the real one, EMA and evaluation deepcopies every step, ``functional_call``.

Each run records every step of the model the optimizer steps and nothing of the copies: the
roots are that model, each step one micro-batch with the loss the script printed, the diagnosis
is healthy, and the script's losses and final weights are bit for bit those of the run without
ampdoctor. With ``--fail`` the overflow is still located in the model trained.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess

import numpy as np
import pytest
from conftest import PYTHON, ROOT, python_env

import ampdoctor

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "fixtures", "copies", "copies_train.py")
KINDS = ["meta", "flops", "fake", "throwaway", "ema", "functional"]


def run(folder, args: list[str], record: bool) -> tuple[subprocess.CompletedProcess, dict]:
    """The script plain or under ``ampdoctor record`` (run.h5 in ``folder``): its process and
    its log (losses in float.hex, the final weights' digest)."""
    folder.mkdir()
    log = folder / "log.json"
    command = [PYTHON, SCRIPT, *args, "--log", str(log)]
    if record:
        command = [PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", "--every", "2", "--",
                   *command]
    proc = subprocess.run(command, cwd=folder, env=python_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(log.read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_trained_is_recorded_and_untouched_beside_its_copies(tmp_path, kind):
    plain, plain_log = run(tmp_path / "plain", ["--copy", kind], record=False)
    rec, rec_log = run(tmp_path / "rec", ["--copy", kind], record=True)
    assert rec_log == plain_log  # losses and final weights, bit for bit
    assert rec.stdout == plain.stdout
    ours = [line for line in rec.stderr.splitlines() if "ampdoctor" in line]
    assert len(ours) == 2 and "recorded 6 steps" in ours[-1], rec.stderr[-3000:]
    path = str(tmp_path / "rec" / "run.h5")
    with ampdoctor.load(path) as r:
        assert r.roots == ["TinyGPT"]
        assert r.steps["micro"].tolist() == [1] * 6
        losses = np.array([float.fromhex(v) for v in plain_log["losses"]], dtype=np.float32)
        np.testing.assert_array_equal(r.steps["loss"], losses)
        assert r.skipped_modules == []
    assert ampdoctor.diagnose(path).verdict == "healthy"


@pytest.mark.parametrize("kind", ["meta", "throwaway", "ema"])
def test_a_failure_is_located_in_the_model_trained(tmp_path, kind):
    rec, _ = run(tmp_path / "rec", ["--copy", kind, "--fail"], record=True)
    d = ampdoctor.diagnose(str(tmp_path / "rec" / "run.h5"))
    assert d.verdict == "unstable_op", rec.stderr[-3000:]
    assert d.first_bad["step"] == 0
    assert fnmatch.fnmatch(d.first_bad["module"], "blocks.*.attn"), d.first_bad
