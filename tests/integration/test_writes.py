"""Commands that write (export, report, parity, record) turn an OS error into one sentence,
exit 2, and never touch what is the user's: they write a new file, or with --force a file of
their own kind, never through a symbolic link or over a device, FIFO or someone's file
(ampdoctor/outputs.py's rules).

The machine's tests run as root, for whom permission bits do not stop a write: /proc and a path
under a regular file stand for a read-only place, as they do for any user.
"""

import os
import stat
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
        "second export there would show every point twice; remove that file, pass --force to "
        "replace it, or export into another directory\n")
    assert os.listdir(logdir) == [written] and (logdir / written).read_bytes() == before
    os.remove(logdir / written)  # the user's own events beside it are no obstacle
    (logdir / "events.out.tfevents.1.host.2.0").write_bytes(b"")
    assert _ampdoctor("export", RUN, "--tensorboard", str(logdir)).returncode == 0


# ---------------------------------------------------------------------------------------------
# Never touch what is the user's (issue 37)

SCRIPT = "print('training')\n"
PARITY = os.path.join(ROOT, "fixtures", "examples", "layer_parity.py") + ":make"


def _one_sentence(proc, *parts):
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for part in parts:
        assert part in proc.stderr, proc.stderr


def _leftovers(folder):
    """Temporary files a write left behind (it must leave none, refused or not)."""
    return [n for n in os.listdir(folder) if n.startswith(".ampdoctor-")]


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("fmt", ["html", "markdown", "json"])
def test_report_never_writes_over_the_users_own_file(tmp_path, fmt, force):
    """`report run.h5 -o mytrain.py` once turned the training script into HTML and said
    "wrote mytrain.py"; with or without --force it is now left as it was."""
    script = tmp_path / "mytrain.py"
    script.write_text(SCRIPT)
    proc = _ampdoctor("report", RUN, "--format", fmt, "-o", "mytrain.py", *force, cwd=tmp_path)
    _one_sentence(proc, "ampdoctor: mytrain.py exists and is not a report ampdoctor wrote")
    assert script.read_text() == SCRIPT and _leftovers(tmp_path) == []


@pytest.mark.parametrize("make,what", [
    (os.mkfifo, "a FIFO"),
    (lambda p: os.symlink("victim.txt", p), "a symbolic link"),
    (lambda p: os.symlink("nowhere", p), "a symbolic link"),  # dangling: write would create it
])
def test_report_never_writes_over_a_fifo_or_through_a_link(tmp_path, make, what):
    (tmp_path / "victim.txt").write_text("mine\n")
    target = tmp_path / "report.html"
    make(str(target))
    before = os.lstat(target)
    proc = _ampdoctor("report", RUN, "-o", str(target), "--force")
    _one_sentence(proc, f"{target} is {what}")
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert (tmp_path / "victim.txt").read_text() == "mine\n"
    assert not (tmp_path / "nowhere").exists() and _leftovers(tmp_path) == []


def test_report_never_replaces_a_device_even_with_force(tmp_path):
    before = os.stat("/dev/null")
    proc = _ampdoctor("report", RUN, "-o", "/dev/null", "--force")
    _one_sentence(proc, "/dev/null is a character device: ampdoctor writes only regular files")
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev, after.st_mode) == \
        (before.st_ino, before.st_rdev, before.st_mode)
    assert stat.S_ISCHR(after.st_mode)


@pytest.mark.parametrize("fmt,name", [("html", "r.html"), ("markdown", "r.md"),
                                      ("json", "r.json")])
def test_a_report_of_its_own_is_replaced_with_force_only(tmp_path, fmt, name):
    """Its own kind is told by its first bytes (render/files.py); a file that merely looks like
    a report, its marker edited away, is the user's."""
    first = _ampdoctor("report", RUN, "--format", fmt, "-o", name, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    target = tmp_path / name
    written = target.read_bytes()
    again = _ampdoctor("report", RUN, "--format", fmt, "-o", name, cwd=tmp_path)
    _one_sentence(again, f"ampdoctor: {name} already exists: pass --force to replace it")
    assert target.read_bytes() == written
    inode = os.stat(target).st_ino
    forced = _ampdoctor("report", RUN, "--format", fmt, "-o", name, "--force", cwd=tmp_path)
    assert forced.returncode == 0 and forced.stderr.startswith(f"ampdoctor: wrote {name} ")
    assert target.read_bytes() == written and os.stat(target).st_ino != inode  # a new file
    target.write_bytes(b"\n" + written)  # edited by hand: no longer what ampdoctor wrote
    edited = _ampdoctor("report", RUN, "--format", fmt, "-o", name, "--force", cwd=tmp_path)
    _one_sentence(edited, "is not a report ampdoctor wrote")
    assert target.read_bytes() == b"\n" + written and _leftovers(tmp_path) == []


def test_plots_dir_never_overwrites_the_users_own_png(tmp_path):
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n my own figure")
    args = ["report", RUN, "--format", "markdown", "--plots-dir", "plots", "-o", "r.md"]
    for force in ([], ["--force"]):
        proc = _ampdoctor(*args, *force, cwd=tmp_path)
        _one_sentence(proc, "plots/loss.png exists and is not a figure ampdoctor drew")
        assert os.listdir(plots) == ["loss.png"] and not (tmp_path / "r.md").exists()
    os.remove(plots / "loss.png")
    assert _ampdoctor(*args, cwd=tmp_path).returncode == 0
    drawn = {n: (plots / n).read_bytes() for n in os.listdir(plots)}
    assert "loss.png" in drawn
    os.remove(tmp_path / "r.md")  # the report is new; the figures are not
    again = _ampdoctor(*args, cwd=tmp_path)
    _one_sentence(again, "already exists: pass --force to replace it")
    assert _ampdoctor(*args, "--force", cwd=tmp_path).returncode == 0
    assert {n: (plots / n).read_bytes() for n in os.listdir(plots)} == drawn


def test_parity_never_writes_over_the_users_file_and_replaces_its_own_with_force(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    proc = _ampdoctor("parity", PARITY, "--dtype", "float16", "-o", str(notes), "--force")
    _one_sentence(proc, "exists and is not a parity result ampdoctor wrote")
    assert notes.read_text() == "mine\n"
    for fmt in ("text", "markdown", "json"):
        out = tmp_path / f"parity.{fmt}"
        assert _ampdoctor("parity", PARITY, "--format", fmt, "-o", str(out)).returncode == 0
        again = _ampdoctor("parity", PARITY, "--format", fmt, "-o", str(out))
        _one_sentence(again, "already exists: pass --force to replace it")
        forced = _ampdoctor("parity", PARITY, "--format", fmt, "-o", str(out), "--force")
        assert forced.returncode == 0, forced.stderr
    assert _leftovers(tmp_path) == []


def test_export_force_replaces_its_own_events_and_nothing_else(tmp_path):
    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tb"
    logdir.mkdir()
    theirs = logdir / "events.out.tfevents.1.host.2.0"
    theirs.write_bytes(b"the user's own events")
    assert _ampdoctor("export", RUN, "--tensorboard", str(logdir)).returncode == 0
    (first,) = set(os.listdir(logdir)) - {theirs.name}
    forced = _ampdoctor("export", RUN, "--tensorboard", str(logdir), "--force")
    assert forced.returncode == 0, forced.stderr
    (second,) = set(os.listdir(logdir)) - {theirs.name}
    assert second != first and theirs.read_bytes() == b"the user's own events"
    # the name carries a random token: no link planted at a guessable name is written through
    assert len(second.split(".")[-2]) == 16 and second.endswith(".ampdoctor")


def test_a_file_made_between_the_check_and_the_write_is_never_replaced(tmp_path, monkeypatch):
    """The check runs before the work (minutes, for a large run); a file someone makes at the
    path meanwhile is refused, not replaced: a new file is linked into place, and a link
    fails where the name exists."""
    from ampdoctor import outputs
    from ampdoctor.errors import OutputError

    target = tmp_path / "report.html"
    real_link = os.link

    def someone_writes_first(src, dst):
        target.write_text("theirs\n")
        return real_link(src, dst)

    monkeypatch.setattr(os, "link", someone_writes_first)
    rules = outputs.Rules(ours=lambda path: False, kind="a report ampdoctor wrote", force=True)
    with pytest.raises(OutputError, match="exists and is not a report ampdoctor wrote"):
        outputs.write_bytes(str(target), b"ours", rules)
    assert target.read_text() == "theirs\n" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("plant", ["symlink", "fifo", "hardlink"])
def test_record_lock_is_a_file_of_its_own(tmp_path, plant):
    """`ln -s victim.txt .lk.h5.lock` then `record -o lk.h5` wrote record's pid into
    victim.txt; the lock is now opened with O_NOFOLLOW and must be a regular file of its own."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    lock = tmp_path / ".lk.h5.lock"
    {"symlink": lambda: os.symlink("victim.txt", lock), "fifo": lambda: os.mkfifo(lock),
     "hardlink": lambda: os.link(victim, lock)}[plant]()
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "record", "-o", "lk.h5", "--", PYTHON,
                           "-c", "open('started', 'w')"], env=python_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    _one_sentence(proc, "ampdoctor: cannot record into lk.h5: its lock .lk.h5.lock ")
    assert victim.read_text() == "mine\n" and os.path.lexists(lock)
    assert not (tmp_path / "started").exists()


def test_record_never_writes_through_a_dangling_link(tmp_path):
    os.symlink(tmp_path / "elsewhere.h5", tmp_path / "run.h5")
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", "--force",
                           "--", PYTHON, "-c", "open('started', 'w')"], env=python_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    _one_sentence(proc, f"cannot record into run.h5: {tmp_path / 'run.h5'} is a symbolic link")
    assert not (tmp_path / "elsewhere.h5").exists() and not (tmp_path / "started").exists()


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
