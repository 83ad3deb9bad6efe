"""How long ``ampdoctor diagnose`` takes over the rank files of a large job, and its memory.

    python benchmarks/scale_diagnose.py                          # 1, 64, 256, 1024 ranks
    python benchmarks/scale_diagnose.py --ranks 1,64 --steps 2000 --modules 20 --full-max 64
    python benchmarks/scale_diagnose.py --ranks 16384 --steps 2000 --modules 20 --no-live

Writes one 10 000-step, 100-module run with ``benchmarks/make_large_run.py`` (healthy: the
loss scale grows every 2000 steps) and a second one whose sampled tier sees one module
overflow fp16 at 90 % of the run and on every step after it (the one late-overflowing rank),
then copies them into N rank files (``run.rank{R}.h5``, root attributes and ``/summary`` set
to rank R of N), the overflowing one at rank 3N/4, and writes their node summaries with
``ampdoctor index``'s call (``nodes.index``: 8 ranks a node, as each node's ``record``
writes them), timed. For each N it diagnoses the files in a fresh process, three ways: from
the node summaries (``engine.diagnose_files``: N/8 node summaries, then the ranks that matter
read in full), from each rank file's own ``/summary`` (``nodes=False``: as before issue 38,
and as ``diagnose`` does where no node summary is there; up to ``--ranks-max``), and the full
read (``full=True``: every rank loaded and diagnosed, as before issue 20; up to
``--full-max``), and prints wall time (import included, as the CLI runs it), peak RSS (the
child's VmHWM) and the answer of each, which must be the same: verdict, first bad step, first
rank; and the load average (1 min) when each row was measured. The full read takes minutes
and gigabytes at 1024 ranks. Then, on the largest job, ``ampdoctor top``'s first frame and its
refreshes with every file changed, and the closing line ``ampdoctor record`` prints on the
node holding the late rank (8 ranks a node), timed. No torch needed.

A rank file of the default size is 4.3 MB: 16 384 of them take 70 GB. ``--steps 2000
--modules 20`` makes them 0.44 MB (7.2 GB); the node summaries do not depend on that size.
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
import json, os, sys, time
t = time.perf_counter()
from ampdoctor.diagnosis import engine
folder, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
paths = [os.path.join(folder, f"run.rank{r}.h5") for r in range(n)]
d = engine.diagnose_files(paths, full=how == "full", nodes=how == "nodes") if n > 1 else \\
    engine.diagnose(paths[0])
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
folder, n = sys.argv[1], int(sys.argv[2])
paths = [os.path.join(folder, f"run.rank{r}.h5") for r in range(n)]
late = n * 3 // 4
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

# `ampdoctor index` over the rank files: the node summaries diagnose reads.
INDEX = """
import json, os, sys, time
t = time.perf_counter()
from ampdoctor.runfile import nodes
ix = nodes.index(os.path.join(sys.argv[1], "run.h5"))
print(json.dumps({"s": time.perf_counter() - t, "written": len(ix.written),
                  "entries": ix.entries}))
"""


def set_rank(path: str, rank: int, world: int) -> None:
    """Make a copied run file rank ``rank`` of ``world``: its root attributes and summary."""
    with h5py.File(path, "r+") as f:
        f.attrs["rank"], f.attrs["world_size"] = rank, world
        row = f["summary"][0]
        row["rank"], row["world_size"] = rank, world
        f["summary"][0] = row


def layout(folder: str, n: int, healthy: str, bad: str, made: dict) -> list[str]:
    # (a node summary of a smaller job, beside these files, goes stale here: index rewrites it)
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


def measure(folder: str, n: int, how: str, code: str = CHILD) -> dict:
    """Run ``code`` over the job's first ``n`` rank files in a fresh process (the paths are
    made there: 16 384 of them would not fit in one argument)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, folder, str(n), how], env=env,
                         check=True, capture_output=True, text=True).stdout
    found = json.loads(out.strip().splitlines()[-1])
    found["load"] = os.getloadavg()[0]
    return found


def main() -> None:
    args = _parser().parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    folder = args.keep or tempfile.mkdtemp(prefix="ampdoctor-ranks-")
    os.makedirs(folder, exist_ok=True)
    healthy, bad = os.path.join(folder, "healthy.h5"), os.path.join(folder, "late.h5")
    write_large_run(healthy, steps=args.steps, modules=args.modules)
    write_large_run(bad, steps=args.steps, modules=args.modules,
                    overflow_step=args.steps * 9 // 10, persist=True)
    size = os.path.getsize(healthy) / 1e6
    if not args.json:
        print(f"each rank file: {args.steps} steps, {args.modules} modules, {size:.2f} MB; "
              f"rank 3N/4 overflows from step {args.steps * 9 // 10}")
        print(f"{'ranks':>6} | {'index s':>7} | {'nodes s':>7} {'MB':>5} {'load':>5} | "
              f"{'ranks s':>7} {'MB':>5} {'load':>5} | {'full s':>7} {'MB':>6} {'load':>5} | "
              "answer (verdict, first bad step, rank)")
    made: dict = {}
    try:
        for n in counts:
            layout(folder, n, healthy, bad, made)
            index = measure(folder, n, "index", INDEX) if n > 1 else None
            fast = measure(folder, n, "nodes")
            ranks = measure(folder, n, "ranks") if 1 < n <= args.ranks_max else None
            full = measure(folder, n, "full") if n <= args.full_max else None
            report(n, index, fast, ranks, full, args.json)
        if not args.no_live and max(counts) > 1:
            live = measure(folder, max(counts), "", LIVE)
            print(json.dumps(live) if args.json else
                  f"top over {max(counts)} rank files: first frame {live['top_first_s']:.2f} s, "
                  f"a refresh with every file changed at most {live['top_refresh_s']:.2f} s; "
                  f"the closing line of the node holding rank {max(counts) * 3 // 4} "
                  f"(8 ranks): {live['node_line_s']:.2f} s (load {live['load']:.1f})\n"
                  f"  {live['node_line']}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,64,256,1024",
                        help="rank counts, comma-separated (default: 1,64,256,1024)")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--modules", type=int, default=100)
    parser.add_argument("--full-max", type=int, default=256,
                        help="run the full read up to this many ranks (it takes minutes and "
                             "gigabytes at 1024)")
    parser.add_argument("--ranks-max", type=int, default=1 << 20,
                        help="read every rank file's own summary (no node summaries) up to "
                             "this many ranks (default: always)")
    parser.add_argument("--no-live", action="store_true",
                        help="skip timing `top` and a node's closing line on the largest job")
    parser.add_argument("--keep", help="folder to keep the rank files in (default: temporary)")
    parser.add_argument("--json", action="store_true", help="one JSON line per rank count")
    return parser


def _answer(r: dict) -> tuple:
    return r["verdict"], r["step"], r["rank"]


def report(n: int, index: dict | None, fast: dict, ranks: dict | None, full: dict | None,
           as_json: bool) -> None:
    same = all(_answer(r) == _answer(fast) for r in (ranks, full) if r is not None)
    if as_json:
        print(json.dumps({"ranks": n, "index": index, "fast": fast, "rank_files": ranks,
                          "full": full, "same": same}))
    else:
        def cells(r: dict | None, mb: int) -> str:
            return (f"{r['s']:>7.2f} {r['rss_mb']:>{mb}.0f} {r['load']:>5.1f}" if r else
                    f"{'-':>7} {'-':>{mb}} {'-':>5}")
        answer = _answer(fast)
        print(f"{n:>6} | {index['s'] if index else 0:>7.2f} | {cells(fast, 5)} | "
              f"{cells(ranks, 5)} | {cells(full, 6)} | "
              f"{answer[0]}, step {answer[1]}, rank {answer[2]}"
              + ("" if same else f"  (READS DIFFER: {ranks} {full})"))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
