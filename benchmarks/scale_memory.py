"""Peak memory of writing and of diagnosing a long run, at two sizes (bounded = flat).

    python benchmarks/scale_memory.py                       # 20 000 and 200 000 steps, 300 modules
    python benchmarks/scale_memory.py --steps 50000 --modules 100 --keep /tmp/runs

Each measurement is its own process, and its peak resident memory comes from the kernel
(``wait4``'s ru_maxrss): writing the run with ``benchmarks/make_large_run.py`` (store.Writer,
as the recorder writes), then ``ampdoctor diagnose`` and ``ampdoctor dump`` on it. The
synthetic run overflows fp16 at 3/4 of its length, so that diagnose reads the statistics up to
there. The first line is the floor: a process that only imports the analysis side. Memory that
does not grow with a run ten times longer is bounded; time does grow (everything is read).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(argv: list[str]) -> tuple[float, float, str]:
    """Run ``argv``; return (peak RSS in MiB, seconds, stdout)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{err}")
    return usage.ru_maxrss / 1024, seconds, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--modules", type=int, default=300)
    parser.add_argument("--keep", help="folder to keep the run files in (default: temporary)")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="ampdoctor-scale-")
    os.makedirs(folder, exist_ok=True)
    py = sys.executable
    floor, _, _ = measure([py, "-c", "import ampdoctor.diagnosis.engine, ampdoctor.runfile.store, "
                                     "ampdoctor.render.diagnosis, ampdoctor.cli"])
    print(f"analysis-side import floor: {floor:.0f} MiB peak RSS")
    print(f"{'steps':>8} {'modules':>7} {'stats rows':>11} {'file MiB':>9} | "
          f"{'write MiB':>9} {'s':>6} | {'diagnose MiB':>12} {'s':>6} | {'dump MiB':>8} {'s':>5}")
    verdicts = []
    for steps in (args.steps // 10, args.steps):
        path = os.path.join(folder, f"run{steps}.h5")
        write_rss, write_s, out = measure(
            [py, os.path.join(ROOT, "benchmarks", "make_large_run.py"), path, "--steps",
             str(steps), "--modules", str(args.modules), "--overflow-step",
             str(steps * 3 // 4)])
        rows = int(out.split(" stats rows")[0].split()[-1])
        diag_rss, diag_s, text = measure([py, "-m", "ampdoctor", "diagnose", path])
        verdicts.append(next(line for line in text.splitlines() if line.startswith("verdict")))
        dump_rss, dump_s, _ = measure([py, "-m", "ampdoctor", "dump", path])
        size = os.path.getsize(path) / 2**20
        print(f"{steps:>8} {args.modules:>7} {rows:>11} {size:>9.1f} | {write_rss:>9.0f} "
              f"{write_s:>6.1f} | {diag_rss:>12.0f} {diag_s:>6.1f} | {dump_rss:>8.0f} "
              f"{dump_s:>5.1f}")
        if not args.keep:
            os.remove(path)
    for steps, verdict in zip((args.steps // 10, args.steps), verdicts):
        print(f"diagnose of {steps} steps: {verdict}")


if __name__ == "__main__":
    main()
