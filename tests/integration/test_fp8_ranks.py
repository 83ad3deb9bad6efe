"""fp8 amaxes that differ across ranks that should agree, through the CLI as a user runs it:
``ampdoctor record -o ddp.h5 -- torchrun --nproc_per_node 2 fixtures/fp8/ddp_replicas.py``
(two DDP replicas of a torchao fp8 MLP over gloo on the CPU, emulated), then ``ampdoctor
diagnose ddp.h5``. With ``no_sync`` on every micro-batch the replicas' weights drift apart and
``fp8_amax_mismatch`` names the layer, the step and each rank's amax and scale; the healthy run
(``--fix``) compares the same weights, finds them bit-equal, and stays healthy, though its
activations differ across the ranks on every step (each rank its own batch).

Cost: two 2-rank launches of a 12-step script, one after the other, about 60 s on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import PYTHON, ROOT, python_env
from recording import finish, start

import ampdoctor
from ampdoctor.diagnosis import fp8

SCRIPT = os.path.join(ROOT, "fixtures", "fp8", "ddp_replicas.py")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    pytest.importorskip("torchao.float8")
    folder = tmp_path_factory.mktemp("fp8ranks")
    out = {}
    # one job at a time: two torchrun --standalone jobs side by side may meet at one port
    for name, args in {"drift": [], "healthy": ["--fix"]}.items():
        proc = start(SCRIPT, str(folder / f"{name}.h5"), args, every=5, nproc=2)
        _, stderr = finish(proc, timeout=180)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = str(folder / f"{name}.h5")
    return out


def diagnose(path: str) -> dict:
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "diagnose", path, "--format", "json"],
                          env=python_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_ddp_replicas_that_drift_apart_are_named(recorded):
    d = diagnose(recorded["drift"])
    assert d["verdict"] == "fp8_amax_mismatch" and d["causes"][0]["kind"] == "ddp"
    first = d["first_bad"]
    assert first["module"] in ("fc1", "fc2") and first["step"] == 5  # step 0 agrees
    ev = next(e for e in d["evidence"] if e["key"] == "fp8_amax_mismatch")
    assert "rank 0: amax" in ev["text"] and "rank 1: amax" in ev["text"]
    assert ev["value"] != 1.0  # the amaxes are not the same
    steps = next(e for e in d["evidence"] if e["key"] == "fp8_amax_steps")
    assert "bit-equal on step 0" in steps["text"]
    assert [fx["id"] for fx in d["fixes"]] == ["fp8_sync_replicas"]
    # what each rank's file holds: the layout declared, and the values that differ
    amax = []
    for rank in (0, 1):
        with ampdoctor.load(recorded["drift"].replace(".h5", f".rank{rank}.h5")) as run:
            layers = run.fp8_layers
            assert {n: v["replicas"] for n, v in layers.items()} == \
                {n: {"weight": {"ranks": [0, 1], "by": "ddp"}} for n in ("fc1", "fc2")}
            amax.append(fp8.casts(run)[0])
    by_key = [{(c.layer, c.role, c.step): c.amax for c in made} for made in amax]
    assert by_key[0][(first["module"], "weight", 0)] == by_key[1][(first["module"], "weight", 0)]
    assert by_key[0][(first["module"], "weight", 5)] != by_key[1][(first["module"], "weight", 5)]


@pytest.mark.slow
def test_the_healthy_two_rank_fp8_run_stays_healthy(recorded):
    d = diagnose(recorded["healthy"])
    assert d["verdict"] == "healthy", d["summary"]
    assert any("compared across the 2 rank files on 3 sampled steps" in n and "bit-equal" in n
               for n in d["notes"])
    # its activations differ across the ranks (each rank its own batch), and are not compared
    inputs = []
    for rank in (0, 1):
        with ampdoctor.load(recorded["healthy"].replace(".h5", f".rank{rank}.h5")) as run:
            made, _ = fp8.casts(run)
            inputs.append({(c.layer, c.step): c.amax for c in made if c.role == "input"})
    assert inputs[0] and all(inputs[0][k] != inputs[1][k] for k in inputs[0])
