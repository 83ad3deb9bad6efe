"""``ampdoctor top`` and ``ampdoctor export --tensorboard`` on runs being written.

The runs are written by a child process on command (``live_writer.py``, no torch), so each
test decides exactly what the file holds when it looks; one test follows a real recording.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import PYTHON, ROOT, SUPPORT, python_env

from ampdoctor.diagnosis import engine
from ampdoctor.live import follow, frame, top
from ampdoctor.release.readiness import underflow_share
from ampdoctor.render import diagnosis as report
from ampdoctor.runfile import store

WRITER = os.path.join(SUPPORT, "live_writer.py")


class Child:
    """A live_writer.py process; ``do`` sends one command and waits for its answer."""

    def __init__(self, path: str, *args: str):
        self.proc = subprocess.Popen([PYTHON, WRITER, path, *args], env=python_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ok"

    def do(self, *commands: str) -> "Child":
        for c in commands:
            self.proc.stdin.write(c + "\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "ok", c
        return self

    def close(self, status: str = "finished") -> None:
        self.do(f"close {status}")
        self.proc.wait(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def ampdoctor(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    env = dict(python_env(), COLUMNS="80", PYTHONIOENCODING="utf-8")
    return subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_top_once_follows_a_run_while_it_is_written(tmp_path):
    path = str(tmp_path / "run.h5")
    child = Child(path).do("steps 4")
    try:
        first = ampdoctor("top", path, "--once")
        assert first.returncode == 0, first.stderr
        assert "running · step 3" in first.stdout
        assert "fp16 headroom: no sampled step yet (next at step 5)" in first.stdout
        child.do("steps 3 nan", "replay", "steps 3", "sampled")
        second = ampdoctor("top", path, "--once")
        assert "running · step 9" in second.stdout and second.stdout != first.stdout
        # skips and GradScaler's probing allowance, as the report counts them
        with store.load(path) as run:
            from ampdoctor.release.report import summarize
            s = summarize(run)
        assert f"skipped   {s.skipped}; after: " in second.stdout
        assert f"({s.skipped_after} of {s.steps}), probing allows {s.probing_allowance}" in \
            second.stdout
        assert "nonfinite loss on 3 steps (first 4)" in second.stdout
        assert "lr        0.00109 1.09e-04 (2 groups)" in second.stdout
        # the layer nearest to 65504 first, with its headroom; the half-flushed gradient
        lines = second.stdout.splitlines()
        table = lines.index(next(l for l in lines if l.startswith("fp16 headroom at step 9")))
        assert lines[table + 2].split()[:5] == ["blocks.0.attn", "activation", "40000",
                                                "2^0.7", "-"]
        assert any(l.split()[:1] == ["blocks.0.mlp.weight"] and l.rstrip().endswith("50%")
                   for l in lines[table:])
        assert "step 6 (skipped step): blocks.0.attn (Attention) in forward: matmul " \
               "overflowed; finite in fp32" in " ".join(second.stdout.split())
        assert all(len(line) <= 80 for line in lines)
        child.close()
        done = ampdoctor("top", path, "--once")
        assert "· finished · step 9" in done.stdout
    finally:
        child.proc.kill()


def test_top_ends_with_the_diagnosis_when_the_run_finishes(tmp_path):
    path = str(tmp_path / "run.h5")
    child = Child(path).do("steps 5")
    proc = subprocess.Popen([PYTHON, "-m", "ampdoctor", "top", path, "--interval", "0.2"],
                            env=dict(python_env(), COLUMNS="80"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # its first frame is out: the run is still running
        assert "running · step 4" in first and proc.poll() is None
        child.do("steps 5")
        child.close()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    frames = out.split("ampdoctor top · ")
    assert "finished · step 9" in frames[-1]
    diagnosis = ampdoctor("diagnose", path).stdout
    assert out.endswith("\n" + diagnosis) and "verdict: healthy" in diagnosis


def test_top_says_writer_gone_when_the_writer_is_killed(tmp_path):
    path = str(tmp_path / "run.h5")
    child = Child(path).do("steps 6")
    once = ampdoctor("top", path, "--once")
    assert "running · step 5" in once.stdout
    child.kill()
    t = time.monotonic()
    ended = ampdoctor("top", path, "--interval", "0.2", timeout=30)
    assert time.monotonic() - t < 20  # ended by itself, not at --stale
    assert ended.returncode == 0, ended.stderr
    assert "writer gone · step 5" in ended.stdout
    assert f"writer gone: process {child.proc.pid} on " in ended.stdout
    assert "ended without finishing the file" in ended.stdout
    assert "interrupted" in ended.stdout.split("verdict:")[0]  # the diagnosis' run line


def test_a_writer_on_another_host_is_gone_once_the_file_is_stale(tmp_path):
    path = str(tmp_path / "run.h5")
    child = Child(path, "--host", "elsewhere").do("steps 3")
    try:
        fresh = ampdoctor("top", path, "--once", "--stale", "30")
        assert "running · step 2" in fresh.stdout  # cannot be checked, but it changed lately
        time.sleep(1.5)
        stale = ampdoctor("top", path, "--once", "--stale", "1")
        assert "writer gone · step 2" in stale.stdout
        assert "its writer (process" in stale.stdout and "on elsewhere) cannot be checked" \
            in " ".join(stale.stdout.split())
    finally:
        child.kill()


def test_top_waits_for_a_missing_file_then_gives_up_in_one_sentence(tmp_path):
    path = str(tmp_path / "run.h5")
    t = time.monotonic()
    gone = ampdoctor("top", path, "--once", "--wait", "1")
    assert 1.0 <= time.monotonic() - t
    assert gone.returncode == 2 and gone.stdout == ""
    assert gone.stderr.strip() == (
        f"ampdoctor: {path} did not appear within 1 s (nor {path[:-3]}.rank*.h5): start the "
        f"recording with ampdoctor record -o {path}, or wait longer with --wait")
    # a file that appears while it waits is shown
    proc = subprocess.Popen([PYTHON, "-m", "ampdoctor", "top", path, "--once", "--wait", "30"],
                            env=python_env(), stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    child = Child(path).do("steps 2")
    try:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "running · step" in out
    finally:
        child.kill()
        proc.kill()


def test_top_follows_the_rank_files_of_a_torchrun_job(tmp_path):
    path = str(tmp_path / "run.h5")
    stem = str(tmp_path / "run")
    r0 = Child(f"{stem}.rank0.h5", "--rank", "0", "--world", "2").do("steps 6")
    r1 = Child(f"{stem}.rank1.h5", "--rank", "1", "--world", "2").do("steps 3", "steps 3 nan")
    try:
        once = ampdoctor("top", path, "--once")
        assert "rank 1 of 2" in once.stdout  # the rank that went non-finite first is shown
        assert "ranks     0: step 5 running · 1: step 5 running, non-finite from 3" in \
            once.stdout
        chosen = ampdoctor("top", path, "--once", "--rank", "0")
        assert "rank 0 of 2" in chosen.stdout
        r0.close()
        r1.close()
        ended = ampdoctor("top", path, "--interval", "0.2")
        assert ended.returncode == 0
        assert ended.stdout.endswith(ampdoctor("diagnose", path).stdout)
        assert "2 rank files diagnosed together" in ended.stdout
    finally:
        r0.proc.kill()
        r1.proc.kill()


def test_top_on_a_file_that_is_not_a_run_is_one_sentence(tmp_path):
    path = tmp_path / "run.h5"
    path.write_bytes(b"not hdf5 at all" * 10)
    bad = ampdoctor("top", str(path), "--once")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == f"ampdoctor: {path} is not an ampdoctor run file (not HDF5)"


# ---------------------------------------------------------------------------------------------
# The frame as data, and its text


def _written(path: str) -> store.Writer:
    from live_writer import Driven

    d = Driven(path, 0, 1, None)
    d.steps(8, False)
    d.steps(2, True)
    d.replay()  # of step 9, skipped
    d.steps(1, False)
    d.sampled()  # step 10
    return d


def test_frame_reads_only_new_rows_and_matches_the_file(tmp_path):
    path = str(tmp_path / "run.h5")
    d = _written(path)
    with follow.Follower(path) as f:
        first = f.poll()
        assert len(first[0].rows["steps"]) == 11
        d.steps(3, False)
        second = f.poll()
        assert len(second[0].rows["steps"]) == 3 and second[0].stats_start == 3
        assert f.poll()[0].rows["steps"].size == 0
        fr = frame.build(f.states)
    d.w.close("finished")
    with store.load(path) as run:
        steps = run.steps
        assert fr.step == int(steps["step"][-1]) and fr.steps == len(steps)
        assert np.array_equal(fr.series["loss"], steps["loss"], equal_nan=True)
        assert fr.lr == pytest.approx([1.13e-3, 1.13e-4])
        assert fr.layer_step == 10 and fr.event.step == 9 and fr.event.module == "blocks.0.attn"
    assert fr.layers[0].name == "blocks.0.attn"
    assert fr.layers[0].headroom == pytest.approx(math.log2(65504 / 40000))
    grad = next(x for x in fr.layers if x.name == "blocks.0.mlp.weight")
    assert grad.underflow == pytest.approx(0.5) and grad.scaled
    assert fr.to_dict()["event"]["text"].startswith("step 9 (skipped step)")


def test_render_fits_any_width_and_height(tmp_path):
    path = str(tmp_path / "run.h5")
    d = _written(path)
    with follow.Follower(path) as f:
        f.poll()
        fr = frame.build(f.states)
    d.w.close("finished")
    fr.layers[0].name = "encoder.layers.11.self_attention.query_key_value.very_long_name"
    for width in (40, 80, 132, 200):
        lines = top.render(fr, width, unicode=False)
        assert all(len(line) <= width for line in lines)
        assert any(line.startswith("loss") and len(line) > width - 12 for line in lines)
    short = top.render(fr, 80, height=14)
    assert len(short) == 14 and any(line.startswith("fp16 headroom") for line in short)
    colored = top.render(fr, 80, color=True)
    assert any("\x1b[31m" in line for line in colored)


def test_sparkline_columns():
    assert list(frame.buckets(np.arange(10.0), 5)) == [0.5, 2.5, 4.5, 6.5, 8.5]
    cols = frame.buckets(np.array([1.0, 2.0, np.nan, 4.0]), 4)
    assert top.sparkline(cols) == "▁▃!█"
    assert top.sparkline(frame.buckets(np.ones(3), 10), unicode=False) == "==="


def test_live_modules_import_no_torch(tmp_path):
    path = str(tmp_path / "run.h5")
    Child(path).do("steps 3", "sampled").close()
    code = ("import sys; from ampdoctor.live import top, tensorboard; "
            f"o = top.top({path!r}, once=True); assert o.frame.step == 2; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# The full-screen view, in a pseudo-terminal


def _pty_top(path: str, *args: str) -> tuple[int, int]:
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, as in an ssh session
        _set_size(0, 30, 80)
        env = dict(python_env(), TERM="xterm", LANG="C.UTF-8")
        os.execvpe(PYTHON, [PYTHON, "-m", "ampdoctor", "top", path, *args], env)
    return pid, fd


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _read_until(fd: int, wanted, limit: float = 20.0) -> str:
    """What the terminal received until ``wanted`` (text, or a test of the text without
    escape sequences) was drawn."""
    import select

    if isinstance(wanted, str):
        text = wanted
        wanted = lambda screen: text in screen  # noqa: E731
    seen, end = b"", time.monotonic() + limit
    while not wanted(ANSI.sub("", seen.decode(errors="replace"))) and \
            not wanted(seen.decode(errors="replace")):
        left = end - time.monotonic()
        assert left > 0, f"{wanted!r} never drawn; screen so far: {seen[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            seen += chunk
    return seen.decode(errors="replace")


def _set_size(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@pytest.mark.parametrize("key,code", [("q", 0), ("\x03", 130)])
def test_full_screen_view_draws_refreshes_and_restores_the_terminal(tmp_path, key, code):
    import termios

    path = str(tmp_path / "run.h5")
    child = Child(path).do("steps 3")
    pid, fd = _pty_top(path, "--interval", "0.2")
    try:
        before = termios.tcgetattr(fd)
        screen = _read_until(fd, "step 2 (")
        assert "\x1b[?1049h" in screen  # the alternate screen
        assert termios.tcgetattr(fd)[3] & termios.ECHO == 0  # keys are not echoed
        child.do("steps 4")
        _read_until(fd, "step 6 (")  # redrawn with the new rows
        _set_size(fd, 30, 120)  # SIGWINCH: redrawn at the new width
        _read_until(fd, lambda screen: any(len(line) > 100 and line.startswith("loss")
                                           for line in screen.split("\r\n")))
        os.write(fd, key.encode())
        rest = _read_until(fd, "\x1b[?1049l")
        assert "\x1b[?25h" in rest  # the cursor is back
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == code
        assert termios.tcgetattr(fd)[3] == before[3]  # echo and line mode as they were
    finally:
        child.kill()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_full_screen_view_ends_by_itself_and_leaves_the_last_frame(tmp_path):
    path = str(tmp_path / "run.h5")
    child = Child(path).do("steps 3")
    pid, fd = _pty_top(path, "--interval", "0.2")
    try:
        _read_until(fd, "step 2 (")
        child.close()
        out = _read_until(fd, "verdict: ")
        after = out.split("\x1b[?1049l", 1)[1]  # on the normal screen, kept in scrollback
        assert "finished · step 2" in after and "\x1b[?1049h" not in after
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        child.kill()
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# TensorBoard


def _scalars(logdir: str) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
    texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)]
             for t in tags["tensors"]}
    return scalars, texts


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_export_is_read_back_by_tensorboard_as_the_run_file_holds_it(tmp_path):
    path = str(tmp_path / "run.h5")
    d = _written(path)
    d.w.close("finished")
    logdir = str(tmp_path / "tb")
    done = ampdoctor("export", path, "--tensorboard", logdir)
    assert done.returncode == 0, done.stderr
    scalars, texts = _scalars(logdir)
    with store.load(path) as run:
        s, groups, stats = run.steps, run.groups.read(), run.stats.read()
        for column, tag in (("loss", "loss"), ("scale", "loss_scale"),
                            ("grad_norm", "grad_norm")):
            got = scalars[f"ampdoctor/{tag}"]
            assert list(got) == list(s["step"])
            assert all(_same(got[k], float(v)) for k, v in zip(s["step"], s[column]))
        assert [scalars["ampdoctor/skipped"][k] for k in s["step"]] == list(s["skipped"])
        for g in (0, 1):
            rows = groups[groups["group"] == g]
            assert scalars[f"ampdoctor/lr/group{g}"] == {int(k): float(v) for k, v in
                                                         zip(rows["step"], rows["lr"])}
        share = underflow_share(stats)
        names = {int(t["id"]): t["name"] for t in run.tensors}
        assert scalars["ampdoctor-absmax/activation/blocks.0.attn"] == {10: 40000.0}
        row = stats[[names[int(t)] == "blocks.0.mlp.weight" for t in stats["tensor"]]]
        assert scalars["ampdoctor-underflow/weight_grad/blocks.0.mlp.weight"][10] == \
            pytest.approx(float(share[stats["tensor"] == row["tensor"][0]][0]))
        assert texts["ampdoctor/forensics"] == [(9, frame.events(run)[0].text)]
    diagnosis = report.render(engine.diagnose(path), "markdown")
    assert texts["ampdoctor/diagnosis"] == [(10, diagnosis)]
    assert "wrote" in done.stderr and logdir in done.stderr


def test_export_follows_a_live_run_and_splits_ranks(tmp_path):
    stem = str(tmp_path / "run")
    logdir = str(tmp_path / "tb")
    r0 = Child(f"{stem}.rank0.h5", "--rank", "0", "--world", "2").do("steps 2")
    r1 = Child(f"{stem}.rank1.h5", "--rank", "1", "--world", "2").do("steps 2")
    proc = subprocess.Popen([PYTHON, "-m", "ampdoctor", "export", f"{stem}.h5",
                             "--tensorboard", logdir, "--follow"], env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        r0.do("steps 3", "sampled")
        r1.do("steps 3 nan")
        r0.close()
        r1.close()
        _, err = proc.communicate(timeout=30)
    finally:
        for p in (proc, r0.proc, r1.proc):
            p.kill()
    assert proc.returncode == 0, err
    for rank in (0, 1):
        scalars, texts = _scalars(os.path.join(logdir, f"rank{rank}"))
        assert sorted(scalars["ampdoctor/loss"]) == [0, 1, 2, 3, 4]
        assert len(texts["ampdoctor/diagnosis"]) == 1
    rank1, _ = _scalars(os.path.join(logdir, "rank1"))
    assert math.isnan(rank1["ampdoctor/loss"][4]) and rank1["ampdoctor/skipped"][4] == 1.0
    rank0, _ = _scalars(os.path.join(logdir, "rank0"))
    assert list(rank0["ampdoctor-absmax/activation/blocks.0.attn"]) == [4]


def test_export_without_tensorboard_says_how_to_install_it(tmp_path):
    path = str(tmp_path / "run.h5")
    Child(path).do("steps 2").close()
    code = ("import sys; sys.modules['tensorboard'] = None; from ampdoctor.cli import main; "
            f"sys.exit(main(['export', {path!r}, '--tensorboard', {str(tmp_path / 'tb')!r}]))")
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "ampdoctor: ampdoctor export --tensorboard needs the tensorboard package, which is "
        "not installed: pip install 'ampdoctor[tensorboard]'")
    assert not (tmp_path / "tb").exists()


# ---------------------------------------------------------------------------------------------
# A real recording


@pytest.mark.slow
def test_top_follows_a_real_recording_to_its_diagnosis(tmp_path):
    path = str(tmp_path / "run.h5")
    script = os.path.join(ROOT, "fixtures", "examples", "train.py")
    rec = subprocess.Popen([PYTHON, "-m", "ampdoctor", "record", "-o", path, "--every", "4",
                            "-q", "--", PYTHON, script, "--steps", "30", "--sleep", "0.05"],
                           env=python_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        watched = ampdoctor("top", path, "--interval", "0.3", "--wait", "60", timeout=120)
        assert rec.wait(60) == 0
    finally:
        rec.kill()
    assert watched.returncode == 0, watched.stderr
    frames = watched.stdout.split("\nampdoctor top · ")
    # The first frame may come before the first step is written ("running · no step yet");
    # while the run trains, some frame before the last must show it running with a step.
    assert len(frames) >= 2 and "· running ·" in frames[0]
    assert any("running · step" in frame for frame in frames[:-1])
    assert "finished · step 29" in frames[-1]
    assert "fp16 headroom at step 28" in frames[-1]
    assert watched.stdout.endswith("\n" + ampdoctor("diagnose", path).stdout)


@pytest.mark.slow
def test_live_cost_benchmark_runs(tmp_path):
    """docs/performance.md quotes it: it must keep running (nothing timed here)."""
    import json

    out = tmp_path / "cost.json"
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "benchmarks", "live_cost.py"), "--rounds",
                           "1", "--steps", "60", "--modes", "plain,top", "--settle", "0.5",
                           "--json", str(out)], env=python_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modes = json.loads(out.read_text())["modes"]
    assert modes["plain"]["ratio"] == 1.0 and modes["top"]["watcher_cpu_s"] > 0


def test_a_month_long_read_is_thinned_to_its_extremes_and_every_bad_step():
    """Export of 10^6 steps wrote each of them (and looped over every step for each LR
    group: unfinished after 900 s); a read longer than MAX_STEPS keeps each curve's bin
    extremes, every skipped or non-finite step, and each group's LR at evenly spaced steps."""
    from ampdoctor.live import thinning
    from ampdoctor.runfile import schema

    n = 5 * thinning.MAX_STEPS
    rows = schema.empty("steps", n)
    rows["step"] = np.arange(n)
    rows["loss"] = 2.0 - np.arange(n) / n
    rows["grad_norm"] = 1.0
    rows["scale"] = 65536.0
    rows["loss"][12_345] = 50.0  # a one-step spike
    rows["skipped"][77_777] = 1
    rows["grad_norm"][88_888] = np.inf
    kept = thinning.thinned(rows)
    assert len(kept) < n // 2
    assert {12_345, 77_777, 88_888} <= set(kept.tolist())
    assert 0 in kept and n - 1 in kept  # the ends of the loss curve
    short = rows[: thinning.MAX_STEPS]
    assert len(thinning.thinned(short)) == len(short)
    lr = thinning.thinned_steps(np.arange(n))
    assert len(lr) == thinning.POINTS and lr[0] == 0 and lr[-1] == n - 1


def test_the_follower_keeps_the_delayed_fp8_rows_of_the_last_sampled_steps_only():
    """The fp8 early warning's window (``follow.FP8_STEPS``): each poll's /fp8 rows are kept
    for the delayed recipe alone, and for the last FP8_STEPS sampled steps."""
    from ampdoctor.runfile import schema

    state = follow.RankState("run.h5")
    for step in range(follow.FP8_STEPS + 8):
        rows = schema.empty("fp8", 4)
        rows["step"], rows["recipe"] = step, [int(r) for r in schema.Recipe]
        state._keep_fp8(rows)
    kept = state.fp8_rows
    assert set(kept["recipe"]) == {int(schema.Recipe.DELAYED)}
    assert list(kept["step"]) == list(range(8, follow.FP8_STEPS + 8))
    state._keep_fp8(None)
    assert len(state.fp8_rows) == follow.FP8_STEPS
