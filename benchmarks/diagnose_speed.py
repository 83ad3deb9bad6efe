"""How long ``ampdoctor diagnose`` takes on a long run, and how much memory it needs.

Writes a synthetic run file the size a long training run leaves (default 100 000 steps,
sampled every 100 steps, 100 modules: 4 statistics rows per module per sample, i.e. 400 000
/stats rows; a calibration at the start, a probing skip per 2000 steps, then an overflow that
lasts to the end so that every rule has work to do), then times the diagnosis in a fresh
process, as the CLI runs it, and reports wall time and peak RSS. No torch needed.

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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ampdoctor import schema, store  # noqa: E402
from ampdoctor.schema import Event, Kind, Source, flag  # noqa: E402


def write_run(path: str, steps: int, every: int, modules: int) -> None:
    w = store.Writer(path, argv=["train.py"])
    w.meta("autocast", {"device_type": "cuda", "enabled": True, "dtype": "float16"})
    w.meta("scaler", {"class": "GradScaler", "enabled": True, "init_scale": 65536.0,
                      "growth_interval": 2000})
    w.meta("optimizer", [{"class": "AdamW", "hyper": {"lr": 3e-4, "eps": 1e-8},
                          "param_dtypes": {"float32": 10_000_000}, "state_dtypes": {}}])
    w.meta("recorder", {"every": every, "forensics": True, "max_replays": 4})
    rng = np.random.default_rng(0)
    ids = {}
    for m in range(modules):
        for kind in (Kind.OUTPUT, Kind.GRAD_OUTPUT, Kind.PARAM_GRAD, Kind.PARAM):
            row = schema.empty("tensors", 1)
            tid = len(ids)
            ids[(m, kind)] = tid
            row["id"], row["kind"], row["numel"] = tid, int(kind), 1 << 20
            name = f"blocks.{m // 4}.mlp.{m % 4}" + (".weight" if kind >= Kind.PARAM_GRAD else "")
            row["name_off"], row["name_len"] = w.text(name)
            row["type_off"], row["type_len"] = w.text("Linear")
            w.append("tensors", row)
    fail = int(steps * 0.9)
    chunk = 10_000
    scale = 65536.0
    for start in range(0, steps, chunk):
        n = min(chunk, steps - start)
        s = schema.empty("steps", n)
        idx = np.arange(start, start + n)
        s["step"] = idx
        s["loss"] = 2.0 + 0.1 * rng.standard_normal(n)
        s["loss_dtype"] = 1
        s["micro"] = 1
        s["grad_norm"] = 1.0 + 0.1 * rng.random(n)
        s["lr"] = 3e-4
        s["found_inf"] = 0
        skip = (idx < 3) | ((idx % 2000) == 1999) | (idx >= fail)
        s["skipped"] = skip
        s["flags"] = np.where(skip, flag(Event.SKIPPED), 0) | np.where(
            idx >= fail, flag(Event.NONFINITE_LOSS), 0)
        s["loss"][idx >= fail] = np.nan
        for i in range(n):
            s["scale"][i] = scale
            if skip[i]:
                scale = max(scale / 2, 1e-30)
            elif (idx[i] % 2000) == 0:
                scale *= 2
            s["scale_after"][i] = scale
        s["sampled"] = (idx % every) == 0
        w.append("steps", s)
        sampled = idx[(idx % every) == 0]
        if len(sampled):
            rows = schema.empty("stats", len(sampled) * len(ids))
            rows["step"] = np.repeat(sampled, len(ids))
            rows["tensor"] = np.tile(np.arange(len(ids)), len(sampled))
            rows["source"] = int(Source.SAMPLED)
            rows["sample_n"] = 4096
            rows["numel"] = 1 << 20
            for key in ("nonfinite", "zeros", "sub16", "subbf16", "near16", "over16"):
                rows[key] = 0
            rows["absmax"] = rng.random(len(rows)) * 10
            rows["rms"] = 1.0
            rows["norm"] = 30.0
            rows["update"] = 1e-3
            rows["unchanged"] = 0.0
            rows["nonfinite"][rows["step"] >= fail] = 1
            w.append("stats", rows)
        w.flush()
    w.close("finished")


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
        write_run(path, args.steps, args.every, args.modules)
        written = time.perf_counter() - t
        # Peak RSS from /proc (VmHWM, in kB): getrusage's ru_maxrss keeps the parent's peak
        # across fork + exec on Linux, and the parent here just wrote the file.
        code = ("import sys, time; t = time.perf_counter(); import ampdoctor; "
                "d = ampdoctor.diagnose(sys.argv[1]); el = time.perf_counter() - t; "
                "hwm = [l.split()[1] for l in open('/proc/self/status') if "
                "l.startswith('VmHWM')][0]; print(el, hwm, d.verdict)")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, "-c", code, path], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            runs.append((float(out[0]), int(out[1]) * 1024, out[2]))
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ampdoctor", "diagnose", path], env=env,
                           check=True, capture_output=True)
            runs[-1] += (time.perf_counter() - t,)
        result = {"steps": args.steps, "stats_rows": (args.steps // args.every) *
                  args.modules * 4, "file_mb": os.path.getsize(path) / 1e6,
                  "write_s": written, "diagnose_s": min(r[0] for r in runs),
                  "cli_s": min(r[3] for r in runs), "peak_rss_mb": max(r[1] for r in runs) / 1e6,
                  "verdict": runs[0][2]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['steps']} steps, {result['stats_rows']} stats rows, "
              f"{result['file_mb']:.1f} MB: diagnose {result['diagnose_s']:.2f} s in-process "
              f"(import + load + rules), {result['cli_s']:.2f} s through the CLI, peak RSS "
              f"{result['peak_rss_mb']:.0f} MB, verdict {result['verdict']}")


if __name__ == "__main__":
    main()
