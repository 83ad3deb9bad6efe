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
