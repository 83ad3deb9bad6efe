"""Reliability: a run file survives what kills the run, every file gets an answer, and
ampdoctor is never what breaks training.

The killed-writer tests run tests/reliability_harness.py once (one process, one fork per
case); the bad-file and fuzz tests go through the real CLI or forked readers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from ampdoctor import analyze, schema, store
from ampdoctor.errors import RunFileError

from conftest import PYTHON, ROOT, python_env

HARNESS = os.path.join(ROOT, "tests", "reliability_harness.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from reliability_harness import BAD_STEP, STEPS, spread  # noqa: E402

COMPARED = ("step", "loss", "scale", "scale_after", "found_inf", "skipped", "grad_norm",
            "clip_norm", "lr", "sampled", "flags")


def _cases():
    kill = [{"id": f"kill-at-{k}", "at": at, "signal": signal.SIGKILL}
            for k, at in enumerate(spread(16, seed=7))]
    kill += [
        # Inside a flush: in the middle of the table writes, and deep in h5py.
        {"id": "kill-flush-tables", "call": ["store.py", "_append_rows", 14, 1]},
        {"id": "kill-flush-h5py", "call": ["store.py", "flush", 9, 60]},
        # During the forensic replay of the NaN step, and while its snapshot is written.
        {"id": "kill-replay", "call": ["forensics.py", "replay", 1, 300]},
        {"id": "kill-snapshot", "call": ["forensics.py", "_write", 1, 40]},
        {"id": "kill-close", "call": ["store.py", "close", 1, 30]},
    ]
    # Killed from outside, a fraction of a millisecond into a flush (lands inside C code).
    kill += [{"id": f"kill-async-{k}", "async_flush": 4 + 5 * k, "delay_us": 150 * k}
             for k in range(4)]
    term = [{"id": f"term-at-{k}", "at": at, "signal": signal.SIGTERM}
            for k, at in enumerate(spread(8, seed=11))]
    term += [{"id": f"term-async-{k}", "async_step": 3 + 6 * k, "delay_us": 300 * k,
              "signal": signal.SIGTERM} for k in range(3)]
    term += [{"id": "term-user-handler", "user_handler": True, "async_step": 5, "delay_us": 0,
              "signal": signal.SIGTERM}]
    raised = [{"id": "raise-with", "raise_at": 7},
              {"id": "raise-no-with", "raise_at": 7, "with": False}]
    return kill + term + raised


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """Every case of the harness, run once: {case id: result}."""
    out = tmp_path_factory.mktemp("ended")
    plan = out / "plan.json"
    plan.write_text(json.dumps({"out": str(out), "cases": _cases()}))
    proc = subprocess.run([PYTHON, HARNESS, str(plan)], env=python_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    return {r["id"]: r for r in results}


def _reported(result, kind):
    return [line[2:] for line in result["lines"] if line.startswith(kind + " ")]


def _steps_on_disk(result):
    """Steps the child knew were on disk when it died: the last completed flush."""
    done = _reported(result, "F")
    return int(done[-1]) if done else 0


def _check_prefix(result, reference, run):
    """The file holds steps 0..n-1, identical to the same steps of an undisturbed run."""
    n = len(run.steps)
    np.testing.assert_array_equal(run.steps["step"], np.arange(n))
    assert n >= _steps_on_disk(result), "a flushed step is missing"
    assert n <= len(_reported(result, "T")) + 1, "more steps than the loop ran"
    for name in COMPARED:
        np.testing.assert_array_equal(run.steps[name], reference.steps[name][:n], err_msg=name)
    assert np.all(run.steps["time"] > 0)
    if n > BAD_STEP:  # the replay's snapshot was flushed with the step that triggered it
        assert len(run.snapshots) >= 1 and int(run.snapshots["step"][0]) == BAD_STEP
    return n


def _ids(prefix):
    return [c["id"] for c in _cases() if c["id"].startswith(prefix)]


@pytest.fixture(scope="module")
def reference(ended):
    run = store.load(ended["calibration"]["path"])
    assert run.status == "finished" and len(run.steps) == STEPS
    return run


@pytest.mark.parametrize("case", _ids("kill-"))
def test_sigkill_leaves_every_flushed_step(ended, reference, case):
    result = ended[case]
    assert result["signal"] == signal.SIGKILL, f"not killed: {result['lines'][-3:]}"
    with store.load(result["path"]) as run:
        n = _check_prefix(result, reference, run)
        if case == "kill-close":
            assert run.status in ("interrupted", "finished") and n == STEPS
            return
        assert run.status == "interrupted"
        d = analyze.diagnose(run)
    assert d.run["status"] == "interrupted" and d.run["last_step"] == (n - 1 if n else None)
    assert any("interrupted" in note and (f"last recorded step is {n - 1}" in note if n else True)
               for note in d.notes), d.notes
    if case.startswith("kill-flush") or case.startswith("kill-async"):
        assert result["lines"][-1] == "S", "the kill did not land inside a flush"
    if case in ("kill-replay", "kill-snapshot"):
        assert _reported(result, "T")[-1] == str(BAD_STEP - 1), "not killed in the replay step"


def test_at_least_twenty_kills_spread_over_the_run(ended):
    kills = [ended[c] for c in _ids("kill-")]
    assert len(kills) >= 20 and all(k["signal"] == signal.SIGKILL for k in kills)
    reached = {len(_reported(k, "T")) for k in kills}
    assert min(reached) <= 2 and max(reached) >= STEPS - 3, sorted(reached)


@pytest.mark.parametrize("case", _ids("term-"))
def test_sigterm_finishes_the_file_and_still_ends_the_process(ended, reference, case):
    result = ended[case]
    with store.load(result["path"]) as run:
        n = _check_prefix(result, reference, run)
        if case == "term-user-handler":
            # The script's own handler decides what SIGTERM means: here, nothing.
            assert result["exit"] == 0 and result["lines"].count("H") == 1
            assert run.status == "finished" and n == STEPS
            return
        assert result["signal"] == signal.SIGTERM, f"not ended by SIGTERM: {result}"
        assert run.status == "signal:SIGTERM"
        # SIGTERM is caught: what was still queued reaches the file, not just the last flush.
        # (A signal that lands in ampdoctor's own code waits for it to finish: up to the
        # whole run when that was its last step.)
        assert n >= len(_reported(result, "T"))
        d = analyze.diagnose(run)
    assert d.run["last_step"] == n - 1
    assert f"interrupted by SIGTERM; the last recorded step is {n - 1}" in " ".join(d.notes)


def test_some_sigterm_landed_in_ampdoctor_code_and_waited_for_it(ended):
    waited = [c for c in _ids("term-at-") if "W" in ended[c]["lines"]]
    assert waited, "no SIGTERM case exercised the wait (the moments need re-drawing)"


@pytest.mark.parametrize("case", ["raise-with", "raise-no-with"])
def test_an_exception_in_the_script_is_the_status(ended, reference, case):
    result = ended[case]
    assert result["exit"] == 1
    with store.load(result["path"]) as run:
        n = _check_prefix(result, reference, run)
        assert n == 8 and run.status == "exception:RuntimeError"
        texts = run.events["text"][run.events["kind"] == schema.Event.EXCEPTION]
        assert list(texts) == ["RuntimeError: the training script failed at step 7"]
        d = analyze.diagnose(run)
    assert "raised RuntimeError after step 7" in " ".join(d.notes)


def test_cli_says_interrupted_with_the_last_step(ended):
    result = ended["kill-at-8"]
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "diagnose", result["path"]],
                          env=python_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with store.load(result["path"]) as run:
        last = int(run.steps["step"][-1])
    assert f"status interrupted" in proc.stdout
    assert f"the last recorded step is {last}" in proc.stdout
