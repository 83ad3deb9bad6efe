"""How long ``ampdoctor diagnose`` takes on a long run, and how much memory it needs.

Writes a synthetic run file the size a long training run leaves with
``benchmarks/make_large_run.py`` (default 100 000 steps, sampled every 100 steps, 100 modules:
about 470 000 /stats rows; GradScaler's periodic probing skips, then one module's output
overflowing fp16 on every step from 90% of the run on, so that the diagnosis reads almost all
of it and has a failure to explain), then times
the diagnosis in a fresh process, as the CLI runs it, and reports wall time and peak RSS. No
torch needed.

    python benchmarks/diagnose_speed.py                 # 100 000 steps
    python benchmarks/diagnose_speed.py --steps 1000000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_large_run import write_large_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--modules", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.h5")
        t = time.perf_counter()
        counts = write_large_run(path, steps=args.steps, modules=args.modules, every=args.every,
                                 flush_steps=1000, overflow_step=args.steps * 9 // 10, persist=True)
        written = time.perf_counter() - t
        # Peak RSS from /proc (VmHWM, in kB): getrusage's ru_maxrss keeps the parent's peak
        # across fork + exec on Linux, and the parent here just wrote the file.
        code = ("import sys, time; t = time.perf_counter(); import ampdoctor; "
                "d = ampdoctor.diagnose(sys.argv[1]); el = time.perf_counter() - t; "
                "hwm = [l.split()[1] for l in open('/proc/self/status') if "
                "l.startswith('VmHWM')][0]; "
                # the early warning's own share: what it reads and judges for this diagnosis
                "from ampdoctor.diagnosis import forecast; step = (d.first_bad or {}).get('step'); "
                "t = time.perf_counter(); run = ampdoctor.load(sys.argv[1]); "
                "forecast.for_diagnosis(run, None if d.healthy else step); run.close(); "
                "fc = time.perf_counter() - t; print(el, hwm, d.verdict, fc)")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, "-c", code, path], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            runs.append((float(out[0]), int(out[1]) * 1024, out[2], float(out[3])))
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", path], env=env,
                           check=True, capture_output=True)
            runs[-1] += (time.perf_counter() - t,)
        result = {"steps": args.steps, "stats_rows": counts["stats"], "file_mb": os.path.getsize(path) / 1e6,
                  "write_s": written, "diagnose_s": min(r[0] for r in runs),
                  "cli_s": min(r[4] for r in runs), "forecast_s": min(r[3] for r in runs), "peak_rss_mb": max(r[1] for r in runs) / 1e6,
                  "verdict": runs[0][2]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['steps']} steps, {result['stats_rows']} stats rows, "
              f"{result['file_mb']:.1f} MB: diagnose {result['diagnose_s']:.2f} s in-process "
              f"(import + load + rules + forecast; the forecast alone {result['forecast_s']:.2f} "
              f"s), {result['cli_s']:.2f} s through the CLI, peak RSS "
              f"{result['peak_rss_mb']:.0f} MB, verdict {result['verdict']}")


if __name__ == "__main__":
    main()
