"""How long ``ampdoctor compare`` and ``ampdoctor report`` take on long runs, and their memory.

Writes two synthetic run files (no torch) of STEPS steps each, sampled every EVERY steps with
LAYERS module outputs, their gradients and as many parameter gradients: a baseline in fp32 and
a bf16 run whose loss drifts a little. Then times, each in a fresh process, ``compare`` (text)
and ``report --baseline`` (HTML with every figure), and prints wall time, peak RSS and the
report's size.

    python benchmarks/report_speed.py                      # 100 000 steps, 100 layers
    python benchmarks/report_speed.py --steps 20000 --layers 50
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ampdoctor.runfile import schema, store  # noqa: E402
from ampdoctor.runfile.schema import Kind, Source  # noqa: E402


def write_run(path: str, steps: int, every: int, layers: int, dtype: str | None,
              seed: int) -> int:
    rng = np.random.default_rng(seed)
    w = store.Writer(path, argv=["synthetic"])
    w.meta("autocast", {"device_type": "cuda", "enabled": dtype is not None, "dtype": dtype})
    w.meta("device", {"type": "cuda", "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0],
                      "bf16_supported": True})
    w.meta("model", {"trainable": 10_000_000})
    kinds = [(Kind.OUTPUT, f"blocks.{i}") for i in range(layers)]
    kinds += [(Kind.GRAD_OUTPUT, f"blocks.{i}") for i in range(layers)]
    kinds += [(Kind.PARAM_GRAD, f"blocks.{i}.weight") for i in range(layers)]
    t = schema.empty("tensors", len(kinds))
    for i, (kind, name) in enumerate(kinds):
        t["id"][i], t["kind"][i] = i, kind
        t["name_off"][i], t["name_len"][i] = w.text(name)
        t["type_off"][i], t["type_len"][i] = w.text("Linear")
    w.append("tensors", t)
    s = schema.empty("steps", steps)
    s["step"] = np.arange(steps)
    s["dt"] = 0.1 + 0.01 * rng.random(steps)
    drift = 1.0 if dtype is None else 1.0 + 0.003 * rng.standard_normal(steps)
    s["loss"] = (3.0 * np.exp(-np.arange(steps) / steps) + 0.05 * np.sin(np.arange(steps))) * drift
    s["grad_norm"] = 1.0 + rng.random(steps)
    s["lr"] = 3e-4
    s["peak_mem"] = (40 if dtype is None else 25) << 30
    s["skipped"], s["flags"] = 0, 0
    s["sampled"] = np.arange(steps) % every == 0
    w.append("steps", s)
    sampled = np.flatnonzero(s["sampled"])
    rows = schema.empty("stats", len(sampled) * len(kinds))
    rows["step"] = np.repeat(sampled, len(kinds))
    rows["tensor"] = np.tile(np.arange(len(kinds)), len(sampled))
    rows["source"] = Source.SAMPLED
    rows["numel"], rows["sample_n"] = 1 << 20, 4096
    for col in ("zeros", "nan", "posinf", "neginf", "over16", "near16", "sub16", "flush16"):
        rows[col] = 0
    rows["sub16"] = rng.integers(0, 40, len(rows))
    rows["absmax"] = 10 ** rng.uniform(-3, 3, len(rows))
    rows["absmin"] = 1e-7
    rows["rms"] = rows["absmax"] / 10 * (1 if dtype is None else 1.001)
    for start in range(0, len(rows), 1 << 16):
        w.append("stats", rows[start:start + (1 << 16)])
        w.flush()
    w.close("finished")
    return len(rows)


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a fresh process running ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--layers", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, amp = os.path.join(tmp, "fp32.h5"), os.path.join(tmp, "bf16.h5")
        n = write_run(base, args.steps, args.every, args.layers, None, 0)
        write_run(amp, args.steps, args.every, args.layers, "bfloat16", 1)
        print(f"{args.steps} steps, {n} statistics rows per run "
              f"({os.path.getsize(amp) / 2**20:.1f} MiB file)")
        exe = [sys.executable, "-m", "ampdoctor"]
        wall, rss = timed(exe + ["compare", base, amp])
        print(f"compare:            {wall:.2f} s, peak RSS {rss:.0f} MiB")
        out = os.path.join(tmp, "report.html")
        wall, rss = timed(exe + ["report", amp, "--baseline", base, "-o", out])
        print(f"report --baseline:  {wall:.2f} s, peak RSS {rss:.0f} MiB, "
              f"{os.path.getsize(out) / 2**10:.0f} KiB of HTML")


if __name__ == "__main__":
    main()
