"""How long ``ampdoctor diagnose`` takes over the rank files of a large job, and its memory.

    python benchmarks/scale_diagnose.py                          # 1, 64, 256, 1024 ranks
    python benchmarks/scale_diagnose.py --ranks 1,64 --steps 2000 --modules 20 --full-max 64

Writes one 10 000-step, 100-module run with ``benchmarks/make_large_run.py`` (healthy: the
loss scale grows every 2000 steps) and a second one whose sampled tier sees one module
overflow fp16 at 90 % of the run and on every step after it (the one late-overflowing rank),
then copies them into N rank files (``run.rank{R}.h5``, root attributes and ``/summary`` set
to rank R of N), the overflowing one at rank 3N/4. For each N it diagnoses the files in a
fresh process, twice: the fast path (``engine.diagnose_files``: every rank's summary, then
the ranks that matter read in full) and the full read (``full=True``: every rank loaded and
diagnosed, as before issue 20), and prints wall time (import included, as the CLI runs it),
peak RSS (the child's VmHWM) and the answer of each, which must be the same: verdict, first
bad step, first rank. The full read takes minutes and gigabytes at 1024 ranks: it is run up
to ``--full-max`` ranks (default 256). Then, on the largest job, ``ampdoctor top``'s first
frame and its refreshes with every file changed, and the closing line ``ampdoctor record``
prints on the node holding the late rank (8 ranks a node), timed. No torch needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import h5py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from make_large_run import write_large_run  # noqa: E402

CHILD = """
import json, sys, time
t = time.perf_counter()
from ampdoctor.diagnosis import engine
paths = json.loads(sys.argv[1])
full = sys.argv[2] == "full"
d = engine.diagnose_files(paths, full=full) if len(paths) > 1 else engine.diagnose(paths[0])
seconds = time.perf_counter() - t
hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
first = d.first_bad or {}
rank = (d.rank_view or {}).get("first") or {}
print(json.dumps({"s": seconds, "rss_mb": int(hwm) / 1024, "verdict": d.verdict,
                  "step": first.get("step"), "rank": rank.get("rank", first.get("rank")),
                  "scale_step": ((d.rank_view or {}).get("scale") or {}).get("diverged_at")}))
"""

# `ampdoctor top` over the files (first frame, then refreshes with every file changed) and
# the closing line of the node that holds the late rank (8 ranks a node).
LIVE = """
import json, os, sys, time
from ampdoctor.live import follow, frame, top
from ampdoctor.record.command import launch, written
paths, late = json.loads(sys.argv[1]), int(sys.argv[2])
base = os.path.join(os.path.dirname(paths[0]), "run.h5")
f = follow.Follower(base, full_ranks=follow.FULL_RANKS)
def refresh():
    t = time.perf_counter()
    f.poll()
    top.render(frame.build(f.states, path=base, final=f.final, summaries=f.summaries), 100)
    return time.perf_counter() - t
first = refresh()
again = []
for _ in range(3):
    now = time.time()
    for p in paths:
        os.utime(p, (now, now))
    again.append(refresh())
f.close()
marker = written.create()
node = late // 8 * 8
for r in range(node, min(node + 8, len(paths))):
    written.note(marker, paths[r])
t = time.perf_counter()
line = launch.summary(launch.Settings(output=base, shown="run.h5", session=marker))
written.remove(marker)
print(json.dumps({"top_first_s": first, "top_refresh_s": max(again),
                  "node_line_s": time.perf_counter() - t, "node_line": line}))
"""


def set_rank(path: str, rank: int, world: int) -> None:
    """Make a copied run file rank ``rank`` of ``world``: its root attributes and summary."""
    with h5py.File(path, "r+") as f:
        f.attrs["rank"], f.attrs["world_size"] = rank, world
        row = f["summary"][0]
        row["rank"], row["world_size"] = rank, world
        f["summary"][0] = row


def layout(folder: str, n: int, healthy: str, bad: str, made: dict) -> list[str]:
    """Rank files 0..n-1 in ``folder`` (copies kept from a smaller n are reused)."""
    paths = [os.path.join(folder, f"run.rank{r}.h5") for r in range(n)]
    late = n * 3 // 4
    for r, path in enumerate(paths):
        source = bad if r == late else healthy
        if made.get(path) != source:
            shutil.copyfile(source, path)
            made[path] = source
        set_rank(path, r, n)
    return paths


def measure(paths: list[str], how: str, code: str = CHILD) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(paths), how], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,64,256,1024",
                        help="rank counts, comma-separated (default: 1,64,256,1024)")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--modules", type=int, default=100)
    parser.add_argument("--full-max", type=int, default=256,
                        help="run the full read up to this many ranks (it takes minutes and "
                             "gigabytes at 1024)")
    parser.add_argument("--no-live", action="store_true",
                        help="skip timing `top` and a node's closing line on the largest job")
    parser.add_argument("--keep", help="folder to keep the rank files in (default: temporary)")
    parser.add_argument("--json", action="store_true", help="one JSON line per rank count")
    args = parser.parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    folder = args.keep or tempfile.mkdtemp(prefix="ampdoctor-ranks-")
    os.makedirs(folder, exist_ok=True)
    healthy, bad = os.path.join(folder, "healthy.h5"), os.path.join(folder, "late.h5")
    write_large_run(healthy, steps=args.steps, modules=args.modules)
    write_large_run(bad, steps=args.steps, modules=args.modules,
                    overflow_step=args.steps * 9 // 10, persist=True)
    size = os.path.getsize(healthy) / 1e6
    if not args.json:
        print(f"each rank file: {args.steps} steps, {args.modules} modules, {size:.1f} MB; "
              f"rank 3N/4 overflows from step {args.steps * 9 // 10}")
        print(f"{'ranks':>6} | {'fast s':>7} {'fast MB':>8} | {'full s':>7} {'full MB':>8} | "
              "answer (verdict, first bad step, rank)")
    made: dict = {}
    try:
        for n in counts:
            paths = layout(folder, n, healthy, bad, made)
            fast = measure(paths, "fast")
            full = measure(paths, "full") if n <= args.full_max else None
            report(n, fast, full, args.json)
        if not args.no_live and max(counts) > 1:
            live = measure(paths, str(max(counts) * 3 // 4), LIVE)
            print(json.dumps(live) if args.json else
                  f"top over {max(counts)} rank files: first frame {live['top_first_s']:.2f} s, "
                  f"a refresh with every file changed at most {live['top_refresh_s']:.2f} s; "
                  f"the closing line of the node holding rank {max(counts) * 3 // 4} "
                  f"(8 ranks): {live['node_line_s']:.2f} s\n  {live['node_line']}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def report(n: int, fast: dict, full: dict | None, as_json: bool) -> None:
    answer = (fast["verdict"], fast["step"], fast["rank"])
    same = full is None or (full["verdict"], full["step"], full["rank"]) == answer
    if as_json:
        print(json.dumps({"ranks": n, "fast": fast, "full": full, "same": same}))
        return
    full_s = f"{full['s']:>7.2f} {full['rss_mb']:>8.0f}" if full else f"{'-':>7} {'-':>8}"
    print(f"{n:>6} | {fast['s']:>7.2f} {fast['rss_mb']:>8.0f} | {full_s} | "
          f"{answer[0]}, step {answer[1]}, rank {answer[2]}"
          + ("" if same else f"  (FULL READ DIFFERS: {full})"))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
