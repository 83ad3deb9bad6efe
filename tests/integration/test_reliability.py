"""Reliability: a run file survives what kills the run, every file gets an answer, and
ampdoctor is never what breaks training.

The killed-writer tests run tests/support/reliability_harness.py once (one process, one fork
per case); the bad-file and fuzz tests go through the real CLI or forked readers.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess

import numpy as np
import pytest
from conftest import PYTHON, ROOT, SUPPORT, python_env

from ampdoctor.diagnosis import engine
from ampdoctor.runfile import attributes, schema, store, summary

HARNESS = os.path.join(SUPPORT, "reliability_harness.py")
from reliability_harness import BAD_STEP, STEPS, spread  # noqa: E402

COMPARED = ("step", "loss", "scale", "scale_after", "found_inf", "skipped", "grad_norm",
            "clip_norm", "lr", "sampled", "flags")


def _cases():
    kill = [{"id": f"kill-at-{k}", "at": at, "signal": signal.SIGKILL}
            for k, at in enumerate(spread(16, seed=7))]
    kill += [
        # Inside a flush: in the middle of the table writes, and deep in h5py.
        {"id": "kill-flush-tables", "call": ["runfile/writer.py", "_append_rows", 14, 1]},
        {"id": "kill-flush-h5py", "call": ["runfile/writer.py", "flush", 9, 60]},
        # During the forensic replay of the NaN step, and while its snapshot is written.
        {"id": "kill-replay", "call": ["forensics.py", "_run", 1, 300]},
        {"id": "kill-snapshot", "call": ["forensics.py", "_write", 1, 300]},
        {"id": "kill-close", "call": ["runfile/writer.py", "close", 1, 30]},
    ]
    # Killed from outside, a fraction of a millisecond into a flush (lands inside C code).
    kill += [{"id": f"kill-async-{k}", "async_flush": 4 + 5 * k, "delay_us": 150 * k}
             for k in range(4)]
    term = [{"id": f"term-at-{k}", "at": at, "signal": signal.SIGTERM}
            for k, at in enumerate(spread(8, seed=11))]
    term += [{"id": f"term-async-{k}", "async_step": 3 + 6 * k, "delay_us": 300 * k,
              "signal": signal.SIGTERM} for k in range(3)]
    # Sent from inside a replay (the model's forward re-run by ampdoctor), while its
    # isolation runs.
    term += [{"id": "term-in-replay", "term_in_replay": True}]
    term += [{"id": "term-user-handler", "user_handler": True, "async_step": 5, "delay_us": 0,
              "signal": signal.SIGTERM},
             # Lands in ampdoctor's flush: waits for it, then the script's handler runs once.
             {"id": "term-user-handler-in-flush", "user_handler": True,
              "call": ["runfile/writer.py", "flush", 6, 5], "signal": signal.SIGTERM}]
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
    """The file holds steps 0..n-1, identical to the same steps of an undisturbed run.

    A recorder that closes the file (SIGTERM, an exception) also writes the step it was in,
    whose update() never came: only its index is compared."""
    n = len(run.steps)
    done = len(_reported(result, "T"))
    np.testing.assert_array_equal(run.steps["step"], np.arange(n))
    assert n >= _steps_on_disk(result), "a flushed step is missing"
    assert n <= done + 1, "more steps than the loop ran"
    for name in COMPARED:
        np.testing.assert_array_equal(run.steps[name][:done], reference.steps[name][:min(n, done)],
                                      err_msg=name)
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


@pytest.mark.slow
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
        d = engine.diagnose(run)
    assert d.run["status"] == "interrupted" and d.run["last_step"] == (n - 1 if n else None)
    assert any("interrupted" in note and (f"last recorded step is {n - 1}" in note if n else True)
               for note in d.notes), d.notes
    if case.startswith("kill-flush"):
        assert result["lines"][-1] == "S", "the kill did not land inside a flush"
    if case in ("kill-replay", "kill-snapshot"):
        assert _reported(result, "T")[-1] == str(BAD_STEP - 1), "not killed in the replay step"


@pytest.mark.slow
def test_at_least_twenty_kills_spread_over_the_run(ended):
    kills = [ended[c] for c in _ids("kill-")]
    assert len(kills) >= 20 and all(k["signal"] == signal.SIGKILL for k in kills)
    reached = {len(_reported(k, "T")) for k in kills}
    assert min(reached) <= 2 and max(reached) >= STEPS - 3, sorted(reached)
    # Kills from outside land where they land; with no delay, inside HDF5's flush.
    assert any(ended[c]["lines"][-1] == "S" for c in _ids("kill-async-"))


@pytest.mark.slow
@pytest.mark.parametrize("case", _ids("term-"))
def test_sigterm_finishes_the_file_and_still_ends_the_process(ended, reference, case):
    result = ended[case]
    with store.load(result["path"]) as run:
        n = _check_prefix(result, reference, run)
        if case.startswith("term-user-handler"):
            # The script's own handler decides what SIGTERM means: here, nothing.
            assert result["exit"] == 0 and result["lines"].count("H") == 1
            assert run.status == "finished" and n == STEPS
            if case.endswith("in-flush"):
                assert "W" in result["lines"]
            return
        assert result["signal"] == signal.SIGTERM, f"not ended by SIGTERM: {result}"
        assert run.status == "signal:SIGTERM"
        # SIGTERM is caught: what was still queued reaches the file, not just the last flush.
        # (A signal that lands in ampdoctor's own code waits for it to finish: up to the
        # whole run when that was its last step.)
        assert n >= len(_reported(result, "T"))
        d = engine.diagnose(run)
    assert d.run["last_step"] == (n - 1 if n else None)
    assert (f"interrupted by SIGTERM; the last recorded step is {n - 1}" if n else
            "interrupted by SIGTERM before its first recorded step") in " ".join(d.notes)


@pytest.mark.slow
def test_some_sigterm_landed_in_ampdoctor_code_and_waited_for_it(ended):
    waited = [c for c in _ids("term-at-") if "W" in ended[c]["lines"]]
    assert waited, "no SIGTERM case exercised the wait (the moments need re-drawing)"
    # A SIGTERM sent from inside a replay waits for it, and is not lost when the replay's
    # isolation puts the user's state back: the run ends by it.
    replayed = ended["term-in-replay"]
    assert "W" in replayed["lines"] and replayed["signal"] == signal.SIGTERM, replayed["lines"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["raise-with", "raise-no-with"])
def test_an_exception_in_the_script_is_the_status(ended, reference, case):
    result = ended[case]
    assert result["exit"] == 1
    with store.load(result["path"]) as run:
        n = _check_prefix(result, reference, run)
        assert n == 8 and run.status == "exception:RuntimeError"
        texts = run.events["text"][run.events["kind"] == schema.Event.EXCEPTION]
        assert list(texts) == ["RuntimeError: the training script failed at step 7"]
        d = engine.diagnose(run)
    said = " ".join(d.notes)
    assert "raised RuntimeError" in said and "after step 7" in said


@pytest.mark.slow
def test_cli_says_interrupted_with_the_last_step(ended):
    result = ended["kill-at-8"]
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "diagnose", result["path"]],
                          env=python_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with store.load(result["path"]) as run:
        last = int(run.steps["step"][-1])
    assert "status interrupted" in proc.stdout
    assert f"the last recorded step is {last}" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Bad files: one sentence naming the file, exit 2, no traceback, through the real CLI

from reliability_tools import bad_file, synthetic_run  # noqa: E402

BAD = {
    "missing": "no such file",
    "directory": "is a directory",
    "empty": "is empty",
    "random_bytes": "not HDF5",
    "truncated": "truncated or damaged",
    "truncated_live": "truncated or damaged",
    "other_hdf5": "not an ampdoctor run",
    "missing_table": "table /events is missing",
    "wrong_dtype": "table /steps has unexpected columns",
    "newer_version": "upgrade ampdoctor",
    "zero_steps": "holds no optimizer step",
}
DUMP_SHOWS = {"zero_steps": "steps              0", "missing_table": "events     MISSING",
              "wrong_dtype": "UNEXPECTED COLUMNS OR SHAPE: step\n"}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    good = str(folder / "good.h5")
    synthetic_run(good)
    live = str(folder / "live.h5")
    subprocess.run([PYTHON, os.path.join(SUPPORT, "reliability_tools.py"), "killed", live],
                   env=python_env(), check=False)
    paths = {}
    for case in BAD:
        path = str(folder / f"{case}.h5")
        if case == "truncated_live":  # flagged as being written: only a SWMR reader gets in
            data = open(live, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
        else:
            bad_file(case, path, good)
        paths[case] = path
    return paths


def test_bad_files_get_one_sentence_and_exit_2_through_the_cli(bad_files):
    runs = {(case, command): subprocess.Popen(
        [PYTHON, "-m", "ampdoctor", command, path], env=python_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
        for case, path in bad_files.items() for command in ("diagnose", "dump")}
    for (case, command), proc in runs.items():
        out, err = proc.communicate(timeout=120)
        path = bad_files[case]
        if command == "dump" and case == "zero_steps":  # a valid file, with nothing to judge
            assert proc.returncode == 0 and DUMP_SHOWS[case] in out, (case, out, err)
            continue
        assert proc.returncode == 2, (case, command, out, err)
        if command == "dump" and case in DUMP_SHOWS:  # dump shows what is there, then says
            assert DUMP_SHOWS[case] in out, (case, out, err)
        else:  # a run with no step still shows its (no_training) diagnosis; nothing else prints
            assert (out == "") != (case == "zero_steps"), (case, command, out)
        assert "Traceback" not in err, (case, command, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ampdoctor: "), (case, command, err)
        assert path in lines[0] and BAD[case] in lines[0], (case, command, lines[0])


def test_zero_steps_says_why(tmp_path):
    from reliability_tools import bad_file as make

    path = make("zero_steps", str(tmp_path / "zero.h5"), "")
    from ampdoctor import cli

    assert cli.main(["diagnose", path]) == 2
    assert engine.diagnose(path).verdict == "no_training"  # the library still answers


# ---------------------------------------------------------------------------------------------
# Damaged and hostile files: never a crash, a hang or a traceback; nothing in a file runs

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reliability_tools import read_everything  # noqa: E402

TOOLS = os.path.join(SUPPORT, "reliability_tools.py")
FORMATS = os.path.join(ROOT, "fixtures", "formats")


@pytest.fixture(scope="module")
def fuzz_bases(tmp_path_factory, bad_files):
    folder = tmp_path_factory.mktemp("fuzz")
    good, live = str(folder / "good.h5"), str(folder / "live.h5")
    synthetic_run(good)
    subprocess.run([PYTHON, TOOLS, "killed", live], env=python_env(), check=False)
    recorded = sorted(os.path.join(FORMATS, n) for n in os.listdir(FORMATS) if n.endswith(".h5"))
    return folder, [good, live] + recorded


@pytest.mark.slow
def test_fuzzed_run_files_get_an_answer_never_a_crash_or_hang(fuzz_bases):
    folder, bases = fuzz_bases
    proc = subprocess.run([PYTHON, TOOLS, "fuzz", str(folder), "360", "2024", *bases],
                          env=python_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["failures"] == [], json.dumps(result["failures"][:3], indent=1)
    assert result["counts"].get("refused", 0) > 50 and result["counts"].get("diagnosis", 0) > 10


_TABLE_SIZES = st.integers(min_value=0, max_value=5)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_values_in_a_well_formed_file_get_an_answer(tmp_path_factory, data):
    """Every column holds arbitrary bits (NaN, huge ids, offsets outside /blob, unknown codes):
    the reader and the analysis answer with a diagnosis or one sentence."""
    path = str(tmp_path_factory.mktemp("values") / "run.h5")
    w = store.Writer(path)
    for table, dtype in schema.TABLES.items():
        n = data.draw(_TABLE_SIZES, label=table)
        raw = data.draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        w.append(table, np.frombuffer(raw, dtype).copy())
    w.bytes(data.draw(st.binary(max_size=64), label="blob"))
    if data.draw(st.booleans(), label="close"):
        w.close()
    else:
        w.flush()
    try:
        assert read_everything(path) in ("diagnosis", "refused")
    finally:
        if not w.closed:
            w.close()


class _Payload:
    """Unpickling this runs a shell command: the marker file appears if anything unpickles."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


_AUDIT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from reliability_tools import read_everything
from ampdoctor.runfile import store
from ampdoctor.errors import RunFileError

def arrays(path):
    with store.load(path) as run:
        for row in range(len(run.arrays)):
            try:
                run.array(row)
            except RunFileError:
                pass

read_everything(sys.argv[1]); arrays(sys.argv[1])  # every module and library loaded now
seen = []
def audit(event, args):
    if event in ("exec", "compile", "import", "pickle.find_class", "marshal.loads", "os.system",
                 "subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn", "os.fork",
                 "ctypes.dlopen", "builtins.input") or event.startswith("os.exec"):
        seen.append(event)
sys.addaudithook(audit)
outcome = read_everything(sys.argv[2]); arrays(sys.argv[2])
print(json.dumps({"outcome": outcome, "events": seen}))
"""


def test_reading_a_file_never_runs_anything_in_it(tmp_path):
    import pickle

    import h5py

    marker = tmp_path / "ran"
    payload = pickle.dumps(_Payload(marker))
    benign, hostile = str(tmp_path / "benign.h5"), str(tmp_path / "hostile.h5")
    synthetic_run(benign)
    w = synthetic_run(hostile, close=False)
    w.meta("model", {"py/reduce": payload.hex(), "__class__": "os.system"})
    # Code where the schema's types hold (a list), so that diagnose reads it, and fails to run it.
    w.meta("optimizer", [f"__import__('os').system('touch {marker}')"])
    row = schema.empty("arrays", 1)  # an array row that claims to hold a pickled object
    row["dtype"], row["ndim"], row["numel"], row["saved"] = b"|O", 1, 1, 1
    row["data_off"], row["data_len"] = w.bytes(payload)
    w.append("arrays", row)
    w.close(schema.STATUS_FINISHED)
    with h5py.File(hostile, "r+") as f:
        f.attrs["pickled"] = np.void(payload)
        f.attrs["argv"] = np.bytes_(json.dumps([f"__import__('os').system('touch {marker}')"])
                                    .encode())  # a list of texts, as the schema says: read
        f.create_dataset("pickled", data=np.frombuffer(payload, "u1"))
    proc = subprocess.run([PYTHON, "-c", _AUDIT, benign, hostile, SUPPORT],
                          env=python_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"outcome": "diagnosis", "events": []}
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Every format version ever released stays readable


def test_every_format_version_has_a_fixture_that_still_loads_and_diagnoses():
    for version in range(1, schema.FORMAT_VERSION + 1):
        path = os.path.join(FORMATS, f"v{version}.h5")
        assert os.path.exists(path), f"no fixture run for format version {version}: " \
                                     "python fixtures/formats/make_fixture.py"
    # v<N>.h5, and v<N>-<variant>.h5 for files an earlier writer of the same version left
    # (v1-vlen-attrs.h5: the first release stored string attributes as variable-length)
    fixtures = sorted(glob.glob(os.path.join(FORMATS, "v*.h5")))
    assert len(fixtures) >= schema.FORMAT_VERSION
    for path in fixtures:
        version = int(re.match(r"v(\d+)", os.path.basename(path)).group(1))
        with open(path[:-len(".h5")] + ".json") as fh:
            expected = json.load(fh)
        with store.load(path) as run:
            assert int(run.attrs["format_version"]) == version == expected["format_version"]
            assert run.status == expected["status"] and len(run.steps) == expected["steps"]
            steps = run.steps["step"]
            assert list(steps[run.steps["skipped"] == 1]) == expected["skipped_steps"]
            assert list(steps[run.steps["sampled"] == 1]) == expected["sampled_steps"]
            assert sorted(set(run.tensors["name"])) == expected["tensors"]
            assert len(run.stats) == expected["stats_rows"]
            assert len(run.stats.read()) == expected["stats_rows"]
            assert list(run.snapshots["step"]) == expected["snapshot_steps"]
            assert len(run.arrays) == expected["arrays"]
            batches = [run.array(i) for i in range(len(run.arrays))]
            assert all(b.size for b in batches)
            assert run.meta["autocast"]["dtype"] == expected["autocast_dtype"]
            assert run.meta["optimizer"][0]["class"] == expected["optimizer"]
            if version >= 3:  # each loss and each optimizer on its own
                assert [s.site for s in run.losses_meta] == expected["losses"]
                assert len(run.losses) == expected["loss_rows"] > 0
                assert len(run.optimizer_steps) == expected["optimizer_rows"] > 0
            else:
                assert len(run.losses) == len(run.optimizer_steps) == 0
            # /fp8 (format 4 on); an older file reads as an empty table
            assert len(run.fp8) == len(run.fp8.rows()) == expected.get("fp8_rows", 0)
            assert (len(run.fp8) > 0) == (version >= 4)
            d = engine.diagnose(run)
        assert d.verdict in engine.VERDICTS
        assert d.first_bad and d.first_bad["step"] == expected["skipped_steps"][0]
        found = summary.read(path)  # format 2 on; a file of format 1 is read in full
        assert (found is None) == (version < 2)
        if found is not None:
            got = {k: getattr(found, k) for k in expected["summary"]}
            assert json.loads(json.dumps(got)) == expected["summary"]


# ---------------------------------------------------------------------------------------------
# Live reading: diagnose and dump a file while it is written, without disturbing the writer

_WRITER = r"""
import os, sys, time, torch
sys.path.insert(0, sys.argv[3])
import ampdoctor
from helpers import fresh, batches
import torch.nn.functional as F

def run(path, stop, limit):
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    rec = ampdoctor.watch(model, opt, scaler, path=path, every=2, flush_seconds=0.0) \
        if path else None
    losses = []
    for i, (x, y) in enumerate(batches(limit)):
        if stop and os.path.exists(stop):
            break
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
        time.sleep(0.01)
    if rec:
        rec.close()
    return losses, [p.detach().clone() for p in model.parameters()]

losses, weights = run(sys.argv[1], sys.argv[2], 100000)
plain, plain_weights = run(None, None, len(losses))  # the same steps, not recorded
same = plain == losses and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
print(len(losses), "identical" if same else "DIFFERENT")
"""


@pytest.mark.slow
def test_live_file_is_read_while_written_without_disturbing_the_writer(tmp_path):
    import time

    path, stop = str(tmp_path / "live.h5"), str(tmp_path / "stop")
    writer = subprocess.Popen([PYTHON, "-c", _WRITER, path, stop, SUPPORT],
                              env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(path) and len(store.load(path).steps) >= 5:
                break
            time.sleep(0.1)
        seen = []
        for _ in range(25):
            with store.load(path) as run:
                assert run.status == "running"
                np.testing.assert_array_equal(run.steps["step"], np.arange(len(run.steps)))
                known = set(run.tensors["id"].tolist())
                assert set(run.stats.column("tensor").tolist()) <= known
                assert all(run.tensors["name"])
                seen.append(len(run.steps))
                d = engine.diagnose(run)
            assert "still being recorded" in " ".join(d.notes)
        assert seen == sorted(seen) and seen[-1] > seen[0], seen
        cli = {cmd: subprocess.run([PYTHON, "-m", "ampdoctor", cmd, path], env=python_env(),
                                   capture_output=True, text=True) for cmd in ("diagnose", "dump")}
        for cmd, proc in cli.items():
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, (cmd, proc.stderr)
        assert "status running" in cli["diagnose"].stdout
        assert "The run is still being recorded" in cli["diagnose"].stdout
        assert '"status": "running"' in cli["dump"].stdout.replace("status: ", '"status": ')
    finally:
        open(stop, "w").close()
        out, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    assert "ampdoctor:" not in err  # no warning: recording never stepped aside
    steps, verdict = out.split()
    assert verdict == "identical"
    with store.load(path) as run:
        assert run.status == "finished" and len(run.steps) == int(steps) > seen[-1]
        assert list(run.steps["sampled"][:6]) == [1, 0, 1, 0, 1, 0]


# ---------------------------------------------------------------------------------------------
# Faults inside ampdoctor: training goes on, bit-identical; one warning says what was lost

import shutil  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from helpers import fresh, train  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.errors import RecorderFault  # noqa: E402


def _loop(model, opt, scaler, steps, dtype=torch.float16, after_step=None, bad_step=None):
    """helpers.train without unscale_ (GradScaler.step unscales); the losses and the weights."""
    on_step = None if after_step is None else (lambda i: after_step(i, model))
    losses = train(model, opt, scaler, steps=steps, dtype=dtype, bad_step=bad_step,
                   on_step=on_step, unscale=False)
    return losses, [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    """Bit-identical losses and weights (NaN payloads included)."""
    np.testing.assert_array_equal(np.array(a[0]).view(np.uint64), np.array(b[0]).view(np.uint64))
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def _ampdoctor_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("ampdoctor:")]


def _record(path, steps, after_step=None, make=fresh, dtype=torch.float16, scaler=True,
            bad_step=None, **kw):
    model, opt = make()
    sc = torch.amp.GradScaler("cpu") if scaler else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampdoctor.watch(model, opt, sc, path=str(path), every=1, flush_seconds=0.0, **kw):
            result = _loop(model, opt, sc, steps, dtype, after_step, bad_step)
    return result, _ampdoctor_warnings(caught)


def _plain(steps, make=fresh, dtype=torch.float16, scaler=True, after_step=None, bad_step=None):
    model, opt = make()
    return _loop(model, opt, torch.amp.GradScaler("cpu") if scaler else None, steps, dtype,
                 after_step, bad_step)


def test_output_directory_removed_mid_run(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()

    def remove(i, model):
        if i == 3:
            shutil.rmtree(folder)

    recorded, said = _record(folder / "run.h5", 8, remove)
    _same(recorded, _plain(8))
    assert len(said) == 1, said
    assert str(folder / "run.h5") in said[0] and "was deleted while recording" in said[0]
    assert "training continues" in said[0]


def test_output_directory_removed_mid_run_strict(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()

    def remove(i, model):
        if i == 3:
            shutil.rmtree(folder)

    with pytest.raises(RecorderFault, match="was deleted"):
        _record(folder / "run.h5", 8, remove, strict=True)


def test_a_write_error_keeps_what_was_flushed(tmp_path, monkeypatch):
    import errno

    from ampdoctor.runfile import writer

    path = tmp_path / "run.h5"
    real = writer._append_rows
    calls = []

    def full(ds, rows):
        calls.append(ds.name)
        if len(calls) > 15:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(ds, rows)

    monkeypatch.setattr(writer, "_append_rows", full)
    recorded, said = _record(path, 10)
    _same(recorded, _plain(10))
    assert len(said) == 1, said
    assert f"could not write {path} (No space left on device)" in said[0]
    kept = int(said[0].split("keeps steps 0-")[1].split(";")[0]) + 1
    with store.load(path) as run:
        assert run.status == "interrupted"
        np.testing.assert_array_equal(run.steps["step"], np.arange(kept))
        assert 0 < kept < 10


HERE = os.path.dirname(os.path.abspath(__file__))  # _DISK_FULL imports this module, then conftest
_DISK_FULL = r"""
import json, os, resource, signal, sys, warnings
sys.path[:0] = sys.argv[3].split(os.pathsep)  # this file's folder, and conftest's
import torch
import test_reliability as t
from ampdoctor.runfile import store

path, limit = sys.argv[1], int(sys.argv[2])
plain = t._plain(30)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
recorded, said = t._record(path, 30)
same = recorded[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(recorded[1], plain[1]))
print(json.dumps({"same": same, "said": said}))
"""


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 64 KiB tmpfs when this process may mount one, else None."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                          capture_output=True)
    if proc.returncode != 0:
        yield None
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["file-size-limit", "tiny-filesystem"])
def test_disk_full_keeps_what_was_flushed(tmp_path, tiny_filesystem, how):
    """A real write failure inside HDF5 (EFBIG past RLIMIT_FSIZE, or ENOSPC on a full tmpfs)."""
    if how == "tiny-filesystem":
        if tiny_filesystem is None:
            pytest.skip("cannot mount a tmpfs here; file-size-limit makes the same failure")
        path, limit = tiny_filesystem / "run.h5", 0
    else:
        path, limit = tmp_path / "run.h5", 48 << 10
    proc = subprocess.run([PYTHON, "-c", _DISK_FULL, str(path), str(limit),
                           os.pathsep.join([HERE, os.path.dirname(SUPPORT)])],
                          env=python_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"] and len(result["said"]) == 1, result
    said = result["said"][0]
    assert f"could not write {path} (" in said and "training continues" in said
    assert "File too large" in said or "No space left on device" in said
    kept = int(said.split("keeps steps 0-")[1].split(";")[0]) + 1
    with store.load(str(path)) as run:
        assert run.status == "interrupted"
        n = len(run.steps)  # what the failed flush wrote before failing may be there too
        np.testing.assert_array_equal(run.steps["step"], np.arange(n))
        assert 0 < kept <= n < 30 and np.all(run.steps["time"] > 0)


class _Refusing(torch.Tensor):
    """A tensor subclass whose reductions raise: what a hook meets in some libraries'
    tensor wrappers. Arithmetic still works, so the model trains."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("aminmax", "amax", "isfinite", "take", "flatten",
                                             "reshape", "view", "abs"):
            raise RuntimeError(f"{cls.__name__} does not support {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class _DictOut(nn.Module):
    def forward(self, h):
        return {"a": h * 2, "b": h + 1}


class _SubclassOut(nn.Module):
    def forward(self, h):
        return h.as_subclass(_Refusing)


class _SparseOut(nn.Module):
    def forward(self, h):
        return h.detach().to_sparse()


class _ComplexOut(nn.Module):
    def forward(self, h):
        return torch.complex(h.float(), h.float())


class _NoneOut(nn.Module):
    def forward(self, h):
        return None


class _GeneratorOut(nn.Module):
    def forward(self, h):
        return (h * k for k in (1.0, 0.5))


class _Exotic(nn.Module):
    """A model whose modules return everything a hook should not choke on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.dict_out, self.sub, self.sparse = _DictOut(), _SubclassOut(), _SparseOut()
        self.complex, self.none, self.gen = _ComplexOut(), _NoneOut(), _GeneratorOut()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc(x)
        d = self.dict_out(h)
        h = d["a"] - d["b"]
        h = self.sub(h).as_subclass(torch.Tensor)
        h = h + 0.0 * self.sparse(h).to_dense()
        h = h + 0.0 * self.complex(h).real.to(h.dtype)
        self.none(h)
        h = sum(self.gen(h))
        with torch.inference_mode():  # an evaluation inside the step: inference tensors
            self.fc(x.detach())
        return self.head(h)


def _exotic(seed=0):
    torch.manual_seed(seed)
    model = _Exotic()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_exotic_module_outputs_lose_only_what_cannot_be_measured(tmp_path):
    # A NaN batch at step 3 sends the forensic replay through the same modules.
    args = dict(make=_exotic, dtype=torch.bfloat16, scaler=False, bad_step=3)
    recorded, said = _record(tmp_path / "run.h5", 6, **args)
    _same(recorded, _plain(6, **args))
    assert len(said) == 1, said  # the subclass, once, though every step is sampled
    assert "output 0 of sub (_Refusing)" in said[0] and "left out" in said[0]
    with store.load(str(tmp_path / "run.h5")) as run:
        assert run.status == "finished" and len(run.steps) == 6
        names = set(run.tensors["name"])
        assert {"fc", "dict_out", "head"} <= names
        sub = run.tensors["id"][run.tensors["name"] == "sub"]
        sampled = run.stats.read()
        sampled = sampled[sampled["source"] == schema.Source.SAMPLED]
        assert not np.isin(sampled["tensor"], sub).any()  # what the warning said was lost
        assert not any(run.events["kind"] == schema.Event.RECORDER_ERROR)
        assert int(run.snapshots["step"][0]) == 3  # the replay ran through them too


def test_exotic_module_outputs_strict_raises(tmp_path):
    with pytest.raises(RecorderFault, match="_Refusing"):
        _record(tmp_path / "run.h5", 3, make=_exotic, dtype=torch.bfloat16, scaler=False,
                strict=True)


# ---------------------------------------------------------------------------------------------
# Forked children (DataLoader workers, a script's own fork) never touch the parent's file

_FORKS = r"""
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
import ampdoctor
from helpers import fresh, batches
import torch.nn.functional as F

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), int(i % 4)

model, opt = fresh()
scaler = torch.amp.GradScaler("cpu")
loader = torch.utils.data.DataLoader(Data(), batch_size=8, num_workers=2,
                                     multiprocessing_context="fork")
codes = []

def step(x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()

with ampdoctor.watch(model, opt, scaler, path=sys.argv[1], every=2, flush_seconds=0.0):
    for x, y in loader:  # two worker processes forked from a recording process
        step(x, y)
    for i, (x, y) in enumerate(batches(4)):
        step(x, y)
        pid = os.fork()
        if pid == 0:  # a child that trains a step, then exits as a script does (atexit, HDF5)
            torch.set_num_threads(1)  # as DataLoader workers do: OpenMP is not fork-safe
            step(x, y)
            if i == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            sys.exit(0)
        codes.append(os.waitpid(pid, 0)[1])
print(codes[2:])
"""


@pytest.mark.slow
def test_forked_children_leave_the_parents_file_alone(tmp_path):
    path = str(tmp_path / "run.h5")
    proc = subprocess.run([PYTHON, "-c", _FORKS, path, SUPPORT],
                          env=python_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ampdoctor:" not in proc.stderr
    exit_ok, by_sigterm = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own
    assert os.WIFEXITED(exit_ok) and os.WEXITSTATUS(exit_ok) == 0
    assert os.WIFSIGNALED(by_sigterm) and os.WTERMSIG(by_sigterm) == signal.SIGTERM
    with store.load(path) as run:
        assert run.status == "finished" and len(run.steps) == 12
        np.testing.assert_array_equal(run.steps["step"], np.arange(12))


# ---------------------------------------------------------------------------------------------
# Scale: the recorder's own memory does not grow with the run


def _sizes(obj, prefix, out, seen):
    """len() of every container reachable from ``obj``'s attributes, two levels deep."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, value in vars(obj).items():
        key = f"{prefix}.{name}"
        if isinstance(value, (list, dict, set, tuple, bytearray)) and not name.startswith("__"):
            out[key] = len(value)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("ampdoctor") \
                and prefix.count(".") < 2:
            _sizes(value, key, out, seen)


def test_recorder_buffers_stay_bounded_over_a_long_run(tmp_path):
    model, opt = fresh()
    rec = ampdoctor.watch(model, opt, path=str(tmp_path / "run.h5"), every=10, strict=True)
    snapshots = {}

    def measure(i, model):
        if i in (201, 1191):  # the same place in the sampling cycle
            rec.flush()  # what waits for the next flush is bounded by flush_seconds
            out = {}
            _sizes(rec, "rec", out, set())
            snapshots[i] = out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on a shared machine
    try:
        _loop(model, opt, None, 1200, torch.bfloat16, measure)
    finally:
        torch.set_num_threads(threads)
    rec.close()
    early, late = snapshots[201], snapshots[1191]
    assert early.keys() == late.keys() and len(early) > 10
    grown = {k: (early[k], late[k]) for k in early if late[k] > early[k]}
    assert not grown, grown
    with store.load(str(tmp_path / "run.h5")) as run:
        assert len(run.steps) == 1200


def test_variable_length_attributes_with_a_damaged_heap_do_not_hang(tmp_path, monkeypatch):
    """The first release stored string attributes variable-length, in HDF5's global heap: a
    damaged heap (a zero-size free object) makes HDF5 loop forever. It is read in a forked
    child with a time limit, so the answer is one sentence, not a hang."""
    data = bytearray(open(os.path.join(FORMATS, "v1-vlen-attrs.h5"), "rb").read())
    heap = data.find(b"GCOL")
    assert heap > 0
    obj = heap + 16  # the first object: index (2 bytes), refcount, reserved, size (8 bytes)
    data[obj:obj + 2] = b"\0\0"
    data[obj + 8:obj + 16] = bytes(8)
    path = tmp_path / "hang.h5"
    path.write_bytes(bytes(data))
    monkeypatch.setattr(attributes, "VLEN_SECONDS", 1.0)
    with pytest.raises(store.RunFileError, match="format attribute could not be read"):
        store.load(path)
