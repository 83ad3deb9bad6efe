"""Time and peak memory of every reading command on every crafted file, beside a good one.

    python benchmarks/crafted_files.py

The crafted files come from ``fixtures/crafted/make_crafted.py`` (a compression bomb inflating
to 537 MB, a table declaring 2**40 rows, external storage at a FIFO, NaN counts in /meta, ...),
made in a temporary folder, and so do the crafted parity results ``report --parity`` is given
(a FIFO, /dev/zero, JSON nested 100k deep, 1e999, fields of the wrong type). Each command is its own process; its peak resident memory comes from the kernel
(``wait4``'s ru_maxrss). A refusal should cost what reading the good file costs: the checks run
before any table is read.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "fixtures", "crafted"))

import make_crafted  # noqa: E402


def measure(args: list[str]) -> tuple[int, float, float]:
    """``python -m ampdoctor ARGS``: (exit code, seconds, peak RSS in MiB)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.execve(sys.executable, [sys.executable, "-m", "ampdoctor", *args], env)
    _pid, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), time.monotonic() - start, usage.ru_maxrss / 1024


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        files = {"(good) v2": make_crafted.BASE, **make_crafted.make_all(folder)}
        out = os.path.join(folder, "out")
        print(f"{'file':18s} {'command':9s} exit  seconds  peak MiB")
        worst = (0.0, 0.0)
        for case, path in files.items():
            for args in (["diagnose", path], ["dump", path], ["top", "--once", "--wait", "0", path],
                         # --force: each case replaces the last one's report and events
                         ["report", path, "-o", out + ".html", "--force"],
                         ["export", path, "--tensorboard", out, "--force"],
                         ["compare", make_crafted.BASE, path]):
                code, seconds, peak = measure(args)
                print(f"{case:18s} {args[0]:9s} {code:4d}  {seconds:7.2f}  {peak:8.1f}")
                if case != "(good) v2":
                    worst = (max(worst[0], seconds), max(worst[1], peak))
        print(f"crafted files, worst: {worst[0]:.2f} s, {worst[1]:.1f} MiB")
        worst = _parity_files(folder, out)
        print(f"crafted parity results, worst: {worst[0]:.2f} s, {worst[1]:.1f} MiB")


def _parity_files(folder: str, out: str) -> tuple[float, float]:
    """``report --parity`` on each crafted parity result (a FIFO, /dev/zero, JSON nested 100k
    deep, ...): each refused in about the time a report takes, never a hang or a MemoryError."""
    worst = (0.0, 0.0)
    for case in make_crafted.PARITY_CASES:
        path = make_crafted.make_parity(case, folder)
        code, seconds, peak = measure(["report", make_crafted.BASE, "--parity", path,
                                       "--format", "json", "-o", out + ".json"])
        print(f"{case:18s} {'report':9s} {code:4d}  {seconds:7.2f}  {peak:8.1f}")
        worst = (max(worst[0], seconds), max(worst[1], peak))
    return worst


if __name__ == "__main__":
    main()
