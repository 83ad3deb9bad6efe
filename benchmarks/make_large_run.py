"""Write a large synthetic run file through ``store.Writer``, as the recorder writes one.

    python benchmarks/make_large_run.py big.h5                      # 200 000 steps, 300 modules
    python benchmarks/make_large_run.py big.h5 --steps 20000 --modules 50 --overflow-step 15000

What it writes, per step: a /steps row and a /groups row per param group (two). On every
``--every``-th step (the sampled tier): an OUTPUT and a GRAD_OUTPUT /stats row per module, and a
PARAM_GRAD and a PARAM row per parameter (weight and bias, for the two thirds of the modules
that hold parameters), ``--every`` steps apart as the recorder's default. The numbers look
like a healthy fp16 run (lognormal abs max and rms, a few subnormal and near-overflow counts,
the loss scale doubling every 2000 clean steps and probing: a skipped step whenever it passes
2**24). With ``--overflow-step S`` one module's output overflows at step S (rounded up to a
sampled step): that step is skipped, the scale halves, and the sampled tier sees the inf, so
``diagnose`` has something to find late in the file, after reading all that comes before;
with ``--persist`` every later step overflows too. The writer flushes every
``--flush-steps`` steps (the recorder flushes about once a second).

No torch needed. Reusable: ``write_large_run(path, steps=..., modules=...)`` returns counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ampdoctor.runfile import schema, store  # noqa: E402
from ampdoctor.runfile.schema import Event, Kind, Source  # noqa: E402


def _tensors(w: store.Writer, modules: int) -> dict:
    """Register every recorded tensor; return id arrays per kind."""
    ids = {"out": [], "gout": [], "pgrad": [], "param": []}
    rows = []

    def add(kind, name, owner):
        row = schema.empty("tensors", 1)
        row["id"], row["kind"], row["dtype"], row["numel"] = len(rows), int(kind), 2, 1 << 16
        row["name_off"], row["name_len"] = w.text(name)
        row["type_off"], row["type_len"] = w.text(owner)
        rows.append(row)
        return len(rows) - 1

    for m in range(modules):
        name = f"blocks.{m // 10}.layer{m % 10}"
        owner = "Linear" if m % 3 else "GELU"
        ids["out"].append(add(Kind.OUTPUT, name, owner))
        ids["gout"].append(add(Kind.GRAD_OUTPUT, name, owner))
        if m % 3:
            for p in ("weight", "bias"):
                ids["pgrad"].append(add(Kind.PARAM_GRAD, f"{name}.{p}", "param"))
                ids["param"].append(add(Kind.PARAM, f"{name}.{p}", "param"))
    w.append("tensors", np.concatenate(rows))
    return {k: np.array(v, dtype=np.int32) for k, v in ids.items()}


def _sampled_rows(step: int, ids: dict, rng: np.random.Generator, overflow: bool) -> np.ndarray:
    parts = []
    seq = 0
    for kind, scale in (("out", 4.0), ("gout", 1e-3), ("pgrad", 1e-2), ("param", 1.0)):
        t = ids[kind]
        rows = schema.empty("stats", len(t))
        rows["step"], rows["tensor"], rows["source"] = step, t, int(Source.SAMPLED)
        rows["seq"] = np.arange(seq, seq + len(t))
        seq += len(t)
        rows["dtype"], rows["numel"], rows["sample_n"] = 2, 1 << 16, 4096
        rows["nonfinite"] = rows["nan"] = rows["posinf"] = rows["neginf"] = 0
        rows["absmax"] = scale * rng.lognormal(0.0, 0.5, len(t))
        rows["absmin"] = rows["absmax"] * 1e-4
        rows["rms"] = rows["absmax"] / 8
        rows["zeros"] = rng.integers(0, 40, len(t))
        rows["sub16"] = rng.integers(0, 20, len(t))
        rows["flush16"] = rng.integers(0, 3, len(t))
        rows["over16"] = rows["near16"] = rows["overbf16"] = 0
        rows["subbf16"] = rows["flushbf16"] = 0
        if kind == "param":
            rows["norm"] = rng.lognormal(2.0, 0.3, len(t))
            rows["update"] = 1e-3 * rng.lognormal(0.0, 0.3, len(t))
            rows["unchanged"] = 0.0
        if overflow and kind == "out":
            k = len(t) // 2  # one module's output passes 65504
            rows["posinf"][k], rows["nonfinite"][k], rows["absmax"][k] = 3, 2, np.inf
            rows["over16"][k] = rows["near16"][k] = 3
        parts.append(rows)
    return np.concatenate(parts)


def scale_history(steps: int, overflow_step: int, growth: int = 2000,
                  ceiling: float = 2.0**24, persist: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GradScaler's scale before and after each update, and which steps it skipped: it
    doubles after ``growth`` clean steps and halves on a skip; above ``ceiling`` the
    gradients of this synthetic model overflow (the periodic probing skip of a healthy run).
    ``persist``: every step from ``overflow_step`` on overflows too."""
    before, after = np.empty(steps), np.empty(steps)
    skipped = np.zeros(steps, bool)
    scale, clean = 65536.0, 0
    for i in range(steps):
        before[i] = scale
        failing = i == overflow_step or (persist and 0 <= overflow_step <= i)
        skipped[i] = failing or scale > ceiling
        if skipped[i]:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == growth:
                scale, clean = scale * 2, 0
        after[i] = scale
    return before, after, skipped


def _step_rows(first: int, n: int, scales: tuple, rng: np.random.Generator) -> np.ndarray:
    steps = np.arange(first, first + n)
    rows = schema.empty("steps", n)
    rows["step"] = steps
    rows["time"] = 1.7e9 + steps * 0.25
    rows["dt"] = 0.25
    rows["loss"] = 3.0 * np.exp(-steps / 50000) + 0.05 * rng.standard_normal(n)
    rows["loss_dtype"], rows["micro"] = 1, 1
    before, after, skipped = (s[first:first + n] for s in scales)
    rows["scale"], rows["scale_after"] = before, after
    bad = skipped
    rows["found_inf"] = rows["skipped"] = bad.astype(np.int8)
    rows["grad_norm"] = np.where(bad, np.inf, 0.5 + 0.1 * rng.standard_normal(n))
    rows["lr"] = 3e-4
    rows["peak_mem"] = 6 << 30
    rows["flags"] = np.where(bad, schema.flag(Event.SKIPPED) | schema.flag(Event.NONFINITE_GRAD),
                             0)
    return rows


def write_large_run(path: str, steps: int = 200_000, modules: int = 300, every: int = 100,
                    flush_steps: int = 100, overflow_step: int = -1, persist: bool = False,
                    seed: int = 0) -> dict:
    """Write the run; return what it holds (rows per table)."""
    rng = np.random.default_rng(seed)
    w = store.Writer(path, argv=["benchmarks/make_large_run.py", path])
    w.meta("status", schema.STATUS_RUNNING)
    w.meta("autocast", {"device_type": "cuda", "enabled": True, "dtype": "float16"})
    w.meta("scaler", {"class": "GradScaler", "enabled": True, "init_scale": 65536.0,
                      "growth_interval": 2000})
    w.meta("optimizer", [{"class": "AdamW", "hyper": {"lr": 3e-4, "eps": 1e-8}, "groups": 2}])
    w.meta("recorder", {"every": every, "synthetic": True})
    ids = _tensors(w, modules)
    if overflow_step >= 0:  # on a sampled step, so that the sampled tier sees it
        overflow_step = -(-overflow_step // every) * every
    scales = scale_history(steps, overflow_step, persist=persist)
    for first in range(0, steps, flush_steps):
        n = min(flush_steps, steps - first)
        w.append("steps", _step_rows(first, n, scales, rng))
        groups = np.zeros(2 * n, schema.GROUPS)
        groups["step"] = np.repeat(np.arange(first, first + n), 2)
        groups["group"] = np.tile([0, 1], n)
        groups["lr"], groups["weight_decay"] = 3e-4, np.tile([0.01, 0.0], n)
        w.append("groups", groups)
        for step in range(-(-first // every) * every, first + n, every):
            overflow = step == overflow_step or (persist and 0 <= overflow_step <= step)
            w.append("stats", _sampled_rows(step, ids, rng, overflow))
        w.flush()
    counts = {t: w.rows(t) for t in ("steps", "groups", "tensors", "stats", "events")}
    w.close(schema.STATUS_FINISHED)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--modules", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--flush-steps", type=int, default=100)
    parser.add_argument("--overflow-step", type=int, default=-1,
                        help="a step whose sampled stats see an fp16 overflow (-1: none)")
    parser.add_argument("--persist", action="store_true",
                        help="the overflow repeats on every step after --overflow-step")
    args = parser.parse_args()
    t0 = time.perf_counter()
    counts = write_large_run(args.out, args.steps, args.modules, args.every, args.flush_steps,
                             args.overflow_step, args.persist)
    print(f"wrote {args.out}: {os.path.getsize(args.out) / 2**20:.1f} MiB, "
          f"{counts['steps']} steps, {counts['stats']} stats rows, {counts['tensors']} tensors "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
