"""``ampdoctor record -- <command>``: the real CLI in a subprocess on scripts written as users
write them (fixtures/examples), then the files it left; plus the pieces it is built from."""

import json
import os
import signal
import subprocess
import textwrap
import time

import numpy as np
import pytest
from conftest import PYTHON, ROOT, python_env
from synthetic import write_rank

import ampdoctor
from ampdoctor.runfile import paths, schema
from ampdoctor.runfile.schema import Event, Phase

EXAMPLES = os.path.join(ROOT, "fixtures", "examples")
TRAIN = os.path.join(EXAMPLES, "train.py")


def example(name):
    return os.path.join(EXAMPLES, name)


def record(args, cwd, env=None, **kwargs):
    """``ampdoctor record ARGS`` as a user runs it; returns the finished process."""
    full_env = python_env()
    full_env.update(env or {})
    kwargs.setdefault("timeout", 300)
    return subprocess.run([PYTHON, "-m", "ampdoctor", "record", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, **kwargs)


def ours(stderr):
    """The lines ampdoctor itself printed on stderr."""
    return [line for line in stderr.splitlines() if line.startswith("ampdoctor:")]


def files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".h5"))


def torchrun():
    script = os.path.join(os.path.dirname(PYTHON), "torchrun")
    return [script] if os.path.exists(script) else [PYTHON, "-m", "torch.distributed.run"]


# ---------------------------------------------------------------------------------------------
# End to end: one script per way users train


@pytest.mark.slow
def test_plain_script_records_and_its_own_options_pass_through(tmp_path):
    proc = record(["-o", "run.h5", "--", PYTHON, TRAIN, "--bad-step", "3", "-o", "w.pt", "--",
                   "--inner", "x"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout.splitlines()[0].split(" ", 1)[1])
    assert argv == ["--bad-step", "3", "-o", "w.pt", "--", "--inner", "x"]
    assert (tmp_path / "w.pt").exists()  # the script's own -o, not ours
    assert files(tmp_path) == ["run.h5"]
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert run.status == "finished"
        assert len(run.steps) == 8
        assert run.meta["roots"] == ["Net"]
        assert run.meta["autocast"]["dtype"] == "float16"
        assert run.meta["scaler"]["class"] == "GradScaler"
        assert list(np.flatnonzero(run.steps["skipped"])) == [3]
        assert int(run.snapshots["step"][0]) == 3
        assert int(run.snapshots["phase"][0]) == Phase.INPUT
    lines = ours(proc.stderr)
    assert proc.stderr.strip().splitlines() == lines  # nothing else on the user's stderr
    assert len(lines) == 2
    assert lines[0].startswith("ampdoctor: recording into run.h5")
    assert "every 100 steps: per-layer statistics" in lines[0]
    assert "recorded 8 steps into run.h5, 1 skipped" in lines[1]
    assert "; diagnosis: bad_input, first bad at step 3" in lines[1]  # as diagnose says
    assert lines[1].endswith("next: ampdoctor diagnose run.h5")
    d = ampdoctor.diagnose(str(tmp_path / "run.h5"))
    assert d.first_bad["step"] == 3


USER_OUTPUT = textwrap.dedent("""
    import logging, sys, warnings
    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    log = logging.getLogger("train")

    def note():
        warnings.warn("this warning is shown once per location")  # default action: once

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    for step, (x, y) in enumerate(loader):
        note()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")
        print(f"stderr line {step}", file=sys.stderr)
        log.info("logged %d", step)
    warnings.warn("a second warning, after training", DeprecationWarning, stacklevel=1)
""")


@pytest.mark.slow
def test_the_users_output_is_the_same_under_record(tmp_path):
    """Nothing of the user's output changes under record: stdout byte for byte, stderr but for
    ampdoctor's own lines; a once-only warning still prints once (a warnings filter added and
    removed would reset Python's once-only memory and print it again)."""
    script = tmp_path / "train.py"
    script.write_text(USER_OUTPUT)
    plain = subprocess.run([PYTHON, str(script)], cwd=tmp_path, env=python_env(),
                           capture_output=True, text=True, timeout=300)
    rec = record(["-o", "run.h5", "--", PYTHON, str(script)], tmp_path)
    assert plain.returncode == 0 == rec.returncode, rec.stderr
    assert rec.stdout == plain.stdout
    theirs = [line for line in rec.stderr.splitlines() if not line.startswith("ampdoctor:")]
    assert theirs == plain.stderr.splitlines()
    assert plain.stderr.count("UserWarning: this warning is shown once") == 1
    assert len(ours(rec.stderr)) == 2 and "recorded 4 steps" in ours(rec.stderr)[-1]


@pytest.mark.slow
def test_recorded_losses_and_weights_are_bit_identical(tmp_path):
    """The script prints every loss and the final weights in float.hex; a recorded run with
    every tier busy (sampling each step, a forensic replay at step 3) prints the same."""
    command = [PYTHON, TRAIN, "--bad-step", "3", "--steps", "8"]
    plain = subprocess.run(command, cwd=tmp_path, env=python_env(), capture_output=True,
                           text=True, timeout=300)
    recorded = record(["-o", "run.h5", "--every", "1", "--", *command], tmp_path)
    assert plain.returncode == recorded.returncode == 0
    assert "step 3 loss nan" in plain.stdout
    assert recorded.stdout == plain.stdout
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert run.steps["sampled"].tolist() == [1] * 8
        assert len(run.snapshots) >= 1


@pytest.mark.slow
def test_python_m_module_bf16_without_scaler(tmp_path):
    out = str(tmp_path / "run.h5")
    proc = record(["-o", out, "--", PYTHON, "-m", "mypkg.train", "--bad-step", "0"], EXAMPLES)
    assert proc.returncode == 0, proc.stderr
    with ampdoctor.load(out) as run:
        assert len(run.steps) == 6
        assert run.steps["micro"].tolist() == [2] * 6  # gradient accumulation
        assert np.isnan(run.steps["scale"]).all()  # no GradScaler
        assert run.meta["autocast"]["dtype"] == "bfloat16"
        assert run.meta["roots"] == ["MaskedMLP"]  # not the loss module
        # The very first call of the model was captured, keyword arguments included: the
        # replay of step 0 ran the model (a missing mask= would be a replay error).
        snap = run.snapshots[0]
        assert int(snap["step"]) == 0 and int(snap["phase"]) == Phase.INPUT
        assert "replay_error" not in json.loads(snap["detail"])


@pytest.mark.slow
def test_dataloader_workers_write_nothing(tmp_path):
    proc = record(["-o", "run.h5", "--", PYTHON, example("train_loader.py")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert files(tmp_path) == ["run.h5"]
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert run.status == "finished"
        assert len(run.steps) == 8  # 2 epochs x 4 batches, workers forked twice
        assert run.attrs["pid"] != 0


_NOISY = textwrap.dedent("""\
    import logging, sys, warnings
    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")

    def once():
        warnings.warn("printed once: same text, same line", UserWarning)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = torch.randn(8, 4), torch.randn(8, 1)

    class Short(torch.utils.data.IterableDataset):
        def __len__(self):
            return 0  # but it yields 2 batches: once len(loader) was asked, the DataLoader
            # warns at each epoch's first batch (before the first step), Python prints it once

        def __iter__(self):
            return iter(zip(xs, ys))

        def __repr__(self):  # the warning's text: no address
            return "Short()"

    loader = torch.utils.data.DataLoader(Short(), batch_size=4)
    print(f"{len(loader)} batch per epoch")
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            once()
            print(f"epoch {epoch} loss {loss.item():.6f}")
            print(f"stderr {epoch}", file=sys.stderr)
        logging.getLogger("train").info("epoch %d done", epoch)
""")


@pytest.mark.slow
def test_a_dataloader_warning_prints_once_under_record(tmp_path):
    """A DataLoader's warning at every epoch's first batch (open_clip's trainer: printed twice
    under record once), over three epochs: stdout equal, stderr equal but for ampdoctor's own
    lines."""
    script = tmp_path / "noisy.py"
    script.write_text(_NOISY)
    plain = subprocess.run([PYTHON, str(script)], cwd=tmp_path, env=python_env(),
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr.count("UserWarning: printed once") == 1
    assert plain.stderr.count("but 1 samples have been fetched") == 1
    assert "epoch 2 done" in plain.stderr
    proc = record(["-o", "run.h5", "--", PYTHON, str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain.stdout
    theirs = [line for line in proc.stderr.splitlines() if not line.startswith("ampdoctor:")]
    assert theirs == plain.stderr.splitlines()
    assert len(ours(proc.stderr)) == 2  # it did record: the start and the end
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 6


@pytest.mark.slow
def test_script_that_raises_leaves_a_complete_file(tmp_path):
    proc = record(["-o", "run.h5", "--", PYTHON, example("train_raises.py")], tmp_path)
    assert proc.returncode == 1
    assert "RuntimeError: data shard 5 is missing" in proc.stderr  # the user's traceback
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert run.status == "exception:RuntimeError"
        assert len(run.steps) == 5
        texts = run.events["text"][run.events["kind"] == Event.EXCEPTION]
        assert any("data shard 5 is missing" in t for t in texts)
    assert "the command raised RuntimeError" in ours(proc.stderr)[-1]


@pytest.mark.slow
def test_script_that_never_trains(tmp_path):
    proc = record(["-o", "run.h5", "--", PYTHON, example("no_training.py")], tmp_path)
    assert proc.returncode == 0
    assert "prediction" in proc.stdout
    assert files(tmp_path) == ["run.h5"]
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 0 and run.status == "finished"
    assert "never trained" in ours(proc.stderr)[-1]
    diag = subprocess.run([PYTHON, "-m", "ampdoctor", "diagnose", "run.h5", "--format", "json"],
                          cwd=tmp_path, env=python_env(), capture_output=True, text=True)
    data = json.loads(diag.stdout)
    assert data["verdict"] == "no_training"
    assert data["summary"].count(". ") == 0  # one sentence


@pytest.mark.slow
def test_script_without_torch_records_nothing_and_keeps_stdin(tmp_path):
    proc = record(["-o", "run.h5", "--", PYTHON, example("no_torch.py")], tmp_path,
                  input="hello\n")
    assert proc.returncode == 0
    assert proc.stdout == "HELLO\n"
    assert "torch imported: False" in proc.stderr  # nothing of ampdoctor pulled torch in
    assert files(tmp_path) == []
    assert "nothing recorded" in ours(proc.stderr)[-1]


@pytest.mark.slow
def test_exit_code_passes_through_and_quiet_prints_nothing(tmp_path):
    proc = record(["-o", "run.h5", "--quiet", "--", PYTHON, TRAIN, "--steps", "1",
                   "--exit-code", "3"], tmp_path)
    assert proc.returncode == 3
    assert ours(proc.stderr) == []
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 1 and run.status == "finished"  # sys.exit is not a crash


@pytest.mark.slow
def test_command_killed_by_a_signal(tmp_path):
    proc = record(["-o", "run.h5", "--", PYTHON, "-c",
                   "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], tmp_path)
    assert proc.returncode == -signal.SIGKILL  # record dies the way its command died


def _start_forever(tmp_path, *extra):
    proc = subprocess.Popen(
        [PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", *extra, "--", PYTHON, TRAIN,
         "--steps", "-1", "--sleep", "0.05"],
        cwd=tmp_path, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)  # no terminal: SIGINT must be forwarded
    for line in proc.stdout:
        if line.startswith("step 2 "):
            return proc
    proc.kill()
    raise AssertionError(f"training did not start: {proc.stderr.read()}")


@pytest.mark.slow
def test_sigint_is_forwarded_and_the_file_says_so(tmp_path):
    proc = _start_forever(tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert proc.returncode == -signal.SIGINT, stderr
    assert "KeyboardInterrupt" in stderr  # the child got it, once
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert run.status == "exception:KeyboardInterrupt"
        assert len(run.steps) >= 3
    assert "the command raised KeyboardInterrupt" in ours(stderr)[-1]


@pytest.mark.slow
def test_sigterm_is_forwarded(tmp_path):
    proc = _start_forever(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert proc.returncode == -signal.SIGTERM, stderr
    with ampdoctor.load(tmp_path / "run.h5") as run:  # the recorder finished the file first
        assert run.status == "signal:SIGTERM"
    assert "stopped by SIGTERM" in ours(stderr)[-1]


@pytest.mark.slow
def test_settings_from_the_environment(tmp_path):
    env = {"AMPDOCTOR_OUTPUT": "env.h5", "AMPDOCTOR_EVERY": "2", "AMPDOCTOR_QUIET": "1"}
    proc = record(["--", PYTHON, TRAIN, "--steps", "4"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ours(proc.stderr) == []
    with ampdoctor.load(tmp_path / "env.h5") as run:
        assert run.steps["sampled"].tolist() == [1, 0, 1, 0]
    # An existing file is replaced only with AMPDOCTOR_FORCE (or --force).
    again = record(["--", PYTHON, TRAIN, "--steps", "1"], tmp_path, env=env)
    assert again.returncode == 2 and "--force" in again.stderr
    forced = record(["--", PYTHON, TRAIN, "--steps", "1"], tmp_path,
                    env=dict(env, AMPDOCTOR_FORCE="1"))
    assert forced.returncode == 0
    with ampdoctor.load(tmp_path / "env.h5") as run:
        assert len(run.steps) == 1


@pytest.mark.slow
def test_torchrun_two_ranks_on_gloo(tmp_path):
    proc = record(["-o", "run.h5", "--", *torchrun(), "--standalone", "--nproc_per_node=2",
                   example("train_ddp.py"), "--bad-rank", "1", "--bad-step", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert files(tmp_path) == ["run.rank0.h5", "run.rank1.h5"]  # the launcher wrote nothing
    for rank in (0, 1):
        with ampdoctor.load(tmp_path / f"run.rank{rank}.h5") as run:
            assert (run.rank, run.attrs["world_size"]) == (rank, 2)
            assert len(run.steps) == 6 and run.status == "finished"
            assert run.meta["roots"] == ["Sequential"]  # the model inside DDP
    summary = ours(proc.stderr)[-1]
    assert "on 2 ranks into run.rank{0,1}.h5" in summary
    assert "first bad at step 3 on rank 1" in summary
    diag = subprocess.run([PYTHON, "-m", "ampdoctor", "diagnose", "run.h5", "--format", "json"],
                          cwd=tmp_path, env=python_env(), capture_output=True, text=True)
    assert diag.returncode == 0, diag.stderr
    data = json.loads(diag.stdout)
    assert data["first_bad"]["rank"] == 1 and data["first_bad"]["step"] == 3
    assert [r["rank"] for r in data["run"]["ranks"]] == [0, 1]
    first = next(e for e in data["evidence"] if e["key"] == "first_rank")
    assert first["text"].startswith("rank 1 went non-finite first, at step 3")
    assert "rank 0 only received it" in first["text"]
    scale = next(e for e in data["evidence"] if e["key"] == "scale_divergence")
    assert "identical" in scale["text"]
    dump = subprocess.run([PYTHON, "-m", "ampdoctor", "dump", "run.h5"], cwd=tmp_path,
                          env=python_env(), capture_output=True, text=True)
    assert dump.returncode == 0 and \
        dump.stdout.count(f"format version {schema.FORMAT_VERSION}") == 2


# ---------------------------------------------------------------------------------------------
# Bad input: one sentence, exit 2, the command never starts


def _marker_command(tmp_path):
    return [PYTHON, "-c", f"open({str(tmp_path / 'started')!r}, 'w')"]


@pytest.mark.parametrize("output,message", [
    ("missing/run.h5", "does not exist"),
    (".", "is a directory"),
    ("/proc/run.h5", "not writable"),
])
def test_output_that_cannot_be_written(tmp_path, output, message):
    proc = record(["-o", output, "--", *_marker_command(tmp_path)], tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "started").exists()


EARLIER_RUN = os.path.join(ROOT, "fixtures", "formats", "v2.h5")


def _earlier_run():
    with open(EARLIER_RUN, "rb") as fh:
        return fh.read()


@pytest.mark.parametrize("existing", ["run.h5", "run.rank1.h5"])
def test_existing_run_needs_force(tmp_path, existing):
    (tmp_path / existing).write_bytes(_earlier_run())
    proc = record(["-o", "run.h5", "--", *_marker_command(tmp_path)], tmp_path)
    assert proc.returncode == 2
    assert f"{existing} already exists" in proc.stderr and "--force" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "started").exists()
    assert (tmp_path / existing).read_bytes() == _earlier_run()  # untouched


def test_force_replaces_the_runs_of_that_name(tmp_path):
    for name in ("run.h5", "run.rank0.h5", "run.rank1.h5", "other.h5"):
        (tmp_path / name).write_bytes(_earlier_run())
    proc = record(["-o", "run.h5", "--force", "--", *_marker_command(tmp_path)], tmp_path)
    assert proc.returncode == 0
    assert (tmp_path / "started").exists()
    assert files(tmp_path) == ["other.h5"]  # the command never imported torch


@pytest.mark.parametrize("output,content", [
    ("mytrain.py", b"print('training')\n"),        # the very script being recorded
    ("notes.txt", b"notes\n"),
    ("run.h5", b"not HDF5 at all"),
    ("run.rank1.h5", b"\x89HDF\r\n\x1a\n but another program's"),
])
@pytest.mark.parametrize("force", [True, False])
def test_force_never_replaces_a_file_that_is_not_a_run_file(tmp_path, output, content, force):
    (tmp_path / output).write_bytes(content)
    shown = "run.h5" if output.startswith("run.") else output
    proc = record(["-o", shown, *(["--force"] if force else []), "--",
                   *_marker_command(tmp_path)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"ampdoctor: cannot record into {shown}: {tmp_path / output} exists "
                           "and is not an ampdoctor run file (--force replaces only such a "
                           "file); choose another file with -o\n")
    assert (tmp_path / output).read_bytes() == content
    assert not (tmp_path / "started").exists()


def test_force_never_replaces_a_device_node(tmp_path):
    before = os.stat("/dev/null")
    proc = record(["-o", "/dev/null", "--force", "--", *_marker_command(tmp_path)], tmp_path)
    assert proc.returncode == 2 and "/dev/null is a character device: ampdoctor writes only " \
        "regular files" in proc.stderr
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev, after.st_mode) == \
        (before.st_ino, before.st_rdev, before.st_mode)


def test_two_records_into_one_output_the_second_refuses(tmp_path):
    (tmp_path / "run.h5").write_bytes(_earlier_run())
    go = tmp_path / "go"
    wait = [PYTHON, "-c", textwrap.dedent(f"""
        import os, time
        open({str(tmp_path / 'first')!r}, 'w').close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
    """)]
    first = subprocess.Popen([PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", "--force",
                              "--", *wait], cwd=tmp_path, env=python_env(),
                             stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1500):
            if (tmp_path / "first").exists():
                break
            first.poll()
            assert first.returncode is None, first.stderr.read()
            time.sleep(0.02)
        second = record(["-o", "run.h5", "--force", "--", *_marker_command(tmp_path)],
                        tmp_path)
        assert second.returncode == 2
        assert second.stderr == (f"ampdoctor: cannot record into run.h5: another ampdoctor "
                                 f"record is recording into it (pid {first.pid}); wait for it "
                                 "to end, or choose another file with -o\n")
        assert not (tmp_path / "started").exists()
    finally:
        go.touch()
        first.wait(timeout=60)
    assert first.returncode == 0
    # The lock goes with the recording that held it: the next record proceeds.
    assert not (tmp_path / ".run.h5.lock").exists()
    third = record(["-o", "run.h5", "--force", "--", *_marker_command(tmp_path)], tmp_path)
    assert third.returncode == 0 and (tmp_path / "started").exists()


def test_a_killed_record_leaves_no_lock_that_blocks_the_next(tmp_path):
    from ampdoctor.record.command.launch import OutputLock

    path = str(tmp_path / "run.h5")
    holder = subprocess.Popen([PYTHON, "-c", textwrap.dedent(f"""
        import sys, time
        from ampdoctor.record.command.launch import OutputLock
        with OutputLock({path!r}, "run.h5"):
            print("held", flush=True)
            time.sleep(60)
    """)], env=python_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ampdoctor.AmpDoctorError, match=f"pid {holder.pid}"):
            OutputLock(path, "run.h5").__enter__()
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(str(tmp_path / ".run.h5.lock"))  # left by the killed holder
    with OutputLock(path, "run.h5"):
        pass


@pytest.mark.parametrize("args,message", [
    (["-o", "run.h5", "--", "no-such-command-xyz"], "no-such-command-xyz: no such command"),
    (["-o", "run.h5"], "Missing argument"),
    (["--every", "-1", "--", "python"], "--every"),
])
def test_bad_command_line(tmp_path, args, message):
    proc = record(args, tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("apply,message", [
    ("bogus", "--apply bogus: unknown fix 'bogus'; record can apply fp32_island="),
    ("adam_eps=abc", "--apply adam_eps=abc: EPS must be a positive number"),
])
def test_a_bad_apply_stops_before_the_command_starts(tmp_path, apply, message):
    proc = record(["--apply", apply, "-o", "run.h5", "--", *_marker_command(tmp_path)], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"ampdoctor: {message}" or message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "started").exists()


# ---------------------------------------------------------------------------------------------
# The bootstrap inside the child


@pytest.mark.slow
def test_user_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nwith open(os.path.join(os.path.dirname(__file__), 'ran'), 'a') as f:\n"
        "    f.write(os.environ.get('AMPDOCTOR_RECORD', 'parent') + '\\n')\n")
    env = {"PYTHONPATH": str(site) + os.pathsep + python_env()["PYTHONPATH"]}
    proc = record(["-o", "run.h5", "--", PYTHON, TRAIN, "--steps", "2"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    # Once in `record` itself (an ordinary Python), once in the recorded script.
    assert sorted((site / "ran").read_text().split()) == ["1", "parent"]
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 2


def test_asking_whether_torch_is_installed_before_importing_it_still_records(tmp_path):
    # datasets, transformers and accelerate call importlib.util.find_spec("torch") before any of
    # them imports torch (transformers' run_clm_no_trainer.py imports datasets first): the
    # lookup once took the bootstrap's one-shot hook, and the run was "nothing recorded"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import importlib.util
        assert importlib.util.find_spec("torch") is not None
        assert importlib.util.find_spec("torch") is not None
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.ones(8, 4)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            print(f"loss {loss.item():.6f}")
    """))
    proc = record(["-o", "run.h5", "--", PYTHON, str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "nothing recorded" not in proc.stderr
    printed = [float(line.split()[1]) for line in proc.stdout.splitlines()
               if line.startswith("loss ")]
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 3
        np.testing.assert_allclose(run.steps["loss"], printed, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_forked_child_never_writes_into_the_parents_file(tmp_path):
    """A child forked after training began (and leaving through sys.exit, which closes what
    it inherited) must leave the parent's file intact."""
    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import torch
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def step():
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        step(); step()
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)  # OpenMP is not fork-safe
            step()                 # the child even trains: still nothing of it in the file
            sys.exit(0)
        os.waitpid(pid, 0)
        step(); step()
    """))
    proc = record(["-o", "run.h5", "--", PYTHON, str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert files(tmp_path) == ["run.h5"]
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert run.status == "finished"
        assert run.steps["step"].tolist() == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# In-process pieces: the lazy recorder, the deferred writer


# ---------------------------------------------------------------------------------------------
# Rank files (numpy only)


@pytest.mark.slow
def test_script_with_its_own_watch_keeps_working(tmp_path):
    """A script that calls ampdoctor.watch() itself, run under record by habit: its recorder
    takes over from the automatic one instead of failing."""
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent("""
        import torch, ampdoctor
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ampdoctor.watch(model, opt, path="own.h5"):
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    """))
    proc = record(["-o", "run.h5", "--", PYTHON, str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    with ampdoctor.load(tmp_path / "own.h5") as run:
        assert len(run.steps) == 3
    assert not (tmp_path / "run.h5").exists()


@pytest.mark.slow
def test_several_python_processes_in_one_command(tmp_path):
    """A driver (no torch) runs an evaluation that never trains, then two trainings: the
    first training replaces the evaluation's empty run, the second gets a file of its own."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import subprocess, sys
        for args in (["{example('no_training.py')}"], ["{TRAIN}", "--steps", "2"],
                     ["{TRAIN}", "--steps", "3"]):
            subprocess.run([sys.executable, *args], check=True)
    """))
    proc = record(["-o", "run.h5", "--", PYTHON, str(driver)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    names = files(tmp_path)
    assert names[0] == "run.h5" and len(names) == 2 and names[1].startswith("run.pid")
    with ampdoctor.load(tmp_path / "run.h5") as run:
        assert len(run.steps) == 2
    with ampdoctor.load(tmp_path / names[1]) as run:
        assert len(run.steps) == 3
    assert f"other training processes wrote {names[1]}" in ours(proc.stderr)[-1]


@pytest.mark.slow
def test_mp_spawn_ranks_are_named_by_torch_distributed(tmp_path):
    """mp.spawn sets no RANK variable: the rank is read from the process group when the
    file is created."""
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent("""
        import os, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
        from torch.nn.parallel import DistributedDataParallel as DDP

        def worker(rank, world, port):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=world)
            model = DDP(torch.nn.Linear(4, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
            del model  # DDP's reducer freed last would free the group holding the GIL
            dist.destroy_process_group()

        if __name__ == "__main__":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
            mp.spawn(worker, args=(2, port), nprocs=2)
    """))
    proc = record(["-o", "run.h5", "--", PYTHON, str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert files(tmp_path) == ["run.rank0.h5", "run.rank1.h5"]
    for rank in (0, 1):
        with ampdoctor.load(tmp_path / f"run.rank{rank}.h5") as run:
            assert (run.rank, run.attrs["world_size"], len(run.steps)) == (rank, 2, 3)


def test_record_and_rank_merging_never_import_torch(tmp_path):
    """The parent process and the merged diagnosis are analysis side: numpy and h5py only."""
    base = str(tmp_path / "ranks.h5")
    write_rank(paths.rank_path(base, 0), 0, 2, [8.0, 4.0], skipped={0})
    write_rank(paths.rank_path(base, 1), 1, 2, [8.0, 4.0], bad_loss={0}, skipped={0})
    out = str(tmp_path / "none.h5")
    code = ("import sys, ampdoctor; from ampdoctor import cli; "
            "from ampdoctor.record.command import launch; "
            f"assert cli.main(['record', '-o', {out!r}, '--', sys.executable, '-c', 'pass']) == 0; "
            f"print(launch.summary(launch.Settings(output={base!r}, shown='ranks.h5'))); "
            f"d = ampdoctor.diagnose({base!r}); assert d.first_bad['rank'] == 1; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert "first bad at step 0 on rank 1" in proc.stdout




@pytest.mark.slow
def test_user_code_with_state_and_hooks_trains_the_same_recorded(tmp_path):
    """A script whose model counts its calls (a warm-up keyed on them), keeps a Python-side
    EMA and appends to lists, with a forward hook collecting statistics, a printing backward
    hook, a tensor hook registered in the forward and a warning: two overflowing steps are
    replayed and their fixes tried, and the script prints exactly what it prints unrecorded
    (each loss in float.hex, the scale, the user state, the weights), warning included."""
    command = [PYTHON, example("train_stateful.py")]
    plain = subprocess.run(command, cwd=tmp_path, env=python_env(), capture_output=True,
                           text=True, timeout=300)
    recorded = record(["-o", "run.h5", "--", *command], tmp_path)
    assert plain.returncode == recorded.returncode == 0, recorded.stderr
    assert "step 5 loss nan" in plain.stdout and "calls 14 14 history 14" in plain.stdout
    assert recorded.stdout == plain.stdout
    theirs = [line for line in recorded.stderr.splitlines() if not line.startswith("ampdoctor:")]
    assert theirs == plain.stderr.splitlines()
    assert plain.stderr.count("UserWarning: activations are growing") == 1
    with ampdoctor.load(tmp_path / "run.h5") as run:
        details = [json.loads(s["detail"]) for s in run.snapshots]
    assert details and all(d["isolation"]["hooks_set_aside"] >= 2 for d in details)
    assert all(d["isolation"]["hooks_not_installed"] >= 1 for d in details)
