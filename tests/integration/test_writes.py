"""Commands that write (export, report) turn an OS error into one sentence, exit 2.

The machine's tests run as root, for whom permission bits do not stop a write: /proc and a path
under a regular file stand for a read-only place, as they do for any user.
"""

import os
import subprocess

import pytest
from conftest import PYTHON, ROOT, python_env

RUN = os.path.join(ROOT, "fixtures", "formats", "v2.h5")


def _ampdoctor(*args, cwd=None):
    return subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=python_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("target,why", [
    ("/proc/tb", "No such file or directory"),
    ("/proc/self", "Permission denied"),
    ("{tmp}/a-file/tb", "Not a directory"),
])
def test_export_into_a_place_it_cannot_write_is_one_sentence(tmp_path, target, why):
    pytest.importorskip("tensorboard")
    (tmp_path / "a-file").write_text("mine\n")
    target = target.format(tmp=tmp_path)
    proc = _ampdoctor("export", RUN, "--tensorboard", target)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == f"ampdoctor: cannot write TensorBoard events into {target}: {why}\n"
    assert (tmp_path / "a-file").read_text() == "mine\n"


@pytest.mark.parametrize("args", [
    ("-o", "/proc/report.html"),
    ("-o", "/sys/report.html"),
    ("--format", "markdown", "-o", "/proc/report.md"),
    ("--format", "markdown", "--plots-dir", "/proc/plots", "-o", "{tmp}/r.md"),
])
def test_report_into_a_place_it_cannot_write_is_one_sentence(tmp_path, args):
    args = [a.format(tmp=tmp_path) for a in args]
    proc = _ampdoctor("report", RUN, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampdoctor: cannot "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_second_export_into_one_directory_refuses_and_keeps_the_first(tmp_path):
    """TensorBoard reads every event file of a run directory: a second export there would show
    each point twice, so it is one sentence and the first export's file stays as it was."""
    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tb"
    first = _ampdoctor("export", RUN, "--tensorboard", str(logdir))
    assert first.returncode == 0, first.stderr
    (written,) = os.listdir(logdir)
    assert written.startswith("events.out.tfevents.") and written.endswith(".ampdoctor")
    before = (logdir / written).read_bytes()
    again = _ampdoctor("export", RUN, "--tensorboard", str(logdir))
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr == (
        f"ampdoctor: {logdir} already holds ampdoctor's TensorBoard events ({written}): a "
        "second export there would show every point twice; remove that file or export into "
        "another directory\n")
    assert os.listdir(logdir) == [written] and (logdir / written).read_bytes() == before
    os.remove(logdir / written)  # the user's own events beside it are no obstacle
    (logdir / "events.out.tfevents.1.host.2.0").write_bytes(b"")
    assert _ampdoctor("export", RUN, "--tensorboard", str(logdir)).returncode == 0


@pytest.mark.slow
def test_record_onto_a_full_disk_says_so_and_training_goes_on(tmp_path):
    """The run file cannot hold the news of its own full disk (EFBIG past RLIMIT_FSIZE stands
    for ENOSPC: the same failed write); the closing line says it, never "killed", training
    runs to its end and the steps flushed before stay readable."""
    import resource

    limit = 48 << 10

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "run.h5"
    proc = subprocess.run(
        [PYTHON, "-m", "ampdoctor", "record", "-o", str(out), "--", PYTHON,
         os.path.join(ROOT, "fixtures", "verdicts", "healthy_fp16.py"), "--steps", "1500"],
        env=python_env(), capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1499" in proc.stdout  # training went on to its last step
    closing = proc.stderr.strip().splitlines()[-1]
    assert f"recording stopped (could not write {out} (File too large)); training went on " \
           "without it" in closing, closing
    assert "killed" not in closing and "never trained" not in closing
    kept = int(closing.split("recorded ")[1].split(" step")[0])
    assert 0 < kept < 1500
    diagnosed = _ampdoctor("diagnose", str(out))
    assert diagnosed.returncode == 0, diagnosed.stderr
    assert f"{kept} steps recorded" in diagnosed.stdout and "status interrupted" in \
        diagnosed.stdout
