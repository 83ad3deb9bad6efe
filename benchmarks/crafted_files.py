"""Time and peak memory of every reading command on every crafted file, beside a good one.

    python benchmarks/crafted_files.py

The crafted files come from ``fixtures/crafted/make_crafted.py`` (a compression bomb inflating
to 537 MB, a table declaring 2**40 rows, external storage at a FIFO, NaN counts in /meta, ...),
made in a temporary folder, and so do the crafted parity results ``report --parity`` is given
(a FIFO, /dev/zero, JSON nested 100k deep, 1e999, fields of the wrong type). Each command is its own process; its peak resident memory comes from the kernel
(``wait4``'s ru_maxrss). A refusal should cost what reading the good file costs: the checks run
before any table is read.

    python benchmarks/crafted_files.py --large 10000000             # a month-long run
    python benchmarks/crafted_files.py --large 1000 --modules 100000 --keep /tmp/big.h5

``--large STEPS``: every reading command on one large honest run instead (written by
``benchmarks/make_large_run.py``, ``--modules`` modules, an overflow at 95% of the run), each
with its wall seconds, CPU seconds (user + system: what it takes on an idle machine; on shared
cores the wall time is higher) and peak MiB. ``--keep PATH``: write the run there, or reuse it.
``--json PATH``: those figures as JSON too. ``--source DIR``: run the ampdoctor package found
in DIR (a ``git worktree`` or ``git archive`` of an earlier commit) instead of this one, so a
before and an after are measured side by side on one machine in one session:

    python benchmarks/crafted_files.py --large 10000000 --keep /tmp/big.h5 --source /tmp/before \
        --json before.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "fixtures", "crafted"))

import make_crafted  # noqa: E402


def measure(args: list[str]) -> tuple[int, float, float]:
    """``python -m ampdoctor ARGS``: (exit code, seconds, peak RSS in MiB)."""
    code, seconds, _cpu, peak = measure_cpu(args)
    return code, seconds, peak


def measure_cpu(args: list[str], source: str = ROOT) -> tuple[int, float, float, float]:
    """``python -m ampdoctor ARGS`` (the package in ``source``): (exit code, seconds, CPU
    seconds, peak RSS in MiB)."""
    env = dict(os.environ, PYTHONPATH=source + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        # -P: not the working directory first on sys.path, where a checkout's ampdoctor would
        # be run instead of the one in ``source``
        os.execve(sys.executable, [sys.executable, "-P", "-m", "ampdoctor", *args], env)
    _pid, status, usage = os.wait4(pid, 0)
    return (os.waitstatus_to_exitcode(status), time.monotonic() - start,
            usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


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


def large(steps: int, modules: int, keep: str | None, source: str = ROOT,
          json_path: str | None = None) -> None:
    """Every reading command on one large run (``--large``)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import make_large_run

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.abspath(keep or os.path.join(folder, "large.h5"))
        if not os.path.exists(path):
            make_large_run.write_large_run(path, steps=steps, modules=modules,
                                           flush_steps=10_000, overflow_step=steps * 95 // 100)
        out = os.path.join(folder, "out")
        print(f"{path}: {os.path.getsize(path) / 2**20:.0f} MiB, load {os.getloadavg()[0]:.1f}")
        print(f"{'command':34s} exit  seconds  cpu s  peak MiB")
        rows = []
        for args in (["diagnose", path], ["dump", path], ["top", "--once", path],
                     ["report", path, "-o", out + ".html", "--force"],
                     ["report", path, "--format", "markdown", "-o", out + ".md", "--force"],
                     ["report", path, "--format", "json", "-o", out + ".json", "--force"],
                     ["export", path, "--tensorboard", out, "--force"],
                     ["compare", path, path]):
            code, seconds, cpu, peak = measure_cpu(args, source)
            shown = " ".join(a if a != path else "RUN" for a in args if not a.startswith(out))
            print(f"{shown[:34]:34s} {code:4d}  {seconds:7.2f}  {cpu:5.2f}  {peak:8.1f}")
            rows.append({"command": shown, "exit": code, "seconds": round(seconds, 2),
                         "cpu_seconds": round(cpu, 2), "peak_mib": round(peak, 1),
                         "load": round(os.getloadavg()[0], 1)})
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"steps": steps, "modules": modules, "source": source,
                           "file_mib": round(os.path.getsize(path) / 2**20, 1),
                           "commands": rows}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", type=int, metavar="STEPS",
                        help="every reading command on one large run of STEPS steps instead")
    parser.add_argument("--modules", type=int, default=4)
    parser.add_argument("--keep", metavar="PATH", help="with --large: the run's path (reused)")
    parser.add_argument("--source", default=ROOT, metavar="DIR",
                        help="with --large: run the ampdoctor package in DIR (an earlier commit)")
    parser.add_argument("--json", metavar="PATH", help="with --large: the figures as JSON too")
    opts = parser.parse_args()
    if opts.large:
        large(opts.large, opts.modules, opts.keep, os.path.abspath(opts.source), opts.json)
    else:
        main()
