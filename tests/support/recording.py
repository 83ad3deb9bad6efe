"""Record a training script into a run file, in a subprocess, the way a user would.

The one place the fixture tests start a recording: ``ampdoctor record -o OUT --every N --force
-q -- python SCRIPT ARGS`` (or ``-- python -m torch.distributed.run ... SCRIPT ARGS``), the
no-code-change door (the model, optimizer and scaler are discovered as the script uses them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from testenv import PYTHON, python_env


def command(script: str, out: str, args: list[str], every: int, nproc: int = 0) -> list[str]:
    """``nproc``: launch the script under torchrun with that many local ranks (gloo on CPU),
    each recording its own ``out``'s rank file."""
    launch = [PYTHON, "-m", "torch.distributed.run", "--standalone",
              f"--nproc_per_node={nproc}"] if nproc else [PYTHON]
    return [PYTHON, "-m", "ampdoctor", "record", "-o", out, "--every", str(every), "--force",
            "-q", "--", *launch, script, *args]


def record(script: str, out: str, args: list[str] = (), every: int = 10,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Record ``python script *args`` into ``out``; returns the finished process."""
    return subprocess.run(command(script, out, list(args), every), env=python_env(),
                          capture_output=True, text=True, timeout=timeout)


def start(script: str, out: str, args: list[str] = (), every: int = 10,
          nproc: int = 0) -> subprocess.Popen:
    """Like ``record`` but without waiting (several fixtures record side by side)."""
    return subprocess.Popen(command(script, out, list(args), every, nproc), env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux's /proc children lists; [] elsewhere)."""
    found, todo = [], [pid]
    while todo:
        here = todo.pop()
        try:
            with open(f"/proc/{here}/task/{here}/children") as fh:
                kids = [int(k) for k in fh.read().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def finish(proc: subprocess.Popen, timeout: float, given: float | None = None
           ) -> tuple[str, str]:
    """Wait for a started recording; returns its (stdout, stderr). Past ``timeout`` the whole
    tree is killed (``record``, torchrun and its workers, which torchrun starts in sessions of
    their own) and the test fails saying so, with the last of what it printed, instead of
    leaving a hung job behind it. ``given``: the time the job had in all, for that message,
    where the caller has already waited part of it (default ``timeout``)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process no longer below it holds the pipes
            out, err = "", "(its output pipes were held by a process outside its tree)"
        said = f"{(out or '')[-1500:]}\n{(err or '')[-3000:]}"
        raise AssertionError(f"{' '.join(proc.args)} still ran after {given or timeout:.0f} s "
                             f"and was killed; it printed:\n{said}") from None


if __name__ == "__main__":  # python tests/support/recording.py SCRIPT OUT [EVERY] [-- ARGS]
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    head = argv[: argv.index("--")] if "--" in argv else argv
    proc = record(head[0], head[1], rest, int(head[2]) if len(head) > 2 else 10)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    sys.exit(proc.returncode)
