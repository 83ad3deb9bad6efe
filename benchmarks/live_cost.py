"""What watching a run costs the training that writes it: ``ampdoctor top`` and ``export --follow``.

    python benchmarks/live_cost.py                   # about three minutes on 2 CPU cores
    python benchmarks/live_cost.py --rounds 1 --steps 60 --modes plain,top     # smoke test

A bf16 MLP trains under ``ampdoctor.watch`` (every step recorded, per-layer statistics every
100 steps, a flush about every second) in a child process, while another process watches the
same file, or nothing does. The modes, interleaved round by round:

* ``plain``: nobody watches; ``plain-again``: the same, the A/A pair that shows the noise;
* ``top``: ``ampdoctor top`` follows the file, refreshing 5 times a second (5x its default);
* ``export``: ``ampdoctor export --tensorboard DIR --follow`` writes TensorBoard events from it.

Reported: the median steady step time (after 50 warm-up steps) of each mode, its ratio to
``plain``, and the CPU time the watcher process used (start-up and the final diagnosis
included), also as a share of one core over the training's wall time. The watcher is a SWMR reader: it takes no lock and the writer never waits for it,
so what is left to see is the CPU it takes from a machine whose cores the training uses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = r"""
import json, sys, time, torch, torch.nn as nn, torch.nn.functional as F
import ampdoctor
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())],
                      nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
with ampdoctor.watch(model, opt, path=sys.argv[1]):
    for step in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""

WATCHERS = {
    "plain": None,
    "plain-again": None,
    "top": ["top", "{run}", "--interval", "0.2", "--wait", "120"],
    # --force: each round replaces the last round's events (else refused: each point twice)
    "export": ["export", "{run}", "--tensorboard", "{dir}", "--follow", "--wait", "120",
               "--force"],
}


def one(mode: str, steps: int, folder: str, settle: float = 2.0) -> tuple[float, float, float]:
    """Median steady step time of one training watched as ``mode`` says, the training's wall
    time, and the CPU seconds the watcher used (its start and final diagnosis included)."""
    run = os.path.join(folder, f"{mode}.h5")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    watcher = None
    if WATCHERS[mode]:
        args = [a.format(run=run, dir=os.path.join(folder, f"tb-{mode}")) for a in
                WATCHERS[mode]]
        watcher = subprocess.Popen([sys.executable, "-m", "ampdoctor", *args], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(settle)  # its imports done before training starts
    cpu = 0.0
    try:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", TRAIN, run, str(steps)], env=env,
                             check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - t0
    finally:
        if watcher is not None:
            cpu = _cpu_seconds(watcher)
        if os.path.exists(run):
            os.remove(run)
    times = json.loads(out)
    return statistics.median(times[50:] if len(times) > 60 else times), wall, cpu


def _cpu_seconds(proc: subprocess.Popen, limit: float = 60.0) -> float:
    """User and system CPU seconds of a child, once it ended (killed after ``limit``)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = 0
            return usage.ru_utime + usage.ru_stime
        time.sleep(0.1)
    proc.kill()
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = -9
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--modes", default=",".join(WATCHERS))
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds given to the watcher to start before the training")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    modes = args.modes.split(",")
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]  # interleaved, alternating order
            for mode in order:
                results[mode].append(one(mode, args.steps, folder, args.settle))
    base = statistics.median(r[0] for r in results[modes[0]])
    table = {}
    for m, rows in results.items():
        step = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[2] for r in rows)
        share = statistics.median(r[2] / r[1] for r in rows)
        table[m] = {"median_step_ms": 1e3 * step, "ratio": step / base, "watcher_cpu_s": cpu,
                    "watcher_cpu_share": share}
    print(f"{'mode':<12}{'step (ms)':>10}{'ratio':>8}{'watcher CPU':>13}{'of a core':>11}")
    for m, row in table.items():
        print(f"{m:<12}{row['median_step_ms']:>10.3f}{row['ratio']:>7.3f}x"
              f"{row['watcher_cpu_s']:>12.2f}s{100 * row['watcher_cpu_share']:>10.1f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rounds": args.rounds, "steps": args.steps, "modes": table}, fh)


if __name__ == "__main__":
    main()
